"""The serving loop: admit -> speculate -> select -> verify -> commit.

One ``step()`` is one target-model iteration over every admitted request: prefill
chunks, plain decodes (root only) and speculative trees share one forward pass.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from adaserve.config import EngineConfig
from adaserve.core.blocks import BlockAllocator, BlockTable, OutOfBlocks
from adaserve.core.tree import CandidateTree, ancestor_mask
from adaserve.errors import (
    AdmissionRejected,
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
)
from adaserve.kv.cache import KVCache
from adaserve.logits import make_generator, target_probs
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.config import ModelConfig
from adaserve.models.loader import load_model, resolve_dtype
from adaserve.request import Request, Status
from adaserve.resources import default_kv_budget, gpu_kv_budget
from adaserve.sampling import SamplingParams
from adaserve.sched.base import BatchView, Plan, ReqView
from adaserve.sched.calibration import Calibrator
from adaserve.sched.registry import make_policy
from adaserve.slo import SLO
from adaserve.spec_decode.draft import DraftOutput, expand, scratch_slots_needed
from adaserve.spec_decode.verify import children_lists, verify_greedy, verify_stochastic
from adaserve.tokenizer import Tokenizer, check_draft_tokenizer, load_tokenizer

log = logging.getLogger("adaserve.engine")


@dataclass
class EngineCounters:
    """Engine-wide counters (monotonic) read by metrics exporters."""

    iterations: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec_drafts: int = 0  # request-iterations that verified at least one candidate
    spec_draft_tokens: int = 0  # candidate nodes verified
    spec_accepted_tokens: int = 0
    accepted_per_pos: dict[int, int] = field(default_factory=dict)
    drafted_tokens: int = 0  # nodes the draft produced (before selection)
    fallback_iterations: dict[str, int] = field(default_factory=dict)
    preemptions: int = 0
    degraded: int = 0
    shed: dict[str, int] = field(default_factory=dict)
    model_time_s: float = 0.0
    step_time_s: float = 0.0


@dataclass
class StepTrace:
    """What one iteration did (for benchmarks, the audit log and tests)."""

    plan: Plan
    tree_nodes: dict[int, int]
    accepted: dict[int, int]
    tokens: int
    duration_s: float


class Engine:
    """Owns models, KV caches, the policy and every request's state."""

    def __init__(self, cfg: EngineConfig | None = None, **overrides):
        cfg = cfg or EngineConfig(**overrides)
        self.cfg = cfg
        from adaserve import paths

        model_dir = Path(cfg.model) if cfg.model else paths.DEFAULT_TARGET
        draft_dir = None
        if not cfg.no_draft:
            if cfg.draft:
                draft_dir = Path(cfg.draft)
            elif cfg.model is None and paths.DEFAULT_DRAFT.is_dir():
                draft_dir = paths.DEFAULT_DRAFT
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ModelLoadError("device 'cuda' requested but CUDA is not available")
        ckpt_dtype = None
        if cfg.dtype == "auto" and self.device.type == "cuda":
            ckpt_dtype = ModelConfig.from_dir(model_dir).extra.get("torch_dtype")
        self.dtype = resolve_dtype(cfg.dtype, self.device, ckpt_dtype)
        self.model_dir = model_dir
        rnd = cfg.random_weights
        self.target = load_model(model_dir, self.device, self.dtype, rnd)  # resolved dtype
        self.draft = load_model(draft_dir, self.device, self.dtype, rnd) if draft_dir else None
        self.draft_dir = draft_dir
        self.tokenizer: Tokenizer | None = load_tokenizer(model_dir)
        if self.draft is not None:
            check_draft_tokenizer(self.tokenizer, load_tokenizer(draft_dir), draft_dir)
        tcfg = self.target.cfg
        self.eos_ids = set(tcfg.eos_token_ids)
        if not self.eos_ids and self.tokenizer is not None and self.tokenizer.eos_id is not None:
            self.eos_ids = {self.tokenizer.eos_id}
        self.max_model_len = min(
            cfg.max_model_len or tcfg.max_position_embeddings, tcfg.max_position_embeddings
        )
        self._build_kv()
        self._class_names = {c.name for c in cfg.classes}
        self.policy = make_policy(cfg.policy)
        self.calibrator = Calibrator()
        if self.draft_dir is not None and Path(self.draft_dir) == paths.DEFAULT_DRAFT:
            self.calibrator.seed_from_stats(paths.DEFAULT_STATS)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._ids = itertools.count()
        self._admit_seq = itertools.count()
        self.counters = EngineCounters()
        self.draft_noise = 0.0
        self.last_trace: StepTrace | None = None
        self.flops_per_token_target = 2.0 * tcfg.num_parameters()
        self.flops_per_token_draft = 2.0 * self.draft.cfg.num_parameters() if self.draft else 0.0
        self.on_step = None  # optional callback(engine, trace)
        self._sel_log = open(cfg.selection_log, "a") if cfg.selection_log else None  # noqa: SIM115
        self._log_salt = os.urandom(8).hex()
        self.hw = None
        if self.policy.uses_draft or cfg.profile:
            from adaserve.profile import load_or_profile

            try:
                self.hw = load_or_profile(self, auto=cfg.auto_profile)
            except ValueError as e:
                raise ModelLoadError(str(e)) from None
        self.counters = EngineCounters()  # profiling may have run a few steps

    # ------------------------------------------------------------------ set-up
    def _build_kv(self) -> None:
        cfg = self.cfg
        esize = torch.tensor([], dtype=self.dtype).element_size()
        per_slot = self.target.cfg.kv_bytes_per_token(esize)
        if self.draft is not None:
            per_slot += self.draft.cfg.kv_bytes_per_token(esize)
        budget = cfg.kv_cache_bytes
        if budget is None:
            budget = self._gpu_kv_budget() if self.device.type == "cuda" else default_kv_budget()
        num_blocks = max(4, budget // (per_slot * cfg.block_size))
        num_slots = int(num_blocks) * cfg.block_size
        self.kv_bytes_per_slot = per_slot
        self.allocator = BlockAllocator(int(num_blocks), cfg.block_size)
        self.kv_target = KVCache(self.target.cfg, num_slots, self.device, self.dtype)
        self.kv_draft = (
            KVCache(self.draft.cfg, num_slots, self.device, self.dtype) if self.draft else None
        )

    def _gpu_kv_budget(self) -> int:
        """KV bytes on this GPU once the models are loaded (``gpu_kv_budget``); the
        activation reserve holds float32 logits for a full batch of trees (64 nodes a
        request) and a prefill chunk, twice (softmax), plus 1 GiB."""
        cfg, t = self.cfg, self.target.cfg
        free, total = torch.cuda.mem_get_info(self.device)
        rows = cfg.max_prefill_tokens + 64 * cfg.max_num_seqs
        activations = (1 << 30) + 2 * rows * t.vocab_size * 4
        try:
            return gpu_kv_budget(total, free, cfg.gpu_memory_utilization, t.num_layers, activations)
        except ValueError as e:
            raise ModelLoadError(str(e)) from None

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (string needs a tokenizer)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "this model has no tokenizer.json: pass prompts as token ids", "prompt"
                )
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        V = self.target.cfg.vocab_size
        if not all(isinstance(t, int) and 0 <= t < V for t in ids):
            raise InvalidRequestError(f"token ids must be integers in [0, {V})", "prompt")
        return ids

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        slo: SLO | None = None,
        arrival: float | None = None,
    ) -> Request:
        """Validate and queue a request; returns its live ``Request``."""
        params = params or SamplingParams()
        ids = self.encode(prompt)
        if not ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        if len(ids) + 1 > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len}",
                "prompt",
            )
        blocks_needed = -(-(len(ids) + 1) // self.cfg.block_size)
        if blocks_needed > self.allocator.num_blocks:
            raise PromptTooLongError("prompt does not fit in the KV cache", "prompt")
        slo = slo or self.default_slo()
        self._admission_check(slo)
        r = Request(
            next(self._ids), ids, params, slo, make_generator(params.seed, self.device), arrival
        )
        self.waiting.append(r)
        return r

    def _admission_check(self, slo: SLO) -> None:
        """Shed a new request when the queue is full or strict demand exceeds capacity."""
        if not self.cfg.admission:
            return
        if len(self.waiting) >= self.cfg.max_waiting:
            self._shed("queue_full")
            raise AdmissionRejected("server queue is full", "queue_full", 1.0)
        cls = self.cfg.class_by_name(slo.cls) if slo.cls in self._class_names else None
        strict = cls is None or cls.rank == 0
        if slo.tpot_ms and strict and self.hw is not None:
            demand = 1000.0 / slo.tpot_ms + sum(
                1000.0 / r.slo.tpot_ms
                for r in itertools.chain(self.running, self.waiting)
                if r.slo.tpot_ms and r.slo.cls == slo.cls
            )
            if demand > self.capacity_tok_s():
                self._shed("capacity")
                raise AdmissionRejected(
                    f"predicted demand of class {slo.cls!r} exceeds capacity", "capacity", 1.0
                )

    def capacity_tok_s(self) -> float:
        """Largest token rate the pair sustains at full batch (from the hardware model)."""
        n = self.cfg.max_num_seqs
        kv = n * 256.0
        return float(n * 1000.0 / self.hw.iteration_ms(n, kv))

    def _shed(self, reason: str) -> None:
        self.counters.shed[reason] = self.counters.shed.get(reason, 0) + 1

    def default_slo(self) -> SLO:
        return self.class_slo(self.cfg.default_class)

    def class_slo(self, name: str) -> SLO:
        return self.cfg.class_by_name(name).resolve(self.unloaded_tpot_ms())

    def unloaded_tpot_ms(self) -> float:
        """Measured (profile) or estimated per-token latency at near-zero load."""
        if self.hw is not None:
            return self.hw.unloaded_tpot_ms()
        return getattr(self, "_tpot_estimate", None) or self._estimate_tpot()

    def _estimate_tpot(self) -> float:
        ids = torch.zeros(1, 8, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            self.target.forward_dense(ids)
            t0 = time.perf_counter()
            for _ in range(3):
                self.target.forward_dense(ids[:, :1])
            est = (time.perf_counter() - t0) / 3 * 1000
        self._tpot_estimate = est
        return est

    def abort(self, req: Request, reason: str = "abort") -> None:
        """Cancel a request; its KV is freed at once (it may be mid-step elsewhere)."""
        if req.finished:
            return
        req.cancelled = True
        self._finish(req, reason)
        if req in self.waiting:
            self.waiting.remove(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ loop
    def step(self) -> list[Request]:
        """Run one iteration; returns the requests that finished in it."""
        t_start = time.perf_counter()
        self._admit()
        if not self.running:
            return []
        view = self.view(t_start)
        plan = self.policy.plan(view)
        if plan.fallback:
            self._count_fallback(plan.fallback)
        self._apply_degrade(plan)
        batch = self._reserve(plan)
        # --- speculate
        drafts = self._speculate(batch.spec, plan)
        trees = {rid: d.tree for rid, d in drafts.items()}
        # --- select
        selected: dict[int, np.ndarray] = {}
        if trees:
            selected = self.policy.select(view, plan, trees)
        subtrees = self._reserve_tree_slots(batch, trees, selected)
        # --- verify
        t_model = time.perf_counter()
        rows = self._verify_forward(batch, subtrees)
        self.counters.model_time_s += time.perf_counter() - t_model
        # --- commit
        finished, accepted = self._commit(batch, subtrees, drafts, rows)
        dur = time.perf_counter() - t_start
        self.policy.feedback(plan, dur * 1000)
        self.counters.iterations += 1
        self.counters.step_time_s += dur
        self.last_trace = StepTrace(
            plan=plan,
            tree_nodes={rid: len(t.tokens) - 1 for rid, t in subtrees.items()},
            accepted=accepted,
            tokens=sum(n for _, n in batch.prefill) + sum(len(t.tokens) for t in subtrees.values()),
            duration_s=dur,
        )
        if self._sel_log is not None:
            self._log_selection(view, plan, subtrees, accepted)
        if self.on_step is not None:
            self.on_step(self, self.last_trace)
        return finished

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def _apply_degrade(self, plan: Plan) -> None:
        """Move requests the policy gave up on to their class's looser class."""
        if not plan.degrade:
            return
        for r in self.running:
            if r.rid in plan.degrade:
                cls = self._class_of(r)
                if cls is None or not cls.degrade_to:
                    continue
                new = self.class_slo(cls.degrade_to)
                r.degraded_from = r.degraded_from or r.slo.cls
                r.slo = new
                self.counters.degraded += 1

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        if not self.waiting:
            return
        if len(self.waiting) > 1:
            now = time.perf_counter()
            order = sorted(
                self.waiting, key=lambda r: self.policy.admission_key(self._req_view(r, now))
            )
            self.waiting = deque(order)
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            r = self.waiting[0]
            first_chunk = min(r.uncached, self.cfg.max_prefill_tokens) + 1
            if (
                self.allocator.num_free < -(-first_chunk // self.cfg.block_size) + 1
                and self.running
            ):
                break
            self.waiting.popleft()
            r.status = Status.RUNNING
            r.table = r.table or BlockTable(self.allocator)
            r.admit_seq = next(self._admit_seq)
            if r.admitted_at is None:
                r.admitted_at = time.perf_counter()
            self.running.append(r)

    def _preempt(self, victim: Request) -> None:
        """Free a running request's KV and put it back in front of the queue (recompute)."""
        victim.table.release()
        victim.num_cached = 0
        victim.draft_cached = 0
        victim.status = Status.WAITING
        victim.stats.preemptions += 1
        self.counters.preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def _ensure(self, r: Request, slots: int, may_preempt: bool) -> bool:
        """Make r's table hold ``slots`` slots, preempting the newest requests if allowed."""
        while True:
            try:
                r.table.ensure(slots)
                return True
            except OutOfBlocks:
                if not may_preempt:
                    return False
                victim = max(self.running, key=lambda x: x.admit_seq)
                self._preempt(victim)
                if victim is r:
                    return False

    # ------------------------------------------------------------------ views
    def _req_view(self, r: Request, now: float) -> ReqView:
        cls = self._class_of(r)
        return ReqView(
            rid=r.rid,
            cls=r.slo.cls,
            tpot_ms=r.slo.tpot_ms,
            ttft_ms=r.slo.ttft_ms,
            n_out=r.num_output,
            decode_ms=(now - r.first_token_at) * 1000 if r.first_token_at else 0.0,
            waited_ms=(now - r.arrival) * 1000,
            prefill_left=r.uncached if r.in_prefill else 0,
            context_len=len(r.tokens),
            rank=cls.rank if cls else 0,
            max_tokens=r.params.max_tokens - r.num_output,
            min_rate=cls.min_rate if cls else 0.0,
            max_queue_ms=r.slo.max_queue_ms,
            deadline_ms=r.slo.deadline_ms,
        )

    def _class_of(self, r: Request):
        for c in self.cfg.classes:
            if c.name == r.slo.cls:
                return c
        return None

    def view(self, now: float | None = None) -> BatchView:
        now = time.perf_counter() if now is None else now
        return BatchView(
            now_ms=now * 1000,
            requests=[self._req_view(r, now) for r in self.running],
            free_kv_slots=self.allocator.num_free * self.cfg.block_size,
            hw=self.hw,
            num_waiting=len(self.waiting),
            acc_by_rank=tuple(self.calibrator.acceptance_by_rank()),
        )

    # ------------------------------------------------------------------ reserve
    @dataclass
    class _Batch:
        prefill: list[tuple[Request, int]]
        decode: list[Request]
        spec: list[tuple[Request, tuple[int, int]]]

    def _reserve(self, plan: Plan) -> Engine._Batch:
        """Pick this iteration's requests and give each the KV slots it needs."""
        prefill, decode, spec = [], [], []
        for r in sorted(self.running, key=lambda x: x.admit_seq):
            if r.status is not Status.RUNNING:
                continue  # preempted by an earlier request in this loop
            if r.in_prefill:
                n = plan.prefill.get(r.rid, 0)
                if n <= 0:
                    continue
                n = min(n, r.uncached)
                if self._ensure(r, r.num_cached + n, may_preempt=True):
                    prefill.append((r, n))
                continue
            if not self._ensure(r, len(r.tokens), may_preempt=True):
                continue
            decode.append(r)
            shape = plan.shapes.get(r.rid)
            if shape and shape[0] > 0 and self.draft is not None:
                extra = scratch_slots_needed(*shape)
                if self._ensure(r, len(r.tokens) + extra, may_preempt=False):
                    spec.append((r, shape))
                else:
                    self._count_fallback("kv_memory")
        alive = {r.rid for r in self.running}
        prefill = [(r, n) for r, n in prefill if r.rid in alive]
        decode = [r for r in decode if r.rid in alive]
        spec = [(r, s) for r, s in spec if r.rid in alive]
        return Engine._Batch(prefill, decode, spec)

    def _reserve_tree_slots(
        self, batch: Engine._Batch, trees: dict[int, CandidateTree], selected
    ) -> dict[int, CandidateTree]:
        """Subtree to verify per decoding request (root-only when not speculating)."""
        out: dict[int, CandidateTree] = {}
        for r in batch.decode:
            t = trees.get(r.rid)
            if t is None:
                out[r.rid] = CandidateTree.root_only(r.tokens[-1])
                continue
            nodes = np.asarray(selected.get(r.rid, np.zeros(1, dtype=np.int64)))
            sub = t.subtree(nodes)
            if not self._ensure(r, len(r.tokens) + len(nodes) - 1, may_preempt=False):
                self._count_fallback("kv_memory")
                sub = CandidateTree.root_only(r.tokens[-1])
            out[r.rid] = sub
        return out

    # ------------------------------------------------------------------ speculate
    def _speculate(self, spec, plan: Plan) -> dict[int, DraftOutput]:
        if not spec:
            return {}
        reqs = [r for r, _ in spec]
        t0 = time.perf_counter()
        outs = expand(
            self.draft,
            self.kv_draft,
            reqs,
            [s for _, s in spec],
            sample=self.cfg.draft_sample,
            noise_std=self.draft_noise,
            vocab_size=self.target.cfg.vocab_size,
        )
        self.counters.model_time_s += time.perf_counter() - t0
        result = {}
        for r, o in zip(reqs, outs):
            self.calibrator.apply(o.tree)
            r.stats.drafted_tokens += o.tree.num_candidates
            self.counters.drafted_tokens += o.tree.num_candidates
            result[r.rid] = o
        return result

    # ------------------------------------------------------------------ verify
    @torch.inference_mode()
    def _verify_forward(self, batch: Engine._Batch, subtrees) -> torch.Tensor | None:
        """One target forward over prefill chunks and trees -> logits of needed rows.

        Rows: for each prefill that completes its prompt, its last token; then for each
        decoding request, its 1+N tree nodes (root first). Returns [rows, V] float32.
        """
        seqs, ids, rows = [], [], []
        extra: list[tuple[Request, int, int, int]] = []  # (request, position, row, count)
        pos = 0
        for r, n in batch.prefill:
            nc = r.num_cached
            seqs.append(
                SeqSpec(r.table.slots(0, nc), r.table.slots(nc, nc + n), list(range(nc, nc + n)))
            )
            ids.extend(r.tokens[nc : nc + n])
            if nc + n == len(r.tokens):
                rows.append(pos + n - 1)
            if r.params.prompt_logprobs is not None:
                # rows nc..: the distributions of prompt tokens nc+1.. (not the output's)
                m = min(n, len(r.prompt_ids) - 1 - nc)
                if m > 0:
                    extra.append((r, nc, pos, m))
            pos += n
        for r in batch.decode:
            t = subtrees[r.rid]
            C = len(r.tokens)
            k = len(t.tokens)
            new_mask = None
            if k > 1:
                new_mask = ancestor_mask(t.parents)
            seqs.append(
                SeqSpec(
                    r.table.slots(0, C - 1),
                    r.table.slots(C - 1, C - 1 + k),
                    (C - 1 + t.depth).tolist(),
                    new_mask=new_mask,
                )
            )
            ids.extend(t.tokens.tolist())
            rows.extend(range(pos, pos + k))
            pos += k
        if not seqs:
            return None
        meta = AttnMetadata.build(seqs, self.device, self.target.cfg.sliding_window)
        hidden = self.target(
            torch.tensor(ids, dtype=torch.long, device=self.device), meta, self.kv_target.layers
        )
        n_rows = len(rows)
        for _, _, row, m in extra:  # after every row _commit reads
            rows.extend(range(row, row + m))
        logits = self.target.logits(
            hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        )
        if extra:
            self._record_prompt_logprobs(extra, logits[n_rows:])
        return logits[:n_rows]

    def _record_prompt_logprobs(self, extra, logits: torch.Tensor) -> None:
        """Prompt logprobs (``params.prompt_logprobs``) from this prefill chunk's rows:
        row j of a chunk starting at position p scores prompt token p + j + 1.
        logits: [sum of counts, V], in ``extra`` order."""
        lsm = torch.log_softmax(logits, dim=-1)
        at = 0
        for r, p, _, m in extra:
            part = lsm[at : at + m]
            at += m
            scored = _logprob_entries(
                part, r.prompt_ids[p + 1 : p + 1 + m], r.params.prompt_logprobs
            )
            if not r.prompt_logprobs:
                r.prompt_logprobs = [None]  # the first token has no context to score it
            del r.prompt_logprobs[p + 1 :]  # a chunk prefilled again after preemption
            r.prompt_logprobs.extend(scored)

    # ------------------------------------------------------------------ commit
    def _commit(self, batch, subtrees, drafts, logits) -> tuple[list[Request], dict[int, int]]:
        now = time.perf_counter()
        finished: list[Request] = []
        accepted_count: dict[int, int] = {}
        if logits is None:
            return finished, accepted_count
        argmax = logits.argmax(-1).tolist()
        row = 0
        moves_src: list[int] = []
        moves_dst: list[int] = []
        for r, n in batch.prefill:
            r.num_cached += n
            self.counters.prompt_tokens += n
            if r.num_cached == len(r.tokens):
                tok = argmax[row] if r.params.greedy else self._sample(logits[row : row + 1], r)
                if r.params.logprobs is not None:
                    self._record_logprobs(r, logits, [row], [tok])
                row += 1
                if r.first_token_at is None:
                    r.first_token_at = now
                self._append(r, [tok], now)
                if r.finished:
                    finished.append(r)
        for r in batch.decode:
            t = subtrees[r.rid]
            k = len(t.tokens)
            ch = children_lists(t.parents)
            if r.params.greedy:
                path, bonus = verify_greedy(t.tokens, ch, argmax[row : row + k])
            else:
                probs = target_probs(logits[row : row + k], r.params)
                q = (
                    self._draft_q_rows(drafts.get(r.rid), t, probs)
                    if self.cfg.draft_sample
                    else None
                )
                path, bonus = verify_stochastic(t.tokens, ch, probs, r.gen, q)
            row += k
            C = len(r.tokens)
            # KV of root + accepted path -> contiguous slots C-1, C, C+1, ...
            for i, node in enumerate(path):
                if node != i + 1:
                    moves_src.append(r.table.slot(C - 1 + node))
                    moves_dst.append(r.table.slot(C + i))
            r.num_cached = C + len(path)
            new = [int(t.tokens[p]) for p in path] + [bonus]
            if r.params.logprobs is not None:  # token j is drawn at node [root, *path][j]
                self._record_logprobs(r, logits, [row - k + n for n in [0, *path]], new)
            self._record_spec(r, t, path)
            accepted_count[r.rid] = len(path)
            self._append(r, new, now)
            if r.finished:
                finished.append(r)
        if moves_src:
            dev = self.device
            self.kv_target.move_slots(
                torch.tensor(moves_src, device=dev), torch.tensor(moves_dst, device=dev)
            )
        for r in batch.decode:
            if not r.finished:
                r.table.truncate(r.num_cached + 1)
        return finished, accepted_count

    def _record_logprobs(self, r: Request, logits, rows: list[int], new: list[int]) -> None:
        """Append the target's log-probabilities of ``new`` (token j drawn at logits row
        ``rows[j]``) and the top ``params.logprobs`` alternatives; only the tokens that
        ``_append`` then keeps stay (it may stop early)."""
        lsm = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)], dim=-1)
        keep = r.num_output  # _append trims what it does not keep
        r.logprobs[keep:] = _logprob_entries(lsm, new, r.params.logprobs)

    def _sample(self, logits_row: torch.Tensor, r: Request) -> int:
        p = target_probs(logits_row, r.params)[0]
        return int(torch.multinomial(p, 1, generator=r.gen).item())

    def _draft_q_rows(
        self, d: DraftOutput | None, sub: CandidateTree, probs
    ) -> torch.Tensor | None:
        if d is None or not d.q_rows or len(sub.tokens) == 1:
            return None
        q = torch.zeros_like(probs)
        for local, o in enumerate(sub.origin):
            row = d.q_rows.get(int(o))
            if row is not None:
                q[local] = row
        return q

    def _record_spec(self, r: Request, t: CandidateTree, path: list[int]) -> None:
        n = len(t.tokens) - 1
        r.stats.steps += 1
        if n == 0:
            return
        c = self.counters
        r.stats.verified_tokens += n
        r.stats.tree_nodes += n
        r.stats.accepted_tokens += len(path)
        c.spec_drafts += 1
        c.spec_draft_tokens += n
        c.spec_accepted_tokens += len(path)
        for depth in range(1, len(path) + 1):
            r.stats.accepted_by_depth[depth] = r.stats.accepted_by_depth.get(depth, 0) + 1
            c.accepted_per_pos[depth - 1] = c.accepted_per_pos.get(depth - 1, 0) + 1
        r.stats.rejected_flops_target += (n - len(path)) * self.flops_per_token_target
        rejected_drafted = max(0, n - len(path))
        r.stats.rejected_flops_draft += rejected_drafted * self.flops_per_token_draft
        self.calibrator.observe(t, path)

    def _append(self, r: Request, new: list[int], now: float) -> None:
        """Append tokens one by one, stopping at EOS / stop ids / stop strings / limits;
        recorded logprobs of tokens not appended are dropped."""
        self._append_tokens(r, new, now)
        if r.params.logprobs is not None:
            del r.logprobs[r.num_output :]

    def _append_tokens(self, r: Request, new: list[int], now: float) -> None:
        p = r.params
        for tok in new:
            r.tokens.append(tok)
            r.token_times.append(now)
            self.counters.generation_tokens += 1
            reason = None
            if tok in p.stop_token_ids or (tok in self.eos_ids and not p.ignore_eos):
                reason = "stop"
            elif r.num_output >= p.max_tokens or len(r.tokens) >= self.max_model_len:
                reason = "length"
            elif p.stop and self.tokenizer is not None and self._hit_stop_string(r):
                reason = "stop"
            if reason:
                self._finish(r, reason)
                return

    def _hit_stop_string(self, r: Request) -> bool:
        longest = max(len(s) for s in r.params.stop)
        tail = self.tokenizer.decode(r.output_ids[-(longest + 8) :])
        if not any(s in tail for s in r.params.stop):
            return False
        text = self.tokenizer.decode(r.output_ids)
        cuts = [text.find(s) for s in r.params.stop if s in text]
        r.stop_text_cut = min(cuts)
        return True

    def _finish(self, r: Request, reason: str) -> None:
        r.finish_reason = reason
        r.finished_at = time.perf_counter()
        if r.status is Status.RUNNING and r in self.running:
            self.running.remove(r)
        r.status = Status.FINISHED
        if r.table is not None:
            r.table.release()

    def _log_selection(self, view: BatchView, plan: Plan, subtrees, accepted) -> None:
        """One JSON line per speculating request: no prompt or output text, and the
        request id only as a salted hash."""
        t_iter = plan.info.get("t_iter")
        req_fn = getattr(self.policy, "requirement", None)
        by_id = {r.rid: r for r in view.requests}
        now = time.time()
        for rid, t in subtrees.items():
            rv = by_id.get(rid)
            if rv is None or (len(t.tokens) == 1 and not plan.fallback):
                continue
            line = {
                "ts": round(now, 4),
                "request": hashlib.sha1(f"{self._log_salt}:{rid}".encode()).hexdigest()[:12],
                "class": rv.cls,
                "policy": self.policy.name,
                "requirement": round(req_fn(rv, t_iter), 3) if req_fn and t_iter else None,
                "nodes": len(t.tokens) - 1,
                "expected_accepted": round(float(t.f[1:].sum()), 3),
                "accepted": accepted.get(rid, 0),
                "budget": plan.budget if plan.budget < 1 << 30 else None,
                "fallback": plan.fallback,
            }
            self._sel_log.write(json.dumps(line) + "\n")
        self._sel_log.flush()

    def close(self) -> None:
        """Release files the engine holds (the selection log)."""
        if self._sel_log is not None:
            self._sel_log.close()
            self._sel_log = None

    def _count_fallback(self, reason: str) -> None:
        fb = self.counters.fallback_iterations
        fb[reason] = fb.get(reason, 0) + 1

    # ------------------------------------------------------------------ outputs
    def output_text(self, r: Request) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(r.output_ids)
        if r.stop_text_cut is not None:
            text = text[: r.stop_text_cut]
        return text

    def kv_usage(self) -> float:
        return self.allocator.usage


def _logprob_entries(lsm: torch.Tensor, ids: list[int], k: int) -> list:
    """lsm: [n, V] log-probabilities; ids: the n tokens taken -> per token
    (its logprob, ((id, logprob) of the k most likely, best first))."""
    chosen = lsm.gather(1, torch.tensor(ids, device=lsm.device)[:, None])[:, 0].tolist()
    if not k:
        return [(c, ()) for c in chosen]
    top = lsm.topk(k, dim=-1)
    alts = [tuple(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    return list(zip(chosen, alts))
