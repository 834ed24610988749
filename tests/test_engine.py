"""Engine foundation: greedy equality with transformers, sampling, preemption, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_prompts

from adaserve import LLM, SamplingParams
from adaserve.errors import InvalidRequestError, PromptTooLongError


def hf_greedy(hf, prompts, n):
    out = []
    for p in prompts:
        g = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)
        out.append(g[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def ar_llm(tiny_pair):
    target, _, _ = tiny_pair
    return LLM(model=str(target), no_draft=True, policy="ar", kv_cache_bytes=16 << 20)


def test_greedy_batch_equals_transformers(tiny_pair, ar_llm):
    _, _, hf = tiny_pair
    prompts = random_prompts(24, seed=1, lo=2, hi=120)
    outs = ar_llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    ref = hf_greedy(hf, prompts, 16)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert all(o.outputs[0].text is None for o in outs)  # no tokenizer in the tiny model


def test_chunked_prefill_gives_same_greedy_output(tiny_pair):
    target, _, hf = tiny_pair
    llm = LLM(
        model=str(target),
        no_draft=True,
        policy="ar-chunked",
        max_prefill_tokens=16,
        kv_cache_bytes=16 << 20,
    )
    prompts = random_prompts(8, seed=2, lo=30, hi=100)
    assert [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8))
    ] == hf_greedy(hf, prompts, 8)


def test_preemption_under_tiny_pool_completes_with_same_output(tiny_pair):
    target, _, hf = tiny_pair
    # 2-layer, 2 kv heads x 16 dims, float32 -> 512 B/token; 24 blocks of 16 tokens
    llm = LLM(
        model=str(target),
        no_draft=True,
        policy="ar",
        kv_cache_bytes=512 * 16 * 24,
        max_prefill_tokens=64,
    )
    prompts = random_prompts(12, seed=3, lo=40, hi=80)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    assert llm.engine.counters.preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, prompts, 24)
    alloc = llm.engine.allocator
    assert alloc.num_free == alloc.num_blocks


def test_seeded_sampling_is_reproducible(ar_llm):
    prompts = random_prompts(6, seed=4)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=123)
    a = [o.outputs[0].token_ids for o in ar_llm.generate(prompts, sp)]
    b = [o.outputs[0].token_ids for o in ar_llm.generate(prompts[::-1], sp)][
        ::-1
    ]  # other batch order
    assert a == b
    c = [
        o.outputs[0].token_ids
        for o in ar_llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=12, seed=7))
    ]
    assert a != c


def test_stop_token_and_max_tokens(ar_llm):
    p = random_prompts(1, seed=5)[0]
    full = ar_llm.generate([p], SamplingParams(temperature=0.0, max_tokens=10))[0].token_ids
    stop_at = full[4]
    first = full.index(stop_at)
    out = ar_llm.generate(
        [p], SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=(stop_at,))
    )[0]
    assert out.outputs[0].token_ids == full[: first + 1] and out.outputs[0].finish_reason == "stop"
    out = ar_llm.generate([p], SamplingParams(temperature=0.0, max_tokens=3))[0]
    assert out.outputs[0].token_ids == full[:3] and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-5), "max_tokens"),
        (dict(seed=-1), "seed"),
        (dict(temperature=float("nan")), "temperature"),
    ],
)
def test_invalid_sampling_parameters(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_prompt_errors(ar_llm):
    with pytest.raises(PromptTooLongError):
        ar_llm.generate([[1] * 600])  # context is 512
    with pytest.raises(InvalidRequestError, match="token ids"):
        ar_llm.generate([[VOCAB + 5]])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        ar_llm.generate(["text needs a tokenizer"])
    with pytest.raises(InvalidRequestError, match="empty"):
        ar_llm.generate([[]])
