"""Worker side of KV offloading: transfer handlers and the worker that routes jobs to them."""
