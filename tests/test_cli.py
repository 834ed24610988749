"""CLI: generate --json, clear errors with non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

from adaserve import LLM, SamplingParams


def adaserve(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "adaserve", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_generate_json_with_token_ids(tiny_pair, tmp_path):
    target, draft, _ = tiny_pair
    import os

    env = dict(os.environ, ADASERVE_CACHE=str(tmp_path))
    r = adaserve(
        "generate",
        "--model",
        str(target),
        "--draft",
        str(target),
        "--policy",
        "spec-chain:3",
        "--prompt",
        "5 6 7 8",
        "--token-ids",
        "--max-tokens",
        "9",
        "--json",
        env=env,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out["stats"]) >= {"steps", "drafted_tokens", "accepted_tokens", "tokens_per_step"}
    assert len(out["token_ids"]) == 9 and out["text"] is None
    assert out["stats"]["accepted_tokens"] > 0  # the target drafts for itself
    assert out["logprobs"] is None  # not asked
    ref = LLM(model=str(target), no_draft=True, policy="ar").generate(
        [[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=9)
    )
    assert out["token_ids"] == ref[0].outputs[0].token_ids


def test_cli_errors_are_one_line_and_nonzero(tiny_pair, tmp_path):
    target, _, _ = tiny_pair
    r = adaserve("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = adaserve("generate", "--model", str(target), "--no-draft", "--prompt", "x")
    assert r.returncode == 2 and "no tokenizer" in r.stderr
    r = adaserve(
        "generate",
        "--model",
        str(target),
        "--no-draft",
        "--prompt",
        "1 2",
        "--token-ids",
        "--temperature",
        "-3",
    )
    assert r.returncode == 2 and "temperature" in r.stderr
    r = adaserve(
        "generate", "--model", str(target), "--policy", "nonsense", "--prompt", "1", "--token-ids"
    )
    assert r.returncode == 2 and "policy" in r.stderr


def test_bfloat16_runs(tiny_pair):
    target, _, _ = tiny_pair
    llm = LLM(
        model=str(target), no_draft=True, policy="ar", dtype="bfloat16", kv_cache_bytes=8 << 20
    )
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert len(out.outputs[0].token_ids) == 5
    assert llm.engine.kv_target.layers[0][0].dtype.is_floating_point
    assert str(llm.engine.kv_target.layers[0][0].dtype) == "torch.bfloat16"


def test_profile_of_random_weight_shapes_needs_only_configs(tmp_path):
    """``adaserve profile --random-weights`` times models given by config.json alone (how
    an 8B-shaped pair is profiled on a GPU without its checkpoints); ``--shapes`` names
    the simulator's model table, and bad names or mixed options are one-line errors."""
    from adaserve.sim.roofline import ModelSpec

    dirs = {}
    specs = {
        "t": ModelSpec("tiny-t", 2, 64, 4, 2, 128, 512),
        "d": ModelSpec("tiny-d", 1, 32, 4, 2, 64, 512, tie_embeddings=True),
    }
    for name, spec in specs.items():
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        (dirs[name] / "config.json").write_text(json.dumps(spec.hf_config()))
    r = adaserve(
        "generate", "--model", str(dirs["t"]), "--no-draft", "--prompt", "1", "--token-ids"
    )
    assert r.returncode == 2 and "safetensors" in r.stderr
    out = tmp_path / "p.json"
    r = adaserve(
        "profile", "--model", str(dirs["t"]), "--draft", str(dirs["d"]), "--random-weights",
        "--reps", "1", "--out", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    prof = json.loads(out.read_text())
    assert prof["random_weights"] is True and prof["gpu"] is None
    assert prof["target"]["params"] == specs["t"].params
    assert len(prof["draft_step"]["latency_ms"]) == len(prof["draft_step"]["tokens"])
    assert all(ms > 0 for ms in prof["verify"]["latency_ms"])
    for bad, msg in (("Llama-9B", "unknown model shape"), ("a:b:c", "TARGET:DRAFT")):
        r = adaserve("profile", "--shapes", bad, "--out", str(tmp_path / "x.json"))
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
    r = adaserve("profile", "--shapes", "Llama-3.2-1B", "--model", str(dirs["t"]), "--out", "x")
    assert r.returncode == 2 and "not both" in r.stderr
    # a model that cannot fit is refused before anything is allocated
    r = adaserve("profile", "--shapes", "Llama-3.1-70B", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2 and "GiB in float32; available RAM is" in r.stderr


def test_gpu_check_script_compares_speculative_and_autoregressive_output(tmp_path):
    """``benchmarks/gpu_check.py`` (run on a GPU by benchmarks/gpu_run.sh) on the CPU:
    the shipped pair's speculative output equals the autoregressive one. A static tree,
    so that it speculates on every step however busy the machine (adaserve rightly
    declines to speculate where its measured profile says drafting costs more than it
    gains, and a busy CI machine measures such a profile)."""
    import pathlib

    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "gpu_check.py"
    out = tmp_path / "c.json"
    r = subprocess.run(
        [
            sys.executable,
            str(script),
            "--device",
            "cpu",
            "--max-tokens",
            "12",
            "--policy",
            "spec-tree:3x2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert res["identical_outputs"] == res["prompts"] == 8
    assert res["policy"] == "spec-tree:3x2"
    assert max(res["speculative"]["tokens_per_step"]) > 1.0  # it did speculate


def test_generate_json_with_logprobs(tiny_pair, tmp_path):
    import os

    target, _, _ = tiny_pair
    env = dict(os.environ, ADASERVE_CACHE=str(tmp_path))
    r = adaserve(
        "generate", "--model", str(target), "--no-draft", "--prompt", "5 6 7", "--token-ids",
        "--max-tokens", "4", "--json", "--logprobs", "2", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    lps = out["logprobs"]
    assert [x["token_id"] for x in lps] == out["token_ids"]
    for x in lps:  # greedy: each token is its position's most likely one
        assert len(x["top"]) == 2 and x["top"][0][0] == x["token_id"]
        assert x["logprob"] == x["top"][0][1] and x["top"][1][1] <= x["logprob"] <= 0
    r = adaserve("generate", "--prompt", "x", "--logprobs", "21", env=env)
    assert r.returncode == 2 and "logprobs" in r.stderr
