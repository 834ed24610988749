"""Workload generation: reproducibility, arrival statistics, classes, shifts, datasets."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from adaserve.bench.arrivals import gamma_arrivals, load_trace, trace_path
from adaserve.bench.datasets import is_heldout_path
from adaserve.bench.workload import build_workload
from adaserve.bench.workload_spec import (
    LengthDist,
    Shift,
    WorkloadError,
    WorkloadSpec,
    parse_class_mix,
    parse_length,
    parse_length_overrides,
    parse_shift,
    strict_share_mix,
)

V = 320


def _items(spec, **kw):
    return [dataclasses.asdict(i) for i in build_workload(spec, vocab_size=V, **kw)]


def test_same_seed_same_workload_and_other_seed_differs():
    spec = WorkloadSpec(seed=7, request_rate=5, duration_s=20)
    a, b = _items(spec), _items(spec)
    assert a == b and len(a) > 50
    c = _items(dataclasses.replace(spec, seed=8))
    assert [x["arrival_s"] for x in c] != [x["arrival_s"] for x in a]
    # changing the dataset does not move the arrivals or classes (independent streams)
    d = _items(dataclasses.replace(spec, dataset="random"))
    assert [(x["arrival_s"], x["cls"]) for x in d] == [(x["arrival_s"], x["cls"]) for x in a]


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_rate_and_burstiness(burstiness):
    rng = np.random.default_rng(0)
    t = gamma_arrivals(rng, 10.0, burstiness, None, 20000)
    gaps = np.diff(np.concatenate(([0.0], t)))
    assert abs(gaps.mean() - 0.1) / 0.1 < 0.04
    cv = gaps.std() / gaps.mean()
    assert abs(cv - 1 / math.sqrt(burstiness)) / (1 / math.sqrt(burstiness)) < 0.06


def test_duration_and_num_prompts_limits():
    spec = WorkloadSpec(seed=1, request_rate=20, duration_s=30, dataset="random")
    items = build_workload(spec, vocab_size=V)
    assert all(i.arrival_s < 30 for i in items)
    assert abs(len(items) - 600) < 4 * math.sqrt(600)
    items = build_workload(dataclasses.replace(spec, num_prompts=17), vocab_size=V)
    assert len(items) == 17
    inf = WorkloadSpec(request_rate=math.inf, duration_s=None, num_prompts=5, dataset="random")
    assert [i.arrival_s for i in build_workload(inf, vocab_size=V)] == [0.0] * 5


def test_class_mix_lengths_and_mix_shift():
    spec = WorkloadSpec(
        seed=3,
        request_rate=50,
        duration_s=40,
        dataset="random",
        input_len=(
            ("interactive", LengthDist("uniform", 5, 9)),
            ("*", LengthDist("fixed", 12, 12)),
        ),
        output_len=(("*", LengthDist("fixed", 7, 7)),),
        shifts=(parse_shift("20:interactive:0.1,batch:0.9"),),
    )
    items = build_workload(spec, vocab_size=V)
    early = [i for i in items if i.arrival_s < 20]
    late = [i for i in items if i.arrival_s >= 20]
    share = sum(i.cls == "interactive" for i in early) / len(early)
    assert abs(share - 0.6) < 0.05
    assert {i.cls for i in late} == {"interactive", "batch"}
    assert abs(sum(i.cls == "batch" for i in late) / len(late) - 0.9) < 0.04
    for i in items:
        assert i.max_tokens == 7
        assert len(i.prompt_ids) == i.prompt_len
        assert (5 <= i.prompt_len <= 9) if i.cls == "interactive" else i.prompt_len == 12
        assert all(1 <= t < V - 1 for t in i.prompt_ids)


def test_rate_shift_changes_density():
    spec = WorkloadSpec(seed=2, request_rate=5, duration_s=100, shifts=(parse_shift("50:rate:20"),))
    items = build_workload(dataclasses.replace(spec, dataset="random"), vocab_size=V)
    n1 = sum(i.arrival_s < 50 for i in items)
    n2 = len(items) - n1
    assert abs(n1 - 250) < 4 * math.sqrt(250) and abs(n2 - 1000) < 4 * math.sqrt(1000)


def test_class_peaks_each_class_peaks_at_a_different_time():
    spec = WorkloadSpec(seed=0, request_rate=40, duration_s=90, dataset="random", class_peaks=True)
    items = build_workload(spec, vocab_size=V)
    peaks = {}
    for c in ("interactive", "chat", "batch"):
        hist, edges = np.histogram(
            [i.arrival_s for i in items if i.cls == c], bins=6, range=(0, 90)
        )
        peaks[c] = int(np.argmax(hist))
    assert peaks["interactive"] < peaks["chat"] < peaks["batch"]


def test_parsers():
    assert parse_class_mix("a:3,b:1") == (("a", 0.75), ("b", 0.25))
    for bad in ("", "a", "a:-1", "a:x", "a:1,a:2", "a:0"):
        with pytest.raises(WorkloadError):
            parse_class_mix(bad)
    assert parse_shift("12.5:draft-noise:2") == Shift(12.5, "draft-noise", 2.0)
    assert parse_shift("3:kv-pressure:0.5") == Shift(3.0, "kv-pressure", 0.5)
    assert parse_shift("3:rate:8").kind == "rate"
    s = parse_shift("30:interactive:0.9,batch:0.1")
    assert s.kind == "mix" and dict(s.value) == pytest.approx({"interactive": 0.9, "batch": 0.1})
    assert s.describe() == "30:interactive:0.9,batch:0.1"
    for bad in ("x:draft-noise:1", "5", "5:kv-pressure:1.5", "5:draft-noise:abc", "-1:a:1"):
        with pytest.raises(WorkloadError):
            parse_shift(bad)
    assert parse_length("64") == LengthDist("fixed", 64, 64)
    assert parse_length("8-16").max == 16
    ln = parse_length("lognormal:100:0.5:300")
    x = ln.sample(np.random.default_rng(0), 5000)
    assert x.max() <= 300 and abs(np.median(x) - 100) < 5
    table = parse_length_overrides(["20", "batch=100-200"], (("interactive", parse_length("5")),))
    assert dict(table)["interactive"].spec() == "20" and dict(table)["batch"].spec() == "100-200"
    mix = strict_share_mix((("interactive", 0.6), ("chat", 0.2), ("batch", 0.2)), 0.9)
    assert mix[0] == ("interactive", 0.9) and mix[1][1] == pytest.approx(0.05)
    with pytest.raises(WorkloadError):
        WorkloadSpec(request_rate=0)
    with pytest.raises(WorkloadError):
        WorkloadSpec(duration_s=None, num_prompts=None)


def test_stdlib_prompts_come_from_the_heldout_split():
    class CharTok:  # a stand-in tokenizer: one id per character
        def encode(self, s):
            return [ord(c) % 250 + 1 for c in s]

        def decode(self, ids):
            return "".join(chr(i - 1) for i in ids)

    spec = WorkloadSpec(seed=0, request_rate=10, num_prompts=30, duration_s=None)
    items = build_workload(spec, tokenizer=CharTok())
    for i in items:
        assert is_heldout_path(i.meta["file"])
        assert len(i.prompt_ids) == i.prompt_len
        assert i.prompt == CharTok().decode(i.prompt_ids)
    assert len({i.meta["file"] for i in items}) > 5
    # without a tokenizer: token ids derived from the same text, exact lengths
    for i in build_workload(spec, vocab_size=V):
        assert i.prompt is None and len(i.prompt_ids) == i.prompt_len


def test_sharegpt_dataset_with_per_request_slo(tmp_path):
    rows = [
        {
            "conversations": [
                {"from": "human", "value": "write a sort function " * 5},
                {"from": "gpt", "value": "x" * 200},
            ],
            "slo": {"tpot_ms": 33.0, "ttft_ms": 500},
            "slo_class": "interactive",
        },
        {
            "conversations": [
                {"from": "human", "value": "summarise this " * 20},
                {"from": "gpt", "value": "y" * 40},
            ]
        },
        {"conversations": []},  # skipped
    ]
    p = tmp_path / "sg.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in rows))
    spec = WorkloadSpec(seed=0, request_rate=10, num_prompts=20, duration_s=None, dataset=str(p))
    items = build_workload(spec, vocab_size=V)
    with_slo = [i for i in items if i.tpot_ms is not None]
    assert with_slo and all(i.tpot_ms == 33.0 and i.ttft_ms == 500 for i in with_slo)
    assert all(i.cls == "interactive" for i in with_slo)
    assert {i.max_tokens for i in with_slo} == {50}  # 200 characters / 4
    (tmp_path / "list.json").write_text(json.dumps(rows[:2]))
    spec2 = dataclasses.replace(spec, dataset=str(tmp_path / "list.json"))
    assert len(build_workload(spec2, vocab_size=V)) == 20
    with pytest.raises(WorkloadError):
        build_workload(dataclasses.replace(spec, dataset=str(tmp_path / "nope.json")), vocab_size=V)


def _azure_csv(path, times, start="2023-11-16 18:17:03"):
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for k, t in enumerate(times):
        whole = int(t)
        frac = f"{t - whole:.7f}"[2:]
        hh, mm, ss = (int(x) for x in start.split(" ")[1].split(":"))
        sec = hh * 3600 + mm * 60 + ss + whole
        clock = f"{sec // 3600:02d}:{sec % 3600 // 60:02d}:{sec % 60:02d}"
        lines.append(f"{start.split(' ')[0]} {clock}.{frac},{100 + k},{10 + k}")
    path.write_text("\n".join(lines) + "\n")


def test_azure_trace_is_rescaled_to_the_requested_rate(tmp_path):
    rng = np.random.default_rng(0)
    times = np.cumsum(rng.exponential(0.5, size=400))  # native ~2 req/s
    p = tmp_path / "trace.csv"
    _azure_csv(p, times)
    rows = load_trace(p)
    assert rows.times_s[0] == 0 and rows.context_tokens[0] == 100
    assert np.allclose(np.diff(rows.times_s), np.diff(times), atol=1e-5)
    spec = WorkloadSpec(seed=0, request_rate=8, duration_s=40, trace=str(p), dataset="random")
    items = build_workload(spec, vocab_size=V)
    assert len(items) == 320 and items[-1].arrival_s < 40
    # the pattern is the trace's: one scale factor maps trace gaps to arrival gaps
    scale = (320 / 8) / (times[320] - times[0])
    for k in (1, 5, 100, 319):
        assert items[k].arrival_s == pytest.approx((times[k] - times[0]) * scale, rel=1e-4)
    # a trace shorter than the request count is repeated
    long = dataclasses.replace(spec, request_rate=20)
    assert len(build_workload(long, vocab_size=V)) == 800
    spec_l = dataclasses.replace(
        spec, trace_lengths=True, input_len=(("*", LengthDist("uniform", 1, 105)),)
    )
    it = build_workload(spec_l, vocab_size=V)
    assert it[0].prompt_len == 100 and it[0].max_tokens == 10 and it[9].prompt_len == 105
    # one time per line works too
    q = tmp_path / "times.txt"
    q.write_text("\n".join(str(t) for t in times))
    assert len(load_trace(q).times_s) == 400


@pytest.mark.parametrize("name,rows", [("azure-code", 8819), ("azure-conv", 19366)])
def test_shipped_azure_traces_load_from_the_package(name, rows):
    # Azure LLM inference trace 2023 (CC-BY 4.0); Patel et al., Splitwise, ISCA 2024
    import adaserve

    path = trace_path(name)
    pkg = Path(adaserve.__file__).resolve().parent
    assert path.resolve().is_relative_to(pkg)  # inside the package, not beside the repo
    assert (path.parent / "LICENSE").is_file() and "Splitwise" in (
        path.parent / "README.md"
    ).read_text()
    tr = load_trace(name)
    assert len(tr.times_s) == rows and len(tr.context_tokens) == rows
    assert tr.times_s[0] == 0 and np.all(np.diff(tr.times_s) >= 0)
    assert 3000 < tr.times_s[-1] < 3700  # one hour of a production service
    spec = WorkloadSpec(seed=0, request_rate=3, duration_s=60, trace=name, dataset="random")
    items = build_workload(spec, vocab_size=V)
    assert len(items) == 180 and all(i.arrival_s < 60 for i in items)
    gaps = np.diff([i.arrival_s for i in items])
    assert gaps.std() / gaps.mean() > 1.0  # the production trace is burstier than Poisson


def test_unknown_trace_name_is_a_clear_error():
    with pytest.raises(WorkloadError, match="shipped traces are azure-conv, azure-code"):
        load_trace("azure-chat")
