"""The scheduler's configuration, shared by ``EngineConfig`` and ``SimConfig``.

Both inherit ``SchedulerConfig``: the scheduling limits are declared and validated once,
and the simulator cannot drift from the engine by copying them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adaserve.core.blocks import EVICTION
from adaserve.core.slo import DEFAULT_CLASSES, SLOClass
from adaserve.errors import InvalidRequestError

# Retry-After (seconds) answered when the waiting queue is full
QUEUE_FULL_RETRY_S = 1.0
# Retry-After (seconds) answered when a strict class's demand exceeds capacity
CAPACITY_RETRY_S = 1.0


# how admission judges a request's TPOT (``SchedulerConfig.admission_check``)
# "auto": the planner's check, and the measured paces too on steep hardware (``STEEP``)
ADMISSION_CHECKS = ("auto", "planner", "paces")

# a hardware model whose ``steepness`` reaches this is steep: a pass's tokens are dear
# there, so the planner composes passes for it (``AdaptiveConfig.sit_out_steepness``)
# and admission asks the measured paces too (``admission_check`` "auto").
# Between the A100 70B preset's 1.5 and the CPU pair's 2.4-3.3 (profiles of two
# machines); at 2.5 the second CPU profile (2.45) was not steep, and adaserve attained
# 1.6-2.4 points less there (docs/results/admission-issue31.md, seventh pass)
STEEP = 2.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of admission, batching and the KV pool's block size.

    max_num_seqs:       requests admitted at once (vLLM's option)
    max_prefill_tokens: prefill chunk budget per iteration
    block_size:         KV slots per block (a power of two)
    max_model_len:      context limit (None: the model's)
    admission:          shed new requests under overload (queue full, strict capacity)
    max_waiting:        waiting-queue bound when ``admission`` is on
    admission_check:    how admission judges a request's TPOT: "planner" (the policy's
                        own planner forecasts the pass over its life; the measured
                        paces where it cannot), "paces" (the measured paces only) or
                        "auto" (the planner, and on a steep hardware model, ``STEEP``,
                        the measured paces too); env ``ADASERVE_ADMISSION_PLANNER``
                        ("1" / "0": the planner / the paces alone) overrides it
    enable_prefix_caching: map a new request's longest cached prefix of full KV
                        blocks instead of computing it (vLLM's automatic prefix caching)
    prefix_cache_eviction: "lru" (vLLM's) or "slo" (the strictest class that used a
                        cached block keeps it longer)
    classes:            the SLO classes; ``default_class`` (one of them) is the SLO of a
                        request that names none (None: the request must name one)
    """

    block_size: int = 16
    max_num_seqs: int = 64
    max_prefill_tokens: int = 256
    max_model_len: int | None = None
    classes: tuple[SLOClass, ...] = field(default_factory=lambda: DEFAULT_CLASSES)
    default_class: str | None = "chat"
    admission: bool = False
    max_waiting: int = 1024
    admission_check: str = "auto"
    enable_prefix_caching: bool = True
    prefix_cache_eviction: str = "lru"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size must be a positive power of two", "block_size")
        if self.max_num_seqs <= 0:
            raise InvalidRequestError("max_num_seqs must be positive", "max_num_seqs")
        if self.max_prefill_tokens <= 0:
            raise InvalidRequestError("max_prefill_tokens must be positive", "max_prefill_tokens")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len must be at least 2", "max_model_len")
        if self.max_waiting < 1:
            raise InvalidRequestError("max_waiting must be positive", "max_waiting")
        if self.admission_check not in ADMISSION_CHECKS:
            raise InvalidRequestError(
                f"admission_check must be one of {', '.join(ADMISSION_CHECKS)}",
                "admission_check",
            )
        if self.prefix_cache_eviction not in EVICTION:
            raise InvalidRequestError(
                f"prefix_cache_eviction must be one of {', '.join(EVICTION)}",
                "prefix_cache_eviction",
            )
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise InvalidRequestError("SLO class names must be unique", "classes")
        if self.default_class is not None and self.default_class not in names:
            raise InvalidRequestError(f"default class {self.default_class!r} is not defined")

    def class_by_name(self, name: str) -> SLOClass:
        """The class called ``name`` (``InvalidRequestError`` when there is none)."""
        for c in self.classes:
            if c.name == name:
                return c
        raise InvalidRequestError(
            f"unknown SLO class {name!r}; known: {', '.join(c.name for c in self.classes)}",
            "slo_class",
        )
