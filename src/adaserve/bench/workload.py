"""Benchmark workloads: arrivals, SLO classes, prompts and lengths, all from one seed.

A workload is a list of ``WorkItem`` built by ``build_workload(spec)``. Everything
random (arrival gaps, class draws, lengths, prompt choice) comes from independent
streams of ``numpy.random.SeedSequence(spec.seed)``, so the same spec gives the same
items on every run and every policy sees the identical workload.

Arrivals: gamma-distributed gaps with shape ``burstiness`` and mean ``1/rate``
(``burstiness`` = 1 is a Poisson process; < 1 is burstier; coefficient of variation
``1/sqrt(burstiness)``), or the timestamps of a trace file rescaled to the requested
mean rate (the Azure LLM inference trace CSV format is accepted).

Prompts (``dataset``):

- ``stdlib`` (default): code snippets from the running interpreter's standard-library
  ``.py`` files whose ``sha1(relative path) % 20 == 0`` -- the held-out split that the
  shipped model pair was not trained on.
- ``random``: random token ids (or random words when a tokenizer is given).
- a ShareGPT-format ``.json`` / ``.jsonl`` file: the first human turn is the prompt,
  the first reply's length the output length; an entry may carry its own SLO
  (``"slo": {"tpot_ms": .., "ttft_ms": ..}`` and/or ``"slo_class"``). Plain entries
  ``{"prompt": .., "output_len": ..}`` are accepted too.
"""

from __future__ import annotations

import csv
import datetime as _dt
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from adaserve.errors import AdaServeError
from adaserve.slo import SLO

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


def _dist_for(table: tuple[tuple[str, LengthDist], ...], cls: str, fallback: LengthDist):
    d = dict(table)
    return d.get(cls) or d.get("*") or fallback


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
    value: object

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


# ---------------------------------------------------------------------- arrivals
def gamma_arrivals(
    rng: np.random.Generator,
    rate: float,
    burstiness: float,
    duration_s: float | None,
    num: int | None,
    rate_changes: list[tuple[float, float]] | None = None,
) -> np.ndarray:
    """Arrival times (s) of a gamma renewal process; ``rate_changes`` = [(t, rate)]."""
    if math.isinf(rate):
        return np.zeros(int(num or 0))
    changes = sorted(rate_changes or [])
    out: list[float] = []
    t = 0.0
    limit = num if num is not None else 10_000_000
    while len(out) < limit:
        r = rate
        for at, new in changes:
            if t >= at:
                r = new
        t += float(rng.gamma(burstiness, 1.0 / (r * burstiness)))
        if duration_s is not None and t >= duration_s:
            break
        out.append(t)
    return np.asarray(out, dtype=float)


def _parse_timestamp(s: str) -> float:
    """Seconds since the epoch of ``YYYY-MM-DD HH:MM:SS[.fffffff]`` (7 digits allowed)."""
    s = s.strip()
    date, _, clock = s.partition(" ") if " " in s else s.partition("T")
    hms, _, frac = clock.partition(".")
    d = _dt.datetime.fromisoformat(f"{date} {hms}").replace(tzinfo=_dt.timezone.utc)
    return d.timestamp() + (float(f"0.{frac}") if frac else 0.0)


@dataclass(frozen=True)
class TraceRows:
    times_s: np.ndarray  # seconds from the first row
    context_tokens: np.ndarray | None
    generated_tokens: np.ndarray | None


def load_trace(path: str | Path) -> TraceRows:
    """Read a trace: Azure LLM inference CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``),
    a CSV with an ``arrival_s``/``timestamp`` column, or one arrival time (s) per line."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read trace {path}: {e}") from None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        raise WorkloadError(f"trace {path} is empty")
    head = lines[0].lower()
    times: list[float] = []
    ctx: list[int] = []
    gen: list[int] = []
    try:
        if any(c.isalpha() for c in head):
            rows = list(csv.DictReader(lines))
            keys = {k.lower(): k for k in rows[0]} if rows else {}
            tkey = keys.get("timestamp") or keys.get("arrival_s") or keys.get("arrival_time")
            if tkey is None:
                raise WorkloadError(f"trace {path}: no TIMESTAMP / arrival_s column")
            ckey, gkey = keys.get("contexttokens"), keys.get("generatedtokens")
            for row in rows:
                v = row[tkey].strip()
                try:
                    times.append(float(v))
                except ValueError:
                    times.append(_parse_timestamp(v))
                if ckey and gkey:
                    ctx.append(int(row[ckey]))
                    gen.append(int(row[gkey]))
        else:
            times = [float(ln.split(",")[0]) for ln in lines]
    except (ValueError, KeyError) as e:
        raise WorkloadError(f"trace {path}: malformed row ({e})") from None
    order = np.argsort(np.asarray(times), kind="stable")
    t = np.asarray(times, dtype=float)[order]
    t = t - t[0]
    c = np.asarray(ctx)[order] if ctx else None
    g = np.asarray(gen)[order] if gen else None
    return TraceRows(t, c, g)


def trace_arrivals(
    rows: TraceRows, rate: float, duration_s: float | None, num: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """The first N trace arrivals, time-scaled so that their window has mean ``rate``.

    N = ``num`` and/or ``round(rate * duration_s)`` (the smaller). The window ends at the
    (N+1)-th arrival, mapped to ``N / rate`` seconds, so the pattern (bursts, lulls) is
    the trace's and the mean rate is the requested one. A trace shorter than N rows is
    repeated. Returns (times, row indices into ``rows``).
    """
    t = rows.times_s
    if len(t) < 2 or t[-1] <= 0:
        raise WorkloadError("trace needs at least two distinct timestamps")
    counts = [num] if num is not None else []
    if duration_s is not None and not math.isinf(rate):
        counts.append(max(1, round(rate * duration_s)))
    n = min(counts)
    if math.isinf(rate):
        return np.zeros(n), np.arange(n) % len(t)
    period = t[-1] + t[-1] / (len(t) - 1)
    reps = -(-(n + 1) // len(t))
    tiled = np.concatenate([t + k * period for k in range(reps)])
    scale = (n / rate) / tiled[n]
    return tiled[:n] * scale, np.arange(n) % len(t)


# ---------------------------------------------------------------------- datasets
_stdlib_cache: list[tuple[str, str]] | None = None


def heldout_stdlib_files() -> list[tuple[str, str]]:
    """(relative path, text) of the interpreter's held-out stdlib files, sorted."""
    global _stdlib_cache
    if _stdlib_cache is None:
        from adaserve.train.corpus import is_heldout, list_files, stdlib_root

        root = stdlib_root()
        out = []
        for rel in list_files(root):
            if not is_heldout(rel):
                continue
            text = (root / rel).read_bytes().decode("utf-8", errors="replace")
            if len(text.splitlines()) >= 20:
                out.append((rel, text))
        if not out:
            raise WorkloadError("no held-out standard-library files found")
        _stdlib_cache = out
    return _stdlib_cache


def is_heldout_path(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode("utf-8")).hexdigest(), 16) % 20 == 0


@dataclass
class _Entry:
    text: str
    output_len: int | None = None
    cls: str | None = None
    tpot_ms: float | None = None
    ttft_ms: float | None = None
    reply: str | None = None


def load_sharegpt(path: str | Path) -> list[_Entry]:
    """Entries of a ShareGPT-format JSON list or JSONL file (see module docstring)."""
    p = Path(path)
    try:
        raw = p.read_text()
    except OSError as e:
        raise WorkloadError(f"cannot read dataset {path}: {e}") from None
    try:
        data = json.loads(raw)
        if isinstance(data, dict):
            data = data.get("data") or [data]
    except json.JSONDecodeError:
        try:
            data = [json.loads(ln) for ln in raw.splitlines() if ln.strip()]
        except json.JSONDecodeError as e:
            raise WorkloadError(f"dataset {path} is neither JSON nor JSONL: {e}") from None
    out: list[_Entry] = []
    for d in data:
        if not isinstance(d, dict):
            continue
        text, reply, out_len = None, None, d.get("output_len")
        conv = d.get("conversations") or d.get("conversation") or d.get("messages")
        if isinstance(conv, list) and conv:
            for i, turn in enumerate(conv):
                if not isinstance(turn, dict):
                    continue
                role = turn.get("from") or turn.get("role")
                if text is None and role in ("human", "user"):
                    text = turn.get("value") or turn.get("content")
                    nxt = conv[i + 1] if i + 1 < len(conv) else None
                    if isinstance(nxt, dict):
                        reply = nxt.get("value") or nxt.get("content")
                    break
        elif isinstance(d.get("prompt"), str):
            text = d["prompt"]
            reply = d.get("completion") or d.get("response")
        if not isinstance(text, str) or not text.strip():
            continue
        slo = d.get("slo") if isinstance(d.get("slo"), dict) else {}
        cls = d.get("slo_class") if isinstance(d.get("slo_class"), str) else None
        e = _Entry(text=text, cls=cls, reply=reply if isinstance(reply, str) else None)
        if isinstance(out_len, int) and out_len > 0:
            e.output_len = out_len
        elif isinstance(reply, str) and reply:
            e.output_len = -len(reply)  # characters; converted with the tokenizer later
        for k in ("tpot_ms", "ttft_ms"):
            v = slo.get(k)
            if isinstance(v, (int, float)) and v > 0:
                setattr(e, k, float(v))
        out.append(e)
    if not out:
        raise WorkloadError(f"dataset {path} has no usable entries")
    return out


def _ids_from_text(text: str, n: int, vocab_size: int) -> list[int]:
    """Token ids without a tokenizer: the text's bytes mapped into [1, V-1)."""
    hi = max(2, vocab_size - 2)
    b = text.encode("utf-8", errors="replace")
    while len(b) < n:
        b = b + b" " + b
    return [1 + (x % hi) for x in b[:n]]


_WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "or",
    "at",
    "an",
    "value",
    "data",
    "list",
    "return",
    "function",
    "class",
    "model",
    "request",
    "time",
    "token",
    "cache",
    "server",
]


# ---------------------------------------------------------------------- build
def _class_weights(spec: WorkloadSpec, t: float, horizon: float) -> list[tuple[str, float]]:
    mix = list(spec.class_mix)
    for s in sorted(spec.shifts, key=lambda s: s.at_s):
        if s.kind == "mix" and t >= s.at_s:
            mix = list(s.value)
    if spec.class_peaks and horizon > 0:
        k = len(mix)
        out = []
        for i, (c, w) in enumerate(mix):
            peak = (i + 0.5) / k
            out.append((c, w * (1.0 + 0.9 * math.cos(2 * math.pi * (t / horizon - peak)))))
        return out
    return mix


def build_workload(spec: WorkloadSpec, tokenizer=None, vocab_size: int | None = None):
    """The items of ``spec`` in arrival order (deterministic in ``spec.seed``).

    With a tokenizer, ``prompt_ids`` is the source text's ids cut to the drawn length and
    ``prompt`` their decoded text. Without one but with ``vocab_size``, ``prompt_ids`` is
    synthesised from the text's bytes (random ids for ``dataset="random"``) and
    ``prompt`` is None. With neither, only ``prompt`` is set (text cut to about four
    characters per token).
    """
    ss = np.random.SeedSequence(spec.seed)
    r_arr, r_cls, r_len, r_prompt = (np.random.default_rng(s) for s in ss.spawn(4))
    rate_changes = [(s.at_s, float(s.value)) for s in spec.shifts if s.kind == "rate"]
    trace_idx = None
    rows = None
    if spec.trace:
        rows = load_trace(spec.trace)
        arrivals, trace_idx = trace_arrivals(
            rows, spec.request_rate, spec.duration_s, spec.num_prompts
        )
    else:
        arrivals = gamma_arrivals(
            r_arr,
            spec.request_rate,
            spec.burstiness,
            spec.duration_s,
            spec.num_prompts,
            rate_changes,
        )
    n = len(arrivals)
    horizon = spec.duration_s or (float(arrivals[-1]) if n else 0.0)

    entries: list[_Entry] | None = None
    if spec.dataset not in ("stdlib", "random"):
        entries = load_sharegpt(spec.dataset)
        order = r_prompt.permutation(len(entries))
    elif spec.dataset == "stdlib":
        files = heldout_stdlib_files()

    items: list[WorkItem] = []
    u_cls = r_cls.random(n)
    for i in range(n):
        t = float(arrivals[i])
        entry = entries[int(order[i % len(entries)])] if entries is not None else None
        weights = _class_weights(spec, t, horizon)
        if entry is not None and entry.cls:
            cls = entry.cls
        else:
            total = sum(w for _, w in weights)
            acc, cls = 0.0, weights[-1][0]
            for c, w in weights:
                acc += w / total
                if u_cls[i] < acc:
                    cls = c
                    break
        in_d = _dist_for(spec.input_len, cls, FALLBACK_INPUT)
        out_d = _dist_for(spec.output_len, cls, FALLBACK_OUTPUT)
        plen = int(in_d.sample(r_len, 1)[0])
        olen = int(out_d.sample(r_len, 1)[0])
        if spec.trace_lengths and rows is not None and rows.context_tokens is not None:
            j = int(trace_idx[i])
            plen = int(np.clip(rows.context_tokens[j], 1, in_d.max))
            olen = int(np.clip(rows.generated_tokens[j], 1, out_d.max))
        text: str | None
        meta: dict = {}
        if entry is not None:
            text = entry.text
            if entry.output_len is not None:
                if entry.output_len > 0:
                    olen = min(entry.output_len, out_d.max)
                elif tokenizer is not None and entry.reply:
                    olen = int(np.clip(len(tokenizer.encode(entry.reply)), 1, out_d.max))
                else:  # about four characters per token
                    olen = int(np.clip(-entry.output_len // 4, 1, out_d.max))
        elif spec.dataset == "stdlib":
            rel, src = files[int(r_prompt.integers(len(files)))]
            lines = src.splitlines(keepends=True)
            start = int(r_prompt.integers(0, max(1, len(lines) - 10)))
            text = "".join(lines[start:])
            meta = {"file": rel, "line": start + 1}
        else:
            text = " ".join(_WORDS[int(k)] for k in r_prompt.integers(len(_WORDS), size=plen * 2))
        if entry is not None:
            plen = in_d.max  # a dataset prompt is used whole, up to the class maximum
        if tokenizer is not None:
            chars = max(64, plen * 8)
            ids = tokenizer.encode(text[:chars])
            while len(ids) < plen and len(text[:chars]) < len(text):
                chars *= 2
                ids = tokenizer.encode(text[:chars])
            ids = ids[:plen]
            if not ids:
                ids = tokenizer.encode("x")
            prompt_ids = ids
            prompt = tokenizer.decode(ids)
        elif vocab_size is not None:
            if entry is not None:
                plen = min(max(1, len(text.encode()) // 4), plen)
            if spec.dataset == "random":
                prompt_ids = [int(x) for x in r_prompt.integers(1, vocab_size - 1, size=plen)]
            else:
                prompt_ids = _ids_from_text(text, plen, vocab_size)
            prompt = None
        else:
            prompt_ids = None
            prompt = text[: plen * 4]
        items.append(
            WorkItem(
                idx=i,
                arrival_s=t,
                cls=cls,
                prompt=prompt,
                prompt_ids=prompt_ids,
                prompt_len=len(prompt_ids) if prompt_ids is not None else plen,
                max_tokens=max(1, olen),
                tpot_ms=entry.tpot_ms if entry is not None else None,
                ttft_ms=entry.ttft_ms if entry is not None else None,
                meta=meta,
            )
        )
    return items


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


def item_slo(item: WorkItem, base: SLO | None) -> SLO:
    """The class SLO with the item's own overrides."""
    base = base or SLO(cls=item.cls)
    return SLO(
        tpot_ms=item.tpot_ms if item.tpot_ms is not None else base.tpot_ms,
        ttft_ms=item.ttft_ms if item.ttft_ms is not None else base.ttft_ms,
        max_queue_ms=base.max_queue_ms,
        deadline_ms=base.deadline_ms,
        cls=item.cls,
    )
