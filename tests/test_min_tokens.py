"""``min_tokens`` (vLLM's): no EOS / stop token before that many output tokens, and the
output is the same with and without speculation (the target's logits are masked at
every tree depth below it, so a drafted stop token is rejected, not accepted)."""

from __future__ import annotations

import pytest
from conftest import random_prompts

from adaserve import LLM, SamplingParams
from adaserve.errors import InvalidRequestError

KV = 8 << 20


@pytest.fixture(scope="module")
def engines(tiny_pair):
    target, draft, _ = tiny_pair
    return {
        "ar": LLM(model=str(target), no_draft=True, policy="ar", kv_cache_bytes=KV),
        # the target drafting for itself: its unmasked proposals include the stop token
        "self": LLM(model=str(target), draft=str(target), policy="spec-chain:4", kv_cache_bytes=KV),
        "tree": LLM(model=str(target), draft=str(draft), policy="spec-tree", kv_cache_bytes=KV),
    }


def test_min_tokens_holds_back_stop_tokens_and_stays_lossless(engines):
    prompts = random_prompts(4, seed=5)
    base = engines["ar"].generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )
    # each prompt's stop id: the token its greedy output has at index 2
    stops = [o.token_ids[2] for o in base]
    early = [SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(s,)) for s in stops]
    held = [
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(s,), min_tokens=6)
        for s in stops
    ]
    for name in ("ar", "self"):
        outs = engines[name].generate(prompts, early)
        for o, s in zip(outs, stops):
            assert o.finish_reason == "stop" and len(o.token_ids) <= 3 and o.token_ids[-1] == s
    ref = engines["ar"].generate(prompts, held)
    for o, s in zip(ref, stops):
        assert s not in o.token_ids[:6]  # masked below min_tokens
        assert len(o.token_ids) > 6 or o.finish_reason == "length"
    for name in ("self", "tree"):
        outs = engines[name].generate(prompts, held)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref], name
        assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref], name
    assert sum(o.metrics["accepted_tokens"] for o in outs) >= 0
    # seeded sampling: the same tokens with and without speculation too
    seeded = [
        SamplingParams(
            max_tokens=10, temperature=1.0, seed=7 + i, stop_token_ids=(s,), min_tokens=5
        )
        for i, s in enumerate(stops)
    ]
    a = engines["ar"].generate(prompts, seeded)
    b = engines["self"].generate(prompts, seeded)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for o, s in zip(a, stops):
        assert s not in o.token_ids[:5]


def test_min_tokens_is_validated():
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(temperature=0.0, max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(temperature=0.0, min_tokens=-1)
