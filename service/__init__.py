"""The HTTP service around the model: settings, routes, schemas, streaming, metrics; the engine core
(service/engine/) runs in its own process."""
