"""JSON logs, one object per line: ``ts``, ``level``, ``logger``, ``msg`` and the structured
fields a record carries in ``extra={"fields": {...}}`` (request id, tenant, token counts, status,
timings). Keys and prompt text are never passed to a log call."""

from __future__ import annotations

import logging
import sys
import time

import orjson

ACCESS = logging.getLogger("kvgate.access")


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


def setup_logging(level: str = "info", stream=None) -> None:
    """Route the ``kvgate`` loggers (and uvicorn's) to ``stream`` (stderr) as JSON lines."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    for name in ("kvgate", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # kvgate.access replaces it


def access(fields: dict) -> None:
    """Log one finished request (``fields``: request_id, tenant, route, status, prompt_tokens,
    completion_tokens, overhead_ms, total_ms, upstream, ...)."""
    if ACCESS.isEnabledFor(logging.INFO):
        ACCESS.info("request", extra={"fields": fields})
