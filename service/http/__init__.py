"""The HTTP side: the server, middlewares, routes and schemas, admission, the engine client,
detokenization and stop strings. Talks to the engine core (service/engine/) only
through service/http/client.py and the core's process it holds (service/http/core_process.py)."""
