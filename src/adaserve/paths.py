"""Where the shipped default model pair, its statistics and the shipped traces live."""

from __future__ import annotations

import os
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_TARGET = ASSETS / "target"
DEFAULT_DRAFT = ASSETS / "draft"
DEFAULT_STATS = ASSETS / "pair_stats.json"
TRACES = ASSETS / "traces"  # the Azure LLM inference trace 2023 (README and LICENSE beside it)


def cache_dir() -> Path:
    """Per-user cache directory (hardware profiles); ``ADASERVE_CACHE`` overrides it."""
    base = os.environ.get("ADASERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "adaserve"
    )
    p = Path(base)
    p.mkdir(parents=True, exist_ok=True)
    return p
