"""The scheduler's per-step output handed to the KV connector and the workers."""
