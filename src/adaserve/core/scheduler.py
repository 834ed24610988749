"""The scheduler: one implementation of admission, KV reservation, preemption and
degradation, run by the engine and by the simulator alike.

A step is two calls (``core.step.run_step``), as vLLM's scheduler's:

    schedule(inputs) -> SchedulerOutput:  begin_step -> admit -> view -> plan (policy.plan,
        fallbacks, degrade) -> reserve (prefill chunks, decodes, draft scratch)
    [executor: drafts -> selects -> reserve_tree (selected nodes' KV) -> verifies]
    update_from_output(out, StepOutcome) -> StepTrace:  commit bookkeeping (``num_cached``,
        ``first_token_at``), finishes, tables truncated, the whole trace, policy.feedback

Who owns what: the scheduler owns the waiting and running queues, the block pool and
every request's block table, admission order, preemption, the run-wide scheduling
counters and the request state of ``SeqState`` (it applies the outcome's ``Commit``s).
The executor (the engine's model runner, or the simulator's synthetic drafting and
pricing) owns tokens, trees and time spent, and says what each request committed.

Invariants:
- ``running`` holds at most ``max_num_seqs`` requests, each RUNNING with a table;
  ``waiting`` holds WAITING requests only; a request is in at most one of them.
- preemption takes the most recently admitted running request, frees all its KV and
  puts it at the front of the queue (it recomputes prompt + output on readmission).
- a request is admitted only when the pool holds its first prefill chunk plus one
  block (or when nothing else runs).
The clock is read once per step (``begin_step``) and when a request is aborted: the
scheduler never reads the wall clock itself (``plan_s`` times the policy with
``time.perf_counter``, for the simulator's measured selection time).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from adaserve.core.admission import DEGRADABLE, TTFT_DEADLINE, AdmissionControl
from adaserve.core.blocks import BlockAllocator, BlockTable, OutOfBlocks, block_digest
from adaserve.core.clock import Clock
from adaserve.core.config import SchedulerConfig
from adaserve.core.counters import Counters
from adaserve.core.policy import BatchView, Plan, Policy, ReqView
from adaserve.core.seq import SeqState, Status
from adaserve.core.slo import SLO, SLOClass, looser_slo
from adaserve.core.step import Batch, SchedulerOutput, StepInputs, StepOutcome
from adaserve.core.trace import StepTrace
from adaserve.core.tree import scratch_slots_needed
from adaserve.errors import InvalidRequestError, PromptTooLongError

# context tokens per sequence assumed when pricing the full-batch capacity
_CAPACITY_CONTEXT = 256.0
# the weight of a pass in the running mean of the drafting decoders' confidence over
# plan (``Scheduler._record_drafts``): about the last ten passes, several requests'
# lives on the CPU pair, so one request's drafts do not set the mean it is judged by
DRAFT_MEAN_WEIGHT = 0.1


class Scheduler:
    """Queues, KV blocks, admission, reservation, preemption and degradation.

    ``unloaded_tpot_ms`` gives the TPOT class targets are multiples of (called when a
    class SLO is resolved); ``hw`` (a ``HardwareModel``, optional) prices capacity
    for admission control and is handed to policies in the view.
    """

    def __init__(
        self,
        cfg: SchedulerConfig,
        policy: Policy,
        clock: Clock,
        num_blocks: int,
        *,
        max_model_len: int,
        unloaded_tpot_ms: Callable[[], float],
        hw: Any = None,  # a hardware.model.HardwareModel (core imports nothing above it)
        counters: Counters | None = None,
        power: Any = None,
    ):
        self.cfg = cfg
        self.policy = policy
        self.clock = clock
        self.allocator = BlockAllocator(
            int(num_blocks),
            cfg.block_size,
            caching=cfg.enable_prefix_caching,
            eviction=cfg.prefix_cache_eviction,
        )
        self.max_model_len = int(max_model_len)
        self.hw = hw
        self.power = power  # hardware.power.PowerModel, handed to policies in the view
        self.counters = counters if counters is not None else Counters()
        self._unloaded = unloaded_tpot_ms
        self._classes: dict[str, SLOClass] = {c.name: c for c in cfg.classes}
        self.waiting: deque[SeqState] = deque()
        self.running: list[SeqState] = []
        self._admit_seq = itertools.count()
        self.now = clock.now()
        # the latest plan and when it was made (read by ``cluster.routing.replica_stats``)
        self.last_plan: Plan | None = None
        self.last_plan_at: float | None = None
        self._admitted: list[int] = []
        self._preempted: list[int] = []
        self._hits: dict[int, int] = {}
        self.admission = AdmissionControl(self)
        self._last: StepTrace | None = None  # the last pass, for admission's measurements
        # the drafting decoders' mean ratio of confidence over plan (``_record_drafts``),
        # a running mean over passes (weight ``DRAFT_MEAN_WEIGHT``)
        self._draft_mean: float | None = None
        # the drafting decoders' accepted and confidence-expected tokens per pass,
        # running means with the same weight: their ratio is the mean request's
        self._realised: tuple[float, float] | None = None
        self._hinted: tuple[Plan, Mapping[int, float]] | None = None  # ``planned_expected``
        # queued requests ended at their TTFT deadline in this step (``begin_step``)
        self.expired: list[SeqState] = []

    # ------------------------------------------------------------------ classes
    def unloaded_tpot_ms(self) -> float:
        """The TPOT class targets are multiples of, now (the deployment's unloaded pass)."""
        return self._unloaded()

    def class_slo(self, name: str) -> SLO:
        """The SLO of class ``name``, multiples resolved against the unloaded TPOT."""
        return self.cfg.class_by_name(name).resolve(self._unloaded())

    def default_slo(self) -> SLO:
        """The SLO of a request that names no class."""
        if self.cfg.default_class is None:
            raise InvalidRequestError("no default SLO class: name one", "slo_class")
        return self.class_slo(self.cfg.default_class)

    # ------------------------------------------------------------------ requests
    def check_prompt(self, prompt_len: int) -> None:
        """Raise a clear error for a prompt that can never run here."""
        if prompt_len < 1:
            raise InvalidRequestError("prompt is empty", "prompt")
        if prompt_len + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {prompt_len} tokens; the model's context is {self.max_model_len}",
                "prompt",
            )
        if -(-(prompt_len + 1) // self.cfg.block_size) > self.allocator.num_blocks:
            raise PromptTooLongError("prompt does not fit in the KV cache", "prompt")

    def check_room(self, prompt_len: int, max_tokens: int) -> None:
        """Raise for a request whose prompt and whole output can never be in the KV pool
        at once (it would preempt itself and start over for ever): its last decode
        needs ``prompt + max_tokens - 1`` slots (the output stops at the context)."""
        slots = min(prompt_len + max_tokens, self.max_model_len) - 1
        capacity = self.allocator.num_blocks * self.cfg.block_size
        if slots > capacity:
            raise InvalidRequestError(
                f"the prompt ({prompt_len} tokens) and max_tokens ({max_tokens}) need "
                f"{slots} KV cache slots; the KV cache holds {capacity} tokens",
                "max_tokens",
            )

    def check_admission(self, seq: SeqState) -> None:
        """Shed a new request (``AdmissionRejected``, counted) when its class's promise
        cannot be kept: queue full, decode capacity, or TTFT (``core.admission``). A
        request with ``on_overload="degrade"`` refused for capacity or TTFT is instead
        admitted in the first class along its ``degrade_to`` chain whose promise can
        be kept (``degraded_from`` names the class it asked for); it is shed, for its
        own class's reason, only when none can."""
        if not self.cfg.admission:
            return
        now = self.clock.now()
        refused = self.admission.verdict(seq, now)
        if (
            refused is not None
            and seq.slo.on_overload == "degrade"
            and refused.reason in DEGRADABLE
            and self._admit_degraded(seq, now)
        ):
            self.counters.count_degraded_on_admission(refused.reason)
            refused = None
        self.admission.use_seat(seq)
        if refused is not None:
            self.counters.count_shed(refused.reason, seq.cls)
            self.admission.refused(seq, refused, now)
            raise refused
        self.admission.admitted(seq, now)

    def _admit_degraded(self, seq: SeqState, now: float) -> bool:
        """Move ``seq`` down its class's ``degrade_to`` chain to the first class that
        admission accepts (True), or leave it as it was (False)."""
        own, own_from = seq.slo, seq.degraded_from
        for name in self.degrade_chain(seq.slo.cls):
            seq.slo = looser_slo(seq.slo, self.class_slo(seq.slo.cls), self.class_slo(name))
            seq.degraded_from = own_from or own.cls
            if self.admission.verdict(seq, now) is None:
                return True
        seq.slo, seq.degraded_from = own, own_from
        return False

    def degrade_chain(self, cls: str) -> list[str]:
        """The classes ``cls`` degrades to, in order (``degrade_to`` links to known
        classes, each once)."""
        out, seen = [], {cls}
        c = self._classes.get(cls)
        while c is not None and c.degrade_to in self._classes and c.degrade_to not in seen:
            seen.add(c.degrade_to)
            out.append(c.degrade_to)
            c = self._classes[c.degrade_to]
        return out

    def knows_class(self, cls: str | None) -> bool:
        """Whether ``cls`` is one of the configured classes."""
        return cls in self._classes

    def rank_of(self, cls: str | None) -> int:
        """The strictness rank of class ``cls`` (0, the strictest, when unknown)."""
        c = self._classes.get(cls) if cls is not None else None
        return c.rank if c is not None else 0

    def capacity_tok_s(self) -> float:
        """Largest token rate the pair sustains at full batch (from the hardware model)."""
        n = self.cfg.max_num_seqs
        return float(n * 1000.0 / self.hw.iteration_ms(n, n * _CAPACITY_CONTEXT, requests=n))

    def add(self, seq: SeqState) -> None:
        """Queue a validated request after the admission check (may raise
        ``AdmissionRejected``)."""
        seq.prefix_hint = self.cached_prefix(seq)
        self.check_admission(seq)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def finish(self, seq: SeqState, reason: str, t: float | None = None) -> None:
        """End a request at ``t`` (default: now on the clock) and release its KV."""
        seq.finish_reason = reason
        seq.finished_at = self.clock.now() if t is None else t
        if seq.status is Status.RUNNING and seq in self.running:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.status is Status.RUNNING:
            self.admission.observe_finish(seq.finished_at, seq)
        seq.status = Status.FINISHED
        if seq.table is not None:
            self.register_blocks(seq)
            seq.table.release()

    def abort(self, seq: SeqState, reason: str = "abort") -> None:
        """Cancel a request, waiting or running; its KV is freed at once."""
        if seq.finished:
            return
        seq.cancelled = True
        self.finish(seq, reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def set_policy(self, policy: Policy) -> None:
        """Schedule with ``policy`` from the next step on (only between runs)."""
        self.policy = policy

    def set_hardware(self, hw: Any) -> None:
        """The hardware model used for admission and handed to policies."""
        self.hw = hw
        self.admission.new_model()

    def set_kv_reserved(self, fraction: float) -> None:
        """Hold back ``fraction`` of the KV pool (simulated memory pressure)."""
        self.allocator.reserved = int(fraction * self.allocator.num_blocks)

    # ------------------------------------------------------------------ the step
    def schedule(self, inputs: StepInputs) -> SchedulerOutput:
        """The first call of a step: the clock read, expired requests ended, admission,
        the policy's view and plan, and the pass's requests with their KV reserved
        (nothing runs when no request is running: ``SchedulerOutput.runs``)."""
        self.begin_step()
        self.admit()
        expired = tuple(self.expired)
        if not self.running:
            return SchedulerOutput(expired, self.now)
        t0 = time.perf_counter()
        view = self.view(inputs.acc_by_rank)
        if inputs.mask_ms_per_node is not None:  # what masks cost on this run
            view.mask_ms_per_node = inputs.mask_ms_per_node
        plan = self.plan(view)
        plan_s = time.perf_counter() - t0
        batch = self.reserve(plan, inputs.can_draft)
        return SchedulerOutput(
            expired,
            self.now,
            view,
            plan,
            batch,
            kv_tokens=batch.kv_tokens,  # before the commit moves the counts on
            prefill_pairs=batch.prefill_pairs,
            plan_s=plan_s,
        )

    def update_from_output(self, out: SchedulerOutput, outcome: StepOutcome) -> StepTrace:
        """The second call of a step: apply each request's commit (``num_cached``, the
        first token's time, its finish) at ``outcome.t_end``; truncate decoding requests'
        tables to their committed tokens + the next root; name full blocks in the prefix
        cache; count the iteration; build the step's trace; feed the policy back."""
        t = outcome.t_end
        for c in outcome.commits:
            r = c.seq
            r.num_cached = c.num_cached
            if c.draft_cached is not None:
                r.draft_cached = c.draft_cached
            if c.first_token and r.first_token_at is None:
                r.first_token_at = t
            if c.finish is not None:
                self.finish(r, c.finish, t)
        batch, view = out.batch, out.view
        assert batch is not None and view is not None and out.plan is not None  # out.runs
        for r in batch.decode:
            if r.running and r.table is not None:
                r.table.truncate(r.num_cached + 1)
        for r in itertools.chain((r for r, _ in batch.prefill), batch.decode):
            if r.running:
                self.register_blocks(r)
        self.counters.iterations += 1
        classes = {r.rid: r.cls for r, _ in batch.prefill}
        classes.update((r.rid, r.cls) for r in batch.decode)
        tr = StepTrace(
            plan=out.plan,
            t_start=out.t_start,
            t_end=t,
            acc_by_rank=view.acc_by_rank,
            admitted=self._admitted,
            preempted=self._preempted,
            cached=self._hits,
            prefill={r.rid: n for r, n in batch.prefill},
            decode=[r.rid for r in batch.decode],
            spec={r.rid: s for r, s in batch.spec},
            classes=classes,
            tree_nodes=dict(outcome.tree_nodes),
            accepted=dict(outcome.accepted),
            expected=dict(outcome.expected),
            tokens=outcome.tokens,
            kv_tokens=out.kv_tokens,
            prefill_pairs=out.prefill_pairs,
            draft=outcome.draft,
            running=len(self.running),
            waiting=len(self.waiting),
            kv_usage=self.allocator.usage,
            predicted_ms=outcome.predicted_ms,
            stall=outcome.stall,
        )
        self._record_drafts(out.plan, batch.decode, outcome.expected, outcome.accepted)
        self._last = tr
        self.policy.feedback(out.plan, outcome.ms)
        return tr

    def planned_expected(self, plan: Plan | None) -> Mapping[int, float]:
        """rid -> the tokens ``plan`` expects each planned decoder's pass to give (the
        policy's ``LoadHints.expected``), worked out once per plan: admission's
        measurements and the draft record both read it after every pass."""
        if plan is None:
            return {}
        if self._hinted is None or self._hinted[0] is not plan:
            self._hinted = (plan, self.policy.load_hints(plan).expected)
        return self._hinted[1]

    def _record_drafts(
        self,
        plan: Plan,
        decode: list[SeqState],
        own: Mapping[int, float],
        accepted: Mapping[int, int],
    ) -> None:
        """Each drafting decoder's record: its verified tree's accepted tokens expected
        by the draft's confidence (``own``) over the plan's expectation of its
        allocation, relative to the running mean of that ratio over passes
        (``SeqState.record_drafts``; ``DRAFT_MEAN_WEIGHT``: the calibrations of the two
        differ by a factor common to all requests), and what it accepted against that
        confidence, relative to the mean request's (``SeqState.record_verified``). A
        constrained request's forced tokens are certain: not counted."""
        planned = self.planned_expected(plan) if own else {}
        ratios: dict[int, float] = {}
        seen: dict[int, tuple[int, float]] = {}
        for r in decode:
            e, o = planned.get(r.rid, 1.0) - 1.0, own.get(r.rid)
            if o is None or r.constrained:
                continue
            if e > 0:
                ratios[r.rid] = o / e
            if o > 0:
                seen[r.rid] = (accepted.get(r.rid, 0), o)
        if ratios:
            mean = sum(ratios.values()) / len(ratios)
            m = self._draft_mean
            self._draft_mean = mean if m is None else m + DRAFT_MEAN_WEIGHT * (mean - m)
        ref = self._draft_mean or 1.0
        for r in decode:
            x = ratios.get(r.rid)
            r.record_drafts(x / ref if x is not None else None)
        if not seen:
            return
        a = float(sum(n for n, _ in seen.values()))
        x = sum(e for _, e in seen.values())
        if self._realised is None:
            self._realised = (a, x)
        else:
            ra, rx = self._realised
            w = DRAFT_MEAN_WEIGHT
            self._realised = (ra + w * (a - ra), rx + w * (x - rx))
        ra, rx = self._realised
        mean_ratio = ra / rx if ra > 0 and rx > 0 else 1.0
        for r in decode:
            if r.rid in seen:
                r.record_verified(*seen[r.rid], mean_ratio)

    def begin_step(self) -> None:
        """Read the clock for this step; start its trace; with admission control, end
        the queued requests past their TTFT deadline (``expired``)."""
        self.now = self.clock.now()
        self.allocator.now = self.now
        self._admitted = []
        self._preempted = []
        self._hits = {}
        if self._last is not None:  # the previous pass, its token counts filled in
            last = self._last
            # with work left after it, the next pass followed at once: start to start
            # is what a pass costs, the executor's overhead between passes included
            busy = last.running + last.waiting > 0
            self.admission.observe(last, self.now - last.t_start if busy else None)
            self._last = None
        self.expired = self.admission.expired(self.now) if self.cfg.admission else []
        for r in self.expired:
            self.counters.count_shed(TTFT_DEADLINE, r.cls)
            self.finish(r, TTFT_DEADLINE, self.now)

    def admit(self) -> None:
        """Move waiting requests to running in ``policy.admission_key`` order while
        seats and KV for their first chunk remain."""
        if not self.waiting or len(self.running) >= self.cfg.max_num_seqs:
            return
        if len(self.waiting) > 1:
            key, now = self.policy.admission_key, self.now
            self.waiting = deque(sorted(self.waiting, key=lambda r: key(self.req_view(r, now))))
        bs = self.cfg.block_size
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            r = self.waiting[0]
            if r.room_for is not None:  # a seat's client at the door: its room first
                if len(self.running) >= r.room_for and self.now < r.door_until:
                    break  # first in line: none behind it starts either
                r.room_for = None
            hit = self._match(r)
            held = sum(1 for b in hit if self.allocator.refcount(b) == 0)
            first_chunk = min(r.uncached - len(hit) * bs, self.cfg.max_prefill_tokens) + 1
            if self.allocator.num_free - held < -(-first_chunk // bs) + 1 and self.running:
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            r.table = r.table or BlockTable(self.allocator)
            r.table.rank = self.rank_of(r.slo.cls)
            self._map_prefix(r, hit)
            r.admit_seq = next(self._admit_seq)
            if r.admitted_at is None:
                r.admitted_at = self.now
            self.running.append(r)
            self._admitted.append(r.rid)
            if r.num_cached:
                self._hits[r.rid] = r.num_cached

    def req_view(self, r: SeqState, now: float) -> ReqView:
        """What a policy may know about ``r`` at ``now``."""
        c = self._classes.get(r.slo.cls)
        return ReqView(
            rid=r.rid,
            cls=r.slo.cls,
            tpot_ms=r.slo.tpot_ms,
            ttft_ms=r.slo.ttft_ms,
            n_out=r.num_output,
            decode_ms=(now - r.first_token_at) * 1000.0 if r.first_token_at is not None else 0.0,
            waited_ms=(now - r.arrival) * 1000.0,
            prefill_left=r.to_prefill if r.in_prefill else 0,
            context_len=r.num_tokens,
            rank=c.rank if c else 0,
            max_tokens=r.max_new_tokens - r.num_output,
            min_rate=c.min_rate if c else 0.0,
            max_queue_ms=r.slo.max_queue_ms,
            deadline_ms=r.slo.deadline_ms,
            constrained=r.constrained,
            acc_scale=r.acc_scale,
        )

    def view(self, acc_by_rank: tuple[float, ...] = ()) -> BatchView:
        """The running requests and free resources at this step's start;
        ``acc_by_rank`` is the executor's calibrated acceptance by sibling rank."""
        now = self.now
        return BatchView(
            now_ms=now * 1000.0,
            requests=[self.req_view(r, now) for r in self.running],
            free_kv_slots=self.allocator.num_free * self.cfg.block_size,
            hw=self.hw,
            num_waiting=len(self.waiting),
            acc_by_rank=tuple(acc_by_rank),
            power=self.power,
            mask_ms_per_node=self.hw.mask_ms_per_node if self.hw is not None else 0.0,
        )

    def plan(self, view: BatchView) -> Plan:
        """The policy's plan for ``view``; counts its fallback and applies its degrades."""
        plan = self.policy.plan(view)
        if plan.fallback:
            self.counters.count_fallback(plan.fallback)
        self._apply_degrade(plan)
        self.last_plan, self.last_plan_at = plan, self.now
        return plan

    def _apply_degrade(self, plan: Plan) -> None:
        """Move requests the policy gave up on to their class's looser class (a class
        naming an unknown ``degrade_to`` is left alone)."""
        if not plan.degrade:
            return
        for r in self.running:
            if r.rid not in plan.degrade:
                continue
            c = self._classes.get(r.slo.cls)
            if c is None or not c.degrade_to or c.degrade_to not in self._classes:
                continue
            r.degraded_from = r.degraded_from or r.slo.cls
            r.slo = looser_slo(r.slo, self.class_slo(r.slo.cls), self.class_slo(c.degrade_to))
            self.counters.degraded += 1

    def reserve(self, plan: Plan, can_draft: bool) -> Batch[SeqState]:
        """Pick this pass's requests and give each the KV slots it needs: prefill chunks
        and decodes may preempt; draft scratch may not (fallback ``kv_memory``)."""
        b: Batch[SeqState] = Batch()
        for r in sorted(self.running, key=_by_admit):
            if r.status is not Status.RUNNING:
                continue  # preempted by an earlier request in this loop
            if r.in_prefill:
                n = plan.prefill.get(r.rid, 0)
                if n <= 0:
                    continue
                n = min(n, r.uncached)
                if self._ensure(r, r.num_cached + n, may_preempt=True):
                    b.prefill.append((r, n))
                continue
            if r.rid in plan.skip:
                continue  # sits this pass out (the policy's pass composition)
            if not self._ensure(r, r.num_tokens, may_preempt=True):
                continue
            b.decode.append(r)
            shape = plan.shapes.get(r.rid)
            if shape and shape[0] > 0 and can_draft:
                shape = (int(shape[0]), int(shape[1]))
                if self._ensure(r, r.num_tokens + scratch_slots_needed(*shape), False):
                    b.spec.append((r, shape))
                else:
                    self.counters.count_fallback("kv_memory")
        if self._preempted:
            b.prefill = [(r, n) for r, n in b.prefill if r.running]
            b.decode = [r for r in b.decode if r.running]
            b.spec = [(r, s) for r, s in b.spec if r.running]
        return b

    def reserve_tree(self, r: SeqState, nodes: int) -> bool:
        """KV slots for a tree of ``nodes`` nodes (root included) past ``r``'s context;
        False (fallback ``kv_memory`` counted) when the pool cannot hold it."""
        if nodes <= 1:
            return True
        if self._ensure(r, r.num_tokens + nodes - 1, may_preempt=False):
            return True
        self.counters.count_fallback("kv_memory")
        return False

    # ------------------------------------------------------------------ prefix cache
    def _digests(self, r: SeqState, n: int) -> list[bytes]:
        """The names of ``r``'s first ``n`` full blocks (computed once, kept on ``r``);
        fewer when its tokens are unknown."""
        d, bs = r.digests, self.cfg.block_size
        while len(d) < n:
            toks = r.block_tokens(len(d) * bs, (len(d) + 1) * bs)
            if toks is None:
                break
            d.append(block_digest(d[-1] if d else b"", toks, r.cache_salt))
        return d[:n]

    def _match(self, r: SeqState) -> list[int]:
        """The cached blocks ``r`` may map: its longest cached run of full blocks
        strictly before its last token (whose KV it computes, in a block of its own)."""
        if not (self.allocator.caching and r.cache_lookup):
            return []
        n = (r.num_tokens - 1) // self.cfg.block_size
        return self.allocator.match(self._digests(r, n)) if n > 0 else []

    def cached_prefix(self, r: SeqState) -> int:
        """Tokens of ``r`` the prefix cache holds now (what it would not compute)."""
        return len(self._match(r)) * self.cfg.block_size

    def _map_prefix(self, r: SeqState, hit: list[int]) -> None:
        """Start ``r``'s empty table on the cached blocks ``hit``; counts the lookup."""
        bs = self.cfg.block_size
        t = r.table
        assert t is not None  # admission gives it a table first
        t.map_cached(hit)
        r.num_cached = len(hit) * bs
        r.draft_cached = t.drafted * bs
        r.prefix_hint = 0
        if r.num_output == 0:
            r.cached_prompt = r.num_cached
        if self.allocator.caching and r.cache_lookup:
            self.allocator.stats.count(r.cls, r.num_tokens, r.num_cached)

    def register_blocks(self, r: SeqState) -> None:
        """Name ``r``'s newly full blocks of committed tokens in the prefix cache, and
        mark those whose draft KV is computed too."""
        t = r.table
        if t is None or not self.allocator.caching:
            return
        bs = self.cfg.block_size
        full = min(r.num_cached // bs, len(t.blocks))
        if full > t.named:
            names = self._digests(r, full)
            while t.named < len(names):
                self.allocator.register(t.blocks[t.named], names[t.named])
                t.named += 1
        drafted = min(r.draft_cached // bs, t.named)
        while t.drafted < drafted:
            self.allocator.mark_draft(t.blocks[t.drafted])
            t.drafted += 1

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; returns how many were named."""
        n = self.allocator.reset_cache()
        for r in self.running:
            if r.table is not None:
                r.table.named = r.table.drafted = 0
        return n

    # ------------------------------------------------------------------ KV
    def _ensure(self, r: SeqState, slots: int, may_preempt: bool) -> bool:
        """Make r's table hold ``slots`` slots, preempting the newest requests if allowed."""
        t = r.table
        assert t is not None  # a running request has a table
        while True:
            try:
                t.ensure(slots)
                return True
            except OutOfBlocks:
                if not may_preempt:
                    return False
                victim = max(self.running, key=_by_admit)
                self._preempt(victim)
                if victim is r:
                    return False

    def _preempt(self, victim: SeqState) -> None:
        """Free a running request's KV and put it back in front of the queue (its named
        blocks stay cached: on readmission it maps what is still there)."""
        self.register_blocks(victim)
        assert victim.table is not None  # a running request has a table
        victim.table.release()
        victim.num_cached = 0
        victim.draft_cached = 0
        victim.status = Status.WAITING
        victim.preemptions += 1
        self.counters.preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)
        self._preempted.append(victim.rid)


def _by_admit(r: SeqState) -> int:
    return r.admit_seq
