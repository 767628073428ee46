"""KV connectors: the engine's interface to KV transfer backends."""
