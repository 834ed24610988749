"""Structured outputs in the engine: lossless under tree speculation.

- greedy constrained output is token-identical with and without speculation, for
  every policy, and valid for its constraint;
- sampled constrained output follows non-speculative constrained sampling (the exact
  masked target distribution of two tokens, chi-square), with a negative control (the
  mask of a node taken one step off) that the test rejects;
- forced tokens go into the tree without a draft step and do not change the output;
- seeded constrained requests reproduce alone and under load; penalties and
  min_tokens compose with the mask; bad constraints are InvalidRequestError.
"""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import numpy as np
import pytest
import torch
from conftest import (
    SMALL_VOCAB,
    chi_square,
    chi_square_rejects,
    fixed_generators,
    save_small_pair,
    shipped_llm,
)

from adaserve import LLM, SamplingParams
from adaserve.core.clock import TickClock
from adaserve.errors import InvalidRequestError
from adaserve.models.loader import load_model
from adaserve.spec_decode.logits import target_probs
from adaserve.structured.params import StructuredOutputsParams
from adaserve.util.paths import DEFAULT_TARGET

POLICIES = ["spec-chain:4", "spec-tree:3x2", "adaserve", "dyn-tree", "smartspec"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    {"json": PERSON},
    {"json": PERSON, "disable_any_whitespace": True},
    {"regex": r"(0|[1-9][0-9]{0,3})-[a-z]{2,6}"},
    {"choice": ["yes", "no", "it depends"]},
    {"grammar": 'root ::= "(" [a-z]{1,8} ("," [a-z]{1,8}){0,3} ")"'},
    {"json_object": True},
]
PROMPTS = ["def add(a, b):", "Hello", "import os\n", "# the answer is"]


def valid(text: str, c: dict) -> bool:
    """The text matches constraint ``c`` (checked independently of the grammar)."""
    if "json" in c:
        try:
            jsonschema.validate(json.loads(text), c["json"])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if "json_object" in c:
        try:
            return isinstance(json.loads(text), dict)
        except ValueError:
            return False
    if "regex" in c:
        return re.fullmatch(c["regex"], text) is not None
    if "choice" in c:
        return text in c["choice"]
    return re.fullmatch(r"\([a-z]{1,8}(,[a-z]{1,8}){0,3}\)", text) is not None


@pytest.fixture(scope="module", params=["llguidance", "xgrammar"])
def shipped(request, profile_file):
    return shipped_llm(profile_file, structured_outputs_backend=request.param)


def _texts(llm, policy, sp, prompts=PROMPTS):
    llm.engine.set_policy(policy)
    return [o.outputs[0] for o in llm.generate(prompts, sp)]


@pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
@pytest.mark.parametrize("c", CONSTRAINTS, ids=lambda c: next(iter(c)))
def test_greedy_constrained_output_is_identical_for_every_policy(shipped, c):
    sp = SamplingParams(temperature=0.0, max_tokens=400, structured_outputs=c)
    ref = _texts(shipped, "ar", sp)
    done = [o for o in ref if o.finish_reason == "stop"]
    assert all(valid(o.text, c) for o in done), [o.text for o in done]
    # greedy decoding of the tiny model may loop inside an open JSON string, never
    # inside the bounded constraints
    assert len(done) == len(ref) or "json_object" in c
    drafted = shipped.engine.counters.spec_draft_tokens
    for pol in POLICIES:
        got = _texts(shipped, pol, sp)
        assert [o.token_ids for o in got] == [o.token_ids for o in ref], pol
    assert shipped.engine.counters.spec_draft_tokens > drafted  # they speculated


@pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
def test_forced_tokens_enter_the_tree_without_drafting(shipped, monkeypatch):
    """A JSON schema's keys and punctuation are forced: they are verified (and nearly
    always accepted) without a draft step, and the output is what plain decoding
    gives."""
    import adaserve.engine.executor as eng_mod

    c = {"json": PERSON, "disable_any_whitespace": True}
    sp = SamplingParams(temperature=0.0, max_tokens=120, structured_outputs=c)
    ref = [o.token_ids for o in _texts(shipped, "ar", sp)]
    s = shipped.engine.structured
    s.forced_tokens = s.forced_accepted = 0
    assert [o.token_ids for o in _texts(shipped, "spec-chain:4", sp)] == ref
    assert s.forced_tokens >= 4 * len(PROMPTS)  # '{"name":"', '","age":', ... per output
    if shipped.engine.structured.backend_name == "llguidance":
        # its masks allow only the canonical tokens of forced text: they are what the
        # target writes. xgrammar's allow other splits too ("n", "name"), which the
        # tiny target often prefers: its forced tokens are proposals like any other
        assert s.forced_accepted >= 0.9 * s.forced_tokens
    assert s.forced_accepted > 0
    monkeypatch.setattr(eng_mod, "MAX_FORCED", 0)  # no forced chains: the same tokens
    s.forced_tokens = 0
    assert [o.token_ids for o in _texts(shipped, "spec-chain:4", sp)] == ref
    assert s.forced_tokens == 0


@pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
def test_seeded_constrained_sampling_reproduces_under_load(shipped):
    c = {"json": PERSON}
    one = SamplingParams(temperature=1.0, seed=7, max_tokens=120, structured_outputs=c)
    alone = _texts(shipped, "ar", one, PROMPTS[:1])[0]
    busy = [one] + [
        SamplingParams(temperature=1.0, max_tokens=60, structured_outputs=CONSTRAINTS[k % 5])
        for k in range(7)
    ]
    for pol in ("adaserve", "spec-tree:3x2"):
        shipped.engine.set_policy(pol)
        outs = shipped.generate([PROMPTS[0]] * 8, busy)
        assert outs[0].outputs[0].token_ids == alone.token_ids, pol
        assert valid(outs[0].outputs[0].text, c)


@pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
def test_penalties_and_min_tokens_compose_with_the_mask(shipped):
    c = {"regex": r"[a-z]{1,8}( [a-z]{1,8}){0,5}"}
    sp = SamplingParams(
        temperature=0.0,
        max_tokens=60,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        structured_outputs=c,
    )
    ref = _texts(shipped, "ar", sp)
    assert all(valid(o.text, c) for o in ref)
    for pol in ("spec-tree:3x2", "adaserve"):
        assert [o.token_ids for o in _texts(shipped, pol, sp)] == [o.token_ids for o in ref]
    # min_tokens past the grammar's end: the grammar wins, the output stays valid
    choice = {"choice": ["yes", "no"]}
    for pol in ("ar", "spec-chain:4"):
        outs = _texts(
            shipped,
            pol,
            SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6, structured_outputs=choice),
        )
        assert all(o.text in ("yes", "no") for o in outs), pol


@pytest.mark.parametrize(
    "c, what",
    [
        ({"json": {"type": "objectx"}}, "invalid JSON schema"),
        ({"regex": "[a-"}, "invalid regex"),
        ({"grammar": "start: undefined_rule"}, "invalid grammar"),
        ({"regex": "a", "choice": ["b"]}, "exactly one of"),
        ({"choice": []}, "must not be empty"),
        ({"json": "{not json"}, "not JSON"),
        ({"jsn": {}}, "unknown field"),
    ],
)
def test_bad_constraints_are_invalid_requests(shipped, c, what):
    with pytest.raises(InvalidRequestError, match=what):
        shipped.generate("x", SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=c))


def test_constraints_are_compiled_once_by_content(shipped):
    s = shipped.engine.structured
    a = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    b = StructuredOutputsParams(json={"type": "object", "properties": {"k": {"type": "integer"}}})
    first = s.compile(a)
    assert s.compile(b) is first


# ---------------------------------------------------------------- distribution test
EOS = SMALL_VOCAB - 1  # "l"
# token 1 in a..h, token 2 in d..k, token 3 in a..f: the mask differs by depth. The
# test looks at tokens 2 and 3, drawn in one tree (2 at its root, 3 below it)
REGEX = "[a-h][d-k][a-f]"
SETS = [range(0, 8), range(3, 11), range(0, 6)]
PROMPT = [3, 7, 1, 4]
N_SAMPLES = 4000


@pytest.fixture(scope="module")
def letter_pair(tmp_path_factory):
    """A 12-token pair whose tokens are the letters a..l (a byte-level tokenizer with
    no merges), EOS = l."""
    from tokenizers import Tokenizer, decoders, models

    root = tmp_path_factory.mktemp("letters")
    save_small_pair(root, eos_token_id=EOS)
    tok = Tokenizer(models.BPE(vocab={chr(97 + i): i for i in range(SMALL_VOCAB)}, merges=[]))
    tok.decoder = decoders.ByteLevel()
    for d in ("t", "d"):
        tok.save(str(root / d / "tokenizer.json"))
        (root / d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "l"}))
    return root / "t", root / "d"


def _mask(rows: torch.Tensor, allowed: range) -> torch.Tensor:
    keep = torch.zeros(rows.shape[-1], dtype=torch.bool)
    keep[list(allowed)] = True
    return rows.masked_fill(~keep, float("-inf"))


def exact_masked_joint(model_dir, sp) -> np.ndarray:
    """P(x2, x3) of the target masked to ``REGEX`` (x1 summed out), by direct forward
    passes."""
    m = load_model(model_dir)
    V = SMALL_VOCAB
    with torch.inference_mode():
        row = m.forward_dense(torch.tensor([PROMPT]))[0, -1]
        p1 = target_probs(_mask(row, SETS[0])[None], sp)[0]  # [V]
        rows = m.forward_dense(torch.tensor([PROMPT + [x] for x in range(V)]))[:, -1]
        p2 = target_probs(_mask(rows, SETS[1]), sp)  # [V(x1), V(x2)]
        seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        rows = m.forward_dense(seqs)[:, -1]
        p3 = target_probs(_mask(rows, SETS[2]), sp).reshape(V, V, V)  # [x1, x2, x3]
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return joint.sum(0).double().numpy()


def sample_masked_joint(target, draft, policy, sp, n, draft_sample) -> np.ndarray:
    llm = LLM(
        model=str(target),
        draft=str(draft),
        policy=policy,
        kv_cache_bytes=64 << 20,
        max_num_seqs=512,
        draft_sample=draft_sample,
    )
    fixed_generators(llm, n)
    params = SamplingParams(
        temperature=sp.temperature,
        top_p=sp.top_p,
        max_tokens=3,
        structured_outputs={"regex": REGEX},
    )
    outs = llm.generate([PROMPT] * n, params)
    counts = np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    for o in outs:
        counts[o.outputs[0].token_ids[1], o.outputs[0].token_ids[2]] += 1
    assert llm.engine.counters.spec_draft_tokens > 0
    return counts


@pytest.mark.parametrize("temperature, top_p, draft_sample", [(1.0, 1.0, False), (1.3, 0.9, True)])
def test_constrained_speculative_sampling_matches_masked_target(
    letter_pair, temperature, top_p, draft_sample
):
    target, draft = letter_pair
    sp = SamplingParams(temperature=temperature, top_p=top_p)
    probs = exact_masked_joint(target, sp)
    counts = sample_masked_joint(target, draft, "spec-tree:3x3", sp, N_SAMPLES, draft_sample)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3f}")
    assert not chi_square_rejects(counts, probs), (stat, df, p)


def test_a_mask_one_node_off_fails_the_distribution_test(letter_pair, monkeypatch):
    """Negative control: each node masked with its parent's grammar state (the path
    without its last token), the off-by-one a tree-mask implementation can make."""
    from adaserve.structured.matcher import GrammarState

    real = GrammarState.masks
    monkeypatch.setattr(
        GrammarState, "masks", lambda self, paths: real(self, [p[:-1] for p in paths])
    )
    target, draft = letter_pair
    sp = SamplingParams(temperature=1.0)
    probs = exact_masked_joint(target, sp)
    counts = sample_masked_joint(target, draft, "spec-tree:3x3", sp, N_SAMPLES, False)
    assert chi_square_rejects(counts, probs)


def test_letter_pair_copy_is_independent(letter_pair, tmp_path):
    """(the fixture's tokenizer gives one token per letter, as the test assumes)"""
    from adaserve.text.tokenizer import load_tokenizer

    shutil.copytree(letter_pair[0], tmp_path / "t")
    tok = load_tokenizer(tmp_path / "t")
    assert tok.encode("abhl", add_special_tokens=False) == [0, 1, 7, 11]


def test_sampling_below_a_forced_chain_matches_the_masked_target(letter_pair):
    """``[a-h]g[a-f]``: after the first token the grammar forces ``g``, which goes into
    the tree as a chain with the sampled draft's candidates below it; the first and
    third tokens still have the masked target's joint distribution."""
    target, draft = letter_pair
    sp = SamplingParams(temperature=1.0)
    m = load_model(target)
    V = SMALL_VOCAB
    with torch.inference_mode():
        row = m.forward_dense(torch.tensor([PROMPT]))[0, -1]
        p1 = target_probs(_mask(row, range(0, 8))[None], sp)[0]
        rows = m.forward_dense(torch.tensor([PROMPT + [x, 6] for x in range(V)]))[:, -1]
        p3 = target_probs(_mask(rows, range(0, 6)), sp)  # [x1, x3]
    probs = (p1[:, None] * p3).double().numpy()
    llm = LLM(model=str(target), draft=str(draft), policy="spec-tree:3x3",
              kv_cache_bytes=64 << 20, max_num_seqs=512, draft_sample=True)  # fmt: skip
    fixed_generators(llm, N_SAMPLES)
    params = SamplingParams(
        temperature=1.0, max_tokens=3, structured_outputs={"regex": "[a-h]g[a-f]"}
    )
    counts = np.zeros((V, V))
    for o in llm.generate([PROMPT] * N_SAMPLES, params):
        t = o.outputs[0].token_ids
        assert t[1] == 6
        counts[t[0], t[2]] += 1
    assert llm.engine.structured.forced_tokens >= N_SAMPLES // 2
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3f}")
    assert not chi_square_rejects(counts, probs), (stat, df, p)


@pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
def test_forced_chains_stop_at_max_tokens_and_the_context(profile_file):
    """A long forced literal near the end of max_tokens, and near the end of the
    model's context: the chain is cut to what the request may still take."""
    llm = LLM(profile=profile_file, clock=TickClock(0.001), kv_cache_bytes=16 << 20,
              max_model_len=48)  # fmt: skip
    literal = {"regex": "(the same fixed literal text, forced token after token, ){3}"}
    prompt = list(range(100, 140))  # 40 token ids
    for max_tokens, n_prompt in ((3, 8), (40, 40)):
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=literal)
        ref = None
        for pol in ("ar", "spec-chain:4", "adaserve"):
            llm.engine.set_policy(pol)
            out = llm.generate([prompt[:n_prompt]], sp)[0].outputs[0]
            assert out.finish_reason == "length", (pol, out)
            ref = ref or out.token_ids
            assert out.token_ids == ref, pol
        assert len(ref) == min(max_tokens, 48 - n_prompt)
