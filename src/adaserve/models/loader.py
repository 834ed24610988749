"""Load and save Hugging Face checkpoint directories (local disk only, never a hub)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from adaserve.errors import ModelLoadError
from adaserve.models.config import ModelConfig
from adaserve.models.llama import LlamaModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(
    dtype: str | torch.dtype,
    device: str | torch.device = "cpu",
    checkpoint_dtype: str | None = None,
) -> torch.dtype:
    """Map a dtype name to a torch dtype (clear error on anything else).

    ``"auto"`` (vLLM's default): on CUDA the checkpoint's own half precision
    (``checkpoint_dtype``, its config's ``torch_dtype``), bfloat16 for a float32 or
    unlabelled checkpoint; on CPU float32, whose results the tests pin exactly."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if torch.device(device).type != "cuda":
            return torch.float32
        return DTYPES["float16"] if checkpoint_dtype == "float16" else DTYPES["bfloat16"]
    if dtype not in DTYPES:
        raise ModelLoadError(
            f"unsupported dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}"
        )
    return DTYPES[dtype]


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (single file, or sharded with an index)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        if any(path.glob("*.bin")):
            raise ModelLoadError(f"{path} has only .bin weights; convert them to safetensors")
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            wanted = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index} is corrupt: {e}") from None
        missing = [f for f in wanted if not (path / f).is_file()]
        if missing:
            raise ModelLoadError(f"{path} lacks weight shard(s): {', '.join(missing)}")
        files = [path / f for f in wanted]
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read weight file {f.name}: {e}") from None
    return tensors


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "float32",
    random_weights: bool = False,
) -> LlamaModel:
    """Build the model of a checkpoint directory and load its weights (eval mode).

    ``random_weights``: the directory needs only ``config.json``; weights are drawn at
    random on ``device`` (for timing: a forward's cost does not depend on their values,
    so an 8B-shaped model can be profiled without its 16 GB download)."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    cfg = ModelConfig.from_dir(path)
    torch_dtype = resolve_dtype(dtype)
    _check_fits(cfg, torch.device(device), torch_dtype)
    tensors = None if random_weights else read_safetensors(path)
    with torch.device("meta"):
        model = LlamaModel(cfg).to(torch_dtype)
    model = model.to_empty(device=device)  # allocated once, in the final dtype
    model.inv_freq = _fresh_inv_freq(cfg, device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if tensors is None:
        _randomize(model)
    else:
        model.load_hf_state_dict(tensors)
    if torch.device(device).type == "cpu":
        model.transpose_weights()
    return model.eval().requires_grad_(False)


def _check_fits(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
    """A clear error, before allocating, when the weights cannot fit in host RAM (CPU)
    or in the GPU's free memory, instead of an out-of-memory kill mid-load."""
    need = cfg.num_parameters() * dtype.itemsize
    if device.type == "cpu":
        from adaserve.util.resources import available_ram

        have, where = available_ram(), "available RAM"
    elif device.type == "cuda" and torch.cuda.is_available():
        have, where = torch.cuda.mem_get_info(device)[0], f"free memory on {device}"
    else:
        return
    if need > have:
        raise ModelLoadError(
            f"the model's {cfg.num_parameters() / 1e9:.2f}B parameters need "
            f"{need / 2**30:.1f} GiB in {str(dtype).removeprefix('torch.')}; "
            f"{where} is {have / 2**30:.1f} GiB"
        )


def _randomize(model: LlamaModel, std: float = 0.02) -> None:
    """Initialise in place as a fresh Llama is: N(0, std) matrices, unit norms, zero biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std)


def _fresh_inv_freq(cfg: ModelConfig, device) -> torch.Tensor:
    from adaserve.models.llama import rope_inv_freq

    return rope_inv_freq(cfg).to(device)


def save_pretrained(
    model: LlamaModel,
    out: str | Path,
    config_dict: dict,
    dtype: torch.dtype = torch.float32,
    generation_config: dict | None = None,
) -> None:
    """Write ``config.json``, ``model.safetensors`` (and ``generation_config.json``)."""
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.to(dtype).cpu().contiguous() for k, v in model.state_dict_hf().items()}
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = dict(config_dict)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if generation_config is not None:
        (out / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
