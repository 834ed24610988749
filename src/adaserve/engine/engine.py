"""The serving loop: admit -> plan -> speculate -> select -> verify -> commit.

One ``step()`` is one target-model iteration over every admitted request: prefill
chunks, plain decodes (root only) and speculative trees share one forward pass. The
scheduling (admission, KV, preemption, degradation) is the torch-free ``Scheduler``
the simulator runs too; the ``ModelRunner`` executes the pass; the
``OutputProcessor`` commits its tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adaserve import paths
from adaserve.config import EngineConfig
from adaserve.core.blocks import CacheStats
from adaserve.core.clock import Clock, WallClock
from adaserve.core.counters import Counters
from adaserve.core.scheduler import Batch, Scheduler
from adaserve.core.stalls import StallDetector
from adaserve.core.trace import StepTrace
from adaserve.core.tree import CandidateTree, scratch_slots_needed
from adaserve.engine.model_runner import ModelRunner
from adaserve.engine.output import OutputProcessor
from adaserve.engine.selection_log import SelectionLog
from adaserve.engine.verification import accept
from adaserve.errors import AdaServeError, InvalidRequestError, ModelLoadError
from adaserve.request import Request
from adaserve.sampling import SamplingParams
from adaserve.sched.base import Policy
from adaserve.sched.calibration import Calibrator
from adaserve.sched.drift import DriftMonitor, predicted_step_ms
from adaserve.sched.power import PowerModel
from adaserve.sched.registry import check_servable, make_policy
from adaserve.slo import SLO
from adaserve.spec_decode.draft import DraftOutput
from adaserve.structured.manager import StructuredOutputs
from adaserve.structured.matcher import GrammarState


@dataclass(frozen=True)
class Faults:
    """Conditions injected for experiments: Gaussian noise on the draft's logits
    (``draft_noise``, a standard deviation) and a held-back share of the KV pool."""

    draft_noise: float = 0.0
    kv_reserved: float = 0.0

    def __post_init__(self) -> None:
        if not self.draft_noise >= 0:
            raise ValueError("draft_noise must be >= 0")
        if not 0 <= self.kv_reserved <= 1:
            raise ValueError("kv_reserved must be in [0, 1]")


# forced tokens one tree carries at most (a long literal is forced over several steps)
MAX_FORCED = 32


class _From:
    """A read-only attribute of one of the engine's parts (the runner, the scheduler):
    reading ``engine.target`` reads ``engine.runner.target``; writing it is an error."""

    def __init__(self, part: str):
        self.part = part

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.part), self.name)

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"Engine.{self.name} is read-only (see the Engine's methods)")


class Engine:
    """Owns the model runner, the scheduler and every request's state.

    Construction loads the models and runs nothing; ``build_engine`` also loads or
    measures the hardware profile the budgeted policies need.
    """

    def __init__(self, cfg: EngineConfig | None = None, clock: Clock | None = None, **overrides):
        cfg = cfg or EngineConfig(**overrides)
        check_servable(cfg.policy)  # before any model loads
        self.cfg = cfg
        self.clock = clock or WallClock()
        self.runner = ModelRunner(cfg)
        run = self.runner
        self.scheduler = Scheduler(
            cfg,
            make_policy(cfg.policy),
            self.clock,
            run.num_blocks,
            max_model_len=run.max_model_len,
            unloaded_tpot_ms=self.unloaded_tpot_ms,
            power=_power_model(run, cfg.device),
        )
        self.output = OutputProcessor(
            self.scheduler,
            run.tokenizer,
            run.eos_ids,
            run.max_model_len,
            (run.flops_per_token_target, run.flops_per_token_draft),
        )
        self.calibrator = self._new_calibrator()
        self._faults = Faults()
        self._catchup = 0  # tokens the draft caught up on in this step (for the trace)
        self._chains: dict[int, int] = {}  # rid -> forced chain of a request not drafted
        self._ids = itertools.count()
        self.last_trace: StepTrace | None = None
        self.on_step: Callable[[Engine, StepTrace], None] | None = None
        self._sel_log = SelectionLog(cfg.selection_log) if cfg.selection_log else None
        self.drift = DriftMonitor(cfg.drift_config)  # measured vs profiled step times
        tok = run.tokenizer
        if cfg.structured_outputs_backend == "xgrammar":
            import importlib.util

            if importlib.util.find_spec("xgrammar") is None:
                raise ModelLoadError(
                    "--structured-outputs-backend xgrammar: xgrammar is not installed "
                    "(pip install 'adaserve[xgrammar]')"
                )
        self.structured = StructuredOutputs(
            cfg.structured_outputs_backend,
            None if tok is None else tok.to_json,
            run.vocab_size,
            run.eos_ids,
        )
        self.stalls = StallDetector()  # passes over 3x their prediction, with a cause

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[Request]:
        """Run one iteration; returns the requests that finished in it."""
        sched = self.scheduler
        probe = self.stalls.begin()
        sched.begin_step()  # (ends queued requests past their TTFT deadline)
        sched.admit()  # --- admit
        if not sched.running:
            return list(sched.expired)
        view = sched.view(self.calibrator.acceptance_by_rank())  # --- plan
        live = self.structured.mask_ms_per_node()
        if live is not None:  # what masks cost on this run, once enough were timed
            view.mask_ms_per_node = live
        plan = sched.plan(view)
        batch = sched.reserve(plan, can_draft=self.runner.draft is not None)
        drafts = self._speculate(batch)  # --- speculate
        selected = {}  # --- select
        if drafts:
            selected = self.policy.select(view, plan, {rid: d.tree for rid, d in drafts.items()})
        trees = self._verified_trees(batch, drafts, selected)
        vpass = self.runner.verify_forward(batch, trees, drafts)  # --- verify
        paced = getattr(self.clock, "pass_ran", None)  # a ``PacedClock``: modelled time
        if paced is not None:
            paced(_pass_tokens(batch, trees))
        result = accept(vpass)
        self._count_forced(drafts, trees, result)
        self.runner.move_target_slots(result.moves_src, result.moves_dst)
        now = self.clock.now()  # --- commit
        for r, p, lsm in vpass.prompt_rows if vpass is not None else ():
            self.output.record_prompt_logprobs(r, p, lsm)
        generated = self.counters.generation_tokens
        finished, accepted = self.output.commit(batch, trees, result, self.calibrator, now)
        finished = [*sched.expired, *finished]
        generated = self.counters.generation_tokens - generated
        trace = sched.end_step(batch, now)
        self._fill_trace(trace, plan, batch, trees, accepted, drafts, generated)
        self.policy.feedback(plan, trace.duration_s * 1000)
        self._judge_pass(trace, probe, now)
        self.last_trace = trace
        if self._sel_log is not None:
            self._sel_log.write(self.policy, view, plan, trees, accepted)
        if self.on_step is not None:
            self.on_step(self, trace)
        return finished

    def _judge_pass(self, trace: StepTrace, probe, now: float) -> None:
        """The pass against the profile's prediction: a stall (over 3x) is counted with
        its cause; drift (the window's median ratio out of bounds) is reported."""
        if self.hw is None:
            return
        predicted = predicted_step_ms(self.hw, trace)
        measured = trace.duration_s * 1000
        trace.predicted_ms = predicted
        cause = self.stalls.end(probe, predicted, measured)
        if cause is not None:
            trace.stall = cause
            self.counters.count_stall(cause)
        if self.drift.observe(predicted, measured, now):
            from adaserve.profile import log_drift

            log_drift(self)

    def run_until_done(self) -> None:
        """Step until no request is waiting or running."""
        while self.has_work():
            self.step()

    def _speculate(self, batch: Batch) -> dict[int, DraftOutput]:
        """Draft a tree per speculating request; the calibrator sets each node's f.

        A constrained request whose grammar forces the next tokens gets them as a chain
        below its root (no draft step; f = 1, the calibrated estimates of the drafted
        nodes below it taken relative to the chain's end), when the pool holds them."""
        self._catchup = sum(len(r.tokens) - r.draft_cached for r, _ in batch.spec)
        forced = [self._forced(r, shape) for r, shape in batch.spec]
        drafts = self.runner.draft_trees(batch.spec, self._faults.draft_noise, forced)
        for r, _ in batch.spec:
            d = drafts[r.rid]
            tree = d.tree
            self.calibrator.apply(tree)
            if d.forced:
                k = d.forced
                tree.f[k + 1 :] /= max(tree.f[k], 1e-12)
                tree.f[: k + 1] = 1.0
                self.structured.forced_tokens += k
            drafted = tree.num_candidates - d.forced
            r.stats.drafted_tokens += drafted
            self.counters.drafted_tokens += drafted
        return drafts

    def _forced(self, r: Request, shape: tuple[int, int]) -> list[int]:
        """The tokens ``r``'s grammar forces next (none without a grammar, or when the
        KV pool cannot hold them beside the drafted tree)."""
        if r.grammar is None:
            return []
        chain = r.grammar.forced()[: self._chain_room(r)]
        room = len(chain) + scratch_slots_needed(*shape) + 1
        if chain and not self.scheduler.reserve_tree(r, room):
            return []
        return chain

    def _chain_room(self, r: Request) -> int:
        """Forced tokens ``r`` may still take: within ``MAX_FORCED``, and with the
        bonus token after them within its output budget and the model's context (the
        chain goes first; drafted levels past the budget are cut at the commit, as
        without a chain)."""
        left = min(self.runner.max_model_len - len(r.tokens), r.max_new_tokens - r.num_output)
        return max(0, min(MAX_FORCED, left - 1))

    def _count_forced(self, drafts, trees, result) -> None:
        """Forced tokens the target accepted (for the share they contribute)."""
        chains = {rid: d.forced for rid, d in drafts.items() if d.forced}
        chains.update(self._chains)
        for rid, k in chains.items():
            if rid not in result.accepted:
                continue
            t = trees[rid]
            origin = t.origin if t.origin is not None else np.arange(len(t.tokens))
            path = result.accepted[rid].path
            self.structured.forced_accepted += sum(1 for n in path if 1 <= origin[n] <= k)

    def _verified_trees(
        self,
        batch: Batch,
        drafts: dict[int, DraftOutput],
        selected: dict[int, np.ndarray],
    ) -> dict[int, CandidateTree]:
        """The subtree each decoding request verifies (root only when not speculating,
        or when the pool cannot hold the selected nodes)."""
        out: dict[int, CandidateTree] = {}
        self._chains = {}
        for r in batch.decode:
            d = drafts.get(r.rid)
            root = CandidateTree.root_only(r.tokens[-1])
            if d is None:
                out[r.rid] = self._forced_chain(r) or root
                continue
            nodes = np.asarray(selected.get(r.rid, np.zeros(1, dtype=np.int64)))
            ok = self.scheduler.reserve_tree(r, len(nodes))
            out[r.rid] = d.tree.subtree(nodes) if ok else root
        return out

    def _forced_chain(self, r: Request) -> CandidateTree | None:
        """A constrained request the planner did not speculate this step still gets the
        tokens its grammar forces, as a chain below its root (verification only), when
        the policy drafts at all (``ar`` stays plain decoding: the baseline)."""
        if r.grammar is None or not self.policy.uses_draft:
            return None
        chain = r.grammar.forced()[: self._chain_room(r)]
        if not chain or not self.scheduler.reserve_tree(r, len(chain) + 1):
            return None
        k = len(chain)
        self._chains[r.rid] = k
        self.structured.forced_tokens += k
        return CandidateTree(
            tokens=np.array([r.tokens[-1], *chain], dtype=np.int64),
            parents=np.maximum(np.arange(k + 1) - 1, 0),
            depth=np.arange(k + 1),
            q=np.ones(k + 1),
            rank=np.zeros(k + 1, dtype=np.int64),
            f=np.ones(k + 1),
        )

    def _fill_trace(self, tr: StepTrace, plan, batch: Batch, trees, accepted, drafts, generated):
        """The executor's part of the trace: pass tokens, tree sizes, draft work (the
        draft caches every prompt and output token and drafts its candidates)."""
        tr.tree_nodes = {rid: len(t.tokens) - 1 for rid, t in trees.items()}
        tr.accepted = accepted
        prefill = sum(n for _, n in batch.prefill)
        tr.tokens = _pass_tokens(batch, trees)
        drafted = sum(d.tree.num_candidates for d in drafts.values())
        tr.drafted, tr.draft_catchup = drafted, self._catchup if drafts else 0
        if self.policy.uses_draft and self.runner.draft is not None:
            tr.draft_tokens = drafted + prefill + generated
            depth = max((d for d, _ in plan.shapes.values()), default=0)
            tr.draft_passes = depth + 1 if depth else 0
        c = self.counters
        c.model_time_s += self.runner.model_time_s
        self.runner.model_time_s = 0.0
        c.step_time_s += tr.duration_s

    # ------------------------------------------------------------------ requests
    def new_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        slo: SLO | None = None,
        arrival: float | None = None,
        grammar: GrammarState | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> Request:
        """A validated request, not queued (``add_request`` queues it). ``grammar``: the
        state of ``params.structured_outputs`` made beforehand (the server compiles off
        the engine thread); None: compiled here when the params have a constraint.
        ``cache_salt``: its prefix-cache blocks are shared only with requests of the
        same salt (vLLM's field; None: with every unsalted request). ``tenant``: whose
        request it is (admission keeps each tenant to its fair share of a contended
        batch)."""
        # the engine's own callers (profile, warm-up) pass theirs; a bare request is greedy
        params = params or SamplingParams(temperature=0.0)
        if params.n != 1:
            raise InvalidRequestError(
                "an engine request is one sample: n > 1 is for LLM.generate and the server",
                "n",
            )
        if params.logit_bias and params.logit_bias[-1][0] >= self.runner.vocab_size:
            raise InvalidRequestError(
                f"logit_bias: token id {params.logit_bias[-1][0]} is not below the "
                f"vocabulary size {self.runner.vocab_size}",
                "logit_bias",
            )
        ids = self.runner.encode(prompt)
        self.scheduler.check_prompt(len(ids))
        self.scheduler.check_room(len(ids), params.max_tokens)
        slo = slo or self.scheduler.default_slo()
        arrival = self.clock.now() if arrival is None else arrival
        gen = self.runner.generator(params.seed)
        r = Request(next(self._ids), ids, params, slo, gen, arrival)
        r.cache_salt = cache_salt or None
        r.tenant = tenant
        # a request scoring its prompt computes every prompt token (vLLM's choice too)
        r.cache_lookup = params.prompt_logprobs is None
        if grammar is not None:
            r.grammar = grammar
        elif params.structured_outputs is not None:
            r.grammar = self.structured.state_for(params.structured_outputs)
        r.constrained = r.grammar is not None
        if params.bad_words:
            r.bad_words_ids = self._bad_words_ids(params.bad_words)
        return r

    def _bad_words_ids(self, words) -> list[list[int]]:
        """Each bad word's token ids, as written and after a space (vLLM's two forms)."""
        tok = self.runner.tokenizer
        if tok is None:
            raise InvalidRequestError("bad_words need the model's tokenizer", "bad_words")
        seqs = {tuple(tok.encode(v, add_special_tokens=False)) for w in words for v in (w, " " + w)}
        return [list(s) for s in sorted(seqs) if s]

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        slo: SLO | None = None,
        arrival: float | None = None,
        grammar: GrammarState | None = None,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> Request:
        """Validate and queue a request (admission control may shed it with
        ``AdmissionRejected``); returns its live ``Request``."""
        r = self.new_request(prompt, params, slo, arrival, grammar, cache_salt, tenant)
        self.scheduler.add(r)
        return r

    def abort(self, req: Request, reason: str = "abort") -> None:
        """Cancel a request; its KV is freed at once."""
        self.scheduler.abort(req, reason)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ policy, stats
    def set_policy(self, policy: str | Policy) -> None:
        """Schedule with ``policy`` (a name or a policy object) from the next step;
        a clairvoyant (simulator-only) policy is an InvalidRequestError."""
        check_servable(policy)
        self.scheduler.set_policy(make_policy(policy) if isinstance(policy, str) else policy)

    def set_hardware(self, hw) -> None:
        """The hardware model (profile) the budgeted policies and admission use (the
        drift window starts afresh)."""
        self.scheduler.set_hardware(hw)
        self.drift.reset()

    def reset_stats(self) -> None:
        """Fresh counters and calibration, no faults: a clean start between runs
        (only when no request is left)."""
        if self.has_work():
            raise AdaServeError("cannot reset an engine that still has requests")
        self.scheduler.counters = Counters()
        self.scheduler.admission.reset()
        self.scheduler.reset_prefix_cache()  # no run starts warm from the one before
        self.allocator.stats = CacheStats()
        self.calibrator = self._new_calibrator()
        self.set_faults(Faults())
        self.last_trace = None

    @property
    def faults(self) -> Faults:
        return self._faults

    def set_faults(self, faults: Faults) -> None:
        """Inject ``faults`` from now on (``Faults()`` clears them)."""
        self._faults = faults
        self.scheduler.set_kv_reserved(faults.kv_reserved)

    def _new_calibrator(self) -> Calibrator:
        cal = Calibrator()
        d = self.runner.draft_dir
        if d is not None and Path(d) == paths.DEFAULT_DRAFT:
            cal.seed_from_stats(paths.DEFAULT_STATS)
        return cal

    def close(self) -> None:
        """Release files the engine holds (the selection log)."""
        if self._sel_log is not None:
            self._sel_log.close()
            self._sel_log = None

    # ------------------------------------------------------------------ read-only views
    policy = _From("scheduler")
    hw = _From("scheduler")
    counters = _From("scheduler")
    waiting = _From("scheduler")
    running = _From("scheduler")
    allocator = _From("scheduler")
    target = _From("runner")
    draft = _From("runner")
    tokenizer = _From("runner")
    model_dir = _From("runner")
    draft_dir = _From("runner")
    device = _From("runner")
    dtype = _From("runner")
    kv_target = _From("runner")
    kv_draft = _From("runner")
    eos_ids = _From("runner")
    max_model_len = _From("runner")
    kv_bytes_per_slot = _From("runner")
    flops_per_token_target = _From("runner")
    flops_per_token_draft = _From("runner")
    thread_plan = _From("runner")

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (a string needs a tokenizer)."""
        return self.runner.encode(prompt)

    def default_slo(self) -> SLO:
        return self.scheduler.default_slo()

    def class_slo(self, name: str) -> SLO:
        return self.scheduler.class_slo(name)

    def capacity_tok_s(self) -> float:
        """Largest token rate the pair sustains at full batch (from the hardware model)."""
        return self.scheduler.capacity_tok_s()

    def unloaded_tpot_ms(self) -> float:
        """Measured (profile) or estimated per-token latency at near-zero load."""
        if self.hw is not None:
            return self.hw.unloaded_tpot_ms()
        return self.runner.estimate_tpot_ms()

    def output_text(self, r: Request) -> str | None:
        """The request's output text (None without a tokenizer)."""
        return self.output.output_text(r)

    def kv_usage(self) -> float:
        """Fraction of the KV pool in use (0-1)."""
        return self.allocator.usage

    def reset_prefix_cache(self) -> int:
        """Forget every cached KV block (vLLM's ``reset_prefix_cache``); returns how
        many were cached. Requests running keep their blocks."""
        return self.scheduler.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict:
        """Prefix-cache lookups since start: queried and cached prompt tokens, hit rate,
        in total and per class (``CacheStats.summary``)."""
        out = self.allocator.stats.summary()
        out["enabled"] = self.allocator.caching
        out["cached_blocks"] = self.allocator.num_cached
        return out


def _pass_tokens(batch: Batch, trees: dict[int, CandidateTree]) -> int:
    """Target tokens of the verification pass: prefill chunks and every verified tree
    (root included)."""
    return sum(n for _, n in batch.prefill) + sum(len(t.tokens) for t in trees.values())


def build_engine(cfg: EngineConfig | None = None, clock: Clock | None = None, **overrides):
    """An engine ready to serve: constructed, then with its hardware profile loaded
    (or measured on first start, when ``cfg.auto_profile``) if its policy drafts or a
    profile was named. Profiling steps the engine; its statistics are reset after."""
    from adaserve.profile import load_or_profile  # imports the engine's modules

    eng = Engine(cfg, clock, **overrides)
    _say_threads(eng.thread_plan)
    if eng.policy.uses_draft or eng.cfg.profile:
        try:
            eng.set_hardware(load_or_profile(eng, auto=eng.cfg.auto_profile))
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        eng.reset_stats()
    return eng


_SAID: set = set()


def _say_threads(plan) -> None:
    """The thread plan, on stderr, once per process and plan."""
    if plan in _SAID:
        return
    _SAID.add(plan)
    import sys

    print(f"adaserve: forward passes: {plan.describe()}", file=sys.stderr, flush=True)


def _power_model(run: ModelRunner, device: str) -> PowerModel | None:
    """The planners' power model from the models' parameter counts, dtype and KV bytes
    on ``device``'s energy figures (``bench.energy``); None when the counts are unknown
    (a policy with a power cap then plans without it, and says so)."""
    from adaserve.bench.energy import device_energy

    flops = (
        getattr(run, "flops_per_token_target", 0.0),
        getattr(run, "flops_per_token_draft", 0.0),
    )
    if not flops[0] > 0:
        return None
    try:
        return PowerModel.of(
            flops, run.weight_bytes, run.kv_bytes_per_slot, device_energy(str(device))
        )
    except (AttributeError, TypeError, ValueError):
        return None
