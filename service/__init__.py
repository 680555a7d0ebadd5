"""The HTTP service around the model: settings, scheduler, engine loop, routes, metrics."""
