"""GPT-2 written from scratch: config, modules, KV cache, sampling, analysis.

Nothing here imports `service` or `transformers`.
"""
