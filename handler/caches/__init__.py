"""The caches: the running batch's KV (`kv_cache`), the prefix cache of earlier prompts and
answers (`prefix_cache`; its byte budget is the host's, `handler.runtime.memory_budget`), and what a
verified step keeps (`rollback`)."""
