"""Compiled loops for the hot paths of the planner and the simulator (numba).

``compiled`` is ``numba.njit`` with the machine code cached on disk (next to the
source, or in the user's cache directory when the package is read-only). Where no
cache location is writable at all, the functions are compiled in each process
instead of failing at import.
"""

from __future__ import annotations

from numba import njit


def compiled(fn):
    """``njit(cache=True)``, or ``njit`` when no cache location is writable."""
    try:
        return njit(cache=True)(fn)
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return njit(fn)
