"""Discrete-event simulation of the serving loop, calling the engine's policy objects.

One event is one iteration of ``adaserve.engine.Engine.step``, mirrored without models:

    arrivals -> admit (policy.admission_key, max_num_seqs, KV) -> plan (policy.plan)
    -> degrade -> reserve KV (preempting the newest request on exhaustion)
    -> speculate (synthetic beam trees, ``sim.acceptance``) -> calibrator f
    -> select (policy.select) -> tree KV slots -> verify (sampled acceptance)
    -> commit (accepted path + 1 bonus token, cut at max_tokens) -> policy.feedback

The iteration lasts ``hw.iteration_ms(...)`` of the batch actually formed (verification
tokens, attended KV, draft steps, draft catch-up), plus host overhead and, optionally,
the policy's measured decision time. Requests arriving during an iteration join the
queue before the next one; every token of an iteration is stamped at its end. Times
are simulated seconds from the start; the result has the in-process benchmark's shape
(``RequestRecord`` list and ``RunTimeline``).
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from adaserve.bench.metrics import RequestRecord
from adaserve.bench.runner import RunTimeline, item_slo
from adaserve.bench.workload import WorkItem
from adaserve.sched.base import BatchView, Plan, Policy, ReqView
from adaserve.sched.calibration import Calibrator
from adaserve.sched.hardware import HardwareModel
from adaserve.sim.acceptance import (
    AcceptanceModel,
    TreeBatch,
    accepted_paths,
    apply_calibration,
    observe_batch,
)
from adaserve.slo import DEFAULT_CLASSES, SLO, SLOClass


@dataclass(frozen=True)
class HostOverhead:
    """Engine host time per iteration not in the profile's forward timings (ms):
    ``per_iteration + per_request * batch + per_spec_request * speculating requests
    + per_spec_step * (speculating requests x draft depth) + per_drafted * drafted
    candidates + per_verified * verified candidates``.
    Measured on the machine (docs/simulator.md, "Fidelity"); zero on GPUs, where the
    presets' framework costs already hold the host work."""

    per_iteration: float = 0.0
    per_request: float = 0.0
    per_spec_request: float = 0.0
    per_spec_step: float = 0.0
    per_drafted: float = 0.0
    per_verified: float = 0.0

    def __post_init__(self) -> None:
        if any(not (x >= 0 and math.isfinite(x)) for x in self.as_tuple()):
            raise ValueError("host overhead coefficients must be finite and >= 0")

    @staticmethod
    def features(requests, spec_requests, spec_steps, drafted, verified) -> tuple[float, ...]:
        """One iteration's counts in coefficient order (``as_tuple``): 1, requests in the
        batch, speculating requests, speculating requests x draft depth, drafted and
        verified candidates."""
        return (1.0, requests, spec_requests, spec_steps, drafted, verified)

    def ms(self, features: tuple[float, ...]) -> float:
        """Host ms of an iteration with these ``features``."""
        return sum(c * x for c, x in zip(self.as_tuple(), features))

    def as_tuple(self) -> tuple[float, ...]:
        return (
            self.per_iteration,
            self.per_request,
            self.per_spec_request,
            self.per_spec_step,
            self.per_drafted,
            self.per_verified,
        )

    @classmethod
    def parse(cls, s) -> HostOverhead:
        """From "a[,b[,c[,d[,e[,f]]]]]" (field order) or a dict with the field names."""
        if isinstance(s, dict):
            return cls(**{k: float(v) for k, v in s.items() if k in cls.__dataclass_fields__})
        vals = [float(x) for x in str(s).split(",") if x.strip()]
        if not 1 <= len(vals) <= 6:
            raise ValueError("host overhead: give 1 to 6 comma-separated numbers (ms)")
        return cls(*vals)


@dataclass(frozen=True)
class SimConfig:
    """The simulated engine's limits (the ``EngineConfig`` fields that matter).

    kv_slots:       KV pool in token slots (target + draft share a slot)
    selection_time: "none" (neglected) or "measured" (wall time of plan + select is
                    added to the iteration, as the real engine pays it)
    has_draft:      a draft model exists (policies that draft need it)
    admission:      shed requests like the server does (queue full, strict capacity)
    timeline_max_samples: per-iteration samples kept (decimated beyond that)
    host_overhead:  the engine's host work per iteration beyond the profiled forwards
    speed_trace:    ((t_s, factor), ...): from t_s on (simulated time, ascending), the
                    models' time and the host overhead of an iteration are multiplied by
                    factor (the first factor before the first t_s); empty = 1. Replays
                    a machine whose speed varied, as measured during a real run
    """

    max_num_seqs: int = 64
    max_prefill_tokens: int = 256
    block_size: int = 16
    kv_slots: int = 1 << 20
    max_model_len: int | None = None
    selection_time: str = "none"
    has_draft: bool = True
    admission: bool = False
    max_waiting: int = 1024
    classes: tuple[SLOClass, ...] = DEFAULT_CLASSES
    seed: int = 0
    timeline_max_samples: int = 20000
    flops_per_token: tuple[float, float] = (0.0, 0.0)  # (target, draft), for energy
    weight_bytes: tuple[float, float] = (0.0, 0.0)
    host_overhead: HostOverhead | None = None
    speed_trace: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        ts = [t for t, _ in self.speed_trace]
        if ts != sorted(ts) or not all(
            math.isfinite(t) and math.isfinite(f) and f > 0 for t, f in self.speed_trace
        ):
            raise ValueError("speed trace: times ascending, factors finite and positive")
        if self.max_num_seqs < 1 or self.max_prefill_tokens < 1 or self.kv_slots < 1:
            raise ValueError("max_num_seqs, max_prefill_tokens and kv_slots must be positive")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        if self.selection_time not in ("none", "measured"):
            raise ValueError("selection_time must be 'none' or 'measured'")


class _Req:
    """A simulated request: token counts instead of tokens, blocks instead of tables."""

    __slots__ = (
        "rid",
        "item",
        "slo",
        "target",
        "arrival",
        "prompt_len",
        "max_tokens",
        "n_tokens",
        "num_cached",
        "draft_cached",
        "blocks",
        "admit_seq",
        "running",
        "first_token",
        "finish",
        "times",
        "reason",
        "drafted",
        "verified",
        "accepted",
        "steps",
        "degraded_from",
        "cls_obj",
        "regime",
        "regime_pos",
        "easy_share",
    )

    def __init__(self, rid: int, item: WorkItem, slo: SLO, cls_obj: SLOClass | None):
        self.rid = rid
        self.item = item
        self.slo = slo  # working SLO (changes when degraded)
        self.target = slo  # the SLO the request is judged against
        self.arrival = item.arrival_s
        self.prompt_len = item.prompt_len
        self.max_tokens = item.max_tokens
        self.n_tokens = item.prompt_len
        self.num_cached = 0
        self.draft_cached = 0
        self.blocks = 0
        self.admit_seq = 0
        self.running = False
        self.first_token: float | None = None
        self.finish: float | None = None
        self.times: list[float] = []
        self.reason: str | None = None
        self.drafted = 0
        self.verified = 0
        self.accepted = 0
        self.steps = 0
        self.degraded_from: str | None = None
        self.cls_obj = cls_obj
        self.regime = -1  # acceptance regime at token position regime_pos - 1 (-1: unknown)
        self.regime_pos = 0
        self.easy_share = 0.0  # per-request share of easy positions (request_spread)

    @property
    def n_out(self) -> int:
        return self.n_tokens - self.prompt_len

    @property
    def uncached(self) -> int:
        return self.n_tokens - self.num_cached

    @property
    def in_prefill(self) -> bool:
        return self.uncached > 1 or self.n_out == 0


class Simulator:
    """Runs workloads through one policy on a hardware model and an acceptance model."""

    def __init__(
        self,
        hw: HardwareModel,
        acceptance: AcceptanceModel,
        cfg: SimConfig | None = None,
        seed_stats: str | None = None,
        unloaded_tpot_ms: float | None = None,
    ):
        self.hw = hw
        self.acc = acceptance
        self.cfg = cfg or SimConfig()
        self.seed_stats = seed_stats
        self._unloaded = unloaded_tpot_ms  # class targets' base (None: the hardware's)
        self._classes = {c.name: c for c in self.cfg.classes}

    # ------------------------------------------------------------------ helpers
    def unloaded_tpot_ms(self) -> float:
        """The TPOT the class targets are multiples of: given, else the hardware
        model's single-request TPOT."""
        return self._unloaded if self._unloaded is not None else self.hw.unloaded_tpot_ms()

    def class_slo(self, name: str) -> SLO:
        return self._classes[name].resolve(self.unloaded_tpot_ms())

    def _view(self, r: _Req, now: float) -> ReqView:
        c = r.cls_obj
        return ReqView(
            rid=r.rid,
            cls=r.slo.cls,
            tpot_ms=r.slo.tpot_ms,
            ttft_ms=r.slo.ttft_ms,
            n_out=r.n_tokens - r.prompt_len,
            decode_ms=(now - r.first_token) * 1000.0 if r.first_token is not None else 0.0,
            waited_ms=(now - r.arrival) * 1000.0,
            prefill_left=r.uncached if r.in_prefill else 0,
            context_len=r.n_tokens,
            rank=c.rank if c else 0,
            max_tokens=r.max_tokens - (r.n_tokens - r.prompt_len),
            min_rate=c.min_rate if c else 0.0,
            max_queue_ms=r.slo.max_queue_ms,
            deadline_ms=r.slo.deadline_ms,
        )

    # ------------------------------------------------------------------ run
    def run(
        self,
        policy: Policy,
        items: list[WorkItem],
        slos: dict[str, SLO],
        *,
        policy_name: str | None = None,
        kv_pressure: list[tuple[float, float]] | None = None,
        progress: bool = False,
    ) -> tuple[list[RequestRecord], RunTimeline]:
        """Simulate ``items`` under ``policy``; ``slos`` maps class -> SLO (already scaled).

        ``kv_pressure``: [(t, fraction)] of the KV pool held back from time t.
        Returns the per-request records and the timeline, like ``run_in_process``.
        """
        return _Run(self, policy, items, slos, policy_name, kv_pressure, progress).go()


class _Run:
    """State of one simulation run (kept off ``Simulator`` so runs are independent)."""

    def __init__(self, sim, policy, items, slos, policy_name, kv_pressure, progress):
        cfg = sim.cfg
        self.sim, self.cfg, self.hw, self.policy = sim, cfg, sim.hw, policy
        self.acc = sim.acc
        self.name = policy_name or getattr(policy, "name", "policy")
        self.items = sorted(items, key=lambda it: (it.arrival_s, it.idx))
        self.slos = slos
        self.rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5EED]))
        # per-request difficulty draws use their own stream (the main one is unchanged)
        self.rng_req = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5EED, 1]))
        self.spread = sim.acc.params.request_spread > 0
        self.by_position = sim.acc.follows_position
        self._speed_t = [t for t, _ in sim.cfg.speed_trace]
        self._speed_f = [f for _, f in sim.cfg.speed_trace]
        self.cal = Calibrator()
        if sim.seed_stats:
            self.cal.seed_from_stats(sim.seed_stats)
        self.num_blocks = max(4, cfg.kv_slots // cfg.block_size)
        self.reserved = 0
        self.free = self.num_blocks
        self.kv_pressure = sorted(kv_pressure or [])
        self._preempted_now = False
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.records: list[RequestRecord] = []
        self.timeline = RunTimeline()
        self.admit_seq = itertools.count()
        self.now = 0.0
        self.iterations = 0
        self.fallback: dict[str, int] = {}
        self.shed: dict[str, int] = {}
        self.preemptions = 0
        self.degraded = 0
        self.sel_s = 0.0
        self.busy_s = 0.0
        self.peak_kv = 0.0
        self.energy = [0.0, 0.0]  # flops, bytes
        self.max_len = cfg.max_model_len or (1 << 40)
        self.progress = progress
        horizon = self.items[-1].arrival_s if self.items else 0.0
        self.sample_every = horizon / cfg.timeline_max_samples if horizon > 0 else 0.0
        self.next_sample = 0.0
        uses_draft = bool(policy.uses_draft and cfg.has_draft)
        self.uses_draft = uses_draft
        if policy.uses_draft and not cfg.has_draft:
            raise ValueError(f"policy {self.name!r} needs a draft model")

    # ------------------------------------------------------------------ KV blocks
    def _num_free(self) -> int:
        return max(0, self.free - self.reserved)

    def _ensure(self, r: _Req, slots: int, may_preempt: bool) -> bool:
        bs = self.cfg.block_size
        while True:
            need = -(-slots // bs) - r.blocks
            if need <= 0:
                return True
            if need <= self.free - self.reserved:
                r.blocks += need
                self.free -= need
                return True
            if not may_preempt:
                return False
            victim = max(self.running, key=lambda x: x.admit_seq)
            self._preempt(victim)
            if victim is r:
                return False

    def _truncate(self, r: _Req, slots: int) -> None:
        keep = -(-slots // self.cfg.block_size)
        if r.blocks > keep:
            self.free += r.blocks - keep
            r.blocks = keep

    def _preempt(self, v: _Req) -> None:
        self._truncate(v, 0)
        v.num_cached = 0
        v.draft_cached = 0
        v.running = False
        self._preempted_now = True
        self.preemptions += 1
        self.running.remove(v)
        self.waiting.appendleft(v)

    # ------------------------------------------------------------------ requests
    def _arrive(self, it: WorkItem) -> None:
        slo = item_slo(it, self.slos.get(it.cls))
        cls_obj = self.sim._classes.get(it.cls)
        if it.prompt_len < 1:
            return self._fail(it, slo, "prompt is empty", False)
        if it.prompt_len + 1 > self.max_len:
            return self._fail(it, slo, "prompt is longer than the model's context", False)
        if -(-(it.prompt_len + 1) // self.cfg.block_size) > self.num_blocks:
            return self._fail(it, slo, "prompt does not fit in the KV cache", False)
        if self.cfg.admission:
            reason = self._admission_check(slo, cls_obj)
            if reason:
                self.shed[reason] = self.shed.get(reason, 0) + 1
                return self._fail(it, slo, f"shed: {reason}", True)
        r = _Req(it.idx, it, slo, cls_obj)
        if self.spread:
            r.easy_share = float(self.acc.request_shares(1, self.rng_req)[0])
        self.waiting.append(r)

    def _admission_check(self, slo: SLO, cls_obj: SLOClass | None) -> str | None:
        """``Engine._admission_check``: queue length and the strict class's demand."""
        if len(self.waiting) >= self.cfg.max_waiting:
            return "queue_full"
        strict = cls_obj is None or cls_obj.rank == 0
        if slo.tpot_ms and strict:
            demand = 1000.0 / slo.tpot_ms + sum(
                1000.0 / r.slo.tpot_ms
                for r in itertools.chain(self.running, self.waiting)
                if r.slo.tpot_ms and r.slo.cls == slo.cls
            )
            n = self.cfg.max_num_seqs
            cap = float(n * 1000.0 / self.hw.iteration_ms(n, n * 256.0))
            if demand > cap:
                return "capacity"
        return None

    def _fail(self, it: WorkItem, slo: SLO, err: str, shed: bool) -> None:
        self.records.append(
            RequestRecord(
                idx=it.idx,
                cls=it.cls,
                arrival_s=it.arrival_s,
                tpot_target_ms=slo.tpot_ms,
                ttft_target_ms=slo.ttft_ms,
                prompt_tokens=it.prompt_len,
                shed=shed,
                error=err,
            )
        )

    def _collect(self, r: _Req) -> None:
        self.records.append(
            RequestRecord(
                idx=r.item.idx,
                cls=r.item.cls,
                arrival_s=r.arrival,
                first_token_s=r.first_token,
                finish_s=r.finish,
                token_times_s=r.times,
                prompt_tokens=r.prompt_len,
                output_tokens=r.n_out,
                tpot_target_ms=r.target.tpot_ms,
                ttft_target_ms=r.target.ttft_ms,
                drafted=r.drafted,
                verified=r.verified,
                accepted=r.accepted,
                finish_reason=r.reason,
                degraded=r.degraded_from is not None,
                steps=r.steps,
            )
        )

    def _finish(self, r: _Req, reason: str, t: float) -> None:
        r.reason = reason
        r.finish = t
        r.running = False
        self.running.remove(r)
        self._truncate(r, 0)
        self._collect(r)

    def _append(self, r: _Req, n: int, t: float) -> int:
        """Append up to n tokens at time t, stopping at the limits; returns appended."""
        left = min(r.max_tokens - r.n_out, self.max_len - r.n_tokens)
        k = max(0, min(n, left))
        r.n_tokens += k
        r.times.extend([t] * k)
        if r.n_out >= r.max_tokens or r.n_tokens >= self.max_len:
            self._finish(r, "length", t)
        return k

    # ------------------------------------------------------------------ the loop
    def go(self) -> tuple[list[RequestRecord], RunTimeline]:
        wall0 = time.perf_counter()
        items, n, i = self.items, len(self.items), 0
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=n, desc=f"sim {self.name}", unit="req", leave=False)
        done_before = 0
        while True:
            while self.kv_pressure and self.kv_pressure[0][0] <= self.now:
                _, frac = self.kv_pressure.pop(0)
                self.reserved = int(frac * self.num_blocks)
            while i < n and items[i].arrival_s <= self.now:
                self._arrive(items[i])
                i += 1
            if not self.running and not self.waiting:
                if i >= n:
                    break
                nxt = items[i].arrival_s
                if self.kv_pressure:
                    nxt = min(nxt, self.kv_pressure[0][0])
                self.now = max(self.now, nxt)
                continue
            self._step()
            if bar is not None and len(self.records) != done_before:
                bar.update(len(self.records) - done_before)
                done_before = len(self.records)
        if bar is not None:
            bar.close()
        self.records.sort(key=lambda r: r.idx)
        self._info(time.perf_counter() - wall0)
        return self.records, self.timeline

    def _admit(self) -> None:
        if not self.waiting or len(self.running) >= self.cfg.max_num_seqs:
            return
        if len(self.waiting) > 1:
            now = self.now
            key = self.policy.admission_key
            self.waiting = deque(sorted(self.waiting, key=lambda r: key(self._rv(r, now))))
        bs = self.cfg.block_size
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            r = self.waiting[0]
            first = min(r.uncached, self.cfg.max_prefill_tokens) + 1
            if self._num_free() < -(-first // bs) + 1 and self.running:
                break
            self.waiting.popleft()
            r.running = True
            r.admit_seq = next(self.admit_seq)
            self.running.append(r)

    def _rv(self, r: _Req, now: float) -> ReqView:
        return self.sim._view(r, now)

    def _step(self) -> None:
        cfg, hw, now = self.cfg, self.hw, self.now
        self._admit()
        if not self.running:
            return
        t_sel = time.perf_counter()
        view = BatchView(
            now_ms=now * 1000.0,
            requests=[self._rv(r, now) for r in self.running],
            free_kv_slots=self._num_free() * cfg.block_size,
            hw=hw,
            num_waiting=len(self.waiting),
            acc_by_rank=tuple(self.cal.acceptance_by_rank()),
        )
        plan = self.policy.plan(view)
        sel_s = time.perf_counter() - t_sel
        if plan.fallback:
            self._count_fallback(plan.fallback)
        self._apply_degrade(plan)
        prefill, decode, spec = self._reserve(plan)
        # --- speculate: one synthetic tree batch per shape
        groups: dict[tuple[int, int], list[_Req]] = {}
        for r, shape in spec:
            g = groups.get(shape)
            if g is None:
                groups[shape] = [r]
            else:
                g.append(r)
        catchup = 0
        steps = [0] * (max((d for d, _ in groups), default=1) - 1)  # frontier tokens fed
        batches: list[tuple[list[_Req], TreeBatch]] = []
        trees = {}
        for (d, w), reqs in groups.items():
            pi = np.array([r.easy_share for r in reqs]) if self.spread else None
            if self.by_position:
                out_pos = np.array([r.n_out for r in reqs])
                pi = self.acc.position_shares(out_pos, pi)
            states = self.acc.advance(
                np.array([r.regime for r in reqs]),
                np.array([r.n_tokens - r.regime_pos for r in reqs]),
                self.rng,
                pi,
            )
            tb = self.acc.grow(d, w, len(reqs), self.rng, states, pi)
            apply_calibration(self.cal, tb)
            batches.append((reqs, tb))
            n = tb.lay.n
            for k, r in enumerate(reqs):
                trees[r.rid] = tb.tree(k)
                catchup += r.n_tokens - r.draft_cached
                r.draft_cached = r.n_tokens
                r.drafted += n
            for t in range(d - 1):
                steps[t] += len(reqs) * w
        selected: dict[int, np.ndarray] = {}
        if trees:
            t_sel = time.perf_counter()
            selected = self.policy.select(view, plan, trees)
            sel_s += time.perf_counter() - t_sel
        self.sel_s += sel_s
        # --- tree KV slots (admission order, like the engine); verification batch size
        sizes: dict[int, int] = {}
        v_tokens = 0
        kv_tokens = 0
        for r, n in prefill:
            v_tokens += n
            kv_tokens += r.num_cached + n
        for r in decode:
            k = 1
            if r.rid in trees:
                nodes = selected.get(r.rid)
                if nodes is not None and len(nodes) > 1:
                    k = len(nodes)
                    if not self._ensure(r, r.n_tokens + k - 1, False):
                        self._count_fallback("kv_memory")
                        k = 1
                        selected[r.rid] = _ROOT
            sizes[r.rid] = k
            v_tokens += k
            kv_tokens += r.n_tokens
        ms = forward_ms(hw, v_tokens, kv_tokens, catchup, steps if batches else None)
        ho = cfg.host_overhead
        if ho is not None:
            ms += ho.ms(
                HostOverhead.features(
                    len(prefill) + len(decode),
                    len(spec),
                    sum(sh[0] for _, sh in spec),
                    sum(tb.lay.n * len(reqs) for reqs, tb in batches),
                    v_tokens - len(decode) - sum(n for _, n in prefill),
                )
            )
        if self._speed_t:
            k = bisect.bisect_right(self._speed_t, now) - 1
            ms *= self._speed_f[max(k, 0)]
        if cfg.selection_time == "measured":
            ms += sel_s * 1000.0
        end = now + ms / 1000.0
        # --- verify (sampled acceptance) and commit
        accepted_n: dict[int, int] = {}
        for reqs, tb in batches:
            mask = np.zeros((len(reqs), tb.lay.n + 1), dtype=bool)
            for k, r in enumerate(reqs):
                if sizes[r.rid] > 1:
                    mask[k, selected[r.rid]] = True
            mask[:, 0] = True
            length, on_path = accepted_paths(tb, mask)
            observe_batch(self.cal, tb, mask, on_path)
            bonus = tb.regimes[np.arange(len(reqs)), length].tolist()
            for r, a, reg in zip(reqs, length.tolist(), bonus):
                accepted_n[r.rid] = a
                r.regime = reg  # the regime at the bonus token's position
                r.regime_pos = r.n_tokens + a + 1
        for r, n in prefill:
            r.num_cached += n
            if r.num_cached == r.n_tokens:
                if r.first_token is None:
                    r.first_token = end
                self._append(r, 1, end)
        tree_nodes: dict[int, int] = {}
        bs = cfg.block_size
        for r in decode:
            nv = sizes[r.rid] - 1
            r.steps += 1
            a = 0
            if nv > 0:
                a = accepted_n[r.rid]
                r.verified += nv
                r.accepted += a
            tree_nodes[r.rid] = nv
            r.num_cached = r.n_tokens + a
            self._append(r, a + 1, end)
            if r.running:  # truncate to the committed tokens + the next root
                keep = -(-(r.num_cached + 1) // bs)
                if r.blocks > keep:
                    self.free += r.blocks - keep
                    r.blocks = keep
        self.policy.feedback(plan, ms)
        self.iterations += 1
        self.busy_s += ms / 1000.0
        used = 1.0 - self.free / self.num_blocks
        if used > self.peak_kv:
            self.peak_kv = used
        self._energy(v_tokens, kv_tokens, catchup, len(steps), spec, tree_nodes)
        if end >= self.next_sample:
            self.next_sample = end + self.sample_every
            self._sample(end, ms, plan, v_tokens, tree_nodes, accepted_n, used)
        self.now = end

    def _reserve(self, plan: Plan):
        """``Engine._reserve``: prefill chunks, decodes and speculating requests."""
        prefill, decode, spec = [], [], []
        has_draft = self.cfg.has_draft
        shapes, pre = plan.shapes, plan.prefill
        for r in sorted(self.running, key=_by_admit):
            if not r.running:
                continue  # preempted earlier in this loop
            unc = r.n_tokens - r.num_cached
            if unc > 1 or r.n_tokens == r.prompt_len:  # in prefill
                n = pre.get(r.rid, 0)
                if n <= 0:
                    continue
                n = min(n, unc)
                if self._ensure(r, r.num_cached + n, True):
                    prefill.append((r, n))
                continue
            if not self._ensure(r, r.n_tokens, True):
                continue
            decode.append(r)
            shape = shapes.get(r.rid)
            if shape and shape[0] > 0 and has_draft:
                extra = (shape[0] - 1) * shape[1]
                if self._ensure(r, r.n_tokens + extra, False):
                    spec.append((r, (int(shape[0]), int(shape[1]))))
                else:
                    self._count_fallback("kv_memory")
        if self._preempted_now:
            self._preempted_now = False
            prefill = [(r, n) for r, n in prefill if r.running]
            decode = [r for r in decode if r.running]
            spec = [(r, s) for r, s in spec if r.running]
        return prefill, decode, spec

    def _apply_degrade(self, plan: Plan) -> None:
        if not plan.degrade:
            return
        for r in self.running:
            if r.rid in plan.degrade:
                c = r.cls_obj if r.cls_obj is not None and r.cls_obj.name == r.slo.cls else None
                c = c or self.sim._classes.get(r.slo.cls)
                if c is None or not c.degrade_to or c.degrade_to not in self.sim._classes:
                    continue
                r.degraded_from = r.degraded_from or r.slo.cls
                r.slo = self.sim.class_slo(c.degrade_to)
                r.cls_obj = self.sim._classes[c.degrade_to]
                self.degraded += 1

    def _count_fallback(self, reason: str) -> None:
        self.fallback[reason] = self.fallback.get(reason, 0) + 1

    # ------------------------------------------------------------------ bookkeeping
    def _energy(self, v_tokens, kv_tokens, catchup, n_steps, spec, tree_nodes):
        (ft, fd), (tw, dw) = self.cfg.flops_per_token, self.cfg.weight_bytes
        d_tok = catchup + sum(tree_nodes.get(r.rid, 0) for r, _ in spec)
        passes = (n_steps + 1) if spec else 0
        self.energy[0] += v_tokens * ft + d_tok * fd
        kvb = (self.hw.kv_bytes_target + self.hw.kv_bytes_draft) or 0
        self.energy[1] += tw + passes * dw + kv_tokens * kvb

    def _sample(self, t, ms, plan, v_tokens, tree_nodes, accepted_n, used) -> None:
        by_cls: dict[str, list[int]] = {}
        by_rid = {r.rid: r for r in self.running}
        for rid, n in tree_nodes.items():
            r = by_rid.get(rid)
            cls = r.item.cls if r is not None else None
            if cls is not None:
                by_cls.setdefault(cls, []).append(n)
        budget = plan.budget if plan.budget < (1 << 29) else None
        self.timeline.samples.append(
            {
                "t": t,
                "iter_ms": ms,
                "running": len(self.running),
                "waiting": len(self.waiting),
                "tokens": v_tokens,
                "tree_nodes": int(sum(tree_nodes.values())),
                "tree_mean": (sum(tree_nodes.values()) / len(tree_nodes)) if tree_nodes else 0.0,
                "tree_by_class": {k: sum(v) / len(v) for k, v in by_cls.items()},
                "accepted": int(sum(accepted_n.values())),
                "kv_usage": float(used),
                "budget": budget,
                "fallback": plan.fallback,
            }
        )

    def _info(self, wall: float) -> None:
        finish = [r.finish_s for r in self.records if r.finish_s is not None]
        duration = max(finish) if finish else max(self.now, 1e-9)
        kvb = self.hw.kv_bytes_target + self.hw.kv_bytes_draft
        pool = self.num_blocks * self.cfg.block_size * kvb
        ft, fd = self.cfg.flops_per_token
        self.timeline.info = {
            "policy": self.name,
            "duration_s": duration if duration > 0 else 1e-9,
            "wall_s": duration,
            "iterations": self.iterations,
            "fallback_iterations": dict(self.fallback),
            "fallback_iterations_total": sum(self.fallback.values()),
            "shed_by_reason": dict(self.shed),
            "degraded_total": self.degraded,
            "preemptions": self.preemptions,
            "model_time_s": self.busy_s,
            "step_time_s": self.busy_s,
            "peak_kv_usage": self.peak_kv,
            "peak_kv_bytes": self.peak_kv * pool,
            "kv_pool_bytes": pool,
            "flops_per_token_target": ft,
            "flops_per_token_draft": fd,
            "energy_tally": {"flops": self.energy[0], "bytes_moved": self.energy[1]},
            "shifts_applied": [],
            "unloaded_tpot_ms": self.sim.unloaded_tpot_ms(),
            "slo_targets": {
                k: {"tpot_ms": v.tpot_ms, "ttft_ms": v.ttft_ms}
                for k, v in sorted(self.slos.items())
            },
            "simulated": True,
            "sim_wall_s": wall,
            "selection_time_s": self.sel_s,
            "selection_share": self.sel_s / self.busy_s if self.busy_s > 0 else None,
            "selection_time_mode": self.cfg.selection_time,
        }


_ROOT = np.zeros(1, dtype=np.int64)


def forward_ms(hw: HardwareModel, v_tokens, kv_tokens, catchup, steps) -> float:
    """The profile's forward time of one iteration (ms): verification of ``v_tokens``
    attending ``kv_tokens``, the per-iteration overhead and, when ``steps`` is not None
    (something was drafted), the draft's catch-up pass over ``catchup`` tokens plus one
    pass per entry of ``steps`` (tokens fed at each later draft step)."""
    ms = float(hw.verify_latency(v_tokens, kv_tokens)) + hw.overhead_ms
    if steps is not None:
        ms += float(hw.draft_latency(np.array([max(catchup, 1)] + list(steps), dtype=float)).sum())
    return ms


def _by_admit(r: _Req) -> int:
    return r.admit_seq
