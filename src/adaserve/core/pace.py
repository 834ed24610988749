"""Each class's measured decode pace, overall and by load (admission's evidence).

Per class, from the passes it decoded in: ms per pass, tokens per pass (1 + accepted),
the batch it was measured at and when it last decoded (running means), and the same
per load bucket (``by_load``: decoders, buckets ``LOAD_BUCKET`` apart). Admission
scales the overall pace to a load with the hardware model, and trusts the pace measured
lately at a load at least as high when it is lower (``measured_at``): the planner
shrinks trees as the batch grows, which the model's scaling does not know.
Torch-free.
"""

from __future__ import annotations

import math

CLASS_EWMA = 0.05  # weight of the newest pass in a class's running means
SEEN_WINDOW_S = 60.0  # a stricter class decoding this recently keeps its room
MIN_FINISHES = 4  # below this many finishes in the window the rate is unknown
FINISH_WINDOW_S = 30.0  # finishes counted for the finish rate
# the load buckets (``by_load``): decoders 20% apart, each a running mean (weight of the
# newest pass) that counts for this long after its last pass. Chosen in the simulator
# (docs/results/admission-issue31.md, third pass): 10 s and 30 s gave 9.7/1.4/1.4% and
# 9.4/0.3/0.7% refused at 0.8x capacity (seeds 1-3), 60 s 9.0/0.3/0.7%
LOAD_BUCKET = 1.2
LOAD_EWMA = 0.1
LOAD_FRESH_S = 30.0


def _mix(old: float | None, new: float, w: float) -> float:
    return new if old is None else (1.0 - w) * old + w * new


def bucket(b: float) -> int:
    """The load bucket of a batch of ``b`` decoders."""
    return int(round(math.log(max(b, 1.0)) / math.log(LOAD_BUCKET)))


class ClassPaces:
    """The measured pace of every class (see the module docstring)."""

    def __init__(self) -> None:
        self.tokens_per_pass: dict[str, float] = {}  # class -> tokens per decode pass
        self.pass_ms: dict[str, float] = {}  # class -> ms of the passes it decoded in
        self.batch: dict[str, float] = {}  # class -> decoders in those passes
        self.seen: dict[str, float] = {}  # class -> when it last decoded
        # class -> load bucket -> [ms per pass, tokens per pass, when last seen]
        self.by_load: dict[str, dict[int, list[float]]] = {}

    def observe(self, cls: str, tokens: list[float], dur_ms: float, b: int, t_end: float) -> None:
        """Class ``cls`` decoded in a pass of ``dur_ms`` with ``b`` decoders, ending at
        ``t_end``; ``tokens``: what each of its requests got from it."""
        tp = sum(tokens) / len(tokens)
        self.tokens_per_pass[cls] = _mix(self.tokens_per_pass.get(cls), tp, CLASS_EWMA)
        self.pass_ms[cls] = _mix(self.pass_ms.get(cls), dur_ms, CLASS_EWMA)
        self.seen[cls] = t_end
        self.batch[cls] = _mix(self.batch.get(cls), float(b), CLASS_EWMA)
        cells = self.by_load.setdefault(cls, {})
        cell = cells.get(bucket(b))
        if cell is None:
            cells[bucket(b)] = [dur_ms, tp, t_end]
        else:
            cell[0] = _mix(cell[0], dur_ms, LOAD_EWMA)
            cell[1] = _mix(cell[1], tp, LOAD_EWMA)
            cell[2] = t_end

    def pace_ms(self, cls: str) -> float | None:
        """The ms per token ``cls`` runs at: its ms per pass over its tokens per pass
        (None until measured)."""
        ms = self.pass_ms.get(cls)
        return None if ms is None else ms / self.tokens_per_pass[cls]

    def measured_at(self, cls: str, n: float, now: float) -> float | None:
        """The ms per token ``cls`` was measured at in the last ``LOAD_FRESH_S`` at the
        nearest load at least ``n`` (None: no such load measured lately)."""
        cells = self.by_load.get(cls, {})
        k = bucket(n)
        above = [b for b, c in cells.items() if b >= k and now - c[2] <= LOAD_FRESH_S]
        if not above:
            return None
        c = cells[min(above)]
        return c[0] / c[1]
