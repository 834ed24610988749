"""The dataclasses that define a workload and their option parsers.

``WorkloadSpec`` (everything ``build_workload`` draws from), its parts (``LengthDist``
token-length distributions, class mixes, ``Shift`` changes over time) with the
command-line string forms they parse from, and ``WorkItem``, one request of a built
workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaserve.core.slo import SLO
from adaserve.errors import AdaServeError

DEFAULT_CLASS_MIX: tuple[tuple[str, float], ...] = (
    ("interactive", 0.6),
    ("chat", 0.2),
    ("batch", 0.2),
)


class WorkloadError(AdaServeError):
    """A workload option is malformed or its input file unusable."""


# ---------------------------------------------------------------------- lengths
@dataclass(frozen=True)
class LengthDist:
    """Token-length distribution.

    kind ``fixed`` (a), ``uniform`` (integers a..b inclusive) or ``lognormal``
    (median a, log-space sigma b, clipped to [1, cap]).
    Spec strings: ``"64"``, ``"32-128"``, ``"lognormal:100:0.6:512"``.
    """

    kind: str = "uniform"
    a: float = 32
    b: float = 128
    cap: int = 4096

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "lognormal"):
            raise WorkloadError(f"unknown length distribution {self.kind!r}")
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a) or self.cap < 1:
            raise WorkloadError(f"invalid length distribution {self.spec()!r}")

    @property
    def max(self) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        return int(self.cap)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, int(self.a), dtype=np.int64)
        if self.kind == "uniform":
            return rng.integers(int(self.a), int(self.b) + 1, size=n)
        x = rng.lognormal(math.log(self.a), self.b, size=n)
        return np.clip(np.rint(x), 1, self.cap).astype(np.int64)

    def spec(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}-{int(self.b)}"
        return f"lognormal:{self.a:g}:{self.b:g}:{self.cap}"


def parse_length(s: str) -> LengthDist:
    """``"64"`` | ``"32-128"`` | ``"lognormal:MEDIAN:SIGMA[:CAP]"``."""
    s = s.strip()
    try:
        if s.startswith("lognormal:"):
            parts = s.split(":")[1:]
            med, sig = float(parts[0]), float(parts[1])
            cap = int(parts[2]) if len(parts) > 2 else 4096
            return LengthDist("lognormal", med, sig, cap)
        if "-" in s:
            lo, hi = s.split("-", 1)
            return LengthDist("uniform", int(lo), int(hi))
        return LengthDist("fixed", int(s), int(s))
    except (ValueError, IndexError):
        raise WorkloadError(
            f"bad length distribution {s!r}: use N, LO-HI or lognormal:MEDIAN:SIGMA[:CAP]"
        ) from None


# Defaults sized for the CPU-scale shipped pair: the coding class has short prompts and
# short completions, chat medium, batch (summarisation) long prompts.
DEFAULT_INPUT_LEN: tuple[tuple[str, LengthDist], ...] = (
    ("interactive", LengthDist("uniform", 32, 128)),
    ("chat", LengthDist("uniform", 32, 192)),
    ("batch", LengthDist("uniform", 128, 384)),
)
DEFAULT_OUTPUT_LEN: tuple[tuple[str, LengthDist], ...] = (
    ("interactive", LengthDist("uniform", 32, 96)),
    ("chat", LengthDist("uniform", 48, 128)),
    ("batch", LengthDist("uniform", 64, 160)),
)
FALLBACK_INPUT = LengthDist("uniform", 32, 128)
FALLBACK_OUTPUT = LengthDist("uniform", 32, 128)


def parse_length_overrides(
    values: list[str] | None, base: tuple[tuple[str, LengthDist], ...]
) -> tuple[tuple[str, LengthDist], ...]:
    """Apply ``[CLASS=]DIST`` overrides (no class = every class) to ``base``."""
    d = dict(base)
    for v in values or []:
        cls, sep, dist = v.rpartition("=")
        parsed = parse_length(dist)
        if sep:
            d[cls.strip()] = parsed
        else:
            d = {k: parsed for k in d}
            d["*"] = parsed
    return tuple(d.items())


# ---------------------------------------------------------------------- class mix / shifts
def parse_class_mix(s: str) -> tuple[tuple[str, float], ...]:
    """``"interactive:0.6,chat:0.2,batch:0.2"`` -> normalised ((class, share), ...)."""
    out: list[tuple[str, float]] = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, share = part.rpartition(":")
        try:
            x = float(share)
        except ValueError:
            x = -1.0
        if not sep or not name or not x >= 0 or math.isinf(x):
            raise WorkloadError(f"bad class mix entry {part!r}: use CLASS:SHARE,...")
        out.append((name, x))
    total = sum(x for _, x in out)
    if not out or total <= 0:
        raise WorkloadError(f"class mix {s!r} has no positive share")
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise WorkloadError(f"class mix {s!r} names a class twice")
    return tuple((n, x / total) for n, x in out)


def format_class_mix(mix) -> str:
    return ",".join(f"{n}:{x:g}" for n, x in mix)


def strict_share_mix(base: tuple[tuple[str, float], ...], share: float):
    """``base`` with its first (strictest) class at ``share`` and the others rescaled."""
    if not 0 < share < 1:
        raise WorkloadError("strict share must be in (0, 1)")
    first, rest = base[0], base[1:]
    total = sum(x for _, x in rest)
    if not rest:
        return ((first[0], 1.0),)
    if total <= 0:
        return ((first[0], share),) + tuple((c, (1 - share) / len(rest)) for c, _ in rest)
    return ((first[0], share),) + tuple((c, (1 - share) * x / total) for c, x in rest)


@dataclass(frozen=True)
class Shift:
    """A change at time ``at_s`` (seconds from the start).

    kind ``mix`` (value: class mix tuple; arrivals from then on follow it), ``rate``
    (value: new request rate), ``draft-noise`` (value: std of the gaussian noise added
    to the draft logits, in-process only) or ``kv-pressure`` (value: fraction of KV
    blocks held back, in-process only).
    """

    at_s: float
    kind: str
    value: Any

    @property
    def change(self) -> str:
        """The CHANGE part of ``T:CHANGE``."""
        if self.kind == "mix":
            return format_class_mix(self.value)
        return f"{self.kind}:{self.value:g}"

    def describe(self) -> str:
        return f"{self.at_s:g}:{self.change}"

    @property
    def engine_side(self) -> bool:
        return self.kind in ("draft-noise", "kv-pressure")


def parse_shift(s: str) -> Shift:
    """``T:CHANGE`` with CHANGE a class mix, ``draft-noise:X``, ``kv-pressure:F`` or
    ``rate:R``."""
    t, sep, change = s.partition(":")
    try:
        at = float(t)
    except ValueError:
        at = -1.0
    if not sep or not at >= 0 or math.isinf(at):
        raise WorkloadError(f"bad shift {s!r}: use T:CHANGE (T in seconds)")
    head, _, rest = change.partition(":")
    if head in ("draft-noise", "kv-pressure", "rate"):
        try:
            x = float(rest)
        except ValueError:
            raise WorkloadError(f"bad shift {s!r}: {head} needs a number") from None
        if not x >= 0 or math.isinf(x) or (head == "kv-pressure" and x >= 1):
            raise WorkloadError(f"bad shift {s!r}: value out of range")
        if head == "rate" and x <= 0:
            raise WorkloadError(f"bad shift {s!r}: rate must be positive")
        return Shift(at, head, x)
    return Shift(at, "mix", parse_class_mix(change))


# ---------------------------------------------------------------------- spec / items
@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that defines a workload (hashable, JSON-able via ``to_dict``).

    request_rate:  mean arrivals per second (``inf``: all at t = 0)
    duration_s / num_prompts: stop at whichever comes first (at least one must be set)
    slo_scale:     multiplies every class's TPOT target (<1 = stricter)
    class_peaks:   time-varying mix: each class's arrival rate peaks at a different time
    trace_lengths: take prompt/output lengths from the trace (clipped to the class max)
    """

    seed: int = 0
    request_rate: float = 2.0
    burstiness: float = 1.0
    duration_s: float | None = 30.0
    num_prompts: int | None = None
    class_mix: tuple[tuple[str, float], ...] = DEFAULT_CLASS_MIX
    slo_scale: float = 1.0
    input_len: tuple[tuple[str, LengthDist], ...] = DEFAULT_INPUT_LEN
    output_len: tuple[tuple[str, LengthDist], ...] = DEFAULT_OUTPUT_LEN
    dataset: str = "stdlib"
    trace: str | None = None
    trace_lengths: bool = False
    shifts: tuple[Shift, ...] = ()
    class_peaks: bool = False

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise WorkloadError("request rate must be positive")
        if not self.burstiness > 0 or math.isinf(self.burstiness):
            raise WorkloadError("burstiness must be a positive number")
        if self.duration_s is None and self.num_prompts is None:
            raise WorkloadError("give a duration or a number of prompts")
        if self.duration_s is not None and not self.duration_s > 0:
            raise WorkloadError("duration must be positive")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise WorkloadError("number of prompts must be at least 1")
        if math.isinf(self.request_rate) and self.num_prompts is None:
            raise WorkloadError("an infinite request rate needs --num-prompts")
        if not self.slo_scale > 0:
            raise WorkloadError("SLO scale must be positive")

    def to_dict(self) -> dict:
        return {
            "seed": self.seed,
            "request_rate": None if math.isinf(self.request_rate) else self.request_rate,
            "burstiness": self.burstiness,
            "duration_s": self.duration_s,
            "num_prompts": self.num_prompts,
            "class_mix": dict(self.class_mix),
            "slo_scale": self.slo_scale,
            "input_len": {c: d.spec() for c, d in self.input_len},
            "output_len": {c: d.spec() for c, d in self.output_len},
            "dataset": self.dataset,
            "trace": self.trace,
            "trace_lengths": self.trace_lengths,
            "shifts": [s.describe() for s in self.shifts],
            "class_peaks": self.class_peaks,
        }


@dataclass
class WorkItem:
    """One request of a workload. ``prompt`` is text (None without a tokenizer);
    ``prompt_ids`` the token ids (None when only text is known). ``tpot_ms`` /
    ``ttft_ms`` override the class targets for this request (None = class default)."""

    idx: int
    arrival_s: float
    cls: str
    prompt: str | None
    prompt_ids: list[int] | None
    prompt_len: int
    max_tokens: int
    tpot_ms: float | None = None
    ttft_ms: float | None = None
    meta: dict = field(default_factory=dict)

    def payload_prompt(self) -> str | list[int]:
        """What to send: token ids when known (exact length), else the text."""
        if self.prompt_ids is not None:
            return list(self.prompt_ids)
        return self.prompt or ""


def item_slo(item: WorkItem, base: SLO | None) -> SLO:
    """The class SLO with the item's own overrides."""
    base = base or SLO(cls=item.cls)
    return SLO(
        tpot_ms=item.tpot_ms if item.tpot_ms is not None else base.tpot_ms,
        ttft_ms=item.ttft_ms if item.ttft_ms is not None else base.ttft_ms,
        max_queue_ms=base.max_queue_ms,
        deadline_ms=base.deadline_ms,
        cls=item.cls,
        on_overload=base.on_overload,
    )
