"""Llama-family decoder (Llama, Qwen2, Mistral) over a flat ragged batch.

Two entry points share the weights:

* ``forward(input_ids [T], meta, kv)`` -> hidden ``[T, hidden]``: the serving path,
  tokens of many requests with a paged KV cache (see ``attention.py``).
* ``forward_dense(input_ids [B, S])`` -> logits ``[B, S, vocab]``: plain causal
  forward without cache, used for training and reference checks.

Q/K/V and gate/up projections are stored fused (one matmul each); ``state_dict_hf``
splits them back into Hugging Face names.
"""

from __future__ import annotations

import contextlib
import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.models.attention import AttnMetadata, paged_attention
from adaserve.models.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., dim] -> [..., dim]. Normalised in float32, scaled after rounding back
        to x's dtype (as Hugging Face's Llama); in float32 one fused op."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        y = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * y.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with Llama-3 scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wl) & (wavelen <= low_wl)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor):
    """``apply_rope`` in three ops: ``sin_signed`` is sin with its first half negated,
    so the rotation is a plain half swap. x: [T, heads, head_dim]; cos, sin_signed:
    [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, rot, sin_signed)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.scale = cfg.head_dim**-0.5

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def _qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        c = self.cfg
        q, k, v = self.qkv_proj(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.unflatten(-1, (c.num_heads, c.head_dim))
        k = k.unflatten(-1, (c.num_kv_heads, c.head_dim))
        v = v.unflatten(-1, (c.num_kv_heads, c.head_dim))
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward_paged(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        meta: AttnMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, hidden]; cos, sin_signed: [T, 1, head_dim] (``apply_rope_signed``);
        caches: [num_slots, n_kv, head_dim] (written in place)."""
        c = self.cfg
        qkv = self.qkv_proj(self.input_layernorm(x))  # [T, (H + 2 Hkv) * D]
        # rotary embedding of q and k in one pass over their [T, H + Hkv, D] view
        qk = apply_rope_signed(
            qkv[:, : c.q_size + c.kv_size].unflatten(-1, (-1, c.head_dim)), cos, sin_signed
        )
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        v = qkv[:, c.q_size + c.kv_size :].unflatten(-1, (c.num_kv_heads, c.head_dim))
        k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        a = paged_attention(q, k_cache, v_cache, meta.groups, self.scale)
        x = x + self.o_proj(a.flatten(-2))
        return x + self._mlp(self.post_attention_layernorm(x))

    def forward_dense(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x: [B, S, hidden] -> [B, S, hidden], causal."""
        q, k, v = self._qkv(self.input_layernorm(x), cos, sin)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            scale=self.scale,
            enable_gqa=self.cfg.num_heads != self.cfg.num_kv_heads,
        )
        x = x + self.o_proj(a.transpose(1, 2).flatten(-2))
        return x + self._mlp(self.post_attention_layernorm(x))


def _gpu_attention_backends(cuda: bool):
    """On CUDA, attention runs without the cuDNN backend, which PyTorch picks for bf16
    and which plans a graph for every new shape: on an H200 it cost 2-6 ms of host time
    per call (the context length changes every step), 70 ms per decode step of an
    8B-shaped model (benchmarks/gpu_step_profile.py). Flash, memory-efficient and math
    kernels remain. A no-op on CPU."""
    if not cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    )


class LlamaModel(nn.Module):
    """Decoder-only transformer; parameter names follow HF except the fused projections."""

    inv_freq: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions: [...] -> cos, sin: [..., 1, head_dim]"""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: AttnMetadata,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """input_ids: [T]; kv: per layer (k_cache, v_cache) -> hidden [T, hidden] (final-normed)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self._cos_sin(meta.positions, x.dtype)
        half = sin.shape[-1] // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)  # apply_rope_signed's
        with _gpu_attention_backends(x.is_cuda):
            for layer, (kc, vc) in zip(cast("list[DecoderLayer]", self.layers), kv):
                x = layer.forward_paged(x, cos, sin, meta, kc, vc)
        return self.norm(x)

    def transpose_weights(self) -> None:
        """Store every projection weight [out, in] as a transposed view of an
        [in, out]-contiguous tensor (values, shapes and names unchanged).

        On CPU, the GEMM for a few rows (a verified tree, a draft step) runs up to 2x
        faster with that layout than with the row-major [out, in] one
        (``benchmarks/bench_weight_layout.py``). Not applied to a weight shared with
        the embedding, whose row lookups want rows contiguous."""
        shared = self.embed_tokens.weight
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear) and m.weight is not shared:
                    w = m.weight
                    m.weight = nn.Parameter(
                        w.detach().t().contiguous().t(), requires_grad=w.requires_grad
                    )

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    def forward_dense(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [B, S] -> logits [B, S, vocab] (causal, positions 0..S-1)."""
        x = self.embed_tokens(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        cos, sin = self._cos_sin(pos, x.dtype)
        for layer in cast("list[DecoderLayer]", self.layers):
            x = layer.forward_dense(x, cos, sin)
        return self.lm_head(self.norm(x))

    # ----------------------------------------------------------------- HF names
    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load weights given under Hugging Face names (checks every shape)."""
        from adaserve.errors import ModelLoadError

        c = self.cfg
        own = self.state_dict()
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ModelLoadError(f"checkpoint lacks weight {name!r}")
            used.add(name)
            return tensors[name]

        def put(dst: str, value: torch.Tensor) -> None:
            if tuple(own[dst].shape) != tuple(value.shape):
                raise ModelLoadError(
                    f"shape mismatch for {dst}: config implies {tuple(own[dst].shape)}, "
                    f"checkpoint has {tuple(value.shape)}"
                )
            with torch.no_grad():
                own[dst].copy_(value.to(own[dst].dtype))

        put("embed_tokens.weight", take("model.embed_tokens.weight"))
        put("norm.weight", take("model.norm.weight"))
        if not c.tie_word_embeddings:
            put("lm_head.weight", take("lm_head.weight"))
        elif "lm_head.weight" in tensors:
            used.add("lm_head.weight")
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            put(f"layers.{i}.input_layernorm.weight", take(p + "input_layernorm.weight"))
            put(
                f"layers.{i}.post_attention_layernorm.weight",
                take(p + "post_attention_layernorm.weight"),
            )
            a = p + "self_attn."
            put(
                f"layers.{i}.qkv_proj.weight",
                _cat_checked(
                    [
                        take(a + "q_proj.weight"),
                        take(a + "k_proj.weight"),
                        take(a + "v_proj.weight"),
                    ],
                    [c.q_size, c.kv_size, c.kv_size],
                    a + "q/k/v_proj.weight",
                ),
            )
            if c.attention_bias:
                put(
                    f"layers.{i}.qkv_proj.bias",
                    _cat_checked(
                        [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")],
                        [c.q_size, c.kv_size, c.kv_size],
                        a + "q/k/v_proj.bias",
                    ),
                )
            put(f"layers.{i}.o_proj.weight", take(a + "o_proj.weight"))
            m = p + "mlp."
            put(
                f"layers.{i}.gate_up_proj.weight",
                _cat_checked(
                    [take(m + "gate_proj.weight"), take(m + "up_proj.weight")],
                    [c.intermediate_size, c.intermediate_size],
                    m + "gate/up_proj.weight",
                ),
            )
            put(f"layers.{i}.down_proj.weight", take(m + "down_proj.weight"))

    def state_dict_hf(self) -> dict[str, torch.Tensor]:
        """Weights under Hugging Face names (fused projections split)."""
        c = self.cfg
        out = {
            "model.embed_tokens.weight": self.embed_tokens.weight,
            "model.norm.weight": self.norm.weight,
        }
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(cast("list[DecoderLayer]", self.layers)):
            p = f"model.layers.{i}."
            out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
            out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
            q, k, v = layer.qkv_proj.weight.split([c.q_size, c.kv_size, c.kv_size])
            out[p + "self_attn.q_proj.weight"] = q
            out[p + "self_attn.k_proj.weight"] = k
            out[p + "self_attn.v_proj.weight"] = v
            if c.attention_bias:
                qb, kb, vb = layer.qkv_proj.bias.split([c.q_size, c.kv_size, c.kv_size])
                out[p + "self_attn.q_proj.bias"] = qb
                out[p + "self_attn.k_proj.bias"] = kb
                out[p + "self_attn.v_proj.bias"] = vb
            out[p + "self_attn.o_proj.weight"] = layer.o_proj.weight
            g, u = layer.gate_up_proj.weight.chunk(2)
            out[p + "mlp.gate_proj.weight"] = g
            out[p + "mlp.up_proj.weight"] = u
            out[p + "mlp.down_proj.weight"] = layer.down_proj.weight
        return {k: v.detach().contiguous() for k, v in out.items()}


def _cat_checked(parts: list[torch.Tensor], sizes: list[int], what: str) -> torch.Tensor:
    from adaserve.errors import ModelLoadError

    for t, n in zip(parts, sizes):
        if t.shape[0] != n:
            raise ModelLoadError(
                f"shape mismatch for {what}: config implies {n} rows, checkpoint has {t.shape[0]}"
            )
    return torch.cat(parts, dim=0)
