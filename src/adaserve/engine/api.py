"""The offline entry point, in vLLM's shape: ``LLM(...).generate(prompts,
SamplingParams(...))`` and ``LLM.chat(messages)`` return one ``RequestOutput`` per
prompt, its ``outputs`` the ``n`` samples (``CompletionOutput``). See docs/offline.md."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tqdm.auto import tqdm

from adaserve.config import EngineConfig
from adaserve.core.clock import Clock
from adaserve.core.slo import COMPLETE_REASONS, SLO, slo_met
from adaserve.engine import Engine, build_engine
from adaserve.errors import InvalidRequestError, ModelLoadError
from adaserve.sampling import SamplingParams
from adaserve.spec_decode.request import Request
from adaserve.text.generation_config import sampling_defaults


@dataclass(frozen=True)
class Logprob:
    """vLLM's ``Logprob``: a token's log-probability under the target (raw logits), its
    rank in that distribution (1: the most likely; None where not known: a sampled
    token outside the requested top ``k``) and its text (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position, token id -> Logprob: the token taken there and the top k alternatives
# (vLLM's ``SampleLogprobs`` / ``PromptLogprobs`` entries)
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One sample of a prompt, as vLLM's ``CompletionOutput``.

    index:              the sample's index among the prompt's ``n``
    text:               the generated text, cut before a stop string (None without a
                        tokenizer)
    token_ids:          the generated token ids
    cumulative_logprob: the sum of the generated tokens' logprobs (raw target logits)
                        with ``SamplingParams(logprobs=k)``, else None
    logprobs:           with ``logprobs=k``: per generated token, token id -> Logprob
    finish_reason:      "stop", "length", "abort" (None while running)
    stop_reason:        the stop string or stop token id that ended it; None for the
                        model's EOS token and for every other finish (as vLLM)
    metrics:            adaserve's per-request latency, SLO and speculation figures
    """

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    metrics: dict = field(default_factory=dict)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result of one prompt, as vLLM's ``RequestOutput``: ``outputs`` holds its
    ``SamplingParams.n`` samples. ``metrics`` are the first sample's (each sample's
    are in ``outputs[i].metrics``). ``text``, ``token_ids`` and ``finish_reason`` read
    ``outputs[0]``'s."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    # prompt tokens found in the prefix cache (vLLM's ``num_cached_tokens``)
    num_cached_tokens: int = 0

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def _position(tok, token_id: int, logprob: float, top) -> PositionLogprobs:
    """token id -> Logprob at one position: the taken token first, then the top k."""

    def text(t: int) -> str | None:
        return tok.decode([t]) if tok is not None else None

    ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
    out = {token_id: Logprob(logprob, ranks.get(token_id), text(token_id))}
    for t, lp in top:
        if t not in out:
            out[t] = Logprob(lp, ranks[t], text(t))
    return out


def token_logprobs(r: Request, tok=None) -> list[PositionLogprobs] | None:
    """A request's recorded logprobs (None when it did not ask for them)."""
    if r.params.logprobs is None:
        return None
    return [_position(tok, t, lp, top) for t, (lp, top) in zip(r.output_ids, r.logprobs)]


def prompt_token_logprobs(r: Request, tok=None) -> list[PositionLogprobs | None] | None:
    """A request's prompt logprobs, None for the first token (None when not asked)."""
    if r.params.prompt_logprobs is None:
        return None
    return [
        None if e is None else _position(tok, t, e[0], e[1])
        for t, e in zip(r.prompt_ids, r.prompt_logprobs)
    ]


def stop_reason(eng: Engine, r: Request) -> int | str | None:
    """What ended a request that finished with "stop": the stop token id or the stop
    string (vLLM's ``stop_reason``); None for EOS and other finishes."""
    if r.finish_reason != "stop" or not r.output_ids:
        return None
    p, last = r.params, r.output_ids[-1]
    if last in p.stop_token_ids:
        return last
    if last in eng.eos_ids and not p.ignore_eos:
        return None
    if r.stop_text_cut is not None and p.stop and eng.tokenizer is not None:
        text = eng.tokenizer.decode(r.output_ids)
        return next((s for s in p.stop if text.startswith(s, r.stop_text_cut)), None)
    return None


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
    """Whether ``r`` met its SLO (``slo.slo_met``: completed, mean TPOT and TTFT within
    their targets where set)."""
    t = r.timing()
    return slo_met(
        r.finish_reason in COMPLETE_REASONS,
        t["tpot_ms"],
        t["ttft_ms"],
        r.slo.tpot_ms,
        r.slo.ttft_ms,
    )


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
        tensor_parallel_size: int = 1,
        trust_remote_code: bool = False,
        generation_config: str = "auto",
        **engine_kwargs,
    ):
        # vLLM's arguments that scripts pass: tensor parallelism does not exist here
        # (several engines scale out: docs/deployment.md); the supported families need
        # no remote code
        if tensor_parallel_size != 1:
            raise InvalidRequestError(
                f"tensor_parallel_size={tensor_parallel_size}: tensor parallelism is not "
                "implemented (1 only)",
                "tensor_parallel_size",
            )
        del trust_remote_code
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
        # vLLM's generation_config="auto": the checkpoint's recommended sampling fields
        # are the defaults of a call that passes no SamplingParams
        self._sampling_defaults = sampling_defaults(self.engine.model_dir, generation_config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The model's tokenizer (vLLM's ``LLM.get_tokenizer``): ``encode``, ``decode``,
        ``apply_chat_template``."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no ``sampling_params``, as
        vLLM's: ``SamplingParams()`` (temperature 1) with the model's
        ``generation_config.json`` sampling fields over it (``generation_config=
        "vllm"``: none)."""
        return SamplingParams(**self._sampling_defaults)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached KV block (vLLM's ``LLM.reset_prefix_cache``)."""
        self.engine.reset_prefix_cache()
        return True

    def generate(
        self,
        prompts: str | dict | list[str] | list[int] | list[list[int]] | list[dict],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        slo: SLO | str | list[SLO | str] | None = None,
        use_tqdm: bool | Callable = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (continuous batching); outputs in prompt order.

        A prompt is a string, a list of token ids, or vLLM's prompt dict
        ``{"prompt": str}`` / ``{"prompt_token_ids": [...]}`` (with an optional
        ``"cache_salt"``: its cached prefix is shared only with prompts of that salt). Each prompt gets
        ``sampling_params.n`` samples (``RequestOutput.outputs``); with a seed, sample
        j is seeded ``seed + j``. ``use_tqdm``: a progress bar of finished prompts on
        stderr (when it is a terminal; a callable: the tqdm class to use, as vLLM).
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[assignment]  # one prompt: a list of one
        n = len(prompts)
        params = _per_prompt(
            sampling_params or self.get_default_sampling_params(), n, "sampling_params"
        )
        slos = _per_prompt(slo, n, "slo")
        eng = self.engine
        groups: list[tuple[str | None, list[Request]]] = []
        try:
            for p, sp, s in zip(prompts, params, slos):
                if not isinstance(sp, SamplingParams):
                    raise InvalidRequestError(
                        "sampling_params must be SamplingParams", "sampling_params"
                    )
                if isinstance(s, str):
                    s = eng.class_slo(s)
                text, ids = _prompt_of(p)
                salt = p.get("cache_salt") if isinstance(p, dict) else None
                if salt is not None and not isinstance(salt, str):
                    raise InvalidRequestError("cache_salt must be a string", "cache_salt")
                samples = [
                    replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j)
                    for j in range(sp.n)
                ]
                groups.append(
                    (text, [eng.add_request(ids, x, s, cache_salt=salt) for x in samples])
                )
            self._run([reqs for _, reqs in groups], use_tqdm)
        except BaseException:
            for _, reqs in groups:  # no request of a failed call is left in the engine
                for r in reqs:
                    if not r.finished:
                        eng.abort(r)
            raise
        return [self._output(text, reqs) for text, reqs in groups]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        slo: SLO | str | list[SLO | str] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of ``{"role", "content"}``
        messages) or to each of a list of them, as vLLM's ``LLM.chat``: the messages
        go through the tokenizer's chat template (the one the server uses), or through
        ``chat_template`` (a Jinja template string or a file holding one). ``tools``
        (OpenAI's tool dicts) and ``chat_template_kwargs`` reach the template, as in
        vLLM; the reply is text (a grammar in ``sampling_params.structured_outputs``
        can hold it to a call's shape)."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list", "messages")
        convs = [messages] if isinstance(messages[0], dict) else messages
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError(
                "this model has no tokenizer: chat is unavailable", "messages"
            )
        if chat_template is not None:
            from adaserve.text.chat_template import ChatTemplate, load_template_arg

            tok = copy.copy(tok)
            tok.chat = ChatTemplate({"default": load_template_arg(chat_template)}, tok.config)
        prompts = []
        for conv in convs:
            if not isinstance(conv, list) or not all(isinstance(m, dict) for m in conv):
                raise InvalidRequestError(
                    "messages must be a list of message dicts or a list of such lists",
                    "messages",
                )
            try:
                kw = dict(chat_template_kwargs or {})
                if tools is not None:
                    kw["tools"] = tools
                text = tok.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, **kw
                )
            except ModelLoadError as e:
                raise InvalidRequestError(
                    f"the chat template rejected the messages: {e}", "messages"
                ) from None
            prompts.append({"prompt": text})
        return self.generate(prompts, sampling_params, slo, use_tqdm)

    def _run(self, groups: list[list[Request]], use_tqdm: bool | Callable) -> None:
        """Step the engine until every request of ``groups`` finished, counting finished
        groups (prompts) on a progress bar."""
        bar_cls = use_tqdm if callable(use_tqdm) else tqdm
        # disable=None: tqdm shows the bar only on a terminal
        bar = bar_cls(
            total=len(groups),
            desc="Processed prompts",
            unit="prompt",
            disable=None if use_tqdm else True,
        )
        done = 0
        try:
            while True:
                now_done = sum(all(r.finished for r in g) for g in groups)
                if now_done > done:
                    bar.update(now_done - done)
                    done = now_done
                if done == len(groups):
                    return
                self.engine.step()
        finally:
            bar.close()

    def _output(self, text: str | None, reqs: list[Request]) -> RequestOutput:
        eng, tok = self.engine, self.tokenizer
        outs = []
        for j, r in enumerate(reqs):
            detok = r.params.detokenize  # vLLM's detokenize=False: ids only, text ""
            lps = token_logprobs(r, tok if detok else None)
            outs.append(
                CompletionOutput(
                    index=j,
                    text=eng.output_text(r) if detok else "",
                    token_ids=r.output_ids,
                    cumulative_logprob=None if lps is None else sum(lp for lp, _ in r.logprobs),
                    logprobs=lps,
                    finish_reason=r.finish_reason,
                    stop_reason=stop_reason(eng, r),
                    metrics=request_metrics(eng, r),
                )
            )
        first = reqs[0]
        return RequestOutput(
            request_id=str(first.rid),
            prompt=text,
            prompt_token_ids=first.prompt_ids,
            prompt_logprobs=prompt_token_logprobs(first, tok),
            outputs=outs,
            finished=all(r.finished for r in reqs),
            metrics=outs[0].metrics,
            num_cached_tokens=first.cached_prompt,
        )


def _prompt_of(p) -> tuple[str | None, str | list[int]]:
    """(prompt text or None, what the engine encodes) of one prompt."""
    if isinstance(p, dict):
        if "prompt_token_ids" in p:
            return p.get("prompt"), p["prompt_token_ids"]
        if isinstance(p.get("prompt"), str):
            return p["prompt"], p["prompt"]
        raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompts")
    if isinstance(p, str):
        return p, p
    if isinstance(p, list):
        return None, p
    raise InvalidRequestError("a prompt is a string, a list of token ids or a dict", "prompts")


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts", name)
        return value
    return [value] * n
