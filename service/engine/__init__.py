"""The engine core: scheduler, KV-cache slots, model forwards, sampling — token ids in and out.

It runs in its own process (process.py) behind service/http/client.py; nothing here imports the HTTP
side. service/inprocess.py joins it with the output processor for tests and scripts.
"""
