"""Log formatting: one JSON object per line in a pod (what log collectors parse), ``key=value`` text
locally. Structured fields travel as ``extra={"fields": {...}}``; ``log_fields`` is the shorthand."""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any


def utc_iso(ts: float) -> str:
    """RFC 3339 UTC with a ``Z``: sorts lexically in time order (the operator compares them as strings)."""
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def log_fields(logger: logging.Logger, level: int, message: str, **fields: Any) -> None:
    logger.log(level, message, extra={"fields": fields})


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``extra={"fields": {...}}`` adds structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {"time": utc_iso(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "message": record.getMessage()}
        doc.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


class TextFormatter(logging.Formatter):
    """Human-readable lines; structured fields follow as ``key=value``."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None) or {}
        extra = "".join(f" {k}={json.dumps(v, default=str)}" for k, v in fields.items())
        return super().format(record) + extra
