"""Compiled loops for the hot paths of the planner and the simulator (numba).

``compiled`` is ``numba.njit`` with the machine code cached on disk in adaserve's cache
folder (``paths.cache_dir() / "numba"``: ``$ADASERVE_CACHE``, else
``$XDG_CACHE_HOME/adaserve``, else ``~/.cache/adaserve``), never inside the installed
package; a user's own ``NUMBA_CACHE_DIR`` wins. numba fixes a function's cache path
when it is decorated, so the folder is set for adaserve's functions only (numba's
config is restored after each decoration: other numba users in the process are left
alone). Where no cache folder is writable, the functions are compiled in each process
instead of failing at import.

The first run compiles (up to a minute on a slow machine; later runs load the cache).
The first compilation in a process says on stderr what it compiles and where it is
cached; each one, when it is done, what it compiled and how long it took.

Bookkeeping, for start-up warm-up (``engine.warmup``) and the stall probe
(``core.stalls``): ``compiles()`` counts the real compiles of adaserve's functions in
this process (a function loaded from the on-disk cache is not one), and
``specialisations()`` / ``compiled_functions()`` count each function's compiled or
loaded specialisations (one per argument-type combination), which is what tells that
nothing new was needed after warm-up, cache or no cache.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

import numba
from numba import njit
from numba.core import event

from adaserve.util import paths

_PACKAGE = Path(__file__).resolve().parents[1]  # src/adaserve


def cache_folder() -> Path | None:
    """Where adaserve's numba cache lives: ``$NUMBA_CACHE_DIR`` when the user set it,
    else ``paths.cache_dir() / "numba"``; None when that folder cannot be written."""
    user = os.environ.get("NUMBA_CACHE_DIR")
    if user:
        return Path(user)
    try:
        d = paths.cache_dir() / "numba"
        d.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return d if os.access(d, os.W_OK) else None


@contextlib.contextmanager
def _numba_cache_dir(folder: Path):
    """numba's ``CACHE_DIR`` set to ``folder`` for one decoration, then restored."""
    old = numba.config.CACHE_DIR  # type: ignore[attr-defined]  # numba.config sets its attributes at import
    numba.config.CACHE_DIR = str(folder)  # type: ignore[attr-defined]  # numba.config sets its attributes at import
    try:
        yield
    finally:
        numba.config.CACHE_DIR = old  # type: ignore[attr-defined]  # numba.config sets its attributes at import


def compiled(fn):
    """``njit(cache=True)`` with the cache in adaserve's cache folder, or ``njit``
    when no cache folder is writable."""
    _install_notice()
    folder = cache_folder()
    if folder is None:
        return _register(njit(fn))
    try:
        with _numba_cache_dir(folder):
            return _register(njit(cache=True)(fn))
    except RuntimeError:  # numba: "cannot cache function ...: no locator available"
        return _register(njit(fn))


# every dispatcher ``compiled`` made, in decoration order (their modules imported)
_DISPATCHERS: list = []


def _register(dispatcher):
    _DISPATCHERS.append(dispatcher)
    return dispatcher


class CompiledFunction(NamedTuple):
    """One of adaserve's numba functions: ``module.function`` (``adaserve.`` left
    out), its dispatcher, and how many specialisations (argument-type combinations)
    it holds now, compiled in this process or loaded from the on-disk cache."""

    name: str
    dispatcher: object
    specialisations: int


def compiles() -> int:
    """Compiles of adaserve's numba functions in this process so far: real compiles
    only (a specialisation loaded from the on-disk cache is not one), each counted once
    it ends (a failed one too), a function compiled inside another's compile counted
    in the outermost one. Monotone; 0 before any."""
    return _NOTICE.count if _NOTICE is not None else 0


def compiled_functions() -> list[CompiledFunction]:
    """adaserve's numba functions whose modules are imported, in decoration order, with
    their specialisations now."""
    return [CompiledFunction(_name(d) or repr(d), d, len(d.signatures)) for d in list(_DISPATCHERS)]


def specialisations() -> dict[str, int]:
    """``module.function`` -> specialisations it holds now (compiled or loaded from
    the cache), for every adaserve numba function whose module is imported. Equal
    before and after a run: the run needed no new specialisation."""
    return {f.name: f.specialisations for f in compiled_functions()}


def _say(msg: str) -> None:
    print(f"adaserve: {msg}", file=sys.stderr, flush=True)


def _name(dispatcher) -> str | None:
    """``module.function`` of one of adaserve's compiled functions, else None."""
    f = getattr(dispatcher, "py_func", None)
    mod = getattr(f, "__module__", "") or ""
    if f is None or not mod.startswith("adaserve."):
        return None
    return f"{mod.removeprefix('adaserve.')}.{f.__name__}"


class _CompileNotice(event.Listener):
    """Says on stderr when one of adaserve's functions is compiled (not when it is
    loaded from the cache: numba fires ``numba:compile`` only for a real compile), and
    how long it took. Nested compiles (a function calling another) count in the
    outermost one; numba holds its compiler lock across them."""

    def __init__(self):
        self.depth = 0
        self.t0 = 0.0
        self.top: str | None = None
        self.announced = False
        self.count = 0  # top-level compiles ended (``compiles``)

    def on_start(self, ev) -> None:
        name = _name(ev.data.get("dispatcher"))
        if name is None:
            return
        self.depth += 1
        if self.depth == 1:
            self.top, self.t0 = name, time.perf_counter()
            if not self.announced:
                self.announced = True
                folder = cache_folder()
                where = f"cached in {folder}" if folder else "not cached: no writable folder"
                _say(f"compiling numba kernels on first use (first run only; {where}): {name}")

    def on_end(self, ev) -> None:
        if _name(ev.data.get("dispatcher")) is None or self.depth == 0:
            return
        self.depth -= 1
        if self.depth == 0:
            self.count += 1
            _say(f"compiled {self.top} (numba) in {time.perf_counter() - self.t0:.1f} s")


_NOTICE: _CompileNotice | None = None


def _install_notice() -> None:
    global _NOTICE
    if _NOTICE is None:
        _NOTICE = _CompileNotice()
        event.register("numba:compile", _NOTICE)
