"""Model runtime: logits equal transformers', tree masks, loading errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, save_tiny

from adaserve.core.tree import ancestor_mask
from adaserve.errors import ModelLoadError
from adaserve.kv.cache import KVCache
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.loader import load_model

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CASES = {
    "llama-gqa-tied-rope3": ("llama", dict(tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)),
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4, rope_theta=500000.0)),
    "qwen2-bias-gqa": ("qwen2", dict(tie_word_embeddings=True)),
    "mistral-gqa": ("mistral", dict(sliding_window=4096)),
}


def paged_logits(model, seqs_tokens, cache_slots=2048):
    """Run sequences as one ragged paged batch (each in its own slot range)."""
    cfg = model.cfg
    kv = KVCache(cfg, cache_slots, torch.device("cpu"), torch.float32)
    specs, ids, base = [], [], 0
    for toks in seqs_tokens:
        n = len(toks)
        specs.append(SeqSpec([], list(range(base, base + n)), list(range(n))))
        ids.extend(toks)
        base += n
    meta = AttnMetadata.build(specs, torch.device("cpu"), cfg.sliding_window)
    with torch.inference_mode():
        return model.logits(model(torch.tensor(ids), meta, kv.layers))


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(tmp_path, case):
    arch, over = CASES[case]
    hf = save_tiny(tmp_path, arch=arch, seed=3, **over)
    ours = load_model(tmp_path)
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (3, 50))
    with torch.no_grad():
        ref = hf(ids).logits
    dense = ours.forward_dense(ids)
    assert (dense - ref).abs().max().item() <= 1e-4
    # ragged paged batch of different lengths, incl. positions past rope's original 32
    lens = [50, 7, 33]
    got = paged_logits(ours, [ids[i, :n].tolist() for i, n in enumerate(lens)])
    off = 0
    for i, n in enumerate(lens):
        assert (got[off : off + n] - ref[i, :n]).abs().max().item() <= 1e-4
        off += n


def test_tree_masked_forward_equals_sequential_paths(tmp_path):
    save_tiny(tmp_path, seed=5)
    m = load_model(tmp_path)
    prefix = [5, 17, 33, 2, 9, 100]
    #        0   1   2   3   4   5   6
    parents = [0, 0, 0, 1, 1, 2, 3]  # node 0 = root (last prefix token)
    tokens = [prefix[-1], 40, 41, 42, 43, 44, 45]
    depth = [0, 1, 1, 2, 2, 2, 3]
    kv = KVCache(m.cfg, 256, torch.device("cpu"), torch.float32)
    C = len(prefix)
    with torch.inference_mode():
        meta = AttnMetadata.build([SeqSpec([], list(range(C - 1)), list(range(C - 1)))], "cpu")
        m(torch.tensor(prefix[:-1]), meta, kv.layers)
        spec = SeqSpec(
            list(range(C - 1)),
            list(range(C - 1, C - 1 + len(tokens))),
            [C - 1 + d for d in depth],
            new_mask=torch.from_numpy(ancestor_mask(__import__("numpy").array(parents))),
        )
        tree_logits = m.logits(
            m(torch.tensor(tokens), AttnMetadata.build([spec], "cpu"), kv.layers)
        )
    # each root-to-leaf path run as a plain sequence
    for leaf in (4, 5, 6):
        path, n = [], leaf
        while n != 0:
            path.append(n)
            n = parents[n]
        path = [0] + path[::-1]
        seq = prefix[:-1] + [tokens[i] for i in path]
        ref = m.forward_dense(torch.tensor([seq]))[0, C - 1 :]
        for j, node in enumerate(path):
            assert (tree_logits[node] - ref[j]).abs().max().item() <= 1e-4


def test_unsupported_architecture_is_named(tmp_path):
    save_tiny(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(tmp_path)


def test_missing_and_corrupt_weights(tmp_path):
    save_tiny(tmp_path)
    w = tmp_path / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="cannot read weight file"):
        load_model(tmp_path)
    w.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_config_weight_shape_mismatch(tmp_path):
    save_tiny(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="shape mismatch"):
        load_model(tmp_path)


def test_sharded_checkpoint_loads(tmp_path):
    hf = save_tiny(tmp_path / "full", seed=2)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a, b = load_model(tmp_path / "full"), load_model(tmp_path / "sharded")
    ids = torch.arange(20).unsqueeze(0)
    assert torch.equal(a.forward_dense(ids), b.forward_dense(ids))


def test_folded_grouped_query_attention_equals_the_native_kernel():
    """The CUDA layout (query heads folded into rows, no GQA flag) computes the same
    attention as the kernel's own GQA, over padded groups of trees, decodes and a
    prefill chunk."""
    import numpy as np

    from adaserve.models.attention import paged_attention

    torch.manual_seed(1)
    H, Hkv, D, slots = 8, 2, 16, 512
    k_cache, v_cache = torch.randn(slots, Hkv, D), torch.randn(slots, Hkv, D)
    tree = np.array([0, 0, 0, 1, 2])
    specs, base = [], 0
    for ctx, q, mask in ((40, 48, None), (9, 5, ancestor_mask(tree)), (20, 3, None), (7, 1, None)):
        specs.append(
            SeqSpec(
                list(range(base, base + ctx)),
                list(range(base + ctx, base + ctx + q)),
                list(range(ctx, ctx + q)),
                new_mask=mask,
            )
        )
        base += ctx + q
    meta = AttnMetadata.build(specs, torch.device("cpu"))
    assert any(g.valid.numel() < g.tok_idx.numel() for g in meta.groups)  # padded rows
    q = torch.randn(sum(len(s.new_slots) for s in specs), H, D)
    native = paged_attention(q, k_cache, v_cache, meta.groups, D**-0.5, fold=False)
    folded = paged_attention(q, k_cache, v_cache, meta.groups, D**-0.5, fold=True)
    assert (native - folded).abs().max().item() <= 1e-5


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_half_on_cuda():
    """``dtype="auto"`` (the default, as vLLM's): CPU keeps float32; on CUDA a bf16 or
    float32 checkpoint runs in bfloat16 and a float16 one in float16."""
    from adaserve.models.loader import resolve_dtype

    assert resolve_dtype("auto", "cpu", "bfloat16") == torch.float32
    assert resolve_dtype("auto", "cuda", "bfloat16") == torch.bfloat16
    assert resolve_dtype("auto", "cuda:1", None) == torch.bfloat16
    assert resolve_dtype("auto", "cuda", "float32") == torch.bfloat16
    assert resolve_dtype("auto", "cuda", "float16") == torch.float16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="auto, float32"):
        resolve_dtype("float8", "cpu")


def test_checkpoint_dtype_is_read_from_either_config_key(tmp_path):
    from adaserve.models.config import ModelConfig

    save_tiny(tmp_path, seed=0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert ModelConfig.from_dir(tmp_path).extra["torch_dtype"] == "float32"
    for key in ("torch_dtype", "dtype"):
        cfg.pop("torch_dtype", None), cfg.pop("dtype", None)
        cfg[key] = "float16"
        assert ModelConfig.from_dict(cfg).extra["torch_dtype"] == "float16"
