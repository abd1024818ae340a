"""Where kvtier's log lines go when a kvtier command runs (``kvtier serve``, its engine process,
``kvtier router``)."""

from __future__ import annotations

import logging

from kvtier.redact import redact_text


class RedactingFormatter(logging.Formatter):
    """Every line with the credentials of any URL in it (and secret query parameters) masked:
    a pool's error may quote its URL, password included (kvtier/redact.py)."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


def setup_logging(level: str) -> None:
    """kvtier's own log lines (the engine's stats line, warnings of the router and the pools) to
    stderr at ``level``, as uvicorn's are. Only where nobody configured logging: an application
    that set up handlers (on ``kvtier`` or the root logger) keeps its own, and its levels."""
    logger = logging.getLogger("kvtier")
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
