"""Log setup: plain text, or one JSON object per line carrying the id of the request it is about."""
from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

request_id_var: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
"""Set by server.guard for the duration of one HTTP request (and the tasks it starts)."""

_EXTRA_FIELDS = ("status", "path", "completion_id", "num_prompt_tokens", "num_output_tokens", "finish_reason")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname.lower(), "logger": record.name, "msg": record.getMessage()}
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id:
            obj["request_id"] = request_id
        obj.update({k: getattr(record, k) for k in _EXTRA_FIELDS if hasattr(record, k)})
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=True)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        return f"{line} [{request_id}]" if request_id else line


class StderrHandler(logging.StreamHandler):
    """A StreamHandler on sys.stderr as it is when a record comes, not as it was when the handler was
    made: a server thread that outlives a replaced stderr (a test's captured one) still logs."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure(level: str, fmt: str) -> None:
    """Root handler with the chosen format; uvicorn's loggers propagate to it (its own access log is off)."""
    handler = StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
