"""Built-in GPU specs, model configs and deployments (``--preset GPU[:PAIR]``).

GPUs (SXM parts, dense bf16 tensor-core peak, HBM bandwidth, memory, NVLink per
direction): ``A100-80GB``, ``H100``, ``H200``. Pairs: ``llama-70b`` (Llama-3.1-70B,
Llama-3.2-1B as draft, 4 GPUs) and ``qwen-32b`` (Qwen2.5-32B, Qwen2.5-0.5B, 2 GPUs), the
reference experiment's two set-ups, and ``llama-8b`` (Llama-3.1-8B, Llama-3.2-1B, 1 GPU),
the shapes of the measured H200 profile (``adaserve profile --shapes``). Architecture numbers are those of the published
``config.json`` files.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from adaserve.core.slo import DEFAULT_CLASSES, SLOClass
from adaserve.sim.roofline import Deployment, Framework, GPUSpec, ModelSpec

GPUS: dict[str, GPUSpec] = {
    "A100-80GB": GPUSpec("A100-80GB", 312e12, 2.039e12, 80e9, 300e9),
    "H100": GPUSpec("H100", 989e12, 3.35e12, 80e9, 450e9),
    "H200": GPUSpec("H200", 989e12, 4.8e12, 141e9, 450e9),
}

MODELS: dict[str, ModelSpec] = {
    "Llama-3.1-8B": ModelSpec("Llama-3.1-8B", 32, 4096, 32, 8, 14336, 128256),
    "Llama-3.1-70B": ModelSpec("Llama-3.1-70B", 80, 8192, 64, 8, 28672, 128256),
    "Llama-3.2-1B": ModelSpec(
        "Llama-3.2-1B", 16, 2048, 32, 8, 8192, 128256, head_dim=64, tie_embeddings=True
    ),
    "Qwen2.5-32B": ModelSpec("Qwen2.5-32B", 64, 5120, 40, 8, 27648, 152064, qkv_bias=True),
    "Qwen2.5-0.5B": ModelSpec(
        "Qwen2.5-0.5B", 24, 896, 14, 2, 4864, 151936, tie_embeddings=True, qkv_bias=True
    ),
}

# pair name -> (target, draft, tensor-parallel degree)
PAIRS: dict[str, tuple[str, str, int]] = {
    "llama-70b": ("Llama-3.1-70B", "Llama-3.2-1B", 4),
    "qwen-32b": ("Qwen2.5-32B", "Qwen2.5-0.5B", 2),
    "llama-8b": ("Llama-3.1-8B", "Llama-3.2-1B", 1),
}

DEFAULT_PAIR = "llama-70b"

# Acceptance assumed for the presets' pairs when no statistics are given: top-1 draft
# token accepted with probability 0.7 at every depth (a 1B/0.5B draft of a 70B/32B
# target of the same family on chat text is typically reported at 0.6-0.8). An
# assumption, not a measurement: override with --accept / --stats.
PRESET_TOP1_ACCEPTANCE = 0.7

# The reference experiment's profiled 70B verification latency (tokens -> ms, A100-80GB,
# 4-way tensor parallel) and its draft step (design note, section 6).
PAPER_70B_VERIFY_MS: dict[int, float] = {128: 55.0, 256: 85.0, 512: 125.0, 1024: 205.0}
PAPER_DRAFT_STEP_MS = 5.0


# Measured profiles shipped beside the roofline presets, named ``GPU:PAIR:measured``:
# the engine itself on that GPU (random-weight models of the pair's shapes, bf16), from
# ``adaserve profile --shapes TARGET:DRAFT --device cuda --dtype bfloat16``
# (benchmarks/gpu_run.sh). File names are under ``assets/profiles``.
MEASURED: dict[str, str] = {"H200:llama-8b": "H200-llama-8b.json"}
MEASURED_SUFFIX = ":measured"


def preset_names(measured: bool = True) -> list[str]:
    names = [f"{g}:{p}" for g in GPUS for p in PAIRS]
    return names + ([m + MEASURED_SUFFIX for m in MEASURED] if measured else [])


def is_measured(name: str) -> bool:
    return name.strip().lower().endswith(MEASURED_SUFFIX)


def measured_profile(name: str) -> tuple[str, dict]:
    """(deployment name, profile dict) of the measured preset ``GPU:PAIR:measured``."""
    import json

    from adaserve.util import paths

    base = name.strip()[: -len(MEASURED_SUFFIX)]
    dep = deployment(base).name
    if dep not in MEASURED:
        raise ValueError(
            f"no measured profile for {dep}; measured presets: "
            f"{', '.join(m + MEASURED_SUFFIX for m in MEASURED)}"
        )
    return dep, json.loads((paths.ASSETS / "profiles" / MEASURED[dep]).read_text())


def lookup(table: dict, name: str, what: str):
    for k in table:
        if k.lower() == name.strip().lower():
            return k
    raise ValueError(f"unknown {what} {name!r}; known: {', '.join(table)}")


def deployment(name: str, framework: Framework | None = None) -> Deployment:
    """The deployment ``GPU[:PAIR]`` (pair defaults to ``llama-70b``)."""
    gpu, _, pair = name.partition(":")
    g = lookup(GPUS, gpu, "GPU")
    p = lookup(PAIRS, pair or DEFAULT_PAIR, "model pair")
    target, draft, tp = PAIRS[p]
    return Deployment(
        gpu=GPUS[g],
        target=MODELS[target],
        draft=MODELS[draft],
        tp=tp,
        framework=framework or Framework(),
        name=f"{g}:{p}",
    )


def gpu_classes(base: tuple[SLOClass, ...] = DEFAULT_CLASSES) -> tuple[SLOClass, ...]:
    """The reference experiment's classes on GPUs: the strictest class keeps its
    multiple of the unloaded TPOT (coding, 1.2x), the second gets 50 ms (chat), the
    third 150 ms (summarisation); names, ranks and overload settings are ``base``'s."""
    out = []
    for c in base:
        if c.rank == 1:
            c = dataclasses.replace(c, tpot_ms=50.0, tpot_x=None)
        elif c.rank >= 2:
            c = dataclasses.replace(c, tpot_ms=150.0, tpot_x=None)
        out.append(c)
    return tuple(out)


def compare_with_profile(dep: Deployment, prof: dict) -> list[dict]:
    """Rows {tokens, measured_ms, roofline_ms, error} of a measured profile's
    verification (at zero KV) and draft step against the deployment's roofline."""
    rows = []
    v = prof["verify"]
    for t, ms in zip(v["tokens"], v["latency_ms"]):
        pred = float(dep.verify_ms(t, 0.0))
        rows.append({"tokens": t, "measured_ms": ms, "roofline_ms": pred, "error": pred / ms - 1})
    if dep.draft is not None and prof.get("draft_step_ms"):
        pred, ms = float(dep.draft_step_ms(1)), float(prof["draft_step_ms"])
        rows.append(
            {"tokens": "draft step", "measured_ms": ms, "roofline_ms": pred, "error": pred / ms - 1}
        )
    return rows


def compare_with_paper(dep: Deployment) -> list[dict]:
    """Rows {tokens, paper_ms, roofline_ms, error} for the 70B verification profile,
    plus the draft step (tokens = 'draft')."""
    rows: list[dict[str, Any]] = []
    for t, ms in PAPER_70B_VERIFY_MS.items():
        pred = float(dep.verify_ms(t, 0.0))
        rows.append({"tokens": t, "paper_ms": ms, "roofline_ms": pred, "error": pred / ms - 1})
    if dep.draft is not None:
        pred = float(dep.draft_step_ms(1))
        rows.append(
            {
                "tokens": "draft step",
                "paper_ms": PAPER_DRAFT_STEP_MS,
                "roofline_ms": pred,
                "error": pred / PAPER_DRAFT_STEP_MS - 1,
            }
        )
    return rows
