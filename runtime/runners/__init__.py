"""The decode backends, side by side: runners of the step functions (prefill, draft, verify,
rollback) that own the KV caches. `eager` calls the PyTorch modules; `compiled` runs a built
engine directory's graphs through one of trtspec.engines' executors."""
