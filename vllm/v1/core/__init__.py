"""Engine-facing scheduler types: block hashing and the scheduler's per-step output."""
