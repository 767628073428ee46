"""CPU primary tier: block pool, cache policies, shared host region and GPU<->CPU handlers."""
