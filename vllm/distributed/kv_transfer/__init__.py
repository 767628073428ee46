"""KV transfer between the engine's GPU KV cache and external stores."""
