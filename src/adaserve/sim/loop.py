"""Discrete-event simulation of the serving loop, calling the engine's policy objects.

One event is one iteration of the engine's step, the same ``core.step.run_step`` with
this module's executor in place of the models:

    arrivals -> admit (policy.admission_key, max_num_seqs, KV) -> plan (policy.plan)
    -> degrade -> reserve KV (preempting the newest request on exhaustion)
    -> speculate (synthetic beam trees, ``sim.acceptance``) -> calibrator f
    -> [clairvoyant policies only: policy.reveal(the target's paths)]
    -> select (policy.select) -> tree KV slots -> verify (sampled acceptance)
    -> commit (accepted path + 1 bonus token, cut at max_tokens) -> policy.feedback

The iteration lasts ``hw.iteration_ms(...)`` of the batch actually formed (verification
tokens, attended KV, draft steps, draft catch-up), plus host overhead (both priced in
``sim.pricing``) and, optionally, the policy's measured decision time. Requests
arriving during an iteration join the queue before the next one; every token of an
iteration is stamped at its end. Times are simulated seconds from the start; the result
has the in-process benchmark's shape (``RequestRecord`` list and ``RunTimeline``).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from adaserve.bench.metrics import RequestRecord
from adaserve.bench.workload_spec import WorkItem, item_slo
from adaserve.core.clock import ManualClock
from adaserve.core.config import SchedulerConfig
from adaserve.core.counters import Counters
from adaserve.core.policy import BatchView, Plan, Policy
from adaserve.core.scheduler import Scheduler
from adaserve.core.slo import SLO
from adaserve.core.step import (
    Batch,
    Commit,
    DraftWork,
    SchedulerOutput,
    StepInputs,
    StepOutcome,
    run_step,
)
from adaserve.core.trace import ModelCosts, RunRecorder, RunTimeline
from adaserve.errors import AdaServeError, AdmissionRejected
from adaserve.hardware.calibration import Calibrator
from adaserve.hardware.model import HardwareModel
from adaserve.sim.acceptance import (
    AcceptanceModel,
    TreeBatch,
    accepted_paths,
    apply_calibration,
    observe_batch,
)
from adaserve.sim.pricing import HostOverhead, forward_ms
from adaserve.sim.request import SimRequest


@dataclass(frozen=True)
class SimConfig(SchedulerConfig):
    """The simulated engine: the scheduler's limits (``SchedulerConfig``, the same
    fields as the engine's) plus what replaces the models.

    kv_slots:       KV pool in token slots (target + draft share a slot)
    selection_time: "none" (neglected) or "measured" (wall time of plan + select is
                    added to the iteration, as the real engine pays it)
    has_draft:      a draft model exists (policies that draft need it)
    timeline_max_samples: per-iteration samples kept (decimated beyond that)
    host_overhead:  the engine's host work per iteration beyond the profiled forwards
    speed_trace:    ((t_s, factor), ...): from t_s on (simulated time, ascending), the
                    models' time and the host overhead of an iteration are multiplied by
                    factor (the first factor before the first t_s); empty = 1. Replays
                    a machine whose speed varied, as measured during a real run
    retry_refused:  a refused client tries once more, after the Retry-After it was
                    given (its record is then the retry's: a new request then); the run
                    counts the retries and how many were admitted (``retries``)
    """

    default_class: str | None = None  # work items always name their class
    kv_slots: int = 1 << 20
    selection_time: str = "none"
    has_draft: bool = True
    seed: int = 0
    timeline_max_samples: int = 20000
    flops_per_token: tuple[float, float] = (0.0, 0.0)  # (target, draft), for energy
    weight_bytes: tuple[float, float] = (0.0, 0.0)
    host_overhead: HostOverhead | None = None
    speed_trace: tuple[tuple[float, float], ...] = ()
    retry_refused: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        ts = [t for t, _ in self.speed_trace]
        if ts != sorted(ts) or not all(
            math.isfinite(t) and math.isfinite(f) and f > 0 for t, f in self.speed_trace
        ):
            raise ValueError("speed trace: times ascending, factors finite and positive")
        if self.kv_slots < 1:
            raise ValueError("kv_slots must be positive")
        if self.selection_time not in ("none", "measured"):
            raise ValueError("selection_time must be 'none' or 'measured'")


class Simulator:
    """Runs workloads through one policy on a hardware model and an acceptance model."""

    def __init__(
        self,
        hw: HardwareModel,
        acceptance: AcceptanceModel,
        cfg: SimConfig | None = None,
        seed_stats: str | None = None,
        unloaded_tpot_ms: float | None = None,
        power=None,
    ):
        self.hw = hw
        self.power = power  # hardware.power.PowerModel for the planners' power constraints
        self.acc = acceptance
        self.cfg = cfg or SimConfig()
        self.seed_stats = seed_stats
        self._unloaded = unloaded_tpot_ms  # class targets' base (None: the hardware's)

    def unloaded_tpot_ms(self) -> float:
        """The TPOT the class targets are multiples of: given, else the hardware
        model's single-request TPOT."""
        return self._unloaded if self._unloaded is not None else self.hw.unloaded_tpot_ms()

    def class_slo(self, name: str) -> SLO:
        """The SLO of class ``name`` resolved against ``unloaded_tpot_ms``."""
        return self.cfg.class_by_name(name).resolve(self.unloaded_tpot_ms())

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


@dataclass
class PassOutcome:
    """What executing one planned pass gave: when it ended, the verified tree size
    (root included) and the accepted candidates per decoding request, and the work."""

    end: float
    ms: float
    sizes: dict[int, int]
    accepted: dict[int, int]
    tokens: int
    draft: DraftWork = DraftWork()
    drafted_rids: frozenset[int] = frozenset()  # requests whose draft cache caught up
    # the verified candidates' expected accepted tokens (their calibrated f), per
    # drafting request (``StepOutcome.expected``)
    expected: dict[int, float] = field(default_factory=dict)


class _Run:
    """State of one simulation run (kept off ``Simulator`` so runs are independent).

    Scheduling is the engine's ``Scheduler``, and a step the engine's
    ``core.step.run_step``; this class is the executor that replaces the models:
    ``_execute`` drafts synthetic trees, verifies them against the acceptance model
    and prices the pass; ``_outcome`` appends token counts."""

    def __init__(
        self,
        sim,
        policy,
        items,
        slos,
        policy_name,
        kv_pressure,
        progress,
        *,
        stream: int = 0,
        recorder: RunRecorder | None = None,
        counters: Counters | None = None,
    ):
        """``stream``: which replica of a cluster this run is (``sim.cluster``): replica
        0 draws the single replica's random streams, replica k its own; ``recorder`` and
        ``counters``: shared by a cluster's replicas (default: this run's own)."""
        cfg = sim.cfg
        self.sim, self.cfg, self.hw, self.policy = sim, cfg, sim.hw, policy
        self.acc = sim.acc
        self.name = policy_name or getattr(policy, "name", "policy")
        self.items = sorted(items, key=lambda it: (it.arrival_s, it.idx))
        self.slos = slos
        tail = [2, stream] if stream else []
        self.rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, 0x5EED, *tail]))
        # per-request difficulty draws use their own stream (the main one is unchanged)
        self.rng_req = np.random.default_rng(
            np.random.SeedSequence([cfg.seed, 0x5EED, 1, *([stream] if stream else [])])
        )
        self.spread = sim.acc.params.request_spread > 0
        self.by_position = sim.acc.follows_position
        self._speed_t = [t for t, _ in sim.cfg.speed_trace]
        self._speed_f = [f for _, f in sim.cfg.speed_trace]
        self.cal = Calibrator()
        if sim.seed_stats:
            self.cal.seed_from_stats(sim.seed_stats)
        self.clock = ManualClock(0.0)
        self.max_len = cfg.max_model_len or (1 << 40)
        self.sched = Scheduler(
            cfg,
            policy,
            self.clock,
            max(4, cfg.kv_slots // cfg.block_size),
            max_model_len=self.max_len,
            unloaded_tpot_ms=sim.unloaded_tpot_ms,
            hw=sim.hw,
            power=sim.power,
            counters=counters,
        )
        self.counters = self.sched.counters
        self.kv_pressure = sorted(kv_pressure or [])
        self.records: list[RequestRecord] = []
        self.now = 0.0
        self.sel_s = 0.0
        self.busy_s = 0.0
        self.progress = progress
        horizon = self.items[-1].arrival_s if self.items else 0.0
        self.recorder = recorder or run_recorder(sim, horizon)
        self.timeline = self.recorder.timeline
        self.uses_draft = bool(policy.uses_draft and cfg.has_draft)
        self._retry_at: list[tuple[float, int, WorkItem]] = []  # refused clients' retries
        self.retries = [0, 0]  # retries made, retries admitted
        self._tokens: dict[int, str] = {}  # a refused client's retry token, by request
        if policy.uses_draft and not cfg.has_draft:
            raise ValueError(f"policy {self.name!r} needs a draft model")

    # ------------------------------------------------------------------ requests
    def _arrive(self, it: WorkItem, retry: bool = False) -> None:
        slo = item_slo(it, self.slos.get(it.cls))
        try:
            self.offer(it, slo)
            self.retries[1] += retry
        except AdmissionRejected as e:
            if self.cfg.retry_refused and not retry:  # once more, when it was told to
                if e.retry_token is not None:
                    self._tokens[it.idx] = e.retry_token
                heapq.heappush(
                    self._retry_at,
                    (
                        self.now + e.retry_after_s,
                        it.idx,
                        dataclasses.replace(it, arrival_s=self.now + e.retry_after_s),
                    ),
                )
                self.retries[0] += 1
                return None
            return self._fail(it, slo, f"shed: {e.reason}", True)
        except AdaServeError as e:
            return self._fail(it, slo, str(e), False)

    def offer(self, it: WorkItem, slo: SLO) -> SimRequest:
        """Queue ``it`` (judged against ``slo``) on this replica; raises
        ``AdmissionRejected`` when shed, another ``AdaServeError`` when it can never run."""
        self.sched.check_prompt(it.prompt_len)
        r = SimRequest(it, slo)
        r.retry_token = self._tokens.pop(it.idx, None)
        self.sched.add(r)
        if self.spread:
            r.easy_share = float(self.acc.request_shares(1, self.rng_req)[0])
        return r

    def _fail(self, it: WorkItem, slo: SLO, err: str, shed: bool) -> None:
        self.records.append(RequestRecord.failed(it, slo, err, shed))

    def _collect(self, r: SimRequest) -> None:
        self.records.append(
            RequestRecord(
                idx=r.item.idx,
                cls=r.item.cls,
                arrival_s=r.arrival,
                first_token_s=r.first_token_at,
                finish_s=r.finished_at,
                token_times_s=r.token_times,
                prompt_tokens=r.prompt_len,
                cached_tokens=r.cached_prompt,
                output_tokens=r.num_output,
                tpot_target_ms=r.target.tpot_ms,
                ttft_target_ms=r.target.ttft_ms,
                drafted=r.drafted,
                verified=r.verified,
                accepted=r.accepted,
                finish_reason=r.finish_reason,
                degraded=r.degraded_from is not None,
                steps=r.steps,
            )
        )

    def _append(self, r: SimRequest, n: int, t: float) -> str | None:
        """Append up to n tokens at time t, stopping at the limits; returns the finish
        reason when it reached one (the scheduler ends it)."""
        left = min(r.max_new_tokens - r.num_output, self.max_len - r.n_tokens)
        k = max(0, min(n, left))
        r.n_tokens += k
        r.token_times.extend([t] * k)
        if r.num_output >= r.max_new_tokens or r.n_tokens >= self.max_len:
            return "length"
        return None

    # ------------------------------------------------------------------ the loop
    def go(self) -> tuple[list[RequestRecord], RunTimeline]:
        wall0 = time.perf_counter()
        items, n, i = self.items, len(self.items), 0
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=n, desc=f"sim {self.name}", unit="req", leave=False)
        done_before = 0
        sched = self.sched
        while True:
            self.apply_kv_pressure()
            while i < n and items[i].arrival_s <= self.now:
                self._arrive(items[i])
                i += 1
            while self._retry_at and self._retry_at[0][0] <= self.now:
                self._arrive(heapq.heappop(self._retry_at)[2], retry=True)
            if not sched.has_work():
                if i >= n and not self._retry_at:
                    break
                nxt = min(
                    items[i].arrival_s if i < n else math.inf,
                    self._retry_at[0][0] if self._retry_at else math.inf,
                )
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

    def apply_kv_pressure(self) -> None:
        """Hold back the KV share the pressure schedule sets from ``now`` on."""
        while self.kv_pressure and self.kv_pressure[0][0] <= self.now:
            _, frac = self.kv_pressure.pop(0)
            self.sched.set_kv_reserved(frac)

    def _step(self) -> None:
        """One step (``core.step.run_step``), then the run's own records: requests that
        expired in the queue or finished, busy time, the recorder."""
        res = run_step(self.sched, self)
        for r in cast(
            "list[SimRequest]", res.out.expired
        ):  # queued past their TTFT deadline: answered 429
            self._fail(r.item, r.slo, f"shed: {r.finish_reason}", True)
        if res.trace is None or res.outcome is None:  # no pass ran
            return
        for r in cast("list[SimRequest]", res.outcome.finished):
            self._collect(r)
        self.busy_s += res.outcome.ms / 1000.0
        self.recorder.record(res.trace)
        self.now = res.outcome.t_end

    # ------------------------------------------------------------------ the executor
    def prepare(self) -> StepInputs:
        """The step starts at ``now``; the policy sees the calibrated acceptance."""
        self.clock.set(self.now)
        return StepInputs(tuple(self.cal.acceptance_by_rank()), self.cfg.has_draft)

    def execute(self, out: SchedulerOutput) -> StepOutcome:
        """Run the scheduled pass (``_execute``); its end is the clock's new time."""
        assert out.view is not None and out.plan is not None and out.batch is not None  # runs
        p = self._execute(out.view, out.plan, out.batch, out.plan_s)
        self.clock.set(p.end)
        return self._outcome(out.batch, p)

    def _outcome(self, batch: Batch, out: PassOutcome) -> StepOutcome:
        """Prefill completion gives the first token; a decode appends its accepted path
        plus the bonus token, stamped at the pass's end."""
        end = out.end
        commits = []
        for r, n in batch.prefill:
            cached = r.num_cached + n
            first = cached == r.n_tokens
            commits.append(Commit(r, cached, first, self._append(r, 1, end) if first else None))
        tree_nodes: dict[int, int] = {}
        accepted: dict[int, int] = {}
        for r in batch.decode:
            nv = out.sizes[r.rid] - 1
            r.steps += 1
            a = 0
            if nv > 0:
                a = out.accepted[r.rid]
                r.verified += nv
                r.accepted += a
            tree_nodes[r.rid] = nv
            if r.rid in out.accepted:
                accepted[r.rid] = out.accepted[r.rid]
            cached = r.n_tokens + a
            # a drafting request's draft cache caught up on its tokens before the pass
            caught = r.n_tokens if r.rid in out.drafted_rids else None
            commits.append(
                Commit(r, cached, finish=self._append(r, a + 1, end), draft_cached=caught)
            )
        return StepOutcome(
            t_end=end,
            ms=out.ms,
            commits=tuple(commits),
            tree_nodes=tree_nodes,
            accepted=accepted,
            expected=out.expected,
            tokens=out.tokens,
            draft=out.draft,
        )

    def _execute(self, view: BatchView, plan: Plan, batch: Batch, sel_s: float) -> PassOutcome:
        """Draft synthetic trees (one batch per shape), select, reserve tree slots, price
        the pass and sample which candidates the target accepts."""
        cfg, hw, now = self.cfg, self.hw, self.now
        # --- speculate: one synthetic tree batch per shape
        groups: dict[tuple[int, int], list[SimRequest]] = {}
        for r, shape in batch.spec:
            g = groups.get(shape)
            if g is None:
                groups[shape] = [r]
            else:
                g.append(r)
        drafting = []  # (context, draft cached, depth, width) per tree (DraftWork.of_trees)
        batches: list[tuple[list[SimRequest], TreeBatch]] = []
        trees = {}
        for (d, w), reqs in groups.items():
            pi = np.array([r.easy_share for r in reqs]) if self.spread else None
            if self.by_position:
                out_pos = np.array([r.num_output for r in reqs])
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
                drafting.append((r.n_tokens, r.draft_cached, d, w))
                r.drafted += n
        selected: dict[int, np.ndarray] = {}
        full = self._reveal(batches) if trees and self.policy.clairvoyant else None
        if trees:
            t_sel = time.perf_counter()
            selected = self.policy.select(view, plan, trees)
            sel_s += time.perf_counter() - t_sel
        self.sel_s += sel_s
        # --- tree KV slots (admission order, like the engine); verification batch size
        sizes: dict[int, int] = {}
        v_tokens = sum(n for _, n in batch.prefill)
        for r in batch.decode:
            k = 1
            if r.rid in trees:
                nodes = selected.get(r.rid)
                if nodes is not None and len(nodes) > 1:
                    k = len(nodes)
                    if not self.sched.reserve_tree(r, k):
                        k = 1
                        selected[r.rid] = _ROOT
            sizes[r.rid] = k
            v_tokens += k
        kv_tokens = batch.kv_tokens
        draft = DraftWork.of_trees(drafting, sum(tb.lay.n * len(reqs) for reqs, tb in batches))
        ms = forward_ms(
            hw,
            v_tokens,
            kv_tokens,
            draft,
            batch.prefill_pairs,
            len(batch.prefill) + len(batch.decode),
            # logits rows: every tree node, and each completing prefill's last token
            sum(sizes.values()) + sum(r.num_cached + n == r.num_tokens for r, n in batch.prefill),
        )
        ho = cfg.host_overhead
        if ho is not None:
            ms += ho.ms(
                HostOverhead.features(
                    len(batch.prefill) + len(batch.decode),
                    len(batch.spec),
                    sum(sh[0] for _, sh in batch.spec),
                    sum(tb.lay.n * len(reqs) for reqs, tb in batches),
                    v_tokens - len(batch.decode) - sum(n for _, n in batch.prefill),
                )
            )
        if self._speed_t:
            k = bisect.bisect_right(self._speed_t, now) - 1
            ms *= self._speed_f[max(k, 0)]
        if cfg.selection_time == "measured":
            ms += sel_s * 1000.0
        # --- verify (sampled acceptance)
        accepted_n: dict[int, int] = {}
        for gi, (reqs, tb) in enumerate(batches):
            mask = np.zeros((len(reqs), tb.lay.n + 1), dtype=bool)
            for k, r in enumerate(reqs):
                if sizes[r.rid] > 1:
                    mask[k, selected[r.rid]] = True
            mask[:, 0] = True
            length, on_path = accepted_paths(tb, mask)
            if full is None:
                observe_batch(self.cal, tb, mask, on_path)
            else:  # the calibrator learns what the revealed full verification showed
                observe_batch(self.cal, tb, *full[gi])
            assert tb.regimes is not None  # the calibration sets them
            bonus = tb.regimes[np.arange(len(reqs)), length].tolist()
            for r, a, reg in zip(reqs, length.tolist(), bonus):
                accepted_n[r.rid] = a
                r.regime = reg  # the regime at the bonus token's position
                r.regime_pos = r.n_tokens + a + 1
        return PassOutcome(
            end=now + ms / 1000.0,
            ms=ms,
            sizes=sizes,
            accepted=accepted_n,
            tokens=v_tokens,
            draft=draft,
            drafted_rids=frozenset(trees),
            expected={
                rid: float(trees[rid].f[selected[rid][1:]].sum())
                for rid in trees
                if sizes.get(rid, 1) > 1
            },
        )

    def _reveal(self, batches) -> list[tuple[np.ndarray, np.ndarray]]:
        """Tell a clairvoyant policy, before it selects, rid -> the nodes (root first)
        the target accepts when every drafted node is verified; returns per tree batch
        that full verification's (selected, on_path) masks."""
        paths: dict[int, np.ndarray] = {}
        full = []
        for reqs, tb in batches:
            everything = np.ones((len(reqs), tb.lay.n + 1), dtype=bool)
            _, on_path = accepted_paths(tb, everything)
            full.append((everything, on_path))
            for k, r in enumerate(reqs):
                paths[r.rid] = np.flatnonzero(on_path[k])
        self.policy.reveal(paths)
        return full

    # ------------------------------------------------------------------ bookkeeping
    def _info(self, wall: float) -> None:
        finish = [r.finish_s for r in self.records if r.finish_s is not None]
        duration = max(finish) if finish else max(self.now, 1e-9)
        kvb = self.hw.kv_bytes_target + self.hw.kv_bytes_draft
        pool = self.sched.allocator.num_blocks * self.cfg.block_size * kvb
        self.timeline.info = {
            **self.recorder.info(self.name, self.counters, pool, self.slos),
            "duration_s": duration if duration > 0 else 1e-9,
            "wall_s": duration,
            "model_time_s": self.busy_s,
            "step_time_s": self.busy_s,
            "shifts_applied": [],
            "unloaded_tpot_ms": self.sim.unloaded_tpot_ms(),
            "simulated": True,
            "sim_wall_s": wall,
            "selection_time_s": self.sel_s,
            "selection_share": self.sel_s / self.busy_s if self.busy_s > 0 else None,
            "selection_time_mode": self.cfg.selection_time,
            **(
                {"retries": {"tried": self.retries[0], "admitted": self.retries[1]}}
                if self.cfg.retry_refused
                else {}
            ),
        }


def run_recorder(sim: Simulator, horizon_s: float) -> RunRecorder:
    """The recorder of a run whose last request arrives at ``horizon_s``."""
    cfg = sim.cfg
    kvb = (sim.hw.kv_bytes_target + sim.hw.kv_bytes_draft) or 0
    return RunRecorder(
        ModelCosts(cfg.flops_per_token, cfg.weight_bytes, kvb),
        t0=0.0,
        sample_every_s=horizon_s / cfg.timeline_max_samples if horizon_s > 0 else 0.0,
    )


_ROOT = np.zeros(1, dtype=np.int64)
