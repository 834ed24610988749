"""Power model of a planned pass (no torch): the bench's energy model, priced before
the pass runs so that a power cap and an energy budget can constrain the plan.

A pass that verifies ``verify_tokens`` target tokens (prefill + one root per decoding
request + every selected candidate) attending ``kv_tokens`` cached ones, after
``draft_depth`` draft passes over ``draft_tokens`` tokens (its catch-up plus the
candidates it drafts), costs ::

    FLOPs = target_flops_per_token x verify_tokens + draft_flops_per_token x draft_tokens
    bytes = target_weight_bytes + draft_depth x draft_weight_bytes
            + kv_tokens x kv_bytes_per_token
    E (J) = (FLOPs x pj_per_flop + bytes x pj_per_byte) x 1e-12 + static_w x t

(the ``RunRecorder``'s tally and ``hardware.energy.DeviceEnergy``; ``static_w`` is an
optional idle power of the deployment, 0 by default). Its predicted power is E over
the predicted pass time t. FLOPs and bytes are those of the whole deployment (every
tensor-parallel GPU), so a cap is the deployment's, not one GPU's.

The planner sees it as ``BatchView.power`` (the ``Scheduler`` hands it out): the
simulator fills it from its preset (or profile) and energy device, the engine from its
models' parameter counts. In the planner the energy of a depth d with ``tot``
candidates is linear, ``e0[d] + e_tok[d] x tot`` (``depth_coefficients``), with the
planner's draft model: a pass at depth d > 0 drafts d passes, its catch-up over the
pass's ``tok0`` = decoders + prefill tokens, then the candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PowerModel:
    """Work per token and energy per unit of work of a deployment (validated).

    target/draft_flops_per_token: FLOPs per token each model processes (2 x params)
    target/draft_weight_bytes:    bytes of weights a forward pass reads
    kv_bytes_per_token:           KV bytes read per attended context token
    pj_per_flop / pj_per_byte:    the device's energies (``hardware.energy.DEVICES``)
    static_w:                     idle power added over the pass time (0 = none)
    """

    target_flops_per_token: float
    draft_flops_per_token: float = 0.0
    target_weight_bytes: float = 0.0
    draft_weight_bytes: float = 0.0
    kv_bytes_per_token: float = 0.0
    pj_per_flop: float = 0.0
    pj_per_byte: float = 0.0
    static_w: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        vals = (
            self.target_flops_per_token,
            self.draft_flops_per_token,
            self.target_weight_bytes,
            self.draft_weight_bytes,
            self.kv_bytes_per_token,
            self.pj_per_flop,
            self.pj_per_byte,
            self.static_w,
        )
        if not all(math.isfinite(v) and v >= 0 for v in vals):
            raise ValueError("power model: every quantity must be finite and >= 0")
        if self.pj_per_flop == 0 and self.pj_per_byte == 0 and self.static_w == 0:
            raise ValueError("power model: no energy per FLOP, per byte or static power")

    @classmethod
    def of(cls, flops_per_token, weight_bytes, kv_bytes_per_token, device, static_w=0.0):
        """The model of (target, draft) FLOPs per token and weight bytes, KV bytes per
        token and a ``DeviceEnergy``-like ``device`` (``pj_per_flop``, ``pj_per_byte``)."""
        return cls(
            target_flops_per_token=float(flops_per_token[0]),
            draft_flops_per_token=float(flops_per_token[1]),
            target_weight_bytes=float(weight_bytes[0]),
            draft_weight_bytes=float(weight_bytes[1]),
            kv_bytes_per_token=float(kv_bytes_per_token),
            pj_per_flop=float(device.pj_per_flop),
            pj_per_byte=float(device.pj_per_byte),
            static_w=float(static_w),
            source=str(getattr(device, "name", "")),
        )

    def dynamic_j(
        self, verify_tokens: float, kv_tokens: float, draft_depth: int, draft_tokens: float
    ) -> float:
        """Joules of a pass's work (FLOPs and bytes), without the static part."""
        flops = self.target_flops_per_token * verify_tokens + self.draft_flops_per_token * (
            draft_tokens if draft_depth > 0 else 0.0
        )
        moved = (
            self.target_weight_bytes
            + max(draft_depth, 0) * self.draft_weight_bytes
            + kv_tokens * self.kv_bytes_per_token
        )
        return (flops * self.pj_per_flop + moved * self.pj_per_byte) * 1e-12

    def pass_energy_j(
        self,
        verify_tokens: float,
        kv_tokens: float,
        draft_depth: int,
        draft_tokens: float,
        t_ms: float = 0.0,
    ) -> float:
        """Predicted joules of a pass (see the module docstring) lasting ``t_ms``."""
        dyn = self.dynamic_j(verify_tokens, kv_tokens, draft_depth, draft_tokens)
        return dyn + self.static_w * t_ms / 1000.0

    def pass_power_w(self, energy_j: float, t_ms: float) -> float:
        """Watts of ``energy_j`` spent over ``t_ms`` (0 for a pass of no time)."""
        return energy_j * 1000.0 / t_ms if t_ms > 0 else 0.0

    def planned_energy_j(
        self, depth: int, n_decode: int, prefill: int, candidates: int, kv_tokens: float, t_ms
    ) -> float:
        """The planner's energy of a pass: ``n_decode`` roots, ``prefill`` tokens and
        ``candidates`` verified candidates; at depth > 0 the draft catches up over
        roots + prefill and drafts the candidates (``depth_coefficients``)."""
        tok0 = n_decode + prefill
        return self.pass_energy_j(
            tok0 + candidates, kv_tokens, depth, tok0 + candidates if depth > 0 else 0, t_ms
        )

    def depth_coefficients(
        self, depths: np.ndarray, tok0: int, kv_tokens: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(e0 [D], e_tok [D]): a pass at depth ``depths[i]`` with ``tot`` candidates
        costs ``e0[i] + e_tok[i] * tot`` joules of work (``planned_energy_j`` without
        the static part)."""
        d = np.asarray(depths, dtype=float)
        spec = d > 0
        ft, fd = self.target_flops_per_token, self.draft_flops_per_token
        pf, pb = self.pj_per_flop * 1e-12, self.pj_per_byte * 1e-12
        flops0 = ft * tok0 + np.where(spec, fd * tok0, 0.0)
        bytes0 = self.target_weight_bytes + d * self.draft_weight_bytes
        bytes0 = bytes0 + kv_tokens * self.kv_bytes_per_token
        e0 = flops0 * pf + bytes0 * pb
        e_tok = (ft + np.where(spec, fd, 0.0)) * pf
        return e0, e_tok
