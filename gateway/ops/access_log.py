"""JSON logs, one object per line: ``ts``, ``level``, ``logger``, ``msg`` and the structured
fields a record carries in ``extra={"fields": {...}}`` (request id, tenant, token counts, status,
timings). Keys and prompt text are never passed to a log call.

Bounded: a string value (``msg`` included) longer than :data:`MAX_FIELD_CHARS` characters is cut
with the marker ``...[N more characters]``, a traceback to :data:`MAX_EXC_CHARS`, and no line is
longer than :data:`MAX_LINE_BYTES` bytes (a line still over it keeps ``ts``, ``level``, ``logger``,
a cut ``msg`` and ``"truncated": true``). Values echoed from a client (a field name, a request id)
therefore never make a line large."""

from __future__ import annotations

import logging
import sys
import time

import orjson

from config.errors import bounded

ACCESS = logging.getLogger("kvgate.access")

#: no log line is longer than this (bytes, UTF-8, without the newline)
MAX_LINE_BYTES = 16 * 1024
#: longest string value in a line (characters)
MAX_FIELD_CHARS = 1024
#: longest traceback in a line (characters)
MAX_EXC_CHARS = 8 * 1024


def _cut(value: object) -> object:
    if isinstance(value, str):
        return bounded(value, MAX_FIELD_CHARS)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    if isinstance(value, (dict, list, tuple)):
        text = orjson.dumps(value, default=str).decode()
        return value if len(text) <= MAX_FIELD_CHARS else bounded(text, MAX_FIELD_CHARS)
    return bounded(str(value), MAX_FIELD_CHARS)


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line of at most :data:`MAX_LINE_BYTES` bytes."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": bounded(record.getMessage(), MAX_FIELD_CHARS),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for k, v in list(fields.items())[:64]:
                out[bounded(str(k), 64)] = _cut(v)
        if record.exc_info:
            out["exc"] = bounded(self.formatException(record.exc_info), MAX_EXC_CHARS)
        line = orjson.dumps(out, default=str)
        if len(line) > MAX_LINE_BYTES:
            short = {k: out[k] for k in ("ts", "level", "logger")}
            short["msg"] = bounded(record.getMessage(), 512)
            short["truncated"] = True
            line = orjson.dumps(short)
        return line.decode()


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
