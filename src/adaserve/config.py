"""Frozen, validated engine configuration."""

from __future__ import annotations

from dataclasses import dataclass, field

from adaserve.errors import InvalidRequestError
from adaserve.slo import DEFAULT_CLASSES, SLOClass


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to start.

    model / draft:       checkpoint directories (None = the shipped pair; draft ""
                         or None with ``no_draft`` = no speculation)
    kv_cache_bytes:      KV pool size for target + draft (None: on CPU 1/4 of available
                         RAM, capped at 4 GiB; on CUDA what gpu_memory_utilization leaves)
    gpu_memory_utilization: share of the GPU's memory the engine may fill (weights, KV
                         cache, activations), as vLLM's option of that name
    max_prefill_tokens:  prefill chunk budget per iteration
    draft_sample:        sampled drafts (q-based verification) for non-greedy requests
    random_weights:      model directories need only config.json; weights are random
                         (profiling model shapes without their checkpoints)
    """

    model: str | None = None
    draft: str | None = None
    no_draft: bool = False
    policy: str = "adaserve"
    device: str = "cpu"
    dtype: str = "auto"  # float32 on CPU; the checkpoint's half precision on CUDA
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    max_num_seqs: int = 64
    max_prefill_tokens: int = 256
    max_model_len: int | None = None
    draft_sample: bool = False
    classes: tuple[SLOClass, ...] = field(default_factory=lambda: DEFAULT_CLASSES)
    default_class: str = "chat"
    profile: str | None = None  # hardware profile path; None = cache lookup
    auto_profile: bool = True  # measure the pair on first start when no profile is cached
    admission: bool = False  # shed requests under overload (the server turns it on)
    max_waiting: int = 1024
    selection_log: str | None = None
    random_weights: bool = False

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError("block_size must be a positive power of two", "block_size")
        if self.max_num_seqs <= 0:
            raise InvalidRequestError("max_num_seqs must be positive", "max_num_seqs")
        if self.max_prefill_tokens <= 0:
            raise InvalidRequestError("max_prefill_tokens must be positive", "max_prefill_tokens")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise InvalidRequestError("kv_cache_bytes must be positive", "kv_cache_bytes")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                "gpu_memory_utilization must be in (0, 1]", "gpu_memory_utilization"
            )
        if self.device not in ("cpu",) and not self.device.startswith("cuda"):
            raise InvalidRequestError(f"unsupported device {self.device!r}", "device")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise InvalidRequestError("SLO class names must be unique", "classes")
        if self.default_class not in names:
            raise InvalidRequestError(f"default class {self.default_class!r} is not defined")

    def class_by_name(self, name: str) -> SLOClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise InvalidRequestError(
            f"unknown SLO class {name!r}; known: {', '.join(c.name for c in self.classes)}",
            "slo_class",
        )
