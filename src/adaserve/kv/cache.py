"""KV tensors of one model: one flat slot array per layer, addressed by physical slot."""

from __future__ import annotations

import torch

from adaserve.models.config import ModelConfig


class KVCache:
    """K and V for every layer: ``[num_slots, n_kv_heads, head_dim]`` each."""

    def __init__(self, cfg: ModelConfig, num_slots: int, device, dtype: torch.dtype):
        shape = (num_slots, cfg.num_kv_heads, cfg.head_dim)
        self.layers = [
            (
                torch.zeros(shape, device=device, dtype=dtype),
                torch.zeros(shape, device=device, dtype=dtype),
            )
            for _ in range(cfg.num_layers)
        ]
        self.num_slots = num_slots

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V from physical slots ``src`` [n] to ``dst`` [n] (all sources read first)."""
        for k, v in self.layers:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))
