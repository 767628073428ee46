"""KV-cache offloading: keys, specs, managers and the tiers behind them."""
