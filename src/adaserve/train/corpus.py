"""Training corpus: the running interpreter's standard-library ``.py`` source.

Files are listed in sorted order (deterministic); ``test``/``tests``/``idlelib``/
``site-packages`` directories are skipped. A file is held out (never trained on) when
``sha1(relative path) % 20 == 0``.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})
HELDOUT_MODULUS = 20


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """Stable split by file name: about 1 file in 20 is held out."""
    h = int(hashlib.sha1(rel_path.encode("utf-8")).hexdigest(), 16)
    return h % HELDOUT_MODULUS == 0


@dataclass(frozen=True)
class SourceFile:
    rel: str
    text: str


def list_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of all corpus files, sorted."""
    root = root or stdlib_root()
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                out.append(Path(dirpath, f).relative_to(root).as_posix())
    return sorted(out)


def load_split(split: str, root: Path | None = None, every: int = 1) -> list[SourceFile]:
    """Files of ``split`` ("train" or "heldout"); ``every`` > 1 keeps every n-th file (smoke)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"unknown split {split!r}")
    root = root or stdlib_root()
    want_heldout = split == "heldout"
    files = [r for r in list_files(root) if is_heldout(r) == want_heldout]
    files = files[::every]
    out = []
    for rel in files:
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")
        if text.strip():
            out.append(SourceFile(rel, text))
    return out


def heldout_prompt_texts(files: list[SourceFile], per_file: int = 2) -> list[str]:
    """Deterministic prompt texts: each starts at a line boundary inside a held-out file.

    For ``per_file`` = n, starts are at lines len/(n+1), 2*len/(n+1), ...; the text runs to
    the end of the file (callers truncate after tokenization).
    """
    out = []
    for f in files:
        lines = f.text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        for j in range(1, per_file + 1):
            start = j * len(lines) // (per_file + 1)
            out.append("".join(lines[start:]))
    return out
