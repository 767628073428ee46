"""Multi-tier offloading: a CPU primary tier fronting write-through secondary tiers."""
