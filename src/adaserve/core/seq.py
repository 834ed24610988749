"""The scheduling state of one request, common to the engine and the simulator.

The engine's ``Request`` (tokens, sampling, logprobs) and the simulator's request
(token counts, acceptance regime) both extend ``SeqState``; the ``Scheduler`` reads and
writes only what is declared here.

Invariants (kept by the ``Scheduler``):
- status WAITING: in ``Scheduler.waiting``, no KV blocks held (``num_cached == 0`` after
  a preemption); RUNNING: in ``Scheduler.running`` with a block table; FINISHED: in
  neither, its blocks released.
- the target cache holds ``num_cached`` tokens (positions ``0..num_cached-1``); while
  decoding exactly one token (the root) is uncached.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from adaserve.core.blocks import BlockTable
from adaserve.core.slo import SLO


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# the share of a request's draft record kept from one decode step to the next
# (``SeqState.record_drafts``): its evidence halves in about three steps. Chosen, not
# measured: a 32-token request decodes in about ten steps on the CPU pair
DRAFT_FORGET = 0.8

# the prior, in accepted tokens its drafts' confidence expected, that shrinks a
# request's realised acceptance toward the mean request's (``SeqState.acc_scale``): the
# inverse of the between-request variance of realised over expected, relative to its
# mean. Measured on the CPU pair (100 lone interactive requests, split-half covariance
# of each request's ratio: relative variance 0.07; docs/results/engine-issue30.md, tenth
# pass): a request's own evidence outweighs the mean after about ten speculating steps
REALISED_PRIOR = 14.0


class SeqState:
    """What the scheduler keeps per request. Subclasses provide ``num_tokens``,
    ``prompt_len`` and ``max_new_tokens``."""

    __slots__ = (
        "rid",
        "slo",
        "arrival",
        "status",
        "table",
        "num_cached",
        "draft_cached",
        "admit_seq",
        "admitted_at",
        "first_token_at",
        "finished_at",
        "finish_reason",
        "degraded_from",
        "preemptions",
        "cancelled",
        "constrained",
        "cache_salt",
        "cache_lookup",
        "digests",
        "prefix_hint",
        "cached_prompt",
        "promise",
        "beside",
        "tenant",
        "pred_tpot_ms",
        "pred_ttft_ms",
        "retry_token",
        "room_for",
        "door_until",
        "draft_steps",
        "draft_ratio",
        "seen_accepted",
        "seen_expected",
    )

    def __init__(self, rid: int, slo: SLO, arrival: float):
        self.rid = rid
        self.slo = slo  # the working SLO (a degraded request gets its looser class's)
        self.arrival = arrival
        self.status = Status.WAITING
        self.table: BlockTable | None = None
        self.num_cached = 0
        self.draft_cached = 0
        self.admit_seq = 0
        self.constrained = False  # its output follows a grammar (structured outputs)
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.finish_reason: str | None = None
        self.degraded_from: str | None = None
        self.preemptions = 0
        self.cancelled = False
        # prefix caching: the salt of its first block's name (None: shared by all),
        # whether it may map cached blocks (a request scoring its prompt's log
        # probabilities computes them all), its blocks' names so far, the cached
        # tokens expected while it waits, and the prompt tokens it found cached
        self.cache_salt: str | None = None
        self.cache_lookup = True
        self.digests: list[bytes] = []
        self.prefix_hint = 0
        self.cached_prompt = 0
        # admission's promise: the predicted chance it meets its SLO, and the TPOT and
        # TTFT (ms, from arrival) predicted when it was admitted (None: not predicted)
        self.tenant: str | None = None  # whose request it is (fair share under contention)
        self.promise: float | None = None
        # requests of its class or a stricter one it was admitted beside (running or
        # queued then; None: admitted unjudged), for the chance by company
        # (``AdmissionControl.company_bound``)
        self.beside: int | None = None
        self.pred_tpot_ms: float | None = None
        self.pred_ttft_ms: float | None = None
        self.retry_token: str | None = None  # the seat it was told to come back for
        # a seat's client admitted at the door (``AdmissionControl._door``): it starts
        # once fewer than ``room_for`` requests run, or at ``door_until`` (its latest start)
        self.room_for: int | None = None
        self.door_until = math.inf
        # its drafts' confidence against the plans' (``record_drafts``): speculating
        # steps remembered, and the mean ratio over them
        self.draft_steps = 0.0
        self.draft_ratio = 1.0
        # what its verified drafts gave against what their confidence expected
        # (``record_verified``): accepted tokens over the mean request's ratio, expected
        self.seen_accepted = 0.0
        self.seen_expected = 0.0

    def record_drafts(self, ratio: float | None) -> None:
        """One decode step of this request: ``ratio`` is the accepted tokens its verified
        tree was expected to give by the draft's own calibrated confidence over what
        the plan expected of its allocation at the calibrated acceptance, relative to
        the running mean over passes (``Scheduler._record_drafts``); None when it did not
        speculate. The record forgets ``DRAFT_FORGET`` of itself a step, so a request
        that stopped speculating returns to the mean and is tried again."""
        self.draft_steps *= DRAFT_FORGET
        if ratio is not None:
            self.draft_ratio += (ratio - self.draft_ratio) / (self.draft_steps + 1.0)
            self.draft_steps += 1.0

    def record_verified(self, accepted: int, expected: float, mean_ratio: float) -> None:
        """One speculating step's outcome: ``accepted`` candidates of a verified tree
        whose draft's calibrated confidence expected ``expected``; ``mean_ratio`` is the
        running mean of accepted over expected across requests
        (``Scheduler._record_drafts``), so the record compares this request with the
        mean one. Kept for the request's life: a draft model confidently wrong about
        this request's text is what its confidence cannot show."""
        self.seen_accepted += accepted / mean_ratio
        self.seen_expected += expected

    @property
    def acc_scale(self) -> float:
        """What its drafts are worth against the mean request's: their confidence
        relative to the mean request's, shrunk toward 1 by one pseudo-step
        ((n r + 1) / (n + 1) over its ``n`` remembered speculating steps, mean ratio
        ``r``), times what they realised against that confidence, shrunk toward 1 by
        ``REALISED_PRIOR`` expected tokens ((a + P) / (e + P)). The first knows a
        request whose prompt the draft does not follow from its first drafts; the
        second, a request whose drafts are confident and wrong, after several steps,
        so one unlucky step (a coin toss per node) moves it little
        (``ReqView.acc_scale``, ``budgeted.planner.own_acceptance``)."""
        n = self.draft_steps
        confidence = (n * self.draft_ratio + 1.0) / (n + 1.0)
        realised = (self.seen_accepted + REALISED_PRIOR) / (self.seen_expected + REALISED_PRIOR)
        return confidence * realised

    # ------------------------------------------------------------ provided by subclasses
    @property
    def num_tokens(self) -> int:
        """Tokens in the context: prompt + output so far."""
        raise NotImplementedError

    @property
    def prompt_len(self) -> int:
        """Prompt tokens."""
        raise NotImplementedError

    @property
    def max_new_tokens(self) -> int:
        """The output-token limit (``max_tokens``)."""
        raise NotImplementedError

    def block_tokens(self, start: int, stop: int) -> Sequence[int] | None:
        """Token ids at positions ``start..stop-1`` (what names a KV block); None when
        the request's tokens are unknown (it is never cached)."""
        return None

    # ------------------------------------------------------------ derived
    @property
    def cls(self) -> str:
        """The class the request arrived in (before any degradation)."""
        return self.degraded_from or self.slo.cls

    @property
    def num_output(self) -> int:
        """Output tokens so far."""
        return self.num_tokens - self.prompt_len

    @property
    def uncached(self) -> int:
        """Context tokens not yet in the target's KV cache."""
        return self.num_tokens - self.num_cached

    @property
    def to_prefill(self) -> int:
        """Context tokens still to compute: the uncached ones, less those a waiting
        request expects to find in the prefix cache."""
        hint = self.prefix_hint if self.status is Status.WAITING else 0
        return max(1, self.uncached - hint) if hint else self.uncached

    @property
    def in_prefill(self) -> bool:
        """True until the prompt is cached and the first token produced."""
        return self.uncached > 1 or self.num_output == 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def running(self) -> bool:
        return self.status is Status.RUNNING
