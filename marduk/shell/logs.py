"""Logging: rich on a terminal, one plain line per record when piped, JSON lines on request."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STD_ATTRS = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, plus any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(*, json_logs: bool = False, level: str = "info") -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler: logging.Handler
    if json_logs:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    elif not sys.stderr.isatty():
        # Piped to a file or a log collector: one unwrapped line per record.
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    else:
        from rich.console import Console
        from rich.logging import RichHandler

        handler = RichHandler(
            console=Console(stderr=True),
            show_path=False,
            rich_tracebacks=False,
            markup=False,
            log_time_format="%H:%M:%S.%f",
        )
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
    # nats-py logs reconnect noise at error level with tracebacks; our bus module reports it.
    logging.getLogger("nats").setLevel(logging.CRITICAL)
    logging.Formatter.converter = time.localtime
