"""vLLM v1 engine components used by the KV-cache offload subsystem."""
