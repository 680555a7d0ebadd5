"""The HTTP side: the server, middlewares, routes and schemas, admission, the engine client,
detokenization and stop strings. Talks to the engine core (service/engine/) only
through service/http/client.py."""
