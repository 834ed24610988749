"""Replay a recorded engine run through the simulator's scheduler.

The engine and the simulator are twins by construction (one ``Scheduler``); a replay
checks it on a real run. The recorded run gives the arrivals (``RecordedRequest``) and,
per step, what only the models could decide: the start and commit times, the
calibrated acceptance shown to the policy, the verified tree sizes, the accepted
candidates and what the draft's confidence expected of them (``StepTrace``). The
simulator runs its own scheduler and a fresh policy on those outcomes; its traces must
make the same admission, prefill-chunk, preemption and plan decisions at every step
(``decisions``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from adaserve.bench.workload_spec import WorkItem
from adaserve.core.config import SchedulerConfig
from adaserve.core.policy import BatchView, Plan, Policy
from adaserve.core.slo import SLO
from adaserve.core.step import Batch, StepInputs, run_step
from adaserve.core.trace import DraftWork, StepTrace
from adaserve.errors import AdmissionRejected
from adaserve.hardware.model import HardwareModel
from adaserve.sim.acceptance import AcceptanceModel
from adaserve.sim.acceptance_params import AcceptanceParams
from adaserve.sim.loop import PassOutcome, SimConfig, SimRequest, Simulator, _Run


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the engine received it (``arrival`` on the engine's clock)."""

    rid: int
    arrival: float
    prompt_len: int
    max_tokens: int
    slo: SLO
    # its prompt and output token ids, when known: the simulator then names its KV
    # blocks as the engine did, and finds the same prefix-cache hits
    tokens: tuple[int, ...] | None = None


def decisions(tr: StepTrace) -> dict:
    """The scheduling decisions of one step, for comparing two runs."""
    p = tr.plan
    return {
        "admitted": list(tr.admitted),
        "preempted": list(tr.preempted),
        "cached": dict(tr.cached),
        "prefill": dict(tr.prefill),
        "decode": list(tr.decode),
        "spec": dict(tr.spec),
        "plan": {
            "shapes": dict(p.shapes),
            "prefill": dict(p.prefill),
            "budget": p.budget,
            "node_cap": dict(p.node_cap),
            "fallback": p.fallback,
            "degrade": dict(p.degrade),
        },
    }


def replay(
    cfg: SchedulerConfig,
    policy: Policy,
    hw: HardwareModel,
    num_blocks: int,
    max_model_len: int,
    unloaded_tpot_ms: float,
    requests: list[RecordedRequest],
    steps: list[StepTrace],
    has_draft: bool = True,
    refusals: dict[int, str] | None = None,
) -> list[StepTrace]:
    """The simulator's traces of ``steps`` replayed under ``policy`` (fresh, the same
    kind as the recorded run's) with the recorded arrivals, times and outcomes. A
    clairvoyant policy is refused: a recording holds no target paths to reveal.

    With admission control on (``cfg.admission``), each arrival is judged when the
    engine judged it: at its arrival, or at the end of the pass running then.
    ``refusals`` (when given) receives ``rid -> reason`` for every request the
    simulator's admission refused."""
    if policy.clairvoyant:
        raise ValueError(f"policy {policy.name!r} is clairvoyant: a replay has no target paths")
    base = {f.name: getattr(cfg, f.name) for f in fields(SchedulerConfig)}
    scfg = SimConfig(
        **{**base, "max_model_len": max_model_len},
        kv_slots=num_blocks * cfg.block_size,
        has_draft=has_draft,
    )
    sim = Simulator(hw, AcceptanceModel(AcceptanceParams()), scfg, None, unloaded_tpot_ms)
    run = _ReplayRun(sim, policy, requests, steps, refusals if refusals is not None else {})
    run.go()
    return run.traces


class _ReplayRun(_Run):
    """A simulation whose passes take their time and acceptance from a recording."""

    def __init__(self, sim, policy, requests, steps, refusals: dict[int, str]):
        items = [
            WorkItem(
                r.rid,
                r.arrival,
                r.slo.cls,
                None,
                None if r.tokens is None else list(r.tokens[: r.prompt_len]),
                r.prompt_len,
                r.max_tokens,
                meta={} if r.tokens is None else {"tokens": list(r.tokens)},
            )
            for r in requests
        ]
        super().__init__(sim, policy, items, {}, None, None, False)
        self._slo = {r.rid: r.slo for r in requests}
        self._steps = list(steps)
        self._k = 0
        self.traces: list[StepTrace] = []
        self.refusals = refusals  # rid -> reason of the arrivals admission refused

    def _arrive(self, it: WorkItem, retry: bool = False) -> None:
        self.clock.set(max(self.clock.now(), it.arrival_s))
        self.sched.check_prompt(it.prompt_len)
        try:
            self.sched.add(SimRequest(it, self._slo[it.idx]))
        except AdmissionRejected as e:
            self.refusals[it.idx] = e.reason

    def go(self):
        items, i = self.items, 0
        for rec in self._steps:
            self.now = rec.t_start
            while i < len(items) and items[i].arrival_s <= self.now:
                self._arrive(items[i])
                i += 1
            self._rec = rec
            self._step()
        return self.records, self.timeline

    def _step(self) -> None:
        """The engine's step (``core.step.run_step``) on the recorded pass."""
        res = run_step(self.sched, self)
        if res.trace is not None:
            self.traces.append(res.trace)

    def prepare(self) -> StepInputs:
        """The recorded start, and the acceptance the engine's policy was shown."""
        self.clock.set(self._rec.t_start)
        return StepInputs(self._rec.acc_by_rank, self.cfg.has_draft)

    def _execute(self, view: BatchView, plan: Plan, batch: Batch, sel_s: float) -> PassOutcome:
        """The recorded pass: its tree sizes (KV reserved as the engine did), its
        accepted candidates, its end."""
        rec = self._rec
        sizes, accepted = {}, {}
        for r in batch.decode:
            k = rec.tree_nodes.get(r.rid, 0) + 1
            if k > 1 and not self.sched.reserve_tree(r, k):
                k = 1
            sizes[r.rid] = k
            if r.rid in rec.accepted:
                accepted[r.rid] = rec.accepted[r.rid]
        # the draft's work as the simulator counts it (``DraftWork.of_trees``) for the
        # recorded shapes: the replay test holds it to the engine's count, step by step
        draft = DraftWork.of_trees(
            [(r.n_tokens, r.draft_cached, d, w) for r, (d, w) in batch.spec], rec.draft.drafted
        )
        return PassOutcome(
            end=rec.t_end,
            ms=rec.duration_s * 1000.0,
            sizes=sizes,
            accepted=accepted,
            tokens=rec.tokens,
            draft=draft,
            drafted_rids=frozenset(r.rid for r, _ in batch.spec),
            expected={rid: e for rid, e in rec.expected.items() if sizes.get(rid, 1) > 1},
        )
