"""The ``vllm-kv-offload`` command: ``run`` (the main job) and ``bench``."""
