"""Request routing across engine replicas (torch-free, no Ray): each replica's SLO
headroom as plain numbers (``ReplicaStats``), and the routers that rank replicas for a
request from them.

The same code routes in the simulator (``sim/cluster.py``: N simulated replicas on one
clock) and in the Ray Serve deployment (a ``RequestRouter`` that calls ``Router.rank``
on the stats the replicas report).

Routers (``make_router``):

* ``slo``: predicts, for each replica, the TPOT its classes and the request would get
  with the request added, and whether the request's TTFT stays reachable behind the
  prefill queued ahead of it. The prediction is a load model priced by the replica's
  hardware model (``replica_stats``: every request drafting and verifying a reference
  chain; not the planner's own pass, which spends any slack on deeper trees and
  prefill), stretched by the share of the replica's time that prefill of the prompts
  the router sent it takes (``SloRouter.prefill_share``). A replica is *feasible* when
  every class there, and the request, stays within its TPOT target less ``margin`` and
  the TTFT is reachable; slack is the smallest margin left.

  By default (``balance=hybrid``) the feasible replicas come first, the most slack
  first (ties: by the balancing below); after them (and when none is feasible, as in a burst) the others by
  *class-aware balancing*: a strict request (rank 0) to the replica with the fewest
  strict requests (running + waiting), then the shortest queue; a relaxed one to the
  shortest queue, then the fewest strict requests; a replica whose KV cannot hold the
  request last, the slack breaking the remaining ties. Strict decoders are what a pass
  is sized for (each needs a deep tree inside its tight TPOT, a relaxed one can take a
  token a pass), so in overload they are spread evenly on their own while relaxed work
  fills the replicas by queue length; the predicted slack, which ranks well while
  targets are reachable, says little once none is (docs/results/scale-out-sim.md).
  ``balance=class``: class-aware balancing alone. ``balance=slack``: the earlier rule,
  the most slack throughout; strict requests (rank 0) to the most slack, relaxed ones
  too (``relaxed=spread``), or packed onto the feasible replica with the least slack
  (``relaxed=pack``), or onto the feasible replica with the fewest strict requests
  (``relaxed=apart``).

  ``rank`` only ranks; the caller reports the replica the request went to with
  ``routed`` (the prefill rate that the slack prices is kept from those reports).
* ``p2c``: Ray Serve's power of two choices: two replicas drawn at random (seeded), the
  one with the shorter queue (running + waiting) first.
* ``rr``: round robin.

Slack of a replica for a request: the smallest, over the classes there and the
request's own, of ``1 - predicted TPOT / (target * (1 - margin))``, of the request's
``1 - predicted TTFT / TTFT target``, and of the KV share left once it is held.
Between two reports a caller applies ``with_routed`` for each request it sent.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, cast

ROUTERS = ("slo", "p2c", "rr")
# the reference chain of the load model (``replica_stats``): candidates a request drafts
REF_DEPTH = 3


@dataclass(frozen=True)
class ClassHeadroom:
    """One SLO class on one replica.

    predicted_tpot_ms: the planner's predicted TPOT of the class at the current load
                       (the pass time over the tokens a request of the class gains a
                       pass)
    prefill_tokens:    prompt tokens of the class still to prefill (waiting + running)
    """

    name: str
    rank: int
    tpot_ms: float
    ttft_ms: float
    predicted_tpot_ms: float
    running: int
    waiting: int
    prefill_tokens: int = 0

    def __post_init__(self) -> None:
        if self.rank < 0 or self.running < 0 or self.waiting < 0 or self.prefill_tokens < 0:
            raise ValueError(f"class {self.name!r}: rank and counts must be >= 0")
        for k in ("tpot_ms", "ttft_ms", "predicted_tpot_ms"):
            v = getattr(self, k)
            if not (v > 0 and not math.isnan(v)):  # inf allowed: no target
                raise ValueError(f"class {self.name!r}: {k} must be positive")


@dataclass(frozen=True)
class ReplicaStats:
    """What a replica reports for routing (every fraction of a second).

    budget_tokens:       verification tokens of the current plan's pass
    spare_budget_tokens: verification tokens the pass could add before the strictest
                         class with requests reaches its target less the margin
    pass_ms:             predicted time of the current pass
    ms_per_token:        predicted pass time one more verification token costs
    kv_ms_per_token:     predicted pass time one more attended context token costs
    tokens_per_pass:     verification tokens a decoding request takes per pass (its
                         root plus its tree, on average)
    prefill_chunk:       prefill tokens a pass carries at most
    max_num_seqs:        requests the replica runs at once
    kv_total_tokens:     KV pool in tokens (0: unknown)
    decode_left:         output tokens each running or waiting request has left at most
                         (its max_tokens less what it produced; empty: unknown)
    base_pass_ms:        the load model: a pass's fixed time (one request, reference tree)
    request_ms:          what each request adds to a pass (its reference tree's tokens)
    gained_per_pass:     tokens a decoding request gains a pass with the reference tree
    """

    replica_id: str
    classes: tuple[ClassHeadroom, ...]
    budget_tokens: int
    spare_budget_tokens: int
    running: int
    waiting: int
    waiting_prefill_tokens: int
    kv_free_fraction: float
    pass_ms: float
    at_s: float
    ms_per_token: float = 0.2
    kv_ms_per_token: float = 0.0
    tokens_per_pass: float = 1.0
    prefill_chunk: int = 256
    max_num_seqs: int = 64
    kv_total_tokens: int = 0
    decode_left: tuple[int, ...] = ()
    base_pass_ms: float = 25.0
    request_ms: float = 1.0
    gained_per_pass: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "decode_left", tuple(int(x) for x in self.decode_left))
        object.__setattr__(self, "classes", tuple(self.classes))
        if not 0.0 <= self.kv_free_fraction <= 1.0:
            raise ValueError("kv_free_fraction must be in [0, 1]")
        if self.running < 0 or self.waiting < 0 or self.waiting_prefill_tokens < 0:
            raise ValueError("running, waiting and waiting_prefill_tokens must be >= 0")
        if not self.pass_ms > 0 or self.prefill_chunk < 1 or self.max_num_seqs < 1:
            raise ValueError("pass_ms, prefill_chunk and max_num_seqs must be positive")
        if not (self.base_pass_ms > 0 and self.request_ms >= 0 and self.gained_per_pass >= 1):
            raise ValueError("base_pass_ms > 0, request_ms >= 0 and gained_per_pass >= 1")

    @property
    def queue_len(self) -> int:
        """Requests on the replica (running + waiting): what ``p2c`` balances."""
        return self.running + self.waiting

    def headroom(self, name: str) -> ClassHeadroom | None:
        """The class called ``name`` on this replica (None if it reports none)."""
        for c in self.classes:
            if c.name == name:
                return c
        return None


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request before it runs."""

    slo_class: str
    rank: int
    tpot_ms: float
    ttft_ms: float
    prompt_tokens: int
    max_tokens: int


class Router(Protocol):
    name: str

    def rank(self, req: RouteRequest, replicas: Sequence[ReplicaStats]) -> list[str]:
        """replica ids, best first (a caller takes the first that accepts)."""
        ...

    def routed(self, req: RouteRequest, s: ReplicaStats) -> None:
        """``req`` went to replica ``s`` (the caller tells, once it is placed)."""
        ...


# ---------------------------------------------------------------------- baselines
@dataclass
class RoundRobinRouter:
    """Replicas in turn (the order they are given in), whatever their load."""

    name: str = "rr"
    _next: int = 0

    def rank(self, req: RouteRequest, replicas: Sequence[ReplicaStats]) -> list[str]:
        ids = [r.replica_id for r in replicas]
        if not ids:
            return []
        k = self._next % len(ids)
        self._next += 1
        return ids[k:] + ids[:k]

    def routed(self, req: RouteRequest, s: ReplicaStats) -> None:
        """Nothing to keep."""


@dataclass
class PowerOfTwoRouter:
    """Ray Serve's default: two replicas drawn at random, the shorter queue first (ties:
    the first drawn); then the others by queue length."""

    seed: int = 0
    name: str = "p2c"
    _rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def rank(self, req: RouteRequest, replicas: Sequence[ReplicaStats]) -> list[str]:
        if len(replicas) <= 1:
            return [r.replica_id for r in replicas]
        a, b = self._rng.sample(range(len(replicas)), 2)
        two = sorted((a, b), key=lambda i: (replicas[i].queue_len, i != a))
        rest = sorted(
            (i for i in range(len(replicas)) if i not in (a, b)),
            key=lambda i: (replicas[i].queue_len, i),
        )
        return [replicas[i].replica_id for i in two + rest]

    def routed(self, req: RouteRequest, s: ReplicaStats) -> None:
        """Nothing to keep."""


# ---------------------------------------------------------------------- SLO-aware
@dataclass(frozen=True)
class Outlook:
    """What adding one request predicts on one replica."""

    replica_id: str
    feasible: bool
    slack: float  # the smallest slack over the classes served and the request's TTFT
    pass_ms: float  # the replica's pass time (``ReplicaStats.pass_ms``) plus what it adds
    kv_fits: bool = True  # the replica's free KV holds the request's prompt and output


@dataclass
class SloRouter:
    """The SLO-aware router (module docstring).

    balance:    "hybrid" (default): the feasible replicas by slack (ties: as below),
                then the others by class-aware balancing (strict requests to the
                fewest strict requests, then the shortest queue; relaxed ones to the
                shortest queue, then the fewest strict; KV that cannot hold it last;
                ties: the most slack).
                "class": class-aware balancing alone. "slack": the most slack
                throughout (the earlier rule, with ``relaxed``)
    margin:     the fraction of each TPOT target predictions must stay below
    pack_slack: the slack a relaxed request must leave on the replica it goes to
    relaxed:    with ``balance=slack``, where relaxed requests go: "spread" (default)
                the most slack, like strict ones; or, among the replicas that stay
                feasible with ``pack_slack`` to spare, "pack" the least slack (bin packing: relaxed
                work fills the room strict work leaves) or "apart" the fewest strict
                requests, then the least slack (relaxed work and its long prompts
                gather where strict work is not). On the reference workload at 8
                replicas neither beat "spread" (docs/results/scale-out-sim.md)
    prefill_tau_s: time constant (s) of the prompt-token rate the router has sent each
                replica (its prefill keeps a share of every pass busy)
    """

    margin: float = 0.1
    pack_slack: float = 0.1
    relaxed: str = "spread"
    prefill_tau_s: float = 10.0
    balance: str = "hybrid"
    name: str = "slo"
    _rate: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if not (0.0 <= self.margin < 1.0 and 0.0 <= self.pack_slack < 1.0):
            raise ValueError("slo router: margin and pack_slack must be in [0, 1)")
        if self.relaxed not in ("apart", "pack", "spread"):
            raise ValueError("slo router: relaxed must be apart, pack or spread")
        if not self.prefill_tau_s > 0:
            raise ValueError("slo router: prefill_tau_s must be positive")
        if self.balance not in ("hybrid", "class", "slack"):
            raise ValueError("slo router: balance must be hybrid, class or slack")
        if self.balance != "slack" and self.relaxed != "spread":
            raise ValueError("slo router: relaxed=apart and relaxed=pack need balance=slack")

    def prefill_share(self, s: ReplicaStats, extra_tokens: int = 0) -> float:
        """The share of ``s``'s time its prefill takes: the prompt tokens per second the
        router has sent it (decayed over ``prefill_tau_s``), plus ``extra_tokens`` more,
        at ``ms_per_token`` each (at most 0.9)."""
        rate, t = self._rate.get(s.replica_id, (0.0, s.at_s))
        rate *= math.exp(-max(s.at_s - t, 0.0) / self.prefill_tau_s)
        rate += extra_tokens / self.prefill_tau_s
        return min(rate * s.ms_per_token / 1000.0, 0.9)

    def routed(self, req: RouteRequest, s: ReplicaStats) -> None:
        """Count ``req``'s prompt into the prefill rate of the replica it went to (the
        caller tells once it is placed: ``rank`` changes nothing)."""
        rate, t = self._rate.get(s.replica_id, (0.0, s.at_s))
        rate *= math.exp(-max(s.at_s - t, 0.0) / self.prefill_tau_s)
        self._rate[s.replica_id] = (rate + req.prompt_tokens / self.prefill_tau_s, s.at_s)

    def outlook(self, req: RouteRequest, s: ReplicaStats) -> Outlook:
        """The predicted effect of adding ``req`` to replica ``s``: the load model's TPOT
        (``replica_stats``: every request's reference tree in each pass) with one more
        request, stretched by the share of time prefill takes there with its prompt."""
        aim = 1.0 - self.margin
        u = self.prefill_share(s, req.prompt_tokens)
        tpots = [c.predicted_tpot_ms for c in s.classes]
        now = max(tpots) if tpots else s.base_pass_ms / s.gained_per_pass
        after = (
            now + (s.request_ms + s.kv_ms_per_token * req.prompt_tokens) / s.gained_per_pass
        ) / (1.0 - u)
        slack = math.inf
        if math.isfinite(req.tpot_ms):
            slack = 1.0 - after / (req.tpot_ms * aim)
        for c in s.classes:
            if c.running + c.waiting and math.isfinite(c.tpot_ms):
                slack = min(slack, 1.0 - after / (c.tpot_ms * aim))
        # TTFT: the prefill of its own and stricter classes runs first
        ahead = sum(c.prefill_tokens for c in s.classes if c.rank <= req.rank)
        if not s.classes:
            ahead = s.waiting_prefill_tokens
        chunks = math.ceil((ahead + req.prompt_tokens) / s.prefill_chunk)
        pass_ms = after * s.gained_per_pass
        ttft = chunks * (pass_ms + s.ms_per_token * s.prefill_chunk) + pass_ms
        if s.running + 1 > s.max_num_seqs:  # it waits for a seat
            ttft += pass_ms * (s.waiting + 1) * 8
        if math.isfinite(req.ttft_ms):
            slack = min(slack, 1.0 - ttft / req.ttft_ms)
        kv_fits = True
        if s.kv_total_tokens > 0:
            kv_need = (req.prompt_tokens + req.max_tokens) / s.kv_total_tokens
            slack = min(slack, s.kv_free_fraction - kv_need)
            kv_fits = s.kv_free_fraction >= kv_need
        if math.isinf(slack):
            slack = 1.0
        added = max(after - now, 0.0) * s.gained_per_pass
        return Outlook(s.replica_id, slack >= 0.0, slack, s.pass_ms + added, kv_fits)

    def rank(self, req: RouteRequest, replicas: Sequence[ReplicaStats]) -> list[str]:
        outs = [self.outlook(req, s) for s in replicas]
        order = list(range(len(outs)))
        most_slack = sorted(order, key=lambda i: (-outs[i].slack, i))
        if self.balance != "slack":
            # class-aware balancing: strict requests by the strict requests there,
            # relaxed ones by queue length; KV that cannot hold the request last
            strict = [_strict_load(s) for s in replicas]
            queue = [s.queue_len for s in replicas]
            first, second = (strict, queue) if req.rank == 0 else (queue, strict)
            ranked = sorted(
                order,
                key=lambda i: (not outs[i].kv_fits, first[i], second[i], -outs[i].slack, i),
            )
            if self.balance == "hybrid":  # the feasible replicas first, by slack
                fit = sorted(
                    (i for i in order if outs[i].feasible),
                    key=lambda i: (-outs[i].slack, first[i], second[i], i),
                )
                ranked = fit + [i for i in ranked if i not in fit]
        elif req.rank == 0 or self.relaxed == "spread":
            ranked = most_slack
        else:
            fit = [i for i in order if outs[i].feasible and outs[i].slack >= self.pack_slack]
            if self.relaxed == "apart":
                fit.sort(key=lambda i: (_strict_load(replicas[i]), outs[i].slack, i))
            else:
                fit.sort(key=lambda i: (outs[i].slack, i))
            ranked = fit + [i for i in most_slack if i not in fit]
        return [outs[i].replica_id for i in ranked]


def _strict_load(s: ReplicaStats) -> int:
    """Requests of the strictest class on ``s`` (rank 0)."""
    return sum(c.running + c.waiting for c in s.classes if c.rank == 0)


def _passes(req: RouteRequest, s: ReplicaStats) -> float:
    """Passes ``req``'s output takes on ``s`` (at least one)."""
    return max(req.max_tokens / s.gained_per_pass, 1.0)


def with_routed(s: ReplicaStats, req: RouteRequest) -> ReplicaStats:
    """``s`` as the router sees it after sending ``req`` there, until the replica's next
    report (a real router counts what it has in flight the same way): one more request
    waiting with its output, its prompt queued for prefill, and every class's predicted
    TPOT longer by its share of the pass."""
    add = (s.request_ms + s.ms_per_token * req.prompt_tokens / _passes(req, s)) / s.gained_per_pass
    classes = tuple(
        replace(
            c,
            predicted_tpot_ms=c.predicted_tpot_ms + add,
            **cast(
                "dict[str, Any]",
                {"waiting": c.waiting + 1, "prefill_tokens": c.prefill_tokens + req.prompt_tokens}
                if c.name == req.slo_class
                else {},
            ),
        )
        for c in s.classes
    )
    return replace(
        s,
        classes=classes,
        waiting=s.waiting + 1,
        waiting_prefill_tokens=s.waiting_prefill_tokens + req.prompt_tokens,
        decode_left=s.decode_left + (req.max_tokens,),
        kv_free_fraction=max(
            0.0,
            s.kv_free_fraction
            - (
                (req.prompt_tokens + req.max_tokens) / s.kv_total_tokens if s.kv_total_tokens else 0
            ),
        ),
    )


def make_router(spec: str, seed: int = 0) -> Router:
    """The router called ``spec``: "slo", "p2c" or "rr" (``slo`` takes options:
    ``slo:balance=slack:margin=0.1:pack_slack=0.1``). ValueError on anything else."""
    if not isinstance(spec, str):
        raise ValueError(f"router must be a string, one of {', '.join(ROUTERS)}")
    head, *opts = spec.strip().split(":")
    kwargs: dict[str, Any] = {}
    for o in opts:
        k, eq, v = o.partition("=")
        if (
            head != "slo"
            or not eq
            or k not in ("margin", "pack_slack", "relaxed", "prefill_tau_s", "balance")
        ):
            raise ValueError(f"unknown router option {o!r} in {spec!r}")
        if k in ("relaxed", "balance"):
            kwargs[k] = v
            continue
        try:
            kwargs[k] = float(v)
        except ValueError:
            raise ValueError(f"router option {k} must be a number, got {v!r}") from None
    if head == "slo":
        return SloRouter(**kwargs)
    if head == "p2c":
        return PowerOfTwoRouter(seed=seed)
    if head == "rr":
        return RoundRobinRouter()
    raise ValueError(f"unknown router {spec!r}; known: {', '.join(ROUTERS)}")


# ---------------------------------------------------------------------- the report
def replica_stats(replica_id: str, scheduler, policy, now_s: float) -> ReplicaStats:
    """What a replica reports, read from its ``core.scheduler.Scheduler`` (queues, KV,
    the latest plan) and its policy (the calibrated acceptance of a budgeted planner);
    the simulator's replicas and the engine's call the same function.

    ``pass_ms`` is the latest plan's prediction (the hardware model's price of the
    running batch when there is none). The predicted TPOT is the load model's: the pass
    where every request (running or waiting) drafts and verifies a ``REF_DEPTH``
    chain, priced by the hardware model (``base_pass_ms + request_ms * requests``, plus
    the context), over the tokens such a chain gains a pass at the calibrated
    acceptance (``gained_per_pass``). What it reads of the policy is its
    ``load_hints``. The planner's own pass is no load signal: it
    spends whatever slack there is on deeper trees and prefill.
    """
    from adaserve.policies.typical_tree import gain_curve

    cfg, hw = scheduler.cfg, scheduler.hw
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    plan = scheduler.last_plan
    hints = policy.load_hints(plan)
    acc = hints.acc_by_rank
    # tokens verified per pass, per planned decoding request
    verified = hints.verified
    kv = float(sum(r.num_tokens for r in running))
    if plan is not None and plan.t_iter_ms:
        pass_ms = float(plan.t_iter_ms)
    elif hw is not None:
        pass_ms = float(hw.iteration_ms(max(1, len(running)), kv, requests=len(running)))
    else:
        pass_ms = float(scheduler.unloaded_tpot_ms())
    pass_ms = max(pass_ms, 1e-3)
    budget = plan.bounded_budget if plan is not None else None
    if budget is None:
        budget = int(sum(verified.values()) or len(running))
    if hw is not None:
        v = hw.verify_latency
        ms_per_token = max(float(v(budget + 16) - v(budget)) / 16.0, 1e-6)
        kv_ms = float(hw.kv_ms_per_token)
    else:
        ms_per_token, kv_ms = 0.2, 0.0
    tpp = sum(verified.values()) / len(verified) if verified else 1.0
    # the load model: a pass where every request drafts and verifies the reference
    # chain (REF_DEPTH candidates), priced by the hardware model; the planner's own pass
    # varies with the slack it spends (deeper trees, prefill), the load does not
    depth = REF_DEPTH if acc and policy.uses_draft else 0
    gained_ref = 1.0
    if depth:
        g = gain_curve(depth, 1, acc)
        gained_ref = 1.0 + float(g[min(depth, len(g) - 1)])
    n_all = len(running) + len(waiting)
    if hw is not None:

        def ref_pass(n: int) -> float:
            return float(
                hw.iteration_ms(n * (1 + depth), 0.0, depth, n, n, n if depth else 0, requests=n)
            )

        n0 = max(n_all, 1)
        request_ms = max((ref_pass(n0 + 8) - ref_pass(n0)) / 8.0, 0.0)
        base_ms = max(ref_pass(1) - request_ms, 1e-3)
    else:
        request_ms, base_ms = 0.0, max(pass_ms, 1e-3)
    load_tpot = (base_ms + request_ms * n_all + kv_ms * kv) / gained_ref

    def prefill_left(r) -> int:  # prompt (or recomputed context) tokens still to prefill
        return int(r.uncached) if r.in_prefill else 0

    heads = []
    extra_ms = math.inf
    for c in cfg.classes:
        slo = scheduler.class_slo(c.name)
        mine = [r for r in running if r.slo.cls == c.name]
        queued = [r for r in waiting if r.slo.cls == c.name]
        pred = load_tpot
        tpot = float(slo.tpot_ms) if slo.tpot_ms else math.inf
        heads.append(
            ClassHeadroom(
                name=c.name,
                rank=c.rank,
                tpot_ms=tpot,
                ttft_ms=float(slo.ttft_ms) if slo.ttft_ms else math.inf,
                predicted_tpot_ms=pred,
                running=len(mine),
                waiting=len(queued),
                prefill_tokens=sum(prefill_left(r) for r in mine + queued),
            )
        )
        if mine and math.isfinite(tpot):
            extra_ms = min(extra_ms, (tpot * (1.0 - hints.margin) - pred) * gained_ref)
    spare = 0 if extra_ms < 0 else int(min(extra_ms / ms_per_token, 1 << 20))
    alloc = scheduler.allocator
    return ReplicaStats(
        replica_id=str(replica_id),
        classes=tuple(heads),
        budget_tokens=int(budget),
        spare_budget_tokens=spare,
        running=len(running),
        waiting=len(waiting),
        waiting_prefill_tokens=sum(prefill_left(r) for r in waiting),
        kv_free_fraction=min(max(alloc.num_free / max(alloc.num_blocks, 1), 0.0), 1.0),
        pass_ms=pass_ms,
        at_s=float(now_s),
        ms_per_token=ms_per_token,
        kv_ms_per_token=kv_ms,
        tokens_per_pass=tpp,
        prefill_chunk=hints.prefill_chunk or int(cfg.max_prefill_tokens),
        max_num_seqs=int(cfg.max_num_seqs),
        kv_total_tokens=int(alloc.num_blocks * cfg.block_size),
        decode_left=tuple(
            max(int(r.max_new_tokens) - int(r.num_output), 0) for r in running + waiting
        ),
        base_pass_ms=base_ms,
        request_ms=request_ms,
        gained_per_pass=gained_ref,
    )
