"""Roofline latency model of a tensor-parallel deployment -> ``HardwareModel``.

One forward pass of a model over ``T`` new tokens that attend ``K`` cached tokens on
``tp`` GPUs costs (milliseconds)::

    t(T, K) = W / (bw * mbu)                  read this GPU's share of the weights
            + K * kv_bytes / (tp * bw * mbu)  read the attended KV cache
            + 2 * P * T / (tp * peak * mfu)   matmul FLOPs (P = parameters used per token)
            + L * 2 * allreduce(T * hidden)   two all-reduces per layer (tensor parallel)
            + L * layer_overhead + pass_overhead

Memory time and compute time are *added*, not overlapped (max): with the moderately
sized matmuls of a verification pass (tens to a few thousand rows) neither side
saturates and the sum fits measured serving systems better than the ideal roofline;
the two agree within a factor of two everywhere. Attention FLOPs (a few percent at the
context lengths served) are left out; attention's KV reads are in. A ring all-reduce of
``B`` bytes over ``tp`` GPUs costs ``2 (tp-1)/tp * B / link_bw + latency``.

The GPU spec carries the physics (peak FLOP/s, HBM bandwidth, memory, interconnect);
``Framework`` carries the software costs (kernel launches per layer, host work per
pass and per draft step), which no roofline predicts. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from adaserve.hardware.model import HardwareModel

TOKENS_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 4096)


@dataclass(frozen=True)
class GPUSpec:
    """One accelerator. Units: FLOP/s, bytes/s, bytes.

    peak_flops: dense bf16 tensor-core peak; hbm_bw: memory bandwidth;
    link_bw: interconnect bandwidth per direction per GPU (NVLink);
    mfu / mbu: achievable fraction of peak FLOP/s / of HBM bandwidth.
    """

    name: str
    peak_flops: float
    hbm_bw: float
    memory_bytes: float
    link_bw: float
    mfu: float = 0.6
    mbu: float = 0.8

    def __post_init__(self) -> None:
        for k in ("peak_flops", "hbm_bw", "memory_bytes", "link_bw"):
            if not getattr(self, k) > 0:
                raise ValueError(f"GPU {self.name}: {k} must be positive")
        if not (0 < self.mfu <= 1 and 0 < self.mbu <= 1):
            raise ValueError(f"GPU {self.name}: mfu and mbu must be in (0, 1]")


@dataclass(frozen=True)
class ModelSpec:
    """Architecture of a Llama-family decoder (what the latency depends on)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0  # 0 = hidden // heads
    tie_embeddings: bool = False
    qkv_bias: bool = False
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for k in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab"):
            if not getattr(self, k) > 0:
                raise ValueError(f"model {self.name}: {k} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads must be a multiple of kv_heads")

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.hd, self.kv_heads * self.hd
        attn = h * (q + 2 * kv) + q * h + ((q + 2 * kv) if self.qkv_bias else 0)
        return attn + 3 * h * self.intermediate + 2 * h

    @property
    def params(self) -> int:
        """Stored parameters (embedding counted once when tied)."""
        emb = self.vocab * self.hidden
        return (
            emb
            + self.layers * self.layer_params
            + self.hidden
            + (0 if self.tie_embeddings else emb)
        )

    @property
    def compute_params(self) -> int:
        """Parameters read and multiplied per token: every layer plus the LM head."""
        return self.layers * self.layer_params + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.layers * self.kv_heads * self.hd * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        return 2.0 * self.compute_params

    def hf_config(self) -> dict:
        """A Hugging Face ``config.json`` of this shape (Qwen2 when the name says Qwen,
        else Llama), for loading it with random weights (``adaserve profile --shapes``)."""
        qwen = "qwen" in self.name.lower()
        return {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"],
            "model_type": "qwen2" if qwen else "llama",
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.hd,
            "vocab_size": self.vocab,
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1e6 if qwen else 5e5,
            "attention_bias": self.qkv_bias,
            "tie_word_embeddings": self.tie_embeddings,
        }


@dataclass(frozen=True)
class Framework:
    """Software costs of the serving framework (milliseconds / microseconds).

    layer_overhead_us:  kernel launches and small ops per layer and forward pass
    allreduce_latency_us: fixed cost of one all-reduce (launch + synchronisation)
    verify_overhead_ms: host work per verification pass (scheduling, sampling, copies)
    draft_step_overhead_ms: host work per draft step (top-k, tree bookkeeping, launches)
    gpu_memory_utilization: fraction of GPU memory the server may use
    activation_reserve_bytes: per GPU, kept free for activations and workspace
    """

    layer_overhead_us: float = 20.0
    allreduce_latency_us: float = 15.0
    verify_overhead_ms: float = 0.0
    draft_step_overhead_ms: float = 3.5
    gpu_memory_utilization: float = 0.9
    activation_reserve_bytes: float = 4e9


@dataclass(frozen=True)
class Deployment:
    """A target (and optional draft) model served on ``tp`` GPUs of one kind.

    The draft runs tensor-parallel on the same GPUs (``draft_tp`` = ``tp`` unless set).
    """

    gpu: GPUSpec
    target: ModelSpec
    draft: ModelSpec | None
    tp: int = 1
    draft_tp: int | None = None
    framework: Framework = Framework()
    name: str = ""

    def __post_init__(self) -> None:
        if self.tp < 1 or (self.draft_tp is not None and self.draft_tp < 1):
            raise ValueError("tensor-parallel degree must be >= 1")
        if self.target.kv_heads % self.tp and self.tp % self.target.kv_heads:
            raise ValueError("target kv_heads and tp must divide one another")

    # ------------------------------------------------------------------ latencies
    def _forward_ms(self, m: ModelSpec, tp: int, tokens, kv_tokens, pass_overhead_ms: float):
        g, fw = self.gpu, self.framework
        t = np.asarray(tokens, dtype=float)
        bw = g.hbm_bw * g.mbu
        weights = m.compute_params * m.dtype_bytes / tp / bw
        kv = np.asarray(kv_tokens, dtype=float) * m.kv_bytes_per_token / max(1, tp) / bw
        compute = m.flops_per_token * t / tp / (g.peak_flops * g.mfu)
        comm: float | np.ndarray = 0.0
        if tp > 1:
            per = 2.0 * (tp - 1) / tp * t * m.hidden * m.dtype_bytes / g.link_bw
            comm = m.layers * 2 * (per + fw.allreduce_latency_us * 1e-6)
        launch = m.layers * fw.layer_overhead_us * 1e-6
        return (weights + kv + compute + comm + launch) * 1e3 + pass_overhead_ms

    def verify_ms(self, tokens, kv_tokens=0.0):
        """Target pass over ``tokens`` new tokens attending ``kv_tokens`` cached ones."""
        return self._forward_ms(
            self.target, self.tp, tokens, kv_tokens, self.framework.verify_overhead_ms
        )

    def draft_step_ms(self, tokens):
        """One batched draft step over ``tokens`` tokens (KV reads neglected)."""
        if self.draft is None:
            raise ValueError("deployment has no draft model")
        return self._forward_ms(
            self.draft,
            self.draft_tp or self.tp,
            tokens,
            0.0,
            self.framework.draft_step_overhead_ms,
        )

    # ------------------------------------------------------------------ memory
    def kv_capacity_tokens(self) -> int:
        """Tokens of KV (target + draft) that fit next to the weights on all GPUs."""
        fw = self.framework
        usable = self.gpu.memory_bytes * fw.gpu_memory_utilization - fw.activation_reserve_bytes
        total = self.tp * usable - self.target.weight_bytes
        per_tok = self.target.kv_bytes_per_token
        if self.draft is not None:
            total -= self.draft.weight_bytes
            per_tok += self.draft.kv_bytes_per_token
        if total <= 0:
            raise ValueError(
                f"{self.target.name} does not fit on {self.tp} x {self.gpu.name} "
                f"({self.target.weight_bytes / 1e9:.0f} GB of weights)"
            )
        return int(total // per_tok)

    # ------------------------------------------------------------------ export
    def profile_dict(self, tokens_grid=TOKENS_GRID) -> dict:
        """The ``adaserve.profile/1``-shaped dict of this deployment's predictions."""
        grid = [int(x) for x in tokens_grid]
        v = [round(float(x), 4) for x in self.verify_ms(grid, 0.0)]
        kv_ms = self.target.kv_bytes_per_token / self.tp / (self.gpu.hbm_bw * self.gpu.mbu) * 1e3
        d: dict[str, Any] = {
            "schema": "adaserve.profile/1",
            "device": f"{self.tp}x{self.gpu.name}",
            "dtype": "bfloat16" if self.target.dtype_bytes == 2 else f"{self.target.dtype_bytes}B",
            "machine": "roofline",
            "target": {
                "path": self.target.name,
                "params": self.target.params,
                "fingerprint": "roofline",
            },
            "draft": None,
            "verify": {
                "tokens": grid,
                "latency_ms": v,
                "kv_len": [0],
                "kv_ms_per_token": kv_ms,
            },
            "overhead_ms": 0.0,
            "kv_bytes_per_token": {"target": self.target.kv_bytes_per_token, "draft": 0},
            "kv_capacity_tokens": self.kv_capacity_tokens(),
        }
        if self.draft is not None:
            dm = [round(float(x), 4) for x in self.draft_step_ms(grid)]
            d["draft"] = {
                "path": self.draft.name,
                "params": self.draft.params,
                "fingerprint": "roofline",
            }
            d["draft_step"] = {"tokens": grid, "latency_ms": dm}
            d["draft_step_ms"] = dm[0]
            d["kv_bytes_per_token"]["draft"] = self.draft.kv_bytes_per_token
        else:
            d["draft_step_ms"] = 1e-3  # unused without a draft; must be positive
        return d

    def hardware_model(self, tokens_grid=TOKENS_GRID) -> HardwareModel:
        """The deployment as the ``HardwareModel`` policies and the simulator use."""
        return HardwareModel.from_dict(
            self.profile_dict(tokens_grid), source=f"roofline:{self.name or self.gpu.name}"
        )
