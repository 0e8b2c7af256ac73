"""Logging set-up for the CLI. Library modules only do ``logging.getLogger(__name__)``."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what log collectors in a pod want."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


FORMATTERS: dict[str, logging.Formatter] = {
    "json": JsonFormatter(),
    "plain": logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"),
}


def configure_logging(log_format: str | None = None, log_level: str | None = None) -> None:
    """Set the format of the log lines, their level, or both; what is not given stays as it was. ``tritonshare``
    sets both before a command runs; a command's own ``--log-format``/``--log-level`` then sets one again."""
    root = logging.getLogger()
    if log_format is not None:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(FORMATTERS[log_format])
        root.handlers[:] = [handler]
    if log_level is not None:
        root.setLevel(log_level.upper())
        # Chatty third-party loggers stay quiet unless asked for.
        for name in ("botocore", "boto3", "urllib3", "google", "s3transfer", "aiohttp.access"):
            logging.getLogger(name).setLevel(max(logging.WARNING, root.level))
