"""The garbage collector's view of a serving process: start-up state frozen out of it.

A serving process holds hundreds of thousands of objects from start-up (the models'
modules, torch's, transformers' and FastAPI's import-time state: 410k on the shipped
pair with the server loaded). Python's full collection walks every one of them: 210 ms
on this project's CPU, a stall of every running request. Full collections are rare
(none ran in an 80 s overload run after start-up: one comes only once the objects that
survived into the oldest generation have grown by a quarter), but each one costs that.
Frozen after start-up (``gc.freeze``), they are
out of the collector's reach and a full collection walks only what serving allocates
(under 1 ms), as vLLM freezes its heap once its engine has started. Start-up state is
meant to live as long as the process; what of it would become cyclic garbage later is
not collected. Torch-free.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass

_frozen: HeapFreeze | None = None


@dataclass(frozen=True)
class HeapFreeze:
    """What ``freeze_startup_heap`` did.

    objects:       objects moved out of the collector's reach
    collect_ms:    the full collection just before, which walked them (ms)
    """

    objects: int
    collect_ms: float

    def as_dict(self) -> dict:
        return {"frozen_objects": self.objects, "full_collection_ms": round(self.collect_ms, 1)}


def freeze_startup_heap(clock=time.perf_counter) -> HeapFreeze:
    """Collect once, then freeze every object alive (``gc.freeze``); once per process
    (later calls return the first one's record: a second freeze would also take the
    garbage-to-be of whatever ran in between). ``clock``: seconds."""
    global _frozen
    if _frozen is None:
        t0 = clock()
        gc.collect()
        ms = (clock() - t0) * 1000.0
        gc.freeze()
        _frozen = HeapFreeze(gc.get_freeze_count(), ms)
    return _frozen


def frozen() -> HeapFreeze | None:
    """This process's freeze, None before any."""
    return _frozen
