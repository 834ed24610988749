"""Energy estimate: FLOPs and bytes moved times a per-unit energy of the device.

    E = FLOPs x e_flop + bytes x e_byte

FLOPs: 2 x parameters per token a model processes (target: prompt tokens, one root
per decode iteration and every verified candidate; draft: every token it caches or
drafts). Bytes: each forward pass reads the model's weights once, plus the KV cache
entries the batch attends (context length x KV bytes per token, per request and pass).

The per-unit energies are order-of-magnitude figures (device power at full load over
peak throughput and memory-access energies from the literature); the estimate is for
comparing policies on one device, not an absolute measurement. Override them with
``--energy-pj-per-flop`` / ``--energy-pj-per-byte``.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaserve.core.trace import EnergyTally  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class DeviceEnergy:
    """Energy per unit of work: picojoules per FLOP and per byte moved from memory."""

    name: str
    pj_per_flop: float
    pj_per_byte: float

    def joules(self, flops: float, bytes_moved: float) -> float:
        return (flops * self.pj_per_flop + bytes_moved * self.pj_per_byte) * 1e-12

    def as_dict(self) -> dict:
        return {
            "device": self.name,
            "pj_per_flop": self.pj_per_flop,
            "pj_per_byte": self.pj_per_byte,
        }


DEVICES: dict[str, DeviceEnergy] = {
    # server CPU, fp32 SIMD: ~200 W over ~2 TFLOP/s; DDR4/5 access ~20 pJ/bit
    "cpu": DeviceEnergy("cpu", 100.0, 160.0),
    # A100: 400 W over 312 TFLOP/s bf16; HBM2e ~4 pJ/bit
    "a100": DeviceEnergy("a100", 1.3, 32.0),
    # H100/H200: 700 W over ~990 TFLOP/s bf16; HBM3 ~3.5 pJ/bit
    "h100": DeviceEnergy("h100", 0.7, 28.0),
}


def device_energy(name: str = "cpu", pj_per_flop=None, pj_per_byte=None) -> DeviceEnergy:
    base = DEVICES.get(name.split(":")[0].lower(), DEVICES["cpu"])
    if name.startswith("cuda") and name.split(":")[0].lower() not in DEVICES:
        base = DEVICES["a100"]
    return DeviceEnergy(
        base.name,
        float(pj_per_flop) if pj_per_flop is not None else base.pj_per_flop,
        float(pj_per_byte) if pj_per_byte is not None else base.pj_per_byte,
    )
