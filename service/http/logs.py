"""Log configuration for the server process: text or one JSON object per line (--log-format),
each line naming the request it was written for (X-Request-Id, service/http/request_context.py).

Handed to uvicorn as its log_config, so its own loggers (uvicorn.error, uvicorn.access) and the
service's share the format.
"""

from __future__ import annotations

import json
import logging
import time

from service.http.request_context import request_id


class RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (UTC, ISO 8601), level, logger, message, request_id."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "-"),
        }
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def log_config(log_format: str) -> dict:
    """logging.config.dictConfig's dict for uvicorn's log_config."""
    formatter = {"()": JsonFormatter} if log_format == "json" else {"format": TEXT_FORMAT}
    handler = {"class": "logging.StreamHandler", "formatter": "main", "filters": ["request_id"], "stream": "ext://sys.stderr"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request_id": {"()": RequestIdFilter}},
        "formatters": {"main": formatter},
        "handlers": {"main": handler},
        "loggers": {
            "uvicorn": {"handlers": ["main"], "level": "INFO", "propagate": False},
            "uvicorn.access": {"handlers": ["main"], "level": "INFO", "propagate": False},
            "service": {"handlers": ["main"], "level": "INFO", "propagate": False},
        },
    }
