"""The ``adaserve`` command line as a user meets it (real subprocesses, run side by
side): every bad flag value is one line on stderr and a non-zero exit, never a
traceback; ``--version``; a closed pipe on stdout; what ``generate`` says and prints
without ``--draft`` and with ``--logprobs``; byte sizes and ports parsed once for all
commands."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from adaserve.util.cli_args import byte_size, human_int, parse_byte_size, port

# (argv, text the one error line must contain)
BAD = [
    (["serve", "--port", "99999"], "--port: port 99999 is not in [0, 65535]"),
    (["serve", "--kv-cache-bytes", "-5"], "--kv-cache-memory-bytes: bad size '-5'"),
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs: must be at least 1"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["serve", "--max-model-len", "lots"], "--max-model-len"),
    (["serve", "a", "--model", "b"], "the model is given twice"),
    (["serve", "--chat-template", "/no/such/template.jinja"], "--chat-template"),
    (["serve", "--generation-config", "/no/such/dir"], "--generation-config"),
    (["serve", "--api-key", ","], "--api-key: no key given"),
    (["serve", "--max-model-len", "99999"], "max_position_embeddings=2048"),
    (["bench", "serve", "--kv-cache-bytes", "lots"], "--kv-cache-bytes"),
    (["generate", "--prompt", "x", "--max-tokens", "0"], "--max-tokens"),
    (["serve", "--tensor-parallel-size", "2"], "tensor parallelism is not implemented"),
    (["serve", "--speculative-config", "{bad"], "--speculative-config is not JSON"),
    (
        ["serve", "--speculative-config", '{"method": "ngram", "model": "x"}'],
        "method 'ngram' is not supported",
    ),
    (["serve", "--speculative-config", '{"method": "draft_model"}'], 'needs "model"'),
    (["serve", "--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["serve", "--usage-db", "mysql://x/y"], "--usage-db: usage.db: unknown scheme 'mysql'"),
    (["usage", "--since", "soon"], "bad time 'soon'"),
    ([], "required: COMMAND"),
]


def _spawn(argv, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **kw.pop("env", {}))
    return subprocess.Popen(
        [sys.executable, "-m", "adaserve", *argv],
        stdout=kw.pop("stdout", subprocess.PIPE),
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        **kw,
    )


def test_every_bad_flag_value_is_one_line_and_a_nonzero_exit():
    procs = [(argv, want, _spawn(argv)) for argv, want in BAD]  # side by side
    for argv, want, p in procs:
        out, err = p.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert p.returncode != 0, (argv, out, err)
        assert len(lines) == 1 and "Traceback" not in err, (argv, err)
        assert want in lines[0], (argv, lines[0])
        assert lines[0].startswith("adaserve"), (argv, lines[0])


def test_version_and_a_closed_stdout():
    p = _spawn(["--version"])
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and out.strip().startswith("adaserve ") and not err
    # ``adaserve simulate --list-presets | head -0``: the reader is gone before anything
    # is written
    r, w = os.pipe()
    os.close(r)
    p = _spawn(["simulate", "--list-presets"], stdout=w)
    os.close(w)
    _, err = p.communicate(timeout=300)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert p.returncode == 141  # as a command killed by SIGPIPE


def test_generate_without_draft_says_so_and_prints_logprobs(tiny_pair, tmp_path):
    target, _, _ = tiny_pair
    env = {"ADASERVE_CACHE": str(tmp_path)}
    p = _spawn(
        ["generate", "--model", str(target), "--prompt", "5 6 7", "--token-ids"]
        + ["--max-tokens", "4", "--logprobs", "2", "--policy", "ar"],
        env=env,
    )
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err
    assert "speculation is off" in err and "--draft" in err
    lines = out.strip().splitlines()
    ids = lines[0].split()
    assert len(ids) == 4
    rows = [ln.split("\t") for ln in lines[1:] if not ln.startswith("#")]
    assert [r[1] for r in rows] == ids  # one row per generated token, its id
    for r in rows:
        assert float(r[2]) <= 0 and len(r[3].split()) == 2  # logprob, the top 2
        assert max(float(x.split(":")[1]) for x in r[3].split()) >= float(r[2])


def test_value_parsers():
    assert parse_byte_size("512M") == 512 << 20 == byte_size("512MiB") == byte_size("512mb")
    assert parse_byte_size("2GiB") == 2 << 30 and parse_byte_size("1.5k") == 1536
    assert parse_byte_size("268435456") == 268435456
    for bad in ("", "-1", "1.5.2G", "M", "0", "0.2", "3 GiBs"):
        with pytest.raises(ValueError):
            parse_byte_size(bad)
    assert human_int("4k") == 4000 and human_int("4K") == 4096 and human_int("2048") == 2048
    assert port("0") == 0 and port("65535") == 65535
    for bad in ("-1", "65536", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            port(bad)


def _configs(argv, env=None, monkeypatch=None):
    from adaserve.server.cli import add_arguments, build_configs

    p = argparse.ArgumentParser()
    add_arguments(p)
    return build_configs(p.parse_args(argv))


def test_vllm_launch_flags_map_onto_ours(monkeypatch):
    """What vLLM scripts pass: -tp 1, --trust-remote-code, --speculative-config (a
    draft and the chain policy; an explicit --policy wins), aliases in
    --served-model-name, --no-admission, $VLLM_API_KEY, --uvicorn-log-level."""
    monkeypatch.delenv("ADASERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    spec = '{"method": "draft_model", "model": "/d", "num_speculative_tokens": 3}'
    e, s = _configs(["-tp", "1", "--trust-remote-code", "--speculative-config", spec])
    assert e.draft == "/d" and e.policy == "spec-chain:3"
    e, _ = _configs(["--speculative-config", spec, "--policy", "adaserve"])
    assert e.draft == "/d" and e.policy == "adaserve"
    e, _ = _configs(["--draft", "/d"])
    assert e.policy == "adaserve"  # a draft alone keeps the adaserve policy
    _, s = _configs(["--served-model-name", "main", "alias-a", "alias-b"])
    assert s.model_name == "main" and s.model_aliases == ("alias-a", "alias-b")
    # without it, the model id is the path as given (vLLM's), its basename an alias
    e, s = _configs(["models/tiny-llama/", "--no-draft"])
    assert e.model == "models/tiny-llama/"
    assert s.model_name == "models/tiny-llama/" and s.model_aliases == ("tiny-llama",)
    _, s = _configs(["--model", "tiny", "--no-draft"])
    assert s.model_name == "tiny" and s.model_aliases == ()
    _, s = _configs([])  # the shipped pair
    assert s.model_name is None
    e, s = _configs(["--no-admission"])
    assert s.admission is False and e.admission is False
    e, s = _configs(["--admission"])
    assert s.admission is True and e.admission is True
    monkeypatch.setenv("VLLM_API_KEY", "vk-1")
    _, s = _configs([])
    assert [t.name for t in s.tenants] and all(t.admin for t in s.tenants)
    p = argparse.ArgumentParser()
    from adaserve.server.cli import add_arguments

    add_arguments(p)
    assert p.parse_args(["--uvicorn-log-level", "trace"]).uvicorn_log_level == "trace"


def test_offline_llm_takes_vllm_arguments(tiny_pair):
    from adaserve import LLM
    from adaserve.errors import InvalidRequestError

    target, _, _ = tiny_pair
    with pytest.raises(InvalidRequestError, match="tensor parallelism"):
        LLM(model=str(target), no_draft=True, policy="ar", tensor_parallel_size=2)
    llm = LLM(model=str(target), no_draft=True, policy="ar", tensor_parallel_size=1,
              trust_remote_code=True)  # fmt: skip
    assert llm.get_tokenizer() is llm.tokenizer
