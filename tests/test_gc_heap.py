"""Start-up state frozen out of the garbage collector's reach (``util.gc_heap``): a full
collection then walks only what serving allocates. Run in a child process, so that the
test suite's own heap is not frozen."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import gc, json
from adaserve.util import gc_heap

assert gc_heap.frozen() is None
# start-up state: 50k objects in reference cycles, alive for the process's life
startup = []
for i in range(50_000):
    d = {"i": i}
    d["self"] = d
    startup.append(d)
ticks = iter([10.0, 10.25])
first = gc_heap.freeze_startup_heap(clock=lambda: next(ticks))
walked_after = len(gc.get_objects())  # what a full collection now walks
# serving allocates: that is still collected (automatic collections held off meanwhile)
gc.disable()
for i in range(1000):
    d = {}
    d["self"] = d
del d
collected = gc.collect()
gc.enable()
second = gc_heap.freeze_startup_heap()
print(json.dumps(dict(objects=first.objects, ms=first.collect_ms, walked=walked_after,
                      collected=collected, same=second is first,
                      record=gc_heap.frozen().as_dict(), frozen_now=gc.get_freeze_count())))
"""


def test_start_up_state_is_frozen_once_and_serving_garbage_still_collected():
    out = subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, check=True, timeout=120
    )
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["objects"] >= 50_001  # the 50k dicts, their list and import-time state
    assert r["ms"] == 250.0  # the collection before the freeze, on the injected clock
    assert r["walked"] < r["objects"] / 20  # out of the collector's reach
    assert r["collected"] >= 1000  # the serving garbage's cycles
    # a second call freezes nothing more (frozen objects freed by refcount leave the count)
    assert r["same"] and r["objects"] - 10 <= r["frozen_now"] <= r["objects"]
    assert r["record"] == {"frozen_objects": r["objects"], "full_collection_ms": 250.0}
