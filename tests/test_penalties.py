"""Presence, frequency and repetition penalties (vLLM's semantics) and the offline API
in vLLM's shape: the penalties' arithmetic against their definition, plain decoding
against a transformers loop, greedy equivalence under chain and tree speculation,
seeded sampling, ``n``, ``use_tqdm``, ``stop_reason`` and ``LLM.chat``."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import random_prompts, ref_penalize
from server_fixtures import model_pair, templated_target

from adaserve import LLM, SamplingParams
from adaserve.core.clock import TickClock
from adaserve.errors import InvalidRequestError
from adaserve.spec_decode.logits import apply_penalties

PEN = dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.5)
NO_PEN = dict(presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0)


def test_apply_penalties_follows_the_definition():
    g = torch.Generator().manual_seed(0)
    M, V = 7, 11
    logits = 3 * torch.randn(M, V, generator=g)
    prompts = [torch.randint(0, V, (4,), generator=g).tolist() for _ in range(M)]
    outputs = [torch.randint(0, V, (i,), generator=g).tolist() for i in range(M)]
    rep = torch.rand(M, generator=g) * 2 + 0.3
    freq = torch.rand(M, generator=g) * 4 - 2
    pres = torch.rand(M, generator=g) * 4 - 2
    mask = torch.zeros(M, V, dtype=torch.bool)
    counts = torch.zeros(M, V)
    for m in range(M):
        mask[m, prompts[m]] = True
        for t in outputs[m]:
            counts[m, t] += 1
    got = apply_penalties(logits, mask, counts, rep, freq, pres)
    for m in range(M):
        sp = SamplingParams(
            temperature=0.0,
            repetition_penalty=rep[m].item(),
            frequency_penalty=freq[m].item(),
            presence_penalty=pres[m].item(),
        )
        assert torch.allclose(
            got[m], ref_penalize(logits[m], prompts[m], outputs[m], sp), atol=1e-5
        )
    # neutral penalties change nothing
    one, zero = torch.ones(M), torch.zeros(M)
    assert torch.equal(apply_penalties(logits, mask, counts, one, zero, zero), logits)


@pytest.mark.parametrize("rep", [5e-324, 1e-40, 1e-30, 1e300])
def test_extreme_repetition_penalty_keeps_a_distribution(rep):
    """A valid but extreme penalty (5e-324 rounds to 0 in float32) made seen logits
    infinite and the softmax NaN: the engine then fed an out-of-vocabulary token to
    the model (a fuzzed request answered 500). Every row stays finite and samplable."""
    from adaserve.spec_decode.logits import target_probs

    g = torch.Generator().manual_seed(1)
    M, V = 3, 9
    logits = 3 * torch.randn(M, V, generator=g)
    mask = torch.zeros(M, V, dtype=torch.bool)
    mask[0, :4] = True
    mask[1] = True  # every token seen: with a huge penalty every logit would be -inf
    counts = torch.zeros(M, V)
    r = torch.full((M,), rep, dtype=torch.float64).float()
    x = apply_penalties(logits, mask, counts, r, torch.zeros(M), torch.zeros(M))
    assert torch.isfinite(x).all()
    for temp in (1e-5, 1.0):
        p = target_probs(x, SamplingParams(temperature=temp))
        assert torch.isfinite(p).all() and torch.allclose(p.sum(-1), torch.ones(M))
        assert ((torch.multinomial(p, 1) >= 0) & (torch.multinomial(p, 1) < V)).all()


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": "1.2"}, "repetition_penalty"),
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
    ],
)
def test_bad_penalties_and_n_are_clear_errors(kw, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kw)
    assert e.value.param == param and param in str(e.value)


def _llm(target, draft=None, policy="ar", profile=None, **kw) -> LLM:
    return LLM(
        model=str(target),
        draft=str(draft) if draft else None,
        no_draft=draft is None,
        policy=policy,
        kv_cache_bytes=32 << 20,
        profile=profile,
        clock=TickClock(0.001),
        **kw,
    )


def _ids(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_plain_decoding_with_penalties_is_the_transformers_loop(tiny_pair):
    """Greedy, non-speculative, with penalties: each token is the argmax of the
    transformers model's logits penalised by the definition over prompt + output."""
    target, _, hf = tiny_pair
    prompts = random_prompts(5, seed=31, lo=3, hi=20)
    sp = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, **PEN)
    got = _ids(_llm(target), prompts, sp)
    for p, g in zip(prompts, got):
        out: list[int] = []
        with torch.no_grad():
            for _ in range(sp.max_tokens):
                row = hf(torch.tensor([p + out])).logits[0, -1].float()
                out.append(int(ref_penalize(row, p, out, sp).argmax()))
        assert g == out
    plain = _ids(
        _llm(target), prompts, SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    )
    assert sum(a != b for a, b in zip(got, plain)) >= 4  # the penalties do change it


@pytest.mark.parametrize("which", ["self", "random"])
def test_greedy_with_penalties_equals_plain_decoding_under_speculation(
    tiny_pair, profile_file, which
):
    """Chain and tree speculation with penalties give plain decoding's tokens, next to
    plain requests in the same batches; the target as its own draft, penalised the
    same way, has its chains accepted whole."""
    target, draft, _ = tiny_pair
    draft = target if which == "self" else draft
    prompts = random_prompts(16, seed=32, lo=2, hi=40)
    params = [
        SamplingParams(temperature=0.0, max_tokens=18, **PEN)
        if i % 4
        else SamplingParams(temperature=0.0, max_tokens=18)
        for i in range(len(prompts))
    ]
    ref = _ids(_llm(target), prompts, params)
    for pol in ("spec-chain:4", "spec-tree:3x2", "adaserve"):
        llm = _llm(target, draft, pol, profile=profile_file)
        assert _ids(llm, prompts, params) == ref, pol
        c = llm.engine.counters
        assert c.spec_draft_tokens > 0, pol
        if which == "self" and pol == "spec-chain:4":
            assert c.spec_accepted_tokens >= 0.9 * c.spec_draft_tokens


def test_the_draft_proposes_from_the_penalised_distribution(tiny_pair, monkeypatch):
    """Control of the draft's penalties: the target drafting for itself without them
    proposes the repeats the penalised target rejects (fewer accepted), yet the
    output is unchanged (losslessness does not depend on the draft)."""
    import adaserve.spec_decode.draft as dr

    target, _, _ = tiny_pair
    prompts = random_prompts(8, seed=33, lo=2, hi=30)
    sp = SamplingParams(temperature=0.0, max_tokens=18, **PEN)
    llm = _llm(target, target, "spec-chain:4")
    with_pen = _ids(llm, prompts, sp)
    acc = llm.engine.counters.spec_accepted_tokens / llm.engine.counters.spec_draft_tokens
    monkeypatch.setattr(dr, "_penalised", lambda logits, *a: logits)
    llm = _llm(target, target, "spec-chain:4")
    assert _ids(llm, prompts, sp) == with_pen
    c = llm.engine.counters
    assert c.spec_accepted_tokens / c.spec_draft_tokens < acc - 0.2, acc


def test_seeded_sampling_with_penalties_is_the_same_under_speculation(tiny_pair, profile_file):
    target, draft, _ = tiny_pair
    prompts = random_prompts(10, seed=34, lo=2, hi=30)
    params = [
        SamplingParams(temperature=1.0, top_k=4, max_tokens=20, seed=70 + i, **PEN)
        for i in range(len(prompts))
    ]
    ref = _ids(_llm(target), prompts, params)
    for d, pol in ((target, "spec-tree:4x2"), (draft, "adaserve")):
        llm = _llm(target, d, pol, profile=profile_file)
        assert _ids(llm, prompts, params) == ref, pol
        assert llm.engine.counters.spec_draft_tokens > 0, pol
    assert ref != _ids(_llm(target), prompts, [replace(p, **NO_PEN) for p in params])


def test_n_samples_are_seeded_choices_in_vllms_shape(tiny_pair):
    """``n``: one RequestOutput per prompt with n CompletionOutputs; with a seed,
    sample j is the single request seeded ``seed + j`` (as the server's choices)."""
    target, _, _ = tiny_pair
    llm = _llm(target)
    prompts = random_prompts(2, seed=35)
    sp = SamplingParams(temperature=1.0, max_tokens=8, seed=5, n=3, **PEN)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert len(outs) == 2
    for p, o in zip(prompts, outs):
        assert o.finished and o.prompt_token_ids == p and o.prompt is None
        assert isinstance(o.request_id, str)
        assert [c.index for c in o.outputs] == [0, 1, 2]
        singles = [llm.generate([p], replace(sp, n=1, seed=5 + j))[0] for j in range(3)]
        assert [c.token_ids for c in o.outputs] == [s.outputs[0].token_ids for s in singles]
        assert len({tuple(c.token_ids) for c in o.outputs}) == 3  # distinct samples
        assert o.token_ids == o.outputs[0].token_ids  # the aliases read outputs[0]
        assert o.metrics == o.outputs[0].metrics and o.metrics["output_tokens"] == 8
    unseeded = llm.generate(prompts[0], SamplingParams(temperature=1.0, n=2), use_tqdm=False)
    assert len(unseeded) == 1 and len(unseeded[0].outputs) == 2
    assert llm.engine.has_work() is False
    with pytest.raises(InvalidRequestError, match="one sample"):  # the engine: no silent n
        llm.engine.add_request(prompts[0], SamplingParams(temperature=0.0, n=2))


def test_use_tqdm_counts_finished_prompts(tiny_pair):
    from tqdm import tqdm

    bars = []

    class Recording(tqdm):
        def __init__(self, *a, **kw):
            kw["disable"] = False  # show even without a terminal
            kw["file"] = open("/dev/null", "w")  # noqa: SIM115 (closed below)
            super().__init__(*a, **kw)
            bars.append(self)

    target, _, _ = tiny_pair
    llm = _llm(target)
    prompts = random_prompts(5, seed=36)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, n=2), use_tqdm=Recording)
    (bar,) = bars
    bar.fp.close()
    assert bar.total == 5 and bar.n == 5 and bar.desc == "Processed prompts"


def test_stop_reason_names_the_stop_token_or_string(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    llm = _llm(target)
    prompt = "def add(a, b):"
    full = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[
        0
    ].outputs[0]
    assert full.stop_reason is None and full.finish_reason == "length"
    tok = full.token_ids[5]
    o = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[tok]))[
        0
    ].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == tok
    stop = full.text[len(full.text) // 2 :][:3]
    o = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[
        0
    ].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop and stop not in o.text


def test_chat_uses_the_servers_template(tmp_path_factory):
    """``LLM.chat`` renders with the tokenizer's template (as the server does), a
    ``chat_template`` string overrides it, ``add_generation_prompt=False`` leaves the
    assistant's opening out; several conversations give one output each."""
    from server_fixtures import CUSTOM_TEMPLATE

    target = templated_target(tmp_path_factory)
    llm = _llm(target)
    tok = llm.tokenizer
    conv = [{"role": "user", "content": "hello"}]
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    (o,) = llm.chat(conv, sp, use_tqdm=False)
    assert o.prompt == "<user>hello</user><assistant>"
    assert o.prompt_token_ids == tok.encode(tok.apply_chat_template(conv))
    assert len(o.outputs[0].token_ids) == 3
    o = llm.chat(conv, sp, chat_template="{{ messages[0]['content'] }}!", use_tqdm=False)[0]
    assert o.prompt == "hello!"
    o = llm.chat(conv, sp, add_generation_prompt=False, use_tqdm=False)[0]
    assert o.prompt == "<user>hello</user>"
    two = llm.chat([conv, conv + [{"role": "assistant", "content": "hi"}]], sp, use_tqdm=False)
    assert [x.prompt for x in two] == [
        "<user>hello</user><assistant>",
        "<user>hello</user><assistant>hi</assistant><assistant>",
    ]
    assert tok.chat_template == CUSTOM_TEMPLATE  # the override did not stick
    for bad in ([], "hello", [conv, "x"]):
        with pytest.raises(InvalidRequestError, match="messages"):
            llm.chat(bad, sp)
    with pytest.raises(InvalidRequestError, match="chat template"):
        llm.chat(conv, sp, chat_template="{% if %}")
