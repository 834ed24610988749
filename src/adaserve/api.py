"""The offline entry point: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from dataclasses import dataclass, field

from adaserve.config import EngineConfig
from adaserve.core.clock import Clock
from adaserve.engine import Engine, build_engine
from adaserve.errors import InvalidRequestError
from adaserve.request import Request
from adaserve.sampling import SamplingParams
from adaserve.slo import SLO


@dataclass
class RequestOutput:
    """Result of one prompt: generated ids only, text (None without tokenizer), metrics."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    # with SamplingParams(logprobs=k): per generated token, its log-probability under
    # the target and the k most likely tokens at that position
    logprobs: list[TokenLogprob] | None = None
    # with SamplingParams(prompt_logprobs=k): the same per prompt token (the first None)
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability (raw target logits) and the top ``k``
    alternatives at its position as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(r: Request) -> list[TokenLogprob] | None:
    """A request's recorded logprobs (None when it did not ask for them)."""
    if r.params.logprobs is None:
        return None
    return [TokenLogprob(t, lp, top) for t, (lp, top) in zip(r.output_ids, r.logprobs)]


def prompt_token_logprobs(r: Request) -> list[TokenLogprob | None] | None:
    """A request's prompt logprobs, None for the first token (None when not asked)."""
    if r.params.prompt_logprobs is None:
        return None
    return [
        None if e is None else TokenLogprob(t, e[0], e[1])
        for t, e in zip(r.prompt_ids, r.prompt_logprobs)
    ]


def request_metrics(engine: Engine, r: Request) -> dict:
    """Per-request metrics: latency, SLO attainment and speculation statistics."""
    m = r.timing()
    m["slo_class"] = r.slo.cls
    m["tpot_target_ms"] = r.slo.tpot_ms
    m["ttft_target_ms"] = r.slo.ttft_ms
    m["slo_attained"] = slo_attained(r)
    m["output_tokens"] = r.num_output
    m["prompt_tokens"] = len(r.prompt_ids)
    m.update(r.stats.as_dict())
    m["preemptions"] = r.preemptions
    m["policy"] = engine.policy.name
    if r.degraded_from:
        m["degraded_from"] = r.degraded_from
    return m


def slo_attained(r: Request) -> bool:
    """Mean TPOT within target and TTFT within target (where set)."""
    t = r.timing()
    if r.slo.tpot_ms is not None and t["tpot_ms"] is not None and t["tpot_ms"] > r.slo.tpot_ms:
        return False
    if r.slo.ttft_ms is not None and t["ttft_ms"] is not None and t["ttft_ms"] > r.slo.ttft_ms:
        return False
    return r.finish_reason in ("stop", "length")


class LLM:
    """Offline engine. All arguments optional: no model means the shipped default pair."""

    def __init__(
        self,
        model: str | None = None,
        draft: str | None = None,
        policy: str = "adaserve",
        device: str = "cpu",
        dtype: str = "auto",
        no_draft: bool = False,
        clock: Clock | None = None,
        **engine_kwargs,
    ):
        cfg = EngineConfig(
            model=model,
            draft=draft,
            no_draft=no_draft,
            policy=policy,
            device=device,
            dtype=dtype,
            **engine_kwargs,
        )
        self.engine = build_engine(cfg, clock)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        slo: SLO | str | list[SLO | str] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), n, "sampling_params")
        slos = _per_prompt(slo, n, "slo")
        eng = self.engine
        reqs = []
        for p, sp, s in zip(prompts, params, slos):
            if isinstance(s, str):
                s = eng.class_slo(s)
            reqs.append(eng.add_request(p, sp, s))
        while any(not r.finished for r in reqs):
            eng.step()
        return [
            RequestOutput(
                request_id=r.rid,
                prompt_token_ids=r.prompt_ids,
                token_ids=r.output_ids,
                text=eng.output_text(r),
                finish_reason=r.finish_reason,
                metrics=request_metrics(eng, r),
                logprobs=token_logprobs(r),
                prompt_logprobs=prompt_token_logprobs(r),
            )
            for r in reqs
        ]


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts", name)
        return value
    return [value] * n
