"""User-facing entry points (the ``vllm-kv-offload`` command)."""
