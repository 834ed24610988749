"""Model configuration read from a Hugging Face ``config.json`` (Llama, Qwen2, Mistral)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from adaserve.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only Llama-family model."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_parameters(self) -> int:
        """Number of parameters (embedding counted once when tied)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        layer = attn + 3 * h * i + 2 * h
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * layer + h + head

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V cache one token takes over all layers."""
        return 2 * self.num_layers * self.kv_size * dtype_bytes

    @classmethod
    def from_dict(cls, cfg: dict, generation_config: dict | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            scaling = None
            # transformers >= 5 writes "rope_parameters" (theta inside); older, "rope_scaling"
            rp = cfg.get("rope_parameters") or {}
            rope_theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            rs = cfg.get("rope_scaling") or rp
            if rs:
                rtype = rs.get("rope_type", rs.get("type"))
                if rtype == "llama3":
                    scaling = RopeScaling(
                        factor=float(rs["factor"]),
                        low_freq_factor=float(rs["low_freq_factor"]),
                        high_freq_factor=float(rs["high_freq_factor"]),
                        original_max_position_embeddings=int(
                            rs["original_max_position_embeddings"]
                        ),
                    )
                elif rtype not in (None, "default"):
                    raise ModelLoadError(f"unsupported rope_scaling type {rtype!r}")
            window = None
            if (
                arch == "MistralForCausalLM"
                or arch == "Qwen2ForCausalLM"
                and cfg.get("use_sliding_window")
            ):
                window = cfg.get("sliding_window")
            eos = _as_tuple((generation_config or {}).get("eos_token_id"))
            if not eos:
                eos = _as_tuple(cfg.get("eos_token_id"))
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=scaling,
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                sliding_window=int(window) if window else None,
                eos_token_ids=eos,
                bos_token_id=cfg.get("bos_token_id"),
                extra={
                    "model_type": cfg.get("model_type"),
                    # transformers >= 5 writes "dtype"; older versions "torch_dtype"
                    "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
                },
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json has an invalid value: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{path} has no config.json")
        try:
            cfg = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_file} is not valid JSON: {e}") from None
        gen = None
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            try:
                gen = json.loads(gen_file.read_text())
            except json.JSONDecodeError:
                gen = None
        return cls.from_dict(cfg, gen)


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
    }.get(model_type, model_type or "<missing>")


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
