"""Where the shipped default model pair, its statistics and the shipped traces live."""

from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets"  # src/adaserve/assets
DEFAULT_TARGET = ASSETS / "target"
DEFAULT_DRAFT = ASSETS / "draft"
DEFAULT_STATS = ASSETS / "pair_stats.json"
TRACES = ASSETS / "traces"  # the Azure LLM inference trace 2023 (README and LICENSE beside it)


def cache_root() -> Path:
    """Per-user cache folder (hardware profiles in ``profiles/``, compiled kernels in
    ``numba/``; see docs/caches.md): ``$ADASERVE_CACHE``, else
    ``$XDG_CACHE_HOME/adaserve``, else ``~/.cache/adaserve``. Not created."""
    base = os.environ.get("ADASERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "adaserve"
    )
    return Path(base)


def cache_dir() -> Path:
    """``cache_root()``, created when missing (``OSError`` when it cannot be)."""
    p = cache_root()
    p.mkdir(parents=True, exist_ok=True)
    return p


def data_root() -> Path:
    """Per-user data folder (the usage ledger's SQLite file and spool; see
    docs/usage-ledger.md): ``$ADASERVE_DATA``, else ``$XDG_DATA_HOME/adaserve``, else
    ``~/.local/share/adaserve``. Not created."""
    base = os.environ.get("ADASERVE_DATA") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "adaserve"
    )
    return Path(base)
