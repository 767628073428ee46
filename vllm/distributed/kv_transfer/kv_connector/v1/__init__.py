"""Version 1 of the KV connector interface and its implementations."""
