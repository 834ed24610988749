"""Helpers shared by the benchmark scripts (held-out prompts, timing)."""

from __future__ import annotations

import hashlib
import sysconfig
import time
from pathlib import Path


def heldout_code_prompts(n: int, min_chars: int = 200, max_chars: int = 1200) -> list[str]:
    """Code snippets from standard-library files of the held-out split (sha1 % 20 == 0)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out: list[str] = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).as_posix()
        if any(
            p in ("test", "tests", "idlelib", "site-packages") for p in f.relative_to(root).parts
        ):
            continue
        if int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 20:
            continue
        text = f.read_text(errors="ignore")
        for start in range(0, max(1, len(text) - max_chars), 3000):
            chunk = text[start : start + max_chars]
            cut = chunk.rfind("\n", min_chars)
            if cut > 0:
                out.append(chunk[: cut + 1])
            if len(out) >= n:
                return out
    return out


class Timer:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.s = time.perf_counter() - self.t0
