"""One step, for the engine, the simulator and the replay alike (no torch).

    inputs = executor.prepare()                     what the executor knows before the step
    out = scheduler.schedule(inputs)                admit -> view -> plan -> reserve
    outcome = executor.execute(out)                 speculate -> select (tree slots through
                                                    ``Scheduler.reserve_tree``) -> verify
                                                    -> tokens appended
    trace = scheduler.update_from_output(out, outcome)   commit bookkeeping, finishes,
                                                    the whole ``StepTrace``, feedback

``run_step`` is that sequence; the engine's ``Engine.step``, the simulator's and the
replay's steps all call it, so a replay checks the engine's real order. The executor
returns what the pass did as a ``StepOutcome``: it writes the tokens it owns (the
engine's token ids, the simulator's token counts) and nothing of the scheduler's
request state (``num_cached``, ``first_token_at``, finishes), which the scheduler
applies from the outcome's ``Commit`` list.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from adaserve.core.policy import BatchView, Plan
from adaserve.core.seq import SeqState
from adaserve.core.trace import DraftWork as DraftWork  # re-exported: the executors build it
from adaserve.core.trace import StepTrace

if TYPE_CHECKING:  # the scheduler imports this module
    from adaserve.core.scheduler import Scheduler

# the request type of a batch: the engine's ``Request``, the simulator's ``SimRequest``
S = TypeVar("S", bound=SeqState)


@dataclass
class Batch(Generic[S]):
    """The requests of one pass, in admission order.

    prefill: (request, prefill tokens) for requests prefilling in this pass
    decode:  requests decoding (their root, and a tree when speculating)
    spec:    (request, (depth, width)) for decoding requests that draft a tree
    """

    prefill: list[tuple[S, int]] = field(default_factory=list)
    decode: list[S] = field(default_factory=list)
    spec: list[tuple[S, tuple[int, int]]] = field(default_factory=list)

    @property
    def kv_tokens(self) -> int:
        """Context tokens the pass attends: cached + new of each prefill, the context
        of each decode."""
        return sum(r.num_cached + n for r, n in self.prefill) + sum(
            r.num_tokens for r in self.decode
        )

    @property
    def prefill_pairs(self) -> int:
        """New x context token pairs of the prefill chunks: each chunk's new tokens
        attend what its KV already holds (a cached prefix, earlier chunks)."""
        return sum(n * r.num_cached for r, n in self.prefill)


@dataclass(frozen=True)
class StepInputs:
    """What the executor tells the scheduler at a step's start.

    acc_by_rank:      its calibrated acceptance by sibling rank (shown to the policy)
    can_draft:        a draft model exists (trees may be reserved)
    mask_ms_per_node: the measured host time of one node's grammar mask (None: the
                      hardware model's)
    """

    acc_by_rank: tuple[float, ...] = ()
    can_draft: bool = True
    mask_ms_per_node: float | None = None


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's schedule (``Scheduler.schedule``).

    expired:   queued requests ended at their TTFT deadline at the step's start
    t_start:   the clock at the step's start
    view / plan / batch: what the policy saw, its plan and the pass's requests with
               their KV reserved (None / None / empty when nothing runs: ``runs``)
    kv_tokens / prefill_pairs: the batch's context tokens and prefill pairs, taken
               before the commit moves the counts on (``Batch``)
    plan_s:    wall seconds the view and the plan took (the simulator's measured
               selection time)
    """

    expired: tuple[SeqState, ...]
    t_start: float
    view: BatchView | None = None
    plan: Plan | None = None
    batch: Batch[SeqState] | None = None
    kv_tokens: int = 0
    prefill_pairs: int = 0
    plan_s: float = 0.0

    @property
    def runs(self) -> bool:
        """Whether a pass runs in this step (some request is running)."""
        return self.plan is not None


@dataclass(frozen=True)
class Commit:
    """What one request of the pass committed, for the scheduler to apply.

    num_cached:  the target KV's committed tokens after the pass
    first_token: the pass produced its first output token (``first_token_at`` is set
                 when it has none yet)
    finish:      the reason it ended in this pass (None: it goes on)
    draft_cached: the draft KV's cached tokens after the pass (None: unchanged)
    """

    seq: SeqState
    num_cached: int
    first_token: bool = False
    finish: str | None = None
    draft_cached: int | None = None


@dataclass(frozen=True)
class StepOutcome:
    """What executing a ``SchedulerOutput`` gave.

    t_end:      the clock at the commit (every token of the pass is stamped then)
    ms:         the pass's time handed to ``policy.feedback``
    commits:    per request of the batch, prefills then decodes, in batch order
    tree_nodes: rid -> candidate nodes verified (0 = root only), per decoding request
    accepted:   rid -> candidates accepted
    expected:   rid -> the verified candidates' accepted tokens expected by the draft's
                calibrated confidence (the sum of their ``f``), per drafting request
    tokens:     target tokens of the verification pass (prefill + roots + candidates)
    draft:      the draft's work
    predicted_ms / stall: the profile's prediction of the pass and the stall cause
                (``core.stalls``), where the executor judges its passes
    """

    t_end: float
    ms: float
    commits: tuple[Commit, ...] = ()
    tree_nodes: Mapping[int, int] = field(default_factory=dict)
    accepted: Mapping[int, int] = field(default_factory=dict)
    expected: Mapping[int, float] = field(default_factory=dict)
    tokens: int = 0
    draft: DraftWork = DraftWork()
    predicted_ms: float = 0.0
    stall: str | None = None

    @property
    def finished(self) -> tuple[SeqState, ...]:
        """The requests that ended in this pass, in commit order."""
        return tuple(c.seq for c in self.commits if c.finish is not None)


@dataclass(frozen=True)
class StepResult:
    """One step as ``run_step`` ran it: the schedule, the outcome and the trace (None
    when nothing ran), and the requests that finished (expired first)."""

    out: SchedulerOutput
    outcome: StepOutcome | None = None
    trace: StepTrace | None = None

    @property
    def finished(self) -> list[SeqState]:
        done = list(self.out.expired)
        if self.outcome is not None:
            done.extend(self.outcome.finished)
        return done


class Executor(Protocol):
    """Runs passes: the engine's models, the simulator's synthetic drafting and
    pricing, or a recording (the replay)."""

    def prepare(self) -> StepInputs: ...

    def execute(self, out: SchedulerOutput) -> StepOutcome: ...


def run_step(sched: Scheduler, ex: Executor) -> StepResult:
    """One step: schedule, execute, update (the module's docstring)."""
    out = sched.schedule(ex.prepare())
    if not out.runs:
        return StepResult(out)
    outcome = ex.execute(out)
    return StepResult(out, outcome, sched.update_from_output(out, outcome))
