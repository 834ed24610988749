"""Time-boxed training loops (fp32 master weights, optional bf16 autocast) with resumable checkpoints.

A phase trains one model for a wall-clock budget on random windows of a token stream:
``kind="ce"`` minimizes next-token cross-entropy on the data, ``kind="kl"`` distils a
teacher (KL(teacher || student) over the full vocabulary on the same windows). The
learning rate follows warmup + cosine over the *fraction of the budget* used, so a
phase always ends its schedule on time. Every ``ckpt_every_s`` seconds the phase writes
``<ckpt_dir>/<name>.pt`` (model, optimizer, RNG, elapsed time); rerunning with the same
checkpoint directory resumes there; a finished phase is not trained again unless the
rerun gives it a larger budget, in which case it continues (the cosine schedule is
re-stretched over the new budget, so the learning rate rises again: a warm restart).
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.models.config import ModelConfig
from adaserve.models.llama import LlamaModel


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int


# Sizes chosen on a 2-core CPU: the target is deep and narrow, so its one-token decode
# (bound by per-layer overhead) costs ~10x the one-layer draft's while its training cost
# per token stays that of a ~16M model; verifying 16 tokens costs < 2x verifying one
# (see pair_stats.json).
TARGET_SPEC = ModelSpec(320, 896, 12, 5, 1)
DRAFT_SPEC = ModelSpec(256, 768, 1, 4, 2)
SMOKE_TARGET_SPEC = ModelSpec(64, 128, 2, 4, 2)
SMOKE_DRAFT_SPEC = ModelSpec(32, 64, 1, 2, 1)


def hf_config(spec: ModelSpec, vocab_size: int, eos_id: int, max_positions: int = 2048) -> dict:
    """A Hugging Face ``LlamaForCausalLM`` config dict for ``spec``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.hidden_size // spec.num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "pad_token_id": eos_id,
        "use_cache": True,
    }


def build_model(config_dict: dict, seed: int) -> LlamaModel:
    """Fresh model with GPT-style init (std 0.02, residual outputs scaled by 1/sqrt(2L))."""
    torch.manual_seed(seed)
    model = LlamaModel(ModelConfig.from_dict(config_dict))
    std = 0.02
    resid_std = std / math.sqrt(2 * model.cfg.num_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith(("o_proj.weight", "down_proj.weight")):
                p.normal_(0.0, resid_std)
            elif p.dim() >= 2:
                p.normal_(0.0, std)
            else:
                p.zero_()
    return model


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class PhaseConfig:
    name: str
    budget_s: float
    batch: int
    seq: int
    lr: float
    kind: str = "ce"  # "ce" or "kl"
    warmup_frac: float = 0.03
    min_lr_frac: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    ckpt_every_s: float = 120.0
    bf16: bool = False  # bf16 autocast for forward/backward matmuls (fp32 master weights)


def bf16_is_fast() -> bool:
    """True when this CPU has native bf16 matmul support (AVX512-BF16 / AMX)."""
    cap = torch.backends.cpu.get_cpu_capability()
    return cap.startswith(("AVX512", "AMX"))


def lr_at(pc: PhaseConfig, progress: float) -> float:
    """Warmup then cosine to ``min_lr_frac * lr``; ``progress`` = fraction of budget used."""
    if progress < pc.warmup_frac:
        return pc.lr * max(progress / pc.warmup_frac, 0.02)
    t = min(1.0, (progress - pc.warmup_frac) / max(1e-9, 1.0 - pc.warmup_frac))
    lo = pc.lr * pc.min_lr_frac
    return lo + 0.5 * (pc.lr - lo) * (1.0 + math.cos(math.pi * t))


def sample_windows(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    """``batch`` random windows of ``seq + 1`` tokens -> [batch, seq + 1]."""
    hi = stream.numel() - seq - 1
    starts = torch.randint(0, max(1, hi), (batch,), generator=gen)
    idx = starts.unsqueeze(1) + torch.arange(seq + 1)
    return stream[idx.clamp_max(stream.numel() - 1)]


def eval_windows(stream: torch.Tensor, seq: int, max_windows: int) -> torch.Tensor:
    """Up to ``max_windows`` non-overlapping windows spread evenly over the whole of
    ``stream`` -> [n, seq + 1]. Evenly spread, because loss differs a lot between
    source files (a table of constants vs a parser) and the first files alone are not
    representative."""
    total = (stream.numel() - 1) // seq
    n = min(max_windows, total)
    if n <= 0:
        raise ValueError("held-out stream is shorter than one window")
    picks = torch.linspace(0, total - 1, n).round().long().tolist()
    return torch.stack([stream[i * seq : i * seq + seq + 1] for i in picks])


@torch.no_grad()
def heldout_loss(model: LlamaModel, windows: torch.Tensor, batch: int = 4) -> float:
    """Mean next-token cross-entropy (nats/token) over ``windows`` [n, seq + 1]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        logits = model.forward_dense(w[:, :-1]).float()
        total += F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten(), reduction="sum").item()
        count += w[:, 1:].numel()
    model.train(was_training)
    return total / count


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_phase(
    model: LlamaModel,
    stream: torch.Tensor,
    pc: PhaseConfig,
    ckpt_dir: Path,
    seed: int,
    teacher: LlamaModel | None = None,
    progress_bar: bool = True,
) -> dict:
    """Train ``model`` in place for ``pc.budget_s`` seconds; returns a summary dict."""
    from tqdm import tqdm

    if pc.kind not in ("ce", "kl"):
        raise ValueError(f"unknown phase kind {pc.kind!r}")
    if pc.kind == "kl" and teacher is None:
        raise ValueError("a distillation phase needs a teacher")
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path = ckpt_dir / f"{pc.name}.pt"

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": pc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=pc.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(seed)
    step, elapsed, tokens, loss_ema = 0, 0.0, 0, None
    history: list[tuple[int, float, float]] = []  # (step, elapsed_s, loss_ema)
    if ckpt_path.is_file():
        ck = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(ck["model"])
        if ck.get("done") and ck["elapsed"] >= pc.budget_s:
            return ck["summary"]  # finished; a larger budget on rerun extends the phase
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["rng"])
        step, elapsed, tokens = ck["step"], ck["elapsed"], ck["tokens"]
        loss_ema, history = ck["loss_ema"], ck["history"]
        print(f"[{pc.name}] resuming at step {step} ({elapsed:.0f}s of {pc.budget_s:.0f}s)")

    def checkpoint(done: bool, summary: dict | None = None) -> None:
        state = {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "rng": gen.get_state(),
            "step": step,
            "elapsed": elapsed,
            "tokens": tokens,
            "loss_ema": loss_ema,
            "history": history,
            "done": done,
            "summary": summary,
            "phase": asdict(pc),
        }
        _atomic_save(state, ckpt_path)

    model.train()
    if teacher is not None:
        teacher.eval().requires_grad_(False)
    bar = tqdm(
        total=int(round(pc.budget_s)),
        initial=min(int(elapsed), int(round(pc.budget_s))),
        desc=pc.name,
        unit="s",
        mininterval=2.0,
        disable=not progress_bar,
        bar_format="{desc}: {percentage:3.0f}%|{bar:20}| {n}/{total}s {postfix}",
    )
    last_ckpt = elapsed
    t_start = time.perf_counter() - elapsed
    while elapsed < pc.budget_s:
        lr = lr_at(pc, elapsed / pc.budget_s)
        for g in opt.param_groups:
            g["lr"] = lr
        w = sample_windows(stream, pc.batch, pc.seq, gen)
        x, y = w[:, :-1], w[:, 1:]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=pc.bf16):
            logits = model.forward_dense(x).float()
            if pc.kind == "kl":
                assert teacher is not None  # the kl kind distils a teacher
                with torch.no_grad():
                    t_logits = teacher.forward_dense(x).float()
        if pc.kind == "ce":
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        else:
            t_logp = F.log_softmax(t_logits, dim=-1).flatten(0, 1)
            s_logp = F.log_softmax(logits.float(), dim=-1).flatten(0, 1)
            loss = F.kl_div(s_logp, t_logp, log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), pc.grad_clip)
        opt.step()
        step += 1
        tokens += x.numel()
        lv = loss.item()
        loss_ema = lv if loss_ema is None else 0.95 * loss_ema + 0.05 * lv
        elapsed = time.perf_counter() - t_start
        if step % 10 == 0:
            history.append((step, round(elapsed, 1), round(loss_ema, 4)))
        bar.set_postfix_str(f"step {step} loss {loss_ema:.3f} lr {lr:.2e}", refresh=False)
        bar.update(min(int(elapsed), int(round(pc.budget_s))) - bar.n)
        if elapsed - last_ckpt >= pc.ckpt_every_s:
            checkpoint(done=False)
            last_ckpt = elapsed
    bar.close()
    model.eval()
    summary = {
        "phase": pc.name,
        "kind": pc.kind,
        "steps": step,
        "tokens": tokens,
        "seconds": round(elapsed, 1),
        "batch": pc.batch,
        "seq": pc.seq,
        "peak_lr": pc.lr,
        "bf16_autocast": pc.bf16,
        "final_train_loss_ema": None if loss_ema is None else round(loss_ema, 4),
        "loss_history": history,
    }
    checkpoint(done=True, summary=summary)
    return summary
