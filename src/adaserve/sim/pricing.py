"""The price of one simulated pass (ms): the profile's forward time of the batch formed
(``forward_ms``) plus the engine's host work beyond it (``HostOverhead``). Torch-free."""

from __future__ import annotations

import math
from dataclasses import dataclass

from adaserve.core.trace import DraftWork
from adaserve.hardware.drift import predicted_pass_ms
from adaserve.hardware.model import HardwareModel


@dataclass(frozen=True)
class HostOverhead:
    """Engine host time per iteration not in the profile's forward timings (ms):
    ``per_iteration + per_request * batch + per_spec_request * speculating requests
    + per_spec_step * (speculating requests x draft depth) + per_drafted * drafted
    candidates + per_verified * verified candidates``.
    Measured on the machine (docs/simulator.md, "Fidelity"); zero on GPUs, where the
    presets' framework costs already hold the host work."""

    per_iteration: float = 0.0
    per_request: float = 0.0
    per_spec_request: float = 0.0
    per_spec_step: float = 0.0
    per_drafted: float = 0.0
    per_verified: float = 0.0

    def __post_init__(self) -> None:
        if any(not (x >= 0 and math.isfinite(x)) for x in self.as_tuple()):
            raise ValueError("host overhead coefficients must be finite and >= 0")

    @staticmethod
    def features(requests, spec_requests, spec_steps, drafted, verified) -> tuple[float, ...]:
        """One iteration's counts in coefficient order (``as_tuple``): 1, requests in the
        batch, speculating requests, speculating requests x draft depth, drafted and
        verified candidates."""
        return (1.0, requests, spec_requests, spec_steps, drafted, verified)

    def ms(self, features: tuple[float, ...]) -> float:
        """Host ms of an iteration with these ``features``."""
        return sum(c * x for c, x in zip(self.as_tuple(), features))

    def as_tuple(self) -> tuple[float, ...]:
        return (
            self.per_iteration,
            self.per_request,
            self.per_spec_request,
            self.per_spec_step,
            self.per_drafted,
            self.per_verified,
        )

    @classmethod
    def parse(cls, s) -> HostOverhead:
        """From "a[,b[,c[,d[,e[,f]]]]]" (field order) or a dict with the field names."""
        if isinstance(s, dict):
            return cls(**{k: float(v) for k, v in s.items() if k in cls.__dataclass_fields__})
        vals = [float(x) for x in str(s).split(",") if x.strip()]
        if not 1 <= len(vals) <= 6:
            raise ValueError("host overhead: give 1 to 6 comma-separated numbers (ms)")
        return cls(*vals)


def forward_ms(
    hw: HardwareModel,
    v_tokens,
    kv_tokens,
    draft: DraftWork,
    prefill_pairs: float = 0.0,
    requests: float = 0.0,
    rows: float = 0.0,
) -> float:
    """The profile's time of one iteration of ``requests`` requests (ms): verification
    of ``v_tokens`` attending ``kv_tokens`` (its prefill chunks' ``prefill_pairs`` new x
    cached token pairs priced too), the host overhead and the draft's passes
    (``drift.predicted_pass_ms``: the engine's stall check prices a pass the same)."""
    return predicted_pass_ms(hw, v_tokens, kv_tokens, prefill_pairs, draft, requests, rows)
