"""Sampling parameters (no torch here: the policies, the simulator and the HTTP layer
use them; the tensor side is ``adaserve.spec_decode.logits``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from adaserve.errors import InvalidRequestError
from adaserve.structured.params import StructuredOutputsParams

MAX_TOKENS_LIMIT = 1 << 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with vLLM's fields and defaults (so
    ``SamplingParams()`` samples at temperature 1, as vLLM's does). ``temperature == 0``
    means greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely (0 = off)
    max_tokens: int = 16
    # independent samples per prompt (``LLM.generate`` returns them as ``outputs``);
    # with a seed, sample j is seeded ``seed + j`` (as the server's ``n``)
    n: int = 1
    # vLLM's penalties, applied to the raw logits before temperature / top-k / top-p /
    # min-p (``adaserve.spec_decode.logits.apply_penalties``): presence and frequency over the
    # output tokens (OpenAI's definition), repetition over prompt + output tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # seeded sampling: the token at output index o is drawn with noise keyed by
    # (seed, o) only (``adaserve.spec_decode.logits.race_noise``), so the output does not depend
    # on the policy, the trees, the batch or the load; None = the request's generator
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # vLLM's: no EOS or stop token id is drawn, and no stop string ends the output,
    # before this many output tokens (the target's logits of those ids are masked at
    # every position below it, drafted tokens included, so speculation stays lossless)
    min_tokens: int = 0
    # log-probability of each generated token under the target model (raw logits, before
    # temperature/top-p, as vLLM's default) plus this many most likely alternatives;
    # None = none recorded
    logprobs: int | None = None
    # the same for the prompt's tokens (the first has none), as vLLM's prompt_logprobs
    prompt_logprobs: int | None = None
    # the output must match this constraint (JSON schema, regex, choice, grammar; a
    # dict in vLLM's shape is accepted): every tree node is masked by its grammar state
    structured_outputs: StructuredOutputsParams | None = None
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before
    # anything else (a dict is kept as sorted (id, bias) pairs); the draft and every tree
    # node of the target see it, so speculation stays lossless
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # vLLM's: words never generated (each word's token sequences, with and without a
    # leading space, are banned at every tree node whose path would complete one)
    bad_words: tuple[str, ...] | None = None
    # vLLM's: the output text keeps the stop string that ended it
    include_stop_str_in_output: bool = False
    # vLLM's: special tokens are left out of the output text (False: kept)
    skip_special_tokens: bool = True
    # vLLM's: False leaves the output text empty (token ids only: no decoding work);
    # stop strings need the text, so they are refused with it
    detokenize: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "structured_outputs", StructuredOutputsParams.of(self.structured_outputs)
        )
        lb = self.logit_bias
        if lb is not None:
            items = lb.items() if isinstance(lb, dict) else lb
            try:
                pairs = tuple(sorted((int(k), float(v)) for k, v in items))
            except (TypeError, ValueError):
                raise InvalidRequestError(
                    "logit_bias maps token ids to numbers", "logit_bias"
                ) from None
            for k, v in pairs:
                if k < 0 or not _real(v) or not -100 <= v <= 100:
                    raise InvalidRequestError(
                        "logit_bias: token ids >= 0, biases in [-100, 100]", "logit_bias"
                    )
            object.__setattr__(self, "logit_bias", pairs or None)
        bw = self.bad_words
        if bw is not None:
            if isinstance(bw, str):
                bw = (bw,)
            if not all(isinstance(w, str) and w.strip() for w in bw):
                raise InvalidRequestError("bad_words must be non-empty strings", "bad_words")
            object.__setattr__(self, "bad_words", tuple(bw) or None)
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        t = self.temperature
        if not isinstance(t, (int, float)) or math.isnan(t) or t < 0 or t > 100:
            raise InvalidRequestError("temperature must be a number in [0, 100]", "temperature")
        p = self.top_p
        if not isinstance(p, (int, float)) or math.isnan(p) or not 0 < p <= 1:
            raise InvalidRequestError("top_p must be in (0, 1]", "top_p")
        m = self.min_p
        if not isinstance(m, (int, float)) or math.isnan(m) or not 0 <= m <= 1:
            raise InvalidRequestError("min_p must be in [0, 1]", "min_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k must be a non-negative integer (0 = off)", "top_k")
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidRequestError(
                f"max_tokens must be an integer in [1, {MAX_TOKENS_LIMIT}]", "max_tokens"
            )
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise InvalidRequestError("n must be a positive integer", "n")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _real(v) or not -2 <= v <= 2:
                raise InvalidRequestError(f"{name} must be a number in [-2, 2]", name)
        r = self.repetition_penalty
        if not _real(r) or not 0 < r < math.inf:
            raise InvalidRequestError(
                "repetition_penalty must be a finite number greater than 0 (1 = off)",
                "repetition_penalty",
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                "min_tokens must be an integer in [0, max_tokens]", "min_tokens"
            )
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError("seed must be a non-negative integer", "seed")
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings", "stop")
        if not isinstance(self.detokenize, bool):
            raise InvalidRequestError("detokenize must be true or false", "detokenize")
        if not self.detokenize and self.stop:
            raise InvalidRequestError(
                "stop strings are matched on the text: they need detokenize=True", "detokenize"
            )
        for name in ("logprobs", "prompt_logprobs"):
            lp = getattr(self, name)
            if lp is not None and (
                not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= 20
            ):
                raise InvalidRequestError(f"{name} must be an integer in [0, 20]", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty is on: the processed distribution at a position depends on the
        tokens before it (not only through the model)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)
