"""``adaserve train`` (smoke run) and the shipped default model pair."""

from __future__ import annotations

import json

import pytest
import torch

from adaserve import cli as adaserve_cli
from adaserve.models.loader import load_model
from adaserve.train import cli, corpus, stats
from adaserve.train.tokenizer import EOS_TOKEN, load_tokenizer
from adaserve.util.paths import DEFAULT_DRAFT, DEFAULT_STATS, DEFAULT_TARGET

transformers = pytest.importorskip("transformers")


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _max_logit_diff(path, ids: torch.Tensor) -> float:
    ours = load_model(path)
    theirs = _hf(path)
    with torch.no_grad():
        a = ours.forward_dense(ids)
        b = theirs(ids).logits.float()
    return (a - b).abs().max().item()


def _heldout_prompts(path, num: int, length: int) -> torch.Tensor:
    tok = load_tokenizer(path)
    texts = corpus.heldout_prompt_texts(corpus.load_split("heldout"), per_file=2)
    return stats.heldout_prompts(tok, texts, num, length)


@pytest.fixture(scope="module")
def smoke_pair(tmp_path_factory):
    out = tmp_path_factory.mktemp("pair")
    # through the top-level CLI: ``adaserve train --out ...`` (a leading option)
    argv = ["train", "--out", str(out), "--smoke", "--minutes", "0.05", "--no-progress"]
    assert adaserve_cli.main(argv) == 0
    return out


def test_train_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit) as ei:  # argparse's one-line error, exit code 2
        adaserve_cli.main(["train", "--out", "/nonexistent/x", "--minutes", "-1"])
    assert ei.value.code == 2
    assert "--minutes: must be a positive number" in capsys.readouterr().err


def test_bf16_autocast_phase_learns(tmp_path):
    """A bf16-autocast phase keeps fp32 master weights and still lowers the loss."""
    from adaserve.train import trainer

    cfg = trainer.hf_config(trainer.SMOKE_TARGET_SPEC, 64, 0)
    model = trainer.build_model(cfg, 0)
    stream = torch.arange(4000) % 7  # a periodic sequence any model can learn
    windows = trainer.eval_windows(stream, 32, 4)
    before = trainer.heldout_loss(model, windows)
    pc = trainer.PhaseConfig("p", 3.0, 4, 32, 3e-3, bf16=True, ckpt_every_s=100)
    summary = trainer.train_phase(model, stream, pc, tmp_path, 0, progress_bar=False)
    assert summary["bf16_autocast"] is True
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert trainer.heldout_loss(model, windows) < 0.5 * before


def test_corpus_split_is_stable_and_disjoint():
    files = corpus.list_files()
    assert files == sorted(files)
    assert not any(part in corpus.EXCLUDED_DIRS for f in files for part in f.split("/")[:-1])
    held = [f for f in files if corpus.is_heldout(f)]
    assert 0 < len(held) < len(files) // 10
    assert corpus.is_heldout(held[0]) and corpus.is_heldout(held[0])


def test_smoke_run_writes_loadable_pair(smoke_pair):
    stats_file = json.loads((smoke_pair / "pair_stats.json").read_text())
    assert 0.0 <= stats_file["greedy_agreement"] <= 1.0
    assert len(stats_file["acceptance_by_rank"]) == 8
    assert len(stats_file["acceptance_by_depth"]) == 8
    # agreement per 32-token block of the continuation averages to the overall agreement
    n, by_pos = stats_file["new_tokens"], stats_file["agreement_by_position"]
    sizes = [min(32, n - i) for i in range(0, n, 32)]
    assert len(by_pos) == len(sizes)
    mean = sum(a * s for a, s in zip(by_pos, sizes)) / n
    assert mean == pytest.approx(stats_file["greedy_agreement"], abs=1e-6)
    # agreement after a miss, from the same counts: over R continuations of n tokens,
    # hits after a miss = hits at positions >= 1 - hit pairs, misses before the last
    # position = (n - 1) R - hits + hits at the last position. The first and last
    # positions' hits are unknown (0..R each), so the value is bounded exactly; a loose
    # tolerance on the ratio instead was flaky (dividing by the miss rate amplifies the
    # edges: 0.6 against an estimate of 0.07 with 16 tokens and an agreement of 0.92).
    g, two = stats_file["greedy_agreement"], stats_file["acceptance_by_depth"][1]
    R = stats_file["num_prompts"]
    hits, pairs = round(g * n * R), round(two * (n - 1) * R)  # counts, from float32 means
    lo_num, hi_num = max(0, hits - R - pairs), hits - pairs
    lo_den, hi_den = (n - 1) * R - hits, (n - 1) * R - hits + R
    if lo_den > 0:
        after = stats_file["agreement_after_miss"]
        assert lo_num / hi_den - 1e-9 <= after <= min(1.0, hi_num / lo_den) + 1e-9
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    for role in ("target", "draft"):
        d = smoke_pair / role
        for name in (
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "generation_config.json",
            "README.md",
        ):
            assert (d / name).is_file(), name
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["architectures"] == ["LlamaForCausalLM"]
        assert (
            json.loads((d / "generation_config.json").read_text())["eos_token_id"]
            == cfg["eos_token_id"]
        )
        assert json.loads((d / "tokenizer_config.json").read_text())["eos_token"] == EOS_TOKEN
        assert _max_logit_diff(d, ids) <= 1e-4
        out = _hf(d).generate(ids[:1, :8], max_new_tokens=6, do_sample=False)
        assert out.shape[1] > 8


def test_smoke_tokenizer_round_trips(smoke_pair):
    tok = load_tokenizer(smoke_pair / "target")
    text = "class A:\n    def f(self, x):\n\t\treturn  x  # ünïcode ✓\n\n\n"
    assert tok.decode(tok.encode(text).ids) == text
    hf_tok = transformers.AutoTokenizer.from_pretrained(smoke_pair / "target")
    assert hf_tok.eos_token == EOS_TOKEN
    chat = hf_tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("### assistant:\n")


def test_smoke_rerun_resumes_from_checkpoints(smoke_pair):
    before = (smoke_pair / "draft" / "model.safetensors").read_bytes()
    argv = ["--out", str(smoke_pair), "--smoke", "--minutes", "0.05", "--no-progress"]
    assert cli.main(argv) == 0
    assert (smoke_pair / "draft" / "model.safetensors").read_bytes() == before


def test_shipped_pair_matches_transformers():
    ids = _heldout_prompts(DEFAULT_TARGET, 4, 64)
    assert _max_logit_diff(DEFAULT_TARGET, ids) <= 1e-4
    assert _max_logit_diff(DEFAULT_DRAFT, ids) <= 1e-4
    total = sum(f.stat().st_size for d in (DEFAULT_TARGET, DEFAULT_DRAFT) for f in d.iterdir())
    assert total <= 50 * 1024 * 1024
    assert json.loads(DEFAULT_STATS.read_text())["greedy_agreement"] > 0.5


def test_shipped_draft_agrees_with_target():
    prompts = _heldout_prompts(DEFAULT_TARGET, 8, 64)
    target, draft = load_model(DEFAULT_TARGET), load_model(DEFAULT_DRAFT)
    res = stats.pair_stats(target, draft, prompts, new_tokens=32)
    assert res["greedy_agreement"] > 0.5
    depth = res["acceptance_by_depth"]
    assert all(a >= b for a, b in zip(depth, depth[1:]))
