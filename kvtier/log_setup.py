"""Where kvtier's log lines go when a kvtier command runs (``kvtier serve``, its engine process,
``kvtier router``)."""

from __future__ import annotations

import logging


def setup_logging(level: str) -> None:
    """kvtier's own log lines (the engine's stats line, warnings of the router and the pools) to
    stderr at ``level``, as uvicorn's are. Only where nobody configured logging: an application
    that set up handlers (on ``kvtier`` or the root logger) keeps its own, and its levels."""
    logger = logging.getLogger("kvtier")
    if logger.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level.upper())
