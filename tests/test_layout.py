"""The layout shows the architecture: scheduling, policies, the simulator and the
benchmark's workload and metrics import no torch (the engine and the simulator share
them; the simulator runs where torch is not installed)."""

from __future__ import annotations

import subprocess
import sys

TORCH_FREE = (
    "adaserve.core",
    "adaserve.policies",
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
    "adaserve.bench.workload",
    "adaserve.bench.workload_spec",
    "adaserve.bench.arrivals",
    "adaserve.bench.datasets",
    "adaserve.bench.metrics",
    "adaserve.hardware.energy",
    "adaserve.bench.capacity",
    "adaserve.bench.tables",
    "adaserve.bench.markdown",
    "adaserve.bench.report",
    "adaserve.slo",
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
