"""The layout shows the architecture: scheduling, policies, the simulator and the
benchmark's workload and metrics import no torch (the engine and the simulator share
them; the simulator runs where torch is not installed)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

TORCH_FREE = (
    "adaserve.core",
    "adaserve.policies",
    "adaserve.hardware",  # the hardware model, calibration, drift, power, energy
    "adaserve.util",
    "adaserve.sim",
    "adaserve.structured",
    "adaserve.ledger",  # the usage ledger: `adaserve usage` reads it without the engine
)
TORCH_FREE_MODULES = (
    "adaserve.cluster.routing",
    # the Ray actor shared by replicas, and what the front door merges, stay light
    "adaserve.cluster.ledger",
    "adaserve.cluster.shared_quotas",
    "adaserve.cluster.merge",
    "adaserve.cluster.asgi",
    "adaserve.cluster.seat_routes",  # the front door's seat map
    "adaserve.bench.workload",
    "adaserve.bench.workload_spec",
    "adaserve.bench.arrivals",
    "adaserve.bench.datasets",
    "adaserve.bench.metrics",
    "adaserve.bench.capacity",
    "adaserve.bench.tables",
    "adaserve.bench.markdown",
    "adaserve.bench.report",
    "adaserve.config",
    "adaserve.errors",
    "adaserve.server.config",
    "adaserve.server.auth",
    "adaserve.server.quotas",
    "adaserve.server.slo_resolution",
    "adaserve.server.usage",
)

PROBE = """
import importlib, pkgutil, sys, json
names = []
for pkg in {pkgs!r}:
    mod = importlib.import_module(pkg)
    names.append(pkg)
    for info in pkgutil.walk_packages(mod.__path__, pkg + "."):
        importlib.import_module(info.name)
        names.append(info.name)
for name in {mods!r}:
    importlib.import_module(name)
    names.append(name)
print(json.dumps({{"modules": names, "torch": "torch" in sys.modules}}))
"""


def test_torch_free_packages_import_no_torch():
    import json

    code = PROBE.format(pkgs=TORCH_FREE, mods=TORCH_FREE_MODULES)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert "adaserve.core.scheduler" in res["modules"] and "adaserve.sim.loop" in res["modules"]
    assert not res["torch"], "a torch-free module imported torch"


def test_the_probe_sees_torch_when_imported():
    """The check can fail: the engine package does import torch."""
    import json

    code = PROBE.format(pkgs=("adaserve.core",), mods=("adaserve.engine",))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1])["torch"]


# ---------------------------------------------------------------- who may import whom
# One unit per folder of src/adaserve and per module left at its top. A unit imports only
# the units listed here (function-local and TYPE_CHECKING imports included); the table
# has no cycle, so no two units import each other. ``__main__`` modules are entry points
# that nothing imports: they may import anything. docs/architecture.md shows the table.
ALLOWED = {
    "errors": set(),
    "util": set(),
    "structured": {"errors"},
    "sampling": {"errors", "structured"},
    "core": {"errors"},
    "hardware": {"core"},
    "policies": {"core", "errors", "hardware", "util"},
    "text": {"errors", "sampling"},
    "config": {"core", "errors", "hardware", "policies", "text"},
    "ledger": {"util"},
    "models": {"errors", "util"},
    "kv": {"models"},
    "spec_decode": {"core", "kv", "models", "sampling", "structured"},
    "engine": {
        "config", "core", "errors", "hardware", "kv", "models", "policies", "sampling",
        "spec_decode", "structured", "text", "util",
    },
    "train": {"engine", "models", "sampling", "util"},
    "bench": {
        "config", "core", "engine", "errors", "hardware", "policies", "sampling", "spec_decode",
        "text", "train", "util",
    },
    "server": {
        "__init__", "config", "core", "engine", "errors", "ledger", "models", "sampling",
        "spec_decode", "structured", "text", "util",
    },
    "cluster": {"config", "errors", "ledger", "policies", "server", "util"},
    "sim": {"bench", "cluster", "core", "errors", "hardware", "policies", "text", "util"},
    "cli": {
        "__init__", "config", "engine", "errors", "models", "sampling", "sim", "text", "util",
    },
    "__init__": {"core", "engine", "sampling", "structured"},
}  # fmt: skip
# (sim is torch-free too, but reaches bench and cluster modules that are: the probe checks it)
TORCH_FREE_UNITS = ("core", "policies", "hardware", "structured", "ledger", "util")
AT_MOST_AT_TOP = 6  # issue 34: the public vocabulary, the CLI entry and the errors

SRC = Path(__file__).resolve().parent.parent / "src" / "adaserve"


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "adaserve":
        return None
    if len(parts) == 1:
        return "__init__"
    head = parts[1]
    if (SRC / head).is_dir() or (SRC / f"{head}.py").exists():
        return head
    return "__init__"  # a name of the package itself (``from adaserve import LLM``)


def _imports(path: Path, module: str):
    """Every adaserve module ``path`` imports, anywhere in it, with the line."""
    pkg = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "adaserve":  # ``from adaserve import x``: x a module or a name
                for a in node.names:
                    yield f"adaserve.{a.name}", node.lineno
            else:
                yield target, node.lineno


def _edges():
    edges: dict[str, dict[str, list[str]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        if rel.name == "__main__":
            continue
        module = ".".join(("adaserve", *rel.parts)).removesuffix(".__init__")
        here = "__init__" if rel.parts == ("__init__",) else rel.parts[0]
        for target, line in _imports(path, module):
            there = _unit(target)
            if there is not None and there != here:
                edges.setdefault(here, {}).setdefault(there, []).append(f"{rel}.py:{line}")
    return edges


def test_every_unit_is_in_the_table():
    units = {p.stem if p.suffix == ".py" else p.name for p in SRC.iterdir()}
    units = {u for u in units if (SRC / u).is_dir() and (SRC / u / "__init__.py").exists()}
    units |= {p.stem for p in SRC.glob("*.py") if p.stem != "__main__"}
    assert units == set(ALLOWED), f"units not in the table: {units ^ set(ALLOWED)}"
    assert len(list(SRC.glob("*.py"))) <= AT_MOST_AT_TOP


def test_imports_follow_the_table():
    bad = [
        f"{a} -> {b} ({', '.join(where[:3])})"
        for a, outs in _edges().items()
        for b, where in outs.items()
        if b not in ALLOWED.get(a, set())
    ]
    assert not bad, "imports the table does not allow:\n" + "\n".join(bad)


def test_the_table_has_no_cycle():
    """No two units import each other (directly or around a loop)."""
    done: set[str] = set()

    def visit(u: str, path: tuple[str, ...]) -> None:
        assert u not in path, f"cycle: {' -> '.join((*path, u))}"
        if u in done:
            return
        for v in ALLOWED.get(u, ()):
            visit(v, (*path, u))
        done.add(u)

    for u in ALLOWED:
        visit(u, ())


def test_torch_free_units_need_nothing_with_torch():
    """What a torch-free unit may import is torch-free too (the probe above checks
    the modules themselves)."""
    for u in TORCH_FREE_UNITS:
        stack, seen = [u], set()
        while stack:
            v = stack.pop()
            if v in seen:
                continue
            seen.add(v)
            stack.extend(ALLOWED[v])
        with_torch = seen & {"engine", "models", "kv", "spec_decode", "train", "server", "api"}
        assert not with_torch, f"{u} may import {with_torch}"


def test_the_check_catches_a_cycle(tmp_path):
    """The edge finder sees function-local imports."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from adaserve.server.app import create_app\n")
    assert ("adaserve.server.app", 2) in list(_imports(f, "adaserve.core.m"))
