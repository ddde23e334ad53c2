"""Logging setup: stdlib logging rendered by structlog, as text or one JSON object per line.

With ``--log-format json`` every stderr line is one JSON object: log records, and the operator's console
lines (startup, status, the final error) written through :class:`Console` with the same keys.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

import attrs
import structlog

__all__ = ["Console", "configure_logging"]


@attrs.frozen(slots=True)
class Console:
    """Lines for the operator on stderr: ``text`` as is, or with the json format an object carrying
    ``event``, ``level``, ``logger``, ``timestamp`` (as log records do) and the line's fields."""

    log_format: str = "text"

    def line(
        self, event: str, text: str, *, level: str = "info", logged: bool = False, **fields: object
    ) -> None:
        """``logged``: a log record already says this, so the json format leaves the line out."""
        if self.log_format == "json":
            if logged:
                return
            record = {
                "event": event,
                **fields,
                "level": level,
                "logger": "kvagent.console",
                "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            }
            text = json.dumps(record, default=str)
        print(text, file=sys.stderr, flush=True)

    def error(self, message: str) -> None:
        """The one line of a failure: ``kvagent: error: MESSAGE`` (json: ``{"event": "error", ...}``)."""
        self.line("error", f"kvagent: error: {message}", level="error", message=message)


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Route every ``logging`` record (and structlog loggers) through one structlog renderer."""
    renderer: structlog.types.Processor
    if log_format == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso"),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            renderer,
        ],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)  # a library's warning is a log record too, not a raw stderr line
