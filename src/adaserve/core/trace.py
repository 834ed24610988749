"""What one iteration did (``StepTrace``), and what a run makes of its traces: the
timeline samples and the energy tally (``RunRecorder``), for the engine's in-process
benchmark and the simulator alike."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from adaserve.core.counters import Counters, admission_summary
from adaserve.core.policy import Plan


class DeviceEnergy(Protocol):
    """What a run's energy is priced with (``hardware.energy.DeviceEnergy``)."""

    def joules(self, flops: float, bytes_moved: float) -> float: ...

    def as_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class DraftWork:
    """The draft model's forward passes in one step: the one definition the engine
    (what its drafter ran), the simulator (what its synthetic drafter would run), the
    price (``HardwareModel.draft_passes_ms``) and the energy tally share.

    catchup:       tokens of the first pass (the draft caching what it has not seen)
    steps:         tokens fed at each later pass (the trees' frontiers), in order
    kv_tokens:     context tokens the passes attended, summed over the passes
    request_steps: speculating requests x their draft depth (the host's tree work)
    drafted:       candidate nodes produced
    requests:      speculating requests (each tree's verification on the host)
    """

    catchup: int = 0
    steps: tuple[int, ...] = ()
    kv_tokens: int = 0
    request_steps: int = 0
    drafted: int = 0
    requests: int = 0

    @classmethod
    def of_trees(cls, trees: Iterable[tuple[int, int, int, int]], drafted: int = 0) -> DraftWork:
        """The passes a drafter runs for ``trees``, (context tokens, tokens the draft has
        cached, depth, width) per request: one catch-up pass over what the draft has
        not cached (attending what it has), then pass t = 1 .. depth - 1 over the w
        frontier nodes of depth t of each request drafting that deep, attending its
        context and the w (t - 1) nodes fed before (``spec_decode.draft.expand``;
        ``tests/test_draft_work.py`` holds the engine's passes to this count)."""
        trees = list(trees)
        if not trees:
            return cls()
        depth = max(d for _, _, d, _ in trees)
        steps, steps_kv = [0] * (depth - 1), [0] * (depth - 1)
        for context, _, d, w in trees:
            for t in range(1, d):
                steps[t - 1] += w
                steps_kv[t - 1] += context + w * (t - 1)
        return cls(
            catchup=sum(c - cached for c, cached, _, _ in trees),
            steps=tuple(steps),
            kv_tokens=sum(cached for _, cached, _, _ in trees) + sum(steps_kv),
            request_steps=sum(d for _, _, d, _ in trees),
            drafted=drafted,
            requests=len(trees),
        )

    @property
    def passes(self) -> int:
        """The draft's forward passes (0 when nothing was drafted)."""
        return 1 + len(self.steps) if self.request_steps else 0

    @property
    def tokens(self) -> int:
        """Tokens the draft processed over its passes."""
        return self.catchup + sum(self.steps) if self.request_steps else 0


@dataclass
class StepTrace:
    """One iteration's decisions and outcome.

    t_start / t_end: clock seconds at the step's start (admission, views) and at commit
    acc_by_rank: the calibrated acceptance by sibling rank the policy was shown
    admitted:    rids admitted at the start of this step, in order
    preempted:   rids preempted while reserving KV, in order
    cached:      rid -> tokens found in the prefix cache, for each request admitted
    prefill:     rid -> prefill tokens run in this pass
    decode:      rids decoding in this pass (admission order)
    spec:        rid -> (depth, width) of the drafted tree
    classes:     rid -> class it arrived in, for every request in the pass
    tree_nodes:  rid -> candidate nodes verified (0 = root only)
    accepted:    rid -> candidates accepted
    expected:    rid -> the verified candidates' accepted tokens expected by the draft's
                 calibrated confidence (``StepOutcome.expected``)
    tokens:      tokens in the verification pass (prefill + roots + candidates)
    kv_tokens:   context tokens the pass attends (cached + new, per request)
    prefill_pairs: new x context token pairs of its prefill chunks (``Batch.prefill_pairs``)
    draft:       the draft model's passes (``DraftWork``)
    predicted_ms: the profile's prediction of this pass (0: no profile)
    stall:       the cause when the pass ran over 3x its prediction (``core.stalls``)
    """

    plan: Plan
    t_start: float = 0.0
    t_end: float = 0.0
    acc_by_rank: tuple[float, ...] = ()
    admitted: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    cached: dict[int, int] = field(default_factory=dict)
    prefill: dict[int, int] = field(default_factory=dict)
    decode: list[int] = field(default_factory=list)
    spec: dict[int, tuple[int, int]] = field(default_factory=dict)
    classes: dict[int, str] = field(default_factory=dict)
    tree_nodes: dict[int, int] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)
    expected: dict[int, float] = field(default_factory=dict)
    tokens: int = 0
    kv_tokens: int = 0
    prefill_pairs: int = 0
    draft: DraftWork = DraftWork()
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    predicted_ms: float = 0.0
    stall: str | None = None

    @property
    def duration_s(self) -> float:
        """Seconds from the step's start to its commit."""
        return self.t_end - self.t_start


@dataclass
class EnergyTally:
    """Running totals of work, fed once per iteration (the model of ``hardware.energy``)."""

    flops: float = 0.0
    bytes_moved: float = 0.0

    def add_iteration(
        self,
        target_tokens: int,
        draft_tokens: int,
        draft_passes: int,
        kv_tokens_attended: int,
        target_flops_per_token: float,
        draft_flops_per_token: float,
        target_weight_bytes: float,
        draft_weight_bytes: float,
        kv_bytes_per_token: float,
    ) -> None:
        """Add one iteration: 2 x params FLOPs per token a model processes; bytes are the
        weights read once per pass plus the KV the batch attends."""
        self.flops += target_tokens * target_flops_per_token + draft_tokens * draft_flops_per_token
        self.bytes_moved += (
            target_weight_bytes
            + draft_passes * draft_weight_bytes
            + kv_tokens_attended * kv_bytes_per_token
        )

    def summary(self, device: DeviceEnergy, output_tokens: int) -> dict[str, Any]:
        """The totals and their energy on ``device`` (a ``hardware.energy.DeviceEnergy``)."""
        j = device.joules(self.flops, self.bytes_moved)
        return {
            **device.as_dict(),
            "flops": self.flops,
            "bytes_moved": self.bytes_moved,
            "energy_j": j,
            "energy_per_token_mj": (j / output_tokens * 1000.0) if output_tokens else None,
        }


@dataclass(frozen=True)
class ModelCosts:
    """Per-token FLOPs and weight bytes of the pair, and KV bytes per context token."""

    flops_per_token: tuple[float, float] = (0.0, 0.0)  # (target, draft)
    weight_bytes: tuple[float, float] = (0.0, 0.0)
    kv_bytes_per_token: float = 0.0


@dataclass
class RunTimeline:
    """Per-iteration samples plus run-level facts (``info``)."""

    samples: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


class RunRecorder:
    """Turns step traces into timeline samples (every ``sample_every_s`` of clock time;
    0 = every iteration) and the energy tally. ``t0`` is the run's start on the clock.

    Energy by class: each iteration's FLOPs and bytes are split across the requests of
    its pass in proportion to the tokens the target verified for each (prefill tokens;
    a decoding request's root plus its verified candidates), draft work and weight
    reads included; ``info()["energy_by_class"]``. Power: every iteration's work and
    duration, and the energy and time its plan predicted (``info()["power_steps"]``,
    arrays, for ``bench.extras.power_summary``)."""

    def __init__(self, costs: ModelCosts, t0: float = 0.0, sample_every_s: float = 0.0):
        self.costs = costs
        self.t0 = t0
        self.sample_every_s = sample_every_s
        self._next = t0
        self.timeline = RunTimeline()
        self.energy = EnergyTally()
        self.peak_kv = 0.0
        self.by_class: dict[str, list[float]] = {}  # class -> [flops, bytes]
        self._steps: list[tuple[float, float, float, float, float]] = []
        self._speed: list[float] = []  # measured / profiled time of each predicted pass
        # (start, end from t0, predicted ms) of every pass (``bench.replayed`` prices them)
        self.passes: list[tuple[float, float, float]] = []
        # (t from t0, start-to-start / profiled time) of each predicted pass: the run's
        # speed as a simulator running passes back to back needs it (``speed_trace``)
        self._pace: list[tuple[float, float]] = []
        self._busy_end: float | None = None  # the last pass's end, work left after it

    def record(self, tr: StepTrace) -> None:
        """Account for one iteration."""
        c = self.costs
        f0, b0 = self.energy.flops, self.energy.bytes_moved
        self.energy.add_iteration(
            target_tokens=tr.tokens,
            draft_tokens=tr.draft.tokens,
            draft_passes=tr.draft.passes,
            kv_tokens_attended=tr.kv_tokens,
            target_flops_per_token=c.flops_per_token[0],
            draft_flops_per_token=c.flops_per_token[1],
            target_weight_bytes=c.weight_bytes[0],
            draft_weight_bytes=c.weight_bytes[1],
            kv_bytes_per_token=c.kv_bytes_per_token,
        )
        df, db = self.energy.flops - f0, self.energy.bytes_moved - b0
        self._attribute(tr, df, db)
        p = tr.plan
        pj = p.energy_j if p.energy_j is not None else float("nan")
        pt = p.t_iter_ms if p.t_iter_ms is not None else float("nan")
        self._steps.append((df, db, tr.duration_s, pj, pt))
        self.peak_kv = max(self.peak_kv, tr.kv_usage)
        self.passes.append((tr.t_start - self.t0, tr.t_end - self.t0, tr.predicted_ms))
        if tr.predicted_ms > 0:
            self._speed.append(tr.duration_s * 1000.0 / tr.predicted_ms)
            start = tr.t_start
            if self._busy_end is not None and tr.t_start - self._busy_end <= tr.duration_s:
                start = self._busy_end  # the host's time before it counts (as admission's paces)
            self._pace.append((tr.t_end - self.t0, (tr.t_end - start) * 1000.0 / tr.predicted_ms))
        self._busy_end = tr.t_end if tr.running + tr.waiting > 0 else None
        if tr.t_end >= self._next:
            self._next = tr.t_end + self.sample_every_s
            self.timeline.samples.append(sample(tr, tr.t_end - self.t0))

    def _attribute(self, tr: StepTrace, flops: float, moved: float) -> None:
        """Split one iteration's work across its requests' classes by verified tokens."""
        share: dict[str, float] = {}
        for rid, n in tr.prefill.items():
            cls = tr.classes.get(rid)
            if cls is not None:
                share[cls] = share.get(cls, 0.0) + n
        for rid in tr.decode:
            cls = tr.classes.get(rid)
            if cls is not None:
                share[cls] = share.get(cls, 0.0) + 1 + tr.tree_nodes.get(rid, 0)
        tot = sum(share.values())
        for cls, v in share.items():
            acc = self.by_class.setdefault(cls, [0.0, 0.0])
            acc[0] += flops * v / tot
            acc[1] += moved * v / tot

    def power_steps(self) -> dict[str, np.ndarray]:
        """Per iteration: ``flops``, ``bytes``, ``duration_s``, the plan's predicted
        ``pred_j`` and ``pred_ms`` (NaN where it predicted none), as numpy arrays."""
        a = np.asarray(self._steps, dtype=float).reshape(-1, 5)
        keys = ("flops", "bytes", "duration_s", "pred_j", "pred_ms")
        return {k: a[:, i] for i, k in enumerate(keys)}

    def pass_speed(self) -> dict[str, Any] | None:
        """How the run's passes compared with the profile: the quartiles and p90 of
        measured / predicted time over every pass with a prediction (None without
        one). A run whose median is 1.3 ran on a machine 1.3x slower than when it
        was profiled (or priced passes its profile misses): what tells a slow round
        from a bad plan."""
        if not self._speed:
            return None
        q = sorted(self._speed)

        def at(f: float) -> float:
            return round(q[min(len(q) - 1, int(f * len(q)))], 4)

        return {"n": len(q), "p25": at(0.25), "p50": at(0.5), "p75": at(0.75), "p90": at(0.9)}

    def speed_trace(self, window_s: float = 1.0) -> dict[str, list[float]] | None:
        """The run's speed over time, in the simulator's ``--speed-trace`` form: for
        each ``window_s`` of the run with a priced pass, from its start (seconds from
        t0), the median over its passes of start-to-start over profiled time (a pass
        that followed the previous one at once begins at that one's end: the host's time
        between them counts, as the simulator runs its passes back to back). None
        without a priced pass."""
        if not self._pace:
            return None
        by: dict[int, list[float]] = {}
        for t, f in self._pace:
            by.setdefault(int(t // window_s), []).append(f)
        keys = sorted(by)
        return {
            "t_s": [0.0 if i == 0 else k * window_s for i, k in enumerate(keys)],
            "factor": [round(float(np.median(by[k])), 4) for k in keys],
        }

    def info(
        self, policy: str, counters: Counters, pool_bytes: float, slos: dict[str, Any]
    ) -> dict[str, Any]:
        """The run-level facts both runners report: iterations, fallbacks, sheds,
        degradations and preemptions (``counters``), peak KV, energy, SLO targets."""
        c, ft = counters, self.costs.flops_per_token
        return {
            "policy": policy,
            "iterations": c.iterations,
            "fallback_iterations": dict(c.fallback_iterations),
            "fallback_iterations_total": sum(c.fallback_iterations.values()),
            "shed_by_reason": dict(c.shed),
            "admission": admission_summary(c.shed_by_class, c.promised),
            "degraded_total": c.degraded,
            "preemptions": c.preemptions,
            "spec_drafts": c.spec_drafts,
            "accepted_per_pos": {int(k): v for k, v in sorted(c.accepted_per_pos.items())},
            "peak_kv_usage": self.peak_kv,
            "peak_kv_bytes": self.peak_kv * pool_bytes,
            "kv_pool_bytes": pool_bytes,
            "flops_per_token_target": ft[0],
            "flops_per_token_draft": ft[1],
            "energy_tally": {"flops": self.energy.flops, "bytes_moved": self.energy.bytes_moved},
            "energy_by_class": {
                k: {"flops": v[0], "bytes_moved": v[1]} for k, v in sorted(self.by_class.items())
            },
            "power_steps": self.power_steps(),
            "pass_speed": self.pass_speed(),
            "speed_trace": self.speed_trace(),
            "slo_targets": {
                k: {"tpot_ms": v.tpot_ms, "ttft_ms": v.ttft_ms} for k, v in sorted(slos.items())
            },
        }


def sample(tr: StepTrace, t: float) -> dict[str, Any]:
    """One timeline sample of ``tr`` stamped ``t`` (seconds from the run's start)."""
    nodes = tr.tree_nodes
    by_cls: dict[str, list[int]] = {}
    acc_cls: dict[str, list[int]] = {}
    for rid, n in nodes.items():
        cls = tr.classes.get(rid)
        if cls is not None:
            by_cls.setdefault(cls, []).append(n)
            acc_cls.setdefault(cls, []).append(tr.accepted.get(rid, 0))
    # the pass's tokens by class (prefill chunks; a decoding request's root plus its
    # verified candidates), against the budget B when the plan set one
    tok_cls: dict[str, int] = {}
    for rid, n in tr.prefill.items():
        cls = tr.classes.get(rid)
        if cls is not None:
            tok_cls[cls] = tok_cls.get(cls, 0) + n
    for rid in tr.decode:
        cls = tr.classes.get(rid)
        if cls is not None:
            tok_cls[cls] = tok_cls.get(cls, 0) + 1 + nodes.get(rid, 0)
    budget = tr.plan.bounded_budget
    return {
        "t": t,
        "iter_ms": tr.duration_s * 1000.0,
        "running": tr.running,
        "waiting": tr.waiting,
        "tokens": tr.tokens,
        "tree_nodes": int(sum(nodes.values())),
        "tree_mean": (sum(nodes.values()) / len(nodes)) if nodes else 0.0,
        "tree_by_class": {k: sum(v) / len(v) for k, v in by_cls.items()},
        # mean candidates accepted per decoding request of the class in this pass
        "accepted_by_class": {k: sum(v) / len(v) for k, v in acc_cls.items()},
        "tokens_by_class": tok_cls,
        # share of the budget B each class's tokens took (None: the plan set no budget)
        "budget_share_by_class": ({k: v / budget for k, v in tok_cls.items()} if budget else None),
        # the deepest tree the plan chose this pass (0: nothing speculated)
        "depth": max((d for d, _ in tr.spec.values()), default=0),
        "accepted": int(sum(tr.accepted.values())),
        "kv_usage": float(tr.kv_usage),
        "budget": budget,
        "fallback": tr.plan.fallback,
        # the work of the pass, for pricing it afterwards (benchmarks/fidelity.py):
        # context tokens of the batch and the (depth, width) of each drafted tree
        "kv_tokens": tr.kv_tokens,
        "prefill_pairs": tr.prefill_pairs,
        "shapes": [list(tr.spec[rid]) for rid in nodes if rid in tr.spec],
        # the draft's passes (``DraftWork``): what the pass's drafting is priced by
        "draft": {
            "catchup": tr.draft.catchup,
            "steps": list(tr.draft.steps),
            "kv_tokens": tr.draft.kv_tokens,
            "request_steps": tr.draft.request_steps,
            "requests": tr.draft.requests,
        },
    }
