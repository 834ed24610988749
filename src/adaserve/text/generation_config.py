"""A checkpoint's recommended sampling defaults (``generation_config.json``), as vLLM
applies them.

``--generation-config`` takes vLLM's values: ``auto`` (the default) reads the model
directory's ``generation_config.json``, ``vllm`` ignores it (the built-in defaults), and
any other value is a directory holding a ``generation_config.json``. Of that file only
the sampling fields vLLM reads are used (``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as the default ``max_tokens``),
and of those only the ones ``SamplingParams`` implements; ``do_sample`` is ignored, as by
vLLM. They apply where a request leaves the field out; an explicit value always wins.
EOS ids are read separately (``ModelConfig``), whatever this setting.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from adaserve.errors import ModelLoadError
from adaserve.sampling import SamplingParams

log = logging.getLogger("adaserve")

# generation_config.json key -> SamplingParams field
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def check_source(source: str | None) -> None:
    """Raise ``ModelLoadError`` for a ``generation_config`` value that is neither
    ``auto``, ``vllm`` nor a directory."""
    if source is None or source in ("auto", "vllm"):
        return
    if not Path(source).is_dir():
        raise ModelLoadError(
            f"--generation-config {source!r}: expected auto, vllm or a directory with a "
            "generation_config.json"
        )


def sampling_defaults(model_dir: str | Path | None, source: str | None = "auto") -> dict:
    """SamplingParams field -> default from ``generation_config.json`` (see the module
    docstring); empty with ``source="vllm"`` or when there is no file."""
    check_source(source)
    if source == "vllm" or (source in (None, "auto") and model_dir is None):
        return {}
    where = model_dir if source is None or source == "auto" else source
    assert where is not None  # no model directory returned above
    folder = Path(where)
    f = folder / "generation_config.json"
    if not f.is_file():
        if source not in (None, "auto"):
            raise ModelLoadError(f"--generation-config: {f} does not exist")
        return {}
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {f}: {e}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"{f} is not a JSON object")
    known = {fl.name for fl in dataclasses.fields(SamplingParams)}
    out: dict[str, Any] = {}
    for key, name in _FIELDS.items():
        v = data.get(key)
        if v is None or name not in known or isinstance(v, bool):
            continue
        if not isinstance(v, (int, float)):
            raise ModelLoadError(f"{f}: {key} must be a number, got {v!r}")
        out[name] = int(v) if name in ("top_k", "max_tokens") else float(v)
    if out.get("top_k", 0) < 0:  # HF/vLLM spell "off" as 0 or -1
        out["top_k"] = 0
    try:  # the values must be valid sampling parameters
        SamplingParams(**{k: v for k, v in out.items() if k != "max_tokens"})
    except Exception as e:  # InvalidRequestError names the field
        raise ModelLoadError(f"{f}: {e}") from None
    if out.get("max_tokens", 1) < 1:
        out.pop("max_tokens")
    return out


def describe(defaults: dict) -> str:
    """One line for the start-up log (empty when there are no defaults)."""
    if not defaults:
        return ""
    items = ", ".join(f"{k}={v:g}" for k, v in sorted(defaults.items()))
    return (
        f"default sampling parameters from the model's generation_config.json: {items} "
        "(--generation-config vllm ignores them)"
    )
