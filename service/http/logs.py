"""Log configuration for the server process: text or one JSON object per line (--log-format),
each line naming the request it was written for (X-Request-Id, service/http/request_context.py).

Handed to uvicorn as its log_config, so its own loggers (uvicorn.error, uvicorn.access) and the
service's share the format. asgi-correlation-id's filter puts the request's id on each record;
python-json-logger writes the JSON lines.
"""

from __future__ import annotations

from pythonjsonlogger.core import RESERVED_ATTRS

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(correlation_id)s] %(message)s"

# One JSON object per line: level, logger, message, request_id, time (UTC, ISO 8601), and the
# exception when there is one.
JSON_FORMATTER = {
    "()": "pythonjsonlogger.json.JsonFormatter",
    "fmt": ["levelname", "name", "message", "correlation_id"],
    "rename_fields": {"levelname": "level", "name": "logger", "correlation_id": "request_id", "exc_info": "exception"},
    "timestamp": "time",
    "json_ensure_ascii": False,
    # uvicorn's records carry a colored copy of their message: not a field of ours.
    "reserved_attrs": [*RESERVED_ATTRS, "color_message"],
}


def log_config(log_format: str) -> dict:
    """logging.config.dictConfig's dict for uvicorn's log_config."""
    formatter = JSON_FORMATTER if log_format == "json" else {"format": TEXT_FORMAT}
    handler = {"class": "logging.StreamHandler", "formatter": "main", "filters": ["request_id"], "stream": "ext://sys.stderr"}
    logger = {"handlers": ["main"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": "asgi_correlation_id.CorrelationIdFilter", "default_value": "-"}},
        "formatters": {"main": formatter},
        "handlers": {"main": handler},
        "loggers": {name: logger for name in ("uvicorn", "uvicorn.access", "service", "asgi_correlation_id")},
    }
