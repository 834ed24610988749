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
from typing import cast

from adaserve.config import EngineConfig
from adaserve.core.blocks import CacheStats
from adaserve.core.clock import Clock, WallClock
from adaserve.core.counters import Counters
from adaserve.core.policy import Policy
from adaserve.core.scheduler import Scheduler
from adaserve.core.slo import SLO
from adaserve.core.stalls import StallDetector
from adaserve.core.step import run_step
from adaserve.core.trace import StepTrace
from adaserve.engine.executor import EngineExecutor
from adaserve.engine.model_runner import ModelRunner
from adaserve.engine.output import OutputProcessor
from adaserve.engine.selection_log import SelectionLog
from adaserve.errors import AdaServeError, InvalidRequestError, ModelLoadError
from adaserve.hardware.calibration import Calibrator
from adaserve.hardware.drift import DriftMonitor
from adaserve.hardware.power import PowerModel
from adaserve.policies.registry import check_servable, make_policy
from adaserve.sampling import SamplingParams
from adaserve.spec_decode.request import Request
from adaserve.structured.manager import StructuredOutputs
from adaserve.structured.matcher import GrammarState
from adaserve.util import paths


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
        self.executor = EngineExecutor(self)  # runs the scheduler's passes on the models
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
        """Run one iteration; returns the requests that finished in it (those that
        expired in the queue first).

        ``core.step.run_step``: the scheduler's ``schedule`` (admit -> plan), the
        ``EngineExecutor`` (speculate -> select -> verify -> tokens), the scheduler's
        ``update_from_output`` (commit, trace, feedback)."""
        res = run_step(self.scheduler, self.executor)
        tr = res.trace
        if tr is None:
            return cast("list[Request]", res.finished)
        if tr.stall is not None:
            self.counters.count_stall(tr.stall)
        if self.hw is not None and self.drift.observe(
            tr.predicted_ms, tr.duration_s * 1000, tr.t_end
        ):
            from adaserve.engine.profile import log_drift

            log_drift(self)
        self.last_trace = tr
        if self._sel_log is not None:
            ex = self.executor
            assert res.out.view is not None  # a trace: a pass ran
            self._sel_log.write(self.policy, res.out.view, tr.plan, ex.trees, ex.accepted)
        if self.on_step is not None:
            self.on_step(self, tr)
        return cast("list[Request]", res.finished)

    def run_until_done(self) -> None:
        """Step until no request is waiting or running."""
        while self.has_work():
            self.step()

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
        retry_token: str | None = None,
    ) -> Request:
        """Validate and queue a request (admission control may shed it with
        ``AdmissionRejected``, whose ``retry_token`` names the seat held for the retry);
        returns its live ``Request``. ``retry_token``: the seat it comes back for."""
        r = self.new_request(prompt, params, slo, arrival, grammar, cache_salt, tenant)
        r.retry_token = retry_token
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


def build_engine(cfg: EngineConfig | None = None, clock: Clock | None = None, **overrides):
    """An engine ready to serve: constructed, then with its hardware profile loaded
    (or measured on first start, when ``cfg.auto_profile``) if its policy drafts or a
    profile was named. Profiling steps the engine; its statistics are reset after."""
    from adaserve.engine.profile import load_or_profile  # imports the engine's modules

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
    on ``device``'s energy figures (``hardware.energy``); None when the counts are unknown
    (a policy with a power cap then plans without it, and says so)."""
    from adaserve.hardware.energy import device_energy

    flops = (
        run.flops_per_token_target,
        run.flops_per_token_draft,
    )
    if not flops[0] > 0:
        return None
    try:
        return PowerModel.of(
            flops, run.weight_bytes, run.kv_bytes_per_slot, device_energy(str(device))
        )
    except (AttributeError, TypeError, ValueError):
        return None
