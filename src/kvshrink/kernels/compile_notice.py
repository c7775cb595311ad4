"""A one-line notice while kernels compile on first use, so a cold start is not a silent wait.

numba compiles kvshrink's CPU kernels the first time a method needs them on a machine (tens of seconds to
minutes on a small CPU; loaded from numba's cache afterwards, in well under a second). `compiling` logs
one warning when the work it wraps is still running after ``after`` seconds: a cached load says nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

__all__ = ["compiling"]

_log = logging.getLogger("kvshrink")
_announced: set[str] = set()


@contextlib.contextmanager
def compiling(what: str, after: float = 2.0) -> Iterator[None]:
    """Wrap the first compilation (or cache load) of ``what``'s kernels."""
    if what in _announced:
        yield
        return
    timer = threading.Timer(after, _announce, args=(what,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _announce(what: str) -> None:
    if what not in _announced:
        _announced.add(what)
        _log.warning("kvshrink: compiling %s's CPU kernels (first use on this machine; cached afterwards, "
                     "this takes a minute or more on a small CPU)...", what)
