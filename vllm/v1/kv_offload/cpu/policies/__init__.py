"""Cache policies of the CPU primary tier (which blocks to evict)."""
