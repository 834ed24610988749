"""Request state: tokens, KV bookkeeping, SLO progress and per-request statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from adaserve.core.seq import SeqState, Status  # noqa: F401  (Status re-exported)
from adaserve.core.slo import SLO
from adaserve.sampling import SamplingParams
from adaserve.structured.matcher import GrammarState


@dataclass
class RequestStats:
    """Per-request speculation statistics (exposed in ``.metrics``)."""

    steps: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    tree_nodes: int = 0
    accepted_by_depth: dict[int, int] = field(default_factory=dict)
    rejected_flops_draft: float = 0.0
    rejected_flops_target: float = 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["accepted_by_depth"] = {str(k): v for k, v in sorted(self.accepted_by_depth.items())}
        d["tokens_per_step"] = (
            (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0
        )
        return d


class Request(SeqState):
    """One generation request inside the engine.

    ``tokens`` holds prompt + output; the scheduling state (KV, status, times) is the
    ``SeqState`` the scheduler keeps. The draft cache holds ``draft_cached`` tokens.
    """

    def __init__(
        self,
        rid: int,
        prompt_ids: list[int],
        params: SamplingParams,
        slo: SLO,
        generator: torch.Generator,
        arrival: float,
    ):
        super().__init__(rid, slo, arrival)
        self.prompt_ids = list(prompt_ids)
        self.tokens = list(prompt_ids)
        self.params = params
        self.gen = generator
        self.token_times: list[float] = []
        self.stop_text_cut: int | None = None  # char offset where a stop string starts
        self.stats = RequestStats()
        # per output token when params.logprobs is set: (logprob, ((id, logprob), ...))
        self.logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = []
        # per prompt token when params.prompt_logprobs is set (the first one None)
        self.prompt_logprobs: list = []
        # the grammar state of a constrained request (params.structured_outputs), at its
        # committed output; None: unconstrained
        self.grammar: GrammarState | None = None
        # params.bad_words as token id sequences (each word with and without a space)
        self.bad_words_ids: list[list[int]] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_tokens

    def block_tokens(self, start: int, stop: int) -> list[int]:
        return self.tokens[start:stop]

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    def timing(self) -> dict:
        """Latency figures in milliseconds (None where not applicable yet)."""
        ttft = (self.first_token_at - self.arrival) * 1000 if self.first_token_at else None
        n = self.num_output
        tpot = None
        if self.first_token_at and self.finished_at and n > 1:
            tpot = (self.finished_at - self.first_token_at) * 1000 / (n - 1)
        e2e = (self.finished_at - self.arrival) * 1000 if self.finished_at else None
        return {
            "ttft_ms": ttft,
            "tpot_ms": tpot,
            "e2e_ms": e2e,
            "queue_ms": ((self.admitted_at or self.arrival) - self.arrival) * 1000,
        }
