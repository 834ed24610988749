"""Where compiled code and profiles are cached: adaserve's cache folder
(``$ADASERVE_CACHE``, ``$XDG_CACHE_HOME/adaserve``, ``~/.cache/adaserve``), never the
installed package; a user's own ``NUMBA_CACHE_DIR`` wins. Each case runs a compiled
kernel in a fresh subprocess (numba fixes cache paths at import)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import adaserve
from adaserve.util import jit, paths

PACKAGE = Path(adaserve.__file__).resolve().parent
SRC = PACKAGE.parent

# one small kernel, checked on a case worked by hand: regime 0 stays while u < 0.5
RUN = """
import numpy as np, numba
from adaserve.sim import kernels
out = kernels.walk(np.array([0]), np.array([[0.1, 0.9, 0.2]]), np.array([[0.5, 0.5]]))
assert out.tolist() == [[0, 1, 1]], out
print("CACHE_DIR", repr(numba.config.CACHE_DIR))
"""


def _nb_files(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.suffix in (".nbi", ".nbc")}


def _run(env_extra: dict, drop=("NUMBA_CACHE_DIR", "ADASERVE_CACHE", "XDG_CACHE_HOME")):
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra)
    p = subprocess.run(
        [sys.executable, "-c", RUN], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    return p


def test_numba_cache_lives_in_the_cache_folder(tmp_path):
    before = _nb_files(PACKAGE)
    p = _run({"ADASERVE_CACHE": str(tmp_path / "c")})
    folder = tmp_path / "c" / "numba"
    files = _nb_files(folder)
    assert any(f.name.startswith("kernels.walk-") and f.suffix == ".nbi" for f in files), files
    assert _nb_files(PACKAGE) == before  # nothing written into the package
    # the first run says what it compiles, where it is cached and how long it took
    assert f"compiling numba kernels on first use (first run only; cached in {folder})" in (
        p.stderr
    )
    assert "compiled sim.kernels.walk (numba) in " in p.stderr
    # numba's own setting is left as it was for everyone else in the process
    assert "CACHE_DIR ''" in p.stdout
    # the next run loads the cache: no compile, no message
    again = _run({"ADASERVE_CACHE": str(tmp_path / "c")})
    assert "compil" not in again.stderr
    assert _nb_files(folder) == files


def test_a_users_numba_cache_dir_wins(tmp_path):
    mine = tmp_path / "mine"
    p = _run({"ADASERVE_CACHE": str(tmp_path / "c"), "NUMBA_CACHE_DIR": str(mine)})
    assert _nb_files(mine) and not (tmp_path / "c" / "numba").exists()
    assert f"cached in {mine}" in p.stderr


def test_no_writable_cache_folder_compiles_without_caching(tmp_path, monkeypatch):
    """(here: a file where the folder should be) compiled in each process, and still
    nothing written into the package."""
    (tmp_path / "file").write_text("")
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path / "file" / "sub"))
    assert jit.cache_folder() is None
    before = _nb_files(PACKAGE)

    def twice(x):
        return 2 * x

    f = jit.compiled(twice)
    assert f(21) == 42
    assert type(f._cache).__name__ == "NullCache"  # numba's "no cache"
    assert _nb_files(PACKAGE) == before


def test_cache_dir_precedence(tmp_path, monkeypatch):
    """``$ADASERVE_CACHE``, else ``$XDG_CACHE_HOME/adaserve``, else ``~/.cache/adaserve``
    (the numba folder is ``cache_dir() / "numba"``)."""
    monkeypatch.delenv("ADASERVE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "adaserve"
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path / "own"))
    assert paths.cache_dir() == tmp_path / "own" and (tmp_path / "own").is_dir()
    monkeypatch.delenv("ADASERVE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty counts as unset (XDG's rule)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "adaserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "adaserve"
