"""Distributed pieces of the engine: KV events and KV transfer connectors."""
