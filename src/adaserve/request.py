"""Request state: tokens, KV bookkeeping, SLO progress and per-request statistics."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from adaserve.core.blocks import BlockTable
from adaserve.sampling import SamplingParams
from adaserve.slo import SLO


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
    preemptions: int = 0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["accepted_by_depth"] = {str(k): v for k, v in sorted(self.accepted_by_depth.items())}
        d["tokens_per_step"] = (
            (self.accepted_tokens + self.steps) / self.steps if self.steps else 0.0
        )
        return d


class Request:
    """One generation request inside the engine.

    ``tokens`` holds prompt + output. The target cache holds ``num_cached`` tokens
    (positions ``0..num_cached-1``); in decode exactly one token (the root) is
    uncached. The draft cache holds ``draft_cached`` tokens.
    """

    def __init__(
        self,
        rid: int,
        prompt_ids: list[int],
        params: SamplingParams,
        slo: SLO,
        generator: torch.Generator,
        arrival: float | None = None,
    ):
        self.rid = rid
        self.prompt_ids = list(prompt_ids)
        self.tokens = list(prompt_ids)
        self.params = params
        self.slo = slo
        self.gen = generator
        self.status = Status.WAITING
        self.table: BlockTable | None = None
        self.num_cached = 0
        self.draft_cached = 0
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.admitted_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.token_times: list[float] = []
        self.finish_reason: str | None = None
        self.stop_text_cut: int | None = None  # char offset where a stop string starts
        self.stats = RequestStats()
        self.admit_seq = 0
        self.cancelled = False
        self.degraded_from: str | None = None
        # per output token when params.logprobs is set: (logprob, ((id, logprob), ...))
        self.logprobs: list[tuple[float, tuple[tuple[int, float], ...]]] = []
        # per prompt token when params.prompt_logprobs is set (the first one None)
        self.prompt_logprobs: list = []

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[len(self.prompt_ids) :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt_ids)

    @property
    def uncached(self) -> int:
        return len(self.tokens) - self.num_cached

    @property
    def in_prefill(self) -> bool:
        return self.uncached > 1 or self.num_output == 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def queue_time(self) -> float:
        return ((self.admitted_at or time.perf_counter()) - self.arrival) * 1000.0

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
