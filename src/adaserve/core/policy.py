"""The policy interface shared by the engine and the simulator (no torch here).

Each iteration the engine (or simulator) builds a ``BatchView``, asks the policy for a
``Plan`` (which requests speculate with which tree shape, how many prefill tokens each
prefilling request gets, the token budget), grows the candidate trees, then asks the
policy to ``select`` nodes from them. Policies see only plain numbers and numpy arrays.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from adaserve.core.tree import CandidateTree


@dataclass(slots=True)
class ReqView:
    """What a policy may know about one admitted request.

    n_out:        output tokens produced so far (o_r)
    decode_ms:    time since its first output token (l_r); 0 before it
    waited_ms:    time since arrival
    prefill_left: prompt tokens still to prefill (0 when decoding)
    context_len:  tokens in its context (prompt + output)
    rank:         strictness of its class (0 = strictest)
    constrained:  its output follows a grammar (structured outputs): every node of its
                  trees costs a grammar mask on the host
    acc_scale:    its drafts' calibrated confidence relative to the mean request's,
                  shrunk toward 1 (``SeqState.acc_scale``)
    """

    rid: int
    cls: str
    tpot_ms: float | None
    ttft_ms: float | None
    n_out: int
    decode_ms: float
    waited_ms: float
    prefill_left: int
    context_len: int
    rank: int = 0
    max_tokens: int = 1 << 30
    min_rate: float = 0.0
    max_queue_ms: float | None = None
    deadline_ms: float | None = None
    constrained: bool = False
    acc_scale: float = 1.0

    @property
    def decoding(self) -> bool:
        """Whether the request is past its prefill."""
        return self.prefill_left == 0


@dataclass
class BatchView:
    """The admitted requests at the start of an iteration, plus resources."""

    now_ms: float
    requests: list[ReqView]
    free_kv_slots: int
    hw: Any = None  # a hardware.model.HardwareModel when a profile is available
    num_waiting: int = 0
    acc_by_rank: tuple[float, ...] = ()  # calibrated acceptance of a child by sibling rank
    # a hardware.power.PowerModel when the deployment's is known (Any: core imports
    # nothing above it, types included)
    power: Any = None
    # ms of host work per grammar mask of a constrained request's node (the engine's
    # live mean, else the profile's ``mask_ms_per_node``)
    mask_ms_per_node: float = 0.0

    @property
    def decoding(self) -> list[ReqView]:
        """The requests past their prefill."""
        return [r for r in self.requests if r.decoding]

    @property
    def prefilling(self) -> list[ReqView]:
        """The requests still prefilling."""
        return [r for r in self.requests if not r.decoding]


NO_BUDGET = 1 << 30  # Plan.budget of a plan that sets no verification token budget


class PlannerState:
    """Base of what a policy's ``plan`` leaves on its ``Plan`` for that same policy's
    ``select`` and ``feedback``: opaque to every other caller, who passes the plan
    back unchanged (its contents are the policy's own and may change at any time)."""

    __slots__ = ()


@dataclass
class Plan:
    """A policy's decision before drafting.

    shapes:    rid -> (depth, width) for decoding requests that speculate (absent = none)
    prefill:   rid -> prefill tokens this iteration
    budget:    verification token budget B (tree nodes + roots + prefill tokens);
               ``NO_BUDGET`` when the policy sets none (see ``bounded_budget``)
    node_cap:  rid -> max selected candidate nodes (absent = no cap)
    fallback:  reason string when the policy fell back to plain decoding
    degrade:   rid -> "looser": move the request to a looser class (overload)
    t_iter_ms: the iteration time the plan predicts (None when it predicts none)
    skip:      rids of decoding requests that sit this pass out (no token this pass)
    energy_j:  the pass's predicted energy (J; None without a power model)
    state:     the planning policy's own state for ``select`` / ``feedback``
               (``PlannerState``; opaque to callers)
    """

    shapes: dict[int, tuple[int, int]] = field(default_factory=dict)
    prefill: dict[int, int] = field(default_factory=dict)
    budget: int = NO_BUDGET
    node_cap: dict[int, int] = field(default_factory=dict)
    fallback: str | None = None
    degrade: dict[int, str] = field(default_factory=dict)
    t_iter_ms: float | None = None
    energy_j: float | None = None
    skip: set[int] = field(default_factory=set)
    state: PlannerState | None = field(default=None, repr=False, compare=False)

    @property
    def bounded_budget(self) -> int | None:
        """The verification token budget, or None when the plan sets none."""
        return None if self.budget >= NO_BUDGET else self.budget


@dataclass(frozen=True)
class LoadHints:
    """What a router may read of a policy and its latest plan (``Policy.load_hints``).

    acc_by_rank:   the calibrated acceptance of a child by sibling rank the policy
                   plans with (empty: the policy calibrates none)
    margin:        the fraction of each TPOT target its plans aim below
    prefill_chunk: prefill tokens per pass it plans (0: none of its own)
    verified:      rid -> tokens a pass of the latest plan verifies for each decoding
                   request it planned (empty: none planned, or no per-request figures)
    expected:      rid -> output tokens the latest plan expects to give each decoding
                   request it planned (1 + its expected accepted candidates; empty:
                   none), what admission measures the planner's forecasts against
    """

    acc_by_rank: tuple[float, ...] = ()
    margin: float = 0.0
    prefill_chunk: int = 0
    verified: dict[int, float] = field(default_factory=dict)
    expected: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class PassForecast:
    """What a policy predicts a pass would give a batch (``Policy.forecast``).

    t_iter_ms: the pass's predicted time (the policy's cost model with its online
               correction)
    tokens:    rid -> expected output tokens the pass gives each decoding request
               (1 + its expected accepted candidates)
    """

    t_iter_ms: float
    tokens: dict[int, float]

    def pace_ms(self, rid: int) -> float:
        """The predicted ms per output token of request ``rid`` at this pass."""
        return self.t_iter_ms / self.tokens[rid]


class Policy(ABC):
    """A scheduling/speculation policy. Subclasses are stateless between runs except
    for what ``feedback`` and the views teach them."""

    name: str = "policy"
    uses_draft: bool = True
    # A clairvoyant policy (``ClairvoyantPolicy``) is told the target's accepted path
    # before ``select``: only the simulator knows it, so only the simulator runs one;
    # the engine refuses it. Upper bounds, not servable policies.
    clairvoyant: bool = False

    @abstractmethod
    def plan(self, view: BatchView) -> Plan:
        """The iteration's plan: prefill chunks, tree shapes and token budget."""

    def select(
        self, view: BatchView, plan: Plan, trees: dict[int, CandidateTree]
    ) -> dict[int, np.ndarray]:
        """rid -> the nodes of its tree to verify (sorted, containing 0). Default: all."""
        return {rid: np.arange(len(t.tokens)) for rid, t in trees.items()}

    def feedback(self, plan: Plan, measured_ms: float) -> None:
        """Nothing; takes the measured duration of the iteration ``plan`` described
        (default: ignored)."""
        return None

    def admission_key(self, waiting: ReqView) -> tuple[Any, ...]:
        """The sort key that orders waiting requests for admission (smallest first).
        Default FCFS."""
        return (-waiting.waited_ms,)

    def explain(self, req: ReqView, plan: Plan) -> dict[str, Any]:
        """What the selection log records of ``req`` under ``plan``: at least
        ``{"requirement": accepted tokens it needs this iteration, or None}``."""
        return {"requirement": None}

    def forecast(
        self, view: BatchView, prefill: dict[int, tuple[float, float]]
    ) -> PassForecast | None:
        """The pass this policy would plan for the decoding requests of ``view`` with
        ``prefill`` to compose into it (rank of a class -> (prompt tokens per pass
        that meet the TTFT deadlines of that class's queued requests, prompt tokens
        per pass offered for that class)): its predicted time and each
        decoder's expected tokens. Asked by admission (``core.admission``) of a
        hypothetical batch: it must change no state of the policy. Default: None (no
        cost model; admission then judges by the measured paces alone)."""
        return None

    def load_hints(self, plan: Plan | None) -> LoadHints:
        """What a router reads of this policy and of its latest ``plan`` (None: no plan
        yet) to judge the replica's load (``cluster/routing.py``). Default: nothing
        calibrated, no margin, no prefill chunk of its own, no per-request figures."""
        return LoadHints()


class ClairvoyantPolicy(Policy):
    """A policy told the target's accepted path before ``select`` (``reveal``): only
    the simulator knows it, so only the simulator runs one (``sim/loop.py`` calls
    ``reveal`` on a policy whose ``clairvoyant`` is set); the engine refuses it."""

    clairvoyant = True

    @abstractmethod
    def reveal(self, paths: dict[int, np.ndarray]) -> None:
        """Called just before ``select`` with rid -> the sorted node indices (root
        first) of the target's path that verifying the whole drafted tree would
        accept."""


def chunk_prefills(
    view: BatchView, token_budget: int, order_key: Callable[[ReqView], Any] | None = None
) -> dict[int, int]:
    """rid -> prefill tokens: ``token_budget`` shared among prefilling requests in
    ``order_key`` order (view order without one)."""
    reqs = view.prefilling
    if order_key is not None:
        reqs = sorted(reqs, key=order_key)
    return chunk_in_order(reqs, token_budget)


def prefill_pairs(view: BatchView, prefill: dict[int, int]) -> float:
    """The (new token x context token) pairs of the prefill chunks ``prefill`` (rid ->
    tokens): each chunk's new tokens attend what is already in its KV (a cached prefix
    and its earlier chunks), ``HardwareModel.prefill_ms_per_pair`` each."""
    if not prefill:
        return 0.0
    return float(
        sum(
            prefill[r.rid] * (r.context_len - r.prefill_left)
            for r in view.prefilling
            if r.rid in prefill
        )
    )


def chunk_in_order(reqs: Iterable[ReqView], budget: int) -> dict[int, int]:
    """rid -> prefill tokens: ``budget`` tokens given out in the order of ``reqs``."""
    out: dict[int, int] = {}
    left = budget
    for r in reqs:
        if left <= 0:
            break
        n = min(r.prefill_left, left)
        if n > 0:
            out[r.rid] = n
            left -= n
    return out


def top_f_nodes(tree: CandidateTree, k: int) -> np.ndarray:
    """The root plus the k candidates of highest f: sorted node indices of a connected
    subtree."""
    n = tree.num_candidates
    if k >= n:
        return np.arange(n + 1)
    if k <= 0:
        return np.zeros(1, dtype=np.int64)
    f = tree.f[1:]
    # stable tie-break by index so parents (smaller index, f >= child) come first
    best = np.lexsort((np.arange(n), -f))[:k] + 1
    return np.concatenate(([0], np.sort(best)))
