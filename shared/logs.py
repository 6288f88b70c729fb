"""Logging helpers shared by the services."""

from __future__ import annotations

import logging
from typing import Callable


def sparse(log: logging.Logger, n: int) -> Callable[..., None]:
    """The level for the ``n``-th (1, 2, ...) occurrence of one repeated condition: a warning at
    the 1st, 2nd, 4th, 8th..., debug in between — a flood (forged frames, a server gone, a
    directory refusing every write) says so, with its count, without flooding the log."""
    return log.warning if n > 0 and n & (n - 1) == 0 else log.debug
