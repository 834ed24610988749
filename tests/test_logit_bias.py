"""OpenAI's ``logit_bias``: added to the target's logits at every tree node (and to the
draft's), so speculation stays lossless; it composes with grammar masks (a bias never
revives a token the grammar forbids); bad values are refused. Over HTTP with the
``openai`` client too."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
from conftest import SMALL_VOCAB, chi_square, chi_square_rejects, fixed_generators, shipped_llm
from server_fixtures import LiveServer, server_test_env
from test_structured import (
    N_SAMPLES,
    PROMPT,
    _mask,
    letter_pair,  # noqa: F401  (the fixture)
)

from adaserve import LLM, SamplingParams
from adaserve.config import EngineConfig
from adaserve.errors import InvalidRequestError
from adaserve.models.loader import load_model
from adaserve.server import ServerConfig
from adaserve.spec_decode.logits import target_probs
from adaserve.util.paths import DEFAULT_TARGET

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)
pytestmark = pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
PROMPTS = ["def add(a, b):", "Hello", "import os\n", "# the answer is"]


@pytest.fixture(scope="module")
def shipped(profile_file):
    return shipped_llm(profile_file)


def _ids(llm, policy, sp):
    llm.engine.set_policy(policy)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


def test_greedy_with_logit_bias_is_identical_for_every_policy(shipped):
    tok = shipped.engine.tokenizer
    plain = _ids(shipped, "ar", SamplingParams(temperature=0.0, max_tokens=32))
    # ban the most frequent tokens of the plain outputs, favour two others a little
    counts = np.bincount(np.concatenate(plain), minlength=4096)
    banned = [int(t) for t in np.argsort(-counts)[:6]]
    favoured = [tok.encode(" return", add_special_tokens=False)[0], 17]
    bias = {**{t: -100.0 for t in banned}, **{t: 4.0 for t in favoured}}
    sp = SamplingParams(temperature=0.0, max_tokens=32, logit_bias=bias)
    ref = _ids(shipped, "ar", sp)
    assert ref != plain and not set(banned) & {t for out in ref for t in out}
    for pol in ("spec-chain:4", "spec-tree:3x2", "adaserve", "dyn-tree"):
        assert _ids(shipped, pol, sp) == ref, pol


def test_a_bias_never_revives_a_token_the_grammar_forbids(shipped):
    tok = shipped.engine.tokenizer
    outside = tok.encode("maybe", add_special_tokens=False)[0]
    no = tok.encode("no", add_special_tokens=False)[0]
    for pol in ("ar", "spec-chain:4"):
        shipped.engine.set_policy(pol)
        outs = shipped.generate(
            PROMPTS,
            SamplingParams(
                temperature=0.0,
                max_tokens=8,
                logit_bias={outside: 100.0, no: 50.0},
                structured_outputs={"choice": ["yes", "no"]},
            ),
        )
        assert [o.outputs[0].text for o in outs] == ["no"] * len(PROMPTS), pol


@pytest.mark.parametrize(
    "bias, what",
    [({-1: 1.0}, "token ids >= 0"), ({5: 101.0}, "[-100, 100]"), ({"x": 1}, "maps token ids")],
)
def test_bad_logit_bias_is_an_invalid_request(bias, what):
    with pytest.raises(InvalidRequestError, match=what.replace("[", r"\[")):
        SamplingParams(temperature=0.0, logit_bias=bias)


def test_logit_bias_past_the_vocabulary_is_refused(shipped):
    with pytest.raises(InvalidRequestError, match="vocabulary size"):
        shipped.generate("x", SamplingParams(temperature=0.0, logit_bias={10**6: 1.0}))


BIAS = {0: 2.0, 3: -1.5, 5: 1.0, 9: -100.0}
REGEX = "[a-h][a-k][a-k]"


def _exact(target) -> np.ndarray:
    """P(x2, x3) of the target with BIAS added and masked to REGEX (x1 summed out)."""
    sp = SamplingParams(temperature=1.0)
    V = SMALL_VOCAB
    add = torch.zeros(V)
    for k, v in BIAS.items():
        add[k] = v
    m = load_model(target)
    with torch.inference_mode():
        row = m.forward_dense(torch.tensor([PROMPT]))[0, -1] + add
        p1 = target_probs(_mask(row, range(0, 8))[None], sp)[0]
        rows = m.forward_dense(torch.tensor([PROMPT + [x] for x in range(V)]))[:, -1]
        p2 = target_probs(_mask(rows + add, range(0, 11)), sp)
        seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        p3 = target_probs(_mask(m.forward_dense(seqs)[:, -1] + add, range(0, 11)), sp)
    joint = p1[:, None, None] * p2[:, :, None] * p3.reshape(V, V, V)
    return joint.sum(0).double().numpy()


def _sampled(target, draft) -> np.ndarray:
    llm = LLM(model=str(target), draft=str(draft), policy="spec-tree:3x3",
              kv_cache_bytes=64 << 20, max_num_seqs=512, draft_sample=True)  # fmt: skip
    fixed_generators(llm, N_SAMPLES)
    params = SamplingParams(
        temperature=1.0, max_tokens=3, logit_bias=BIAS, structured_outputs={"regex": REGEX}
    )
    counts = np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    for o in llm.generate([PROMPT] * N_SAMPLES, params):
        t = o.outputs[0].token_ids
        counts[t[1], t[2]] += 1
    assert llm.engine.counters.spec_accepted_tokens > 0
    return counts


def test_biased_speculative_sampling_matches_the_biased_target(letter_pair):  # noqa: F811
    """Under a tree of sampled drafts, (x2, x3) (drawn at a tree's root and below it)
    follow the target with the bias added, masked by a regex."""
    target, draft = letter_pair
    probs, counts = _exact(target), _sampled(target, draft)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3f}")
    assert not chi_square_rejects(counts, probs), (stat, df, p)


def test_a_bias_on_the_root_row_only_fails_the_distribution_test(letter_pair, monkeypatch):  # noqa: F811
    """Negative control: the bias added to each request's root row only, not to the
    rows of its candidates."""
    import adaserve.engine.model_runner as mr

    real = mr.add_logit_bias
    monkeypatch.setattr(mr, "add_logit_bias", lambda lg, rows, b: real(lg, list(rows)[:1], b))
    target, draft = letter_pair
    assert chi_square_rejects(_sampled(target, draft), _exact(target))


def test_logit_bias_over_http(profile_file):
    s = LiveServer(EngineConfig(profile=profile_file, kv_cache_bytes=16 << 20), ServerConfig())
    try:
        c = s.client()
        tok = s.state.loop.info.tokenizer
        x = tok.encode(" banana", add_special_tokens=False)[0]
        r = c.completions.create(
            model="adaserve", prompt="def f():", max_tokens=5, temperature=0,
            logit_bias={str(x): 100},
        )  # fmt: skip
        assert r.choices[0].text == tok.decode([x] * 5)
        for bad in ({"abc": 1}, {"5": 500}, {str(10**6): 1}):
            with pytest.raises(openai.BadRequestError) as e:
                c.completions.create(model="adaserve", prompt="x", max_tokens=2, logit_bias=bad)
            assert e.value.body["param"] == "logit_bias"
    finally:
        s.stop()
