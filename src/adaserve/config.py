"""Frozen, validated engine configuration."""

from __future__ import annotations

from dataclasses import dataclass

from adaserve.core.config import SchedulerConfig
from adaserve.errors import AdaServeError, InvalidRequestError
from adaserve.hardware.drift import DriftConfig
from adaserve.policies.registry import check_servable


@dataclass(frozen=True)
class EngineConfig(SchedulerConfig):
    """Everything the engine needs to start: the scheduler's limits
    (``SchedulerConfig``: ``max_num_seqs``, ``max_prefill_tokens``, ``block_size``,
    ``max_model_len``, ``classes``, ``default_class``, ``admission``, ``max_waiting``)
    plus the models and their memory.

    model / draft:       checkpoint directories (None = the shipped pair; draft ""
                         or None with ``no_draft`` = no speculation)
    kv_cache_bytes:      KV pool size for target + draft (None: on CPU 1/4 of available
                         RAM, capped at 4 GiB; on CUDA what gpu_memory_utilization leaves)
    gpu_memory_utilization: share of the GPU's memory the engine may fill (weights, KV
                         cache, activations), as vLLM's option of that name
    draft_sample:        sampled drafts (q-based verification) for non-greedy requests
    random_weights:      model directories need only config.json; weights are random
                         (profiling model shapes without their checkpoints)
    generation_config:   where default sampling parameters come from, as vLLM's flag:
                         "auto" (the model's generation_config.json), "vllm" (none),
                         or a directory (see ``adaserve.text.generation_config``)
    drift_detect:        watch for drift from the profile: when the median measured /
                         profiled iteration time over ``drift_window`` iterations
                         leaves [``drift_low``, ``drift_high``] it is reported (log,
                         metric, dashboard), at most once per ``drift_min_interval_s``;
                         the profile is never re-measured inside the serving loop
                         (see ``adaserve.hardware.drift``)
    threads:             intra-op threads of the forward passes (None: ``$ADASERVE_NUM_THREADS``,
                         ``$OMP_NUM_THREADS``, else the usable cores less a reserve;
                         see ``adaserve.util.threads``)
    reprofile:           adopt a freshly measured profile even when it is slower than
                         the stored one's spread, and take its class targets
                         (``--reprofile``; see ``adaserve.engine.profile``)
    structured_outputs_backend: the grammar library of constrained requests:
                         "llguidance", "xgrammar" or "auto" (llguidance; see
                         ``adaserve.structured.compiler``)
    """

    model: str | None = None
    draft: str | None = None
    no_draft: bool = False
    policy: str = "adaserve"
    device: str = "cpu"
    dtype: str = "auto"  # float32 on CPU; the checkpoint's half precision on CUDA
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    draft_sample: bool = False
    profile: str | None = None  # hardware profile path; None = cache lookup
    auto_profile: bool = True  # measure the pair on first start when no profile is cached
    selection_log: str | None = None
    random_weights: bool = False
    generation_config: str = "auto"
    seed: int | None = None  # seeds the generators of requests without their own seed
    # the drift monitor's settings, flat like the rest (defaults: DriftConfig's)
    drift_detect: bool = DriftConfig.enabled
    drift_window: int = DriftConfig.window
    drift_low: float = DriftConfig.low
    drift_high: float = DriftConfig.high
    drift_min_interval_s: float = DriftConfig.min_interval_s
    threads: int | None = None
    reprofile: bool = False
    structured_outputs_backend: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.default_class is None:
            raise InvalidRequestError("the engine needs a default SLO class", "default_class")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise InvalidRequestError("kv_cache_bytes must be positive", "kv_cache_bytes")
        if self.threads is not None and (
            not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1
        ):
            raise InvalidRequestError("threads must be a positive integer", "threads")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidRequestError("seed must be a non-negative integer", "seed")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidRequestError(
                "gpu_memory_utilization must be in (0, 1]", "gpu_memory_utilization"
            )
        try:
            _ = self.drift_config  # validates the drift_* fields
        except ValueError as e:
            raise InvalidRequestError(str(e), "drift") from None
        if self.device not in ("cpu",) and not self.device.startswith("cuda"):
            raise InvalidRequestError(f"unsupported device {self.device!r}", "device")
        from adaserve.text.generation_config import check_source

        try:
            check_source(self.generation_config)
        except AdaServeError as e:
            raise InvalidRequestError(str(e), "generation_config") from None
        check_servable(self.policy)  # clairvoyant policies are simulator only
        if self.structured_outputs_backend not in ("auto", "llguidance", "xgrammar"):
            raise InvalidRequestError(
                "structured_outputs_backend must be auto, llguidance or xgrammar",
                "structured_outputs_backend",
            )

    @property
    def drift_config(self) -> DriftConfig:
        """The drift monitor's settings (``drift_detect``, ``drift_*``)."""
        return DriftConfig(
            enabled=self.drift_detect,
            window=self.drift_window,
            low=self.drift_low,
            high=self.drift_high,
            min_interval_s=self.drift_min_interval_s,
        )
