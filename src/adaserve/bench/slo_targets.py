"""The class SLO targets of a bench run: the engine's classes, or a class table
resolved with an unloaded TPOT (measured or reported by a server)."""

from __future__ import annotations

from adaserve.core.slo import DEFAULT_CLASSES, SLO, SLOClass
from adaserve.errors import AdaServeError


def class_slos(
    class_names,
    slo_scale: float = 1.0,
    engine=None,
    unloaded_tpot_ms: float | None = None,
    classes: tuple[SLOClass, ...] = DEFAULT_CLASSES,
) -> dict[str, SLO]:
    """Per-class SLO: the engine's classes (TPOT resolved from the measured unloaded
    TPOT) or ``classes`` resolved with ``unloaded_tpot_ms``; TPOT times ``slo_scale``.
    A class the engine does not know gets no targets."""
    out: dict[str, SLO] = {}
    for name in class_names:
        if engine is not None:
            known = {c.name for c in engine.cfg.classes}
            base = engine.class_slo(name) if name in known else SLO(cls=name)
        else:
            c = next((c for c in classes if c.name == name), None)
            if c is not None and unloaded_tpot_ms is None and c.tpot_ms is None:
                raise AdaServeError("class TPOT targets need the unloaded TPOT")
            base = c.resolve(unloaded_tpot_ms or 0.0) if c is not None else SLO(cls=name)
        tpot = base.tpot_ms * slo_scale if base.tpot_ms is not None else None
        out[name] = SLO(
            tpot_ms=tpot,
            ttft_ms=base.ttft_ms,
            max_queue_ms=base.max_queue_ms,
            deadline_ms=base.deadline_ms,
            cls=name,
        )
    return out


def class_ranks(classes: tuple[SLOClass, ...] = DEFAULT_CLASSES) -> dict[str, int]:
    """Class name -> its rank (0 = strictest: vLLM's ``priority``)."""
    return {c.name: c.rank for c in classes}
