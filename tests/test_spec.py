"""Speculation is lossless: greedy equivalence, distribution test, cut paths, KV hygiene."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import (
    SMALL_VOCAB,
    chi_square,
    chi_square_rejects,
    fixed_generators,
    random_prompts,
    ref_penalize,
    save_small_pair,
)

from adaserve import LLM, SLO, SamplingParams
from adaserve.core.clock import TickClock
from adaserve.models.loader import load_model
from adaserve.spec_decode.logits import target_probs
from adaserve.util.paths import DEFAULT_DRAFT, DEFAULT_TARGET

POLICIES = ["spec-chain:4", "spec-tree", "spec-tree:3x2", "adaserve", "dyn-tree", "smartspec"]


def run(model, draft, policy, prompts, sp, profile=None, **kw):
    llm = LLM(
        model=str(model),
        draft=str(draft) if draft else None,
        no_draft=draft is None,
        policy=policy,
        kv_cache_bytes=kw.pop("kv_cache_bytes", 32 << 20),
        profile=profile,
        clock=TickClock(0.001),  # the budgeted policies' decisions never follow machine speed
        **kw,
    )
    outs = llm.generate(prompts, sp)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("which", ["self", "random"])
def test_greedy_equivalence_all_policies(tiny_pair, profile_file, which):
    target, draft, _ = tiny_pair
    draft = target if which == "self" else draft
    prompts = random_prompts(56, seed=11, lo=2, hi=60)
    sp = SamplingParams(temperature=0.0, max_tokens=20)
    ref, _ = run(target, None, "ar", prompts, sp)
    for pol in POLICIES:
        got, llm = run(target, draft, pol, prompts, sp, profile=profile_file)
        assert got == ref, pol
        c = llm.engine.counters
        assert c.spec_draft_tokens > 0, f"{pol} never speculated"
        if which == "self":
            # the target as its own draft: the draft's top-1 child is always the target's
            # argmax, so chains are accepted whole (trees: one child per level at least)
            if pol in ("spec-chain:4", "smartspec"):
                assert c.spec_accepted_tokens >= 0.9 * c.spec_draft_tokens, pol
            else:
                assert c.spec_accepted_tokens >= c.spec_drafts, pol


@pytest.mark.skipif(not DEFAULT_TARGET.is_dir(), reason="shipped pair not present")
def test_greedy_equivalence_shipped_pair(tmp_path):
    prompts = random_prompts(52, seed=12, lo=4, hi=48)
    tok = LLM(model=str(DEFAULT_TARGET), no_draft=True, policy="ar").tokenizer
    texts = [tok.decode(p) for p in prompts]
    ids = [tok.encode(t) or [1] for t in texts]
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    ref, _ = run(DEFAULT_TARGET, None, "ar", ids, sp)
    for pol in POLICIES:
        got, llm = run(DEFAULT_TARGET, DEFAULT_DRAFT, pol, ids, sp)
        assert got == ref, pol


def test_eos_inside_accepted_path_cuts_it(tiny_pair, profile_file):
    target, _, _ = tiny_pair
    prompts = random_prompts(10, seed=13)
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    full, _ = run(target, None, "ar", prompts, sp)
    stop_tok = full[0][3]
    sp2 = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop_tok,))
    ref, _ = run(target, None, "ar", prompts, sp2)
    got, llm = run(target, target, "spec-chain:6", prompts, sp2)
    assert got == ref
    assert got[0][-1] == stop_tok and len(got[0]) == full[0].index(stop_tok) + 1
    # the eos set of the checkpoint works the same way
    llm.engine.eos_ids.clear()  # the set the output processor checks
    llm.engine.eos_ids.add(stop_tok)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == ref


def test_request_finishing_mid_tree(tiny_pair):
    target, _, _ = tiny_pair
    prompts = random_prompts(8, seed=14)
    ref, _ = run(target, None, "ar", prompts, SamplingParams(temperature=0.0, max_tokens=3))
    got, llm = run(
        target, target, "spec-chain:8", prompts, SamplingParams(temperature=0.0, max_tokens=3)
    )
    assert got == ref and all(len(g) == 3 for g in got)
    a = llm.engine.allocator
    assert a.num_free == a.num_blocks


def test_kv_pool_full_after_random_workload_with_preemption(tiny_pair):
    target, draft, _ = tiny_pair
    prompts = random_prompts(20, seed=15, lo=20, hi=90)
    sp = SamplingParams(temperature=0.0, max_tokens=30)
    ref, _ = run(target, None, "ar", prompts, sp)
    # target (512 B/token) + draft (1 layer, 1 kv head x 16: 128 B/token); ~20 blocks
    got, llm = run(
        target,
        draft,
        "spec-tree:4x2",
        prompts,
        sp,
        kv_cache_bytes=640 * 16 * 20,
        max_prefill_tokens=32,
    )
    assert got == ref
    assert llm.engine.counters.preemptions > 0
    a = llm.engine.allocator
    assert a.num_free == a.num_blocks


# ---------------------------------------------------------------- distribution test


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    return save_small_pair(tmp_path_factory.mktemp("small"))


def exact_joint(model_dir, prompt, sp) -> np.ndarray:
    """P(x1, x2) of the processed target distribution, by direct forward passes."""
    m = load_model(model_dir)
    with torch.inference_mode():
        row = ref_penalize(m.forward_dense(torch.tensor([prompt]))[0, -1], prompt, [], sp)
        p1 = target_probs(row[None], sp)[0]
        seqs = torch.tensor([prompt + [x] for x in range(SMALL_VOCAB)])
        rows = m.forward_dense(seqs)[:, -1]
        rows = torch.stack([ref_penalize(rows[x], prompt, [x], sp) for x in range(SMALL_VOCAB)])
        p2 = target_probs(rows, sp)
    return (p1[:, None] * p2).double().numpy()


def sample_joint(
    target, draft, policy, prompt, sp, n, draft_sample=False, seeded=False
) -> np.ndarray:
    """Counts of the first two tokens of n requests for ``prompt`` through the engine.

    seeded: request i has ``seed=i`` (the position-keyed noise of seeded sampling);
    else no seed (the residual method), the generators still fixed (0..n-1) so that
    the test is reproducible."""
    llm = LLM(
        model=str(target),
        draft=str(draft),
        policy=policy,
        kv_cache_bytes=64 << 20,
        max_num_seqs=512,
        draft_sample=draft_sample,
    )
    if not seeded:
        fixed_generators(llm, n)
    params = [
        SamplingParams(
            temperature=sp.temperature,
            top_p=sp.top_p,
            min_p=sp.min_p,
            max_tokens=2,
            seed=i if seeded else None,
            presence_penalty=sp.presence_penalty,
            frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty,
        )
        for i in range(n)
    ]
    outs = llm.generate([prompt] * n, params)
    counts = np.zeros((SMALL_VOCAB, SMALL_VOCAB))
    for o in outs:
        counts[o.outputs[0].token_ids[0], o.outputs[0].token_ids[1]] += 1
    assert llm.engine.counters.spec_draft_tokens > 0
    return counts


N_SAMPLES = 6000
PROMPT = [3, 7, 1, 4]


@pytest.mark.parametrize(
    "temperature, top_p, draft_sample, min_p, seeded",
    [
        (1.0, 1.0, False, 0.0, False),
        (1.0, 0.8, False, 0.0, False),
        (1.0, 1.0, True, 0.0, False),
        (1.5, 0.9, True, 0.0, False),
        (1.5, 1.0, True, 0.05, False),
        # seeded sampling (one seed a request): the position-keyed noise verified greedily
        (1.0, 1.0, False, 0.0, True),
        (1.0, 0.8, True, 0.0, True),
        (1.5, 1.0, True, 0.05, True),
    ],
)
def test_speculative_sampling_matches_target_distribution(
    small_pair, temperature, top_p, draft_sample, min_p, seeded
):
    target, draft = small_pair
    sp = SamplingParams(temperature=temperature, top_p=top_p, min_p=min_p)
    probs = exact_joint(target, PROMPT, sp)
    if min_p:  # it does cut tokens here
        plain = exact_joint(target, PROMPT, SamplingParams(temperature=temperature, top_p=top_p))
        assert (probs == 0).sum() > (plain == 0).sum()
    counts = sample_joint(
        target, draft, "spec-tree:3x3", PROMPT, sp, N_SAMPLES, draft_sample, seeded
    )
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3f}")
    assert not chi_square_rejects(counts, probs), (stat, df, p)


def test_speculative_sampling_with_penalties_matches_target_distribution(small_pair):
    """Presence, frequency and repetition penalties under a branching tree of sampled
    draft children (the draft penalised as the target): the engine's first two tokens
    have the joint distribution of the penalised target."""
    target, draft = small_pair
    sp = SamplingParams(
        temperature=1.0, presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.3
    )
    probs = exact_joint(target, PROMPT, sp)
    assert abs(probs - exact_joint(target, PROMPT, SamplingParams(temperature=1.0))).sum() > 0.2
    counts = sample_joint(target, draft, "spec-tree:3x3", PROMPT, sp, N_SAMPLES, True)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3f}")
    assert not chi_square_rejects(counts, probs), (stat, df, p)


def test_broken_verifier_fails_the_distribution_test(small_pair, monkeypatch):
    """Negative control: accepting any child in the target's top-2 (and drawing the
    bonus from the unchanged distribution) is not lossless."""
    import adaserve.spec_decode.verify as ver

    def almost_lossless(step, batch, probs, u, acc):
        par, ch = step.parent, step.child
        alive = acc.index_select(0, par) < 0
        top2 = probs.index_select(0, par).topk(2, dim=-1).indices  # [M, 2]
        ok = alive & (top2 == batch.tokens.index_select(0, ch)[:, None]).any(-1)
        acc.index_copy_(0, par, torch.where(ok, ch, acc.index_select(0, par)))

    monkeypatch.setattr(ver, "_try_siblings", almost_lossless)
    target, draft = small_pair
    sp = SamplingParams(temperature=1.0)
    probs = exact_joint(target, PROMPT, sp)
    counts = sample_joint(target, draft, "spec-tree:3x3", PROMPT, sp, N_SAMPLES)
    assert chi_square_rejects(counts, probs)


def test_seeded_noise_shared_by_positions_fails_the_distribution_test(small_pair, monkeypatch):
    """Negative control of seeded sampling: one noise row for every output position
    (keyed by the seed alone) gives each token the right marginal but not the joint:
    the noise must be independent from position to position."""
    import adaserve.spec_decode.batch as vb
    from adaserve.spec_decode.logits import noise_key

    monkeypatch.setattr(vb, "noise_key", lambda seed, index: noise_key(seed, 0))
    target, draft = small_pair
    sp = SamplingParams(temperature=1.0)
    probs = exact_joint(target, PROMPT, sp)
    counts = sample_joint(target, draft, "spec-tree:3x3", PROMPT, sp, N_SAMPLES, seeded=True)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3g}")
    assert chi_square_rejects(counts, probs), (stat, df, p)


def resized_copy(src, dst, vocab: int, seed: int = 0):
    """The checkpoint at ``src`` with its embedding and LM head cut or padded to
    ``vocab`` rows (a draft that is the target on the ids both have)."""
    import transformers

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src)
    hf.resize_token_embeddings(vocab, mean_resizing=False)
    hf.save_pretrained(dst)
    return dst


@pytest.mark.parametrize("delta", [-16, 16])
def test_draft_of_another_vocabulary_size_is_lossless(tiny_pair, profile_file, tmp_path, delta):
    """Qwen2.5's 0.5B draft has 128 fewer (padding) rows than its larger siblings: a
    draft vocabulary smaller or larger than the target's drafts only ids the target has,
    takes target-only ids in its input, and leaves greedy output unchanged."""
    from conftest import VOCAB

    target, _, _ = tiny_pair
    draft = resized_copy(target, tmp_path / "d", VOCAB + delta)
    prompts = random_prompts(24, seed=5, lo=2, hi=40)
    prompts += [[VOCAB - 3, 5, VOCAB - 2, 7], [9, VOCAB - 1 - 1, 3]]  # ids past a small draft's
    sp = SamplingParams(temperature=0.0, max_tokens=16)
    ref, _ = run(target, None, "ar", prompts, sp)
    for pol in ("spec-tree:3x2", "adaserve"):
        got, llm = run(target, draft, pol, prompts, sp, profile=profile_file)
        assert got == ref, pol
        c = llm.engine.counters
        assert c.spec_accepted_tokens >= 0.5 * c.spec_drafts, pol  # it is the target


def test_smaller_draft_vocabulary_keeps_the_target_distribution(small_pair, tmp_path):
    """Sampled drafts over a draft vocabulary that lacks 4 of the target's ids (q = 0
    there): the residual still gives those ids their target probability."""
    target, draft = small_pair
    small = resized_copy(draft, tmp_path / "d", SMALL_VOCAB - 4)
    sp = SamplingParams(temperature=1.0)
    probs = exact_joint(target, PROMPT, sp)
    assert probs[SMALL_VOCAB - 4 :].sum() > 0.05 or probs[:, SMALL_VOCAB - 4 :].sum() > 0.05
    counts = sample_joint(target, small, "spec-tree:3x3", PROMPT, sp, N_SAMPLES, True)
    assert not chi_square_rejects(counts, probs)


def test_a_draft_with_another_tokenizer_is_refused():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel

    from adaserve.errors import ModelLoadError
    from adaserve.text.tokenizer import Tokenizer, check_draft_tokenizer

    def tok(words):
        return Tokenizer(HFTokenizer(WordLevel({w: i for i, w in enumerate(words)}, "a")), {})

    check_draft_tokenizer(tok("abcd"), tok("abcd"), "d")
    check_draft_tokenizer(tok("abcd"), None, "d")  # nothing to compare
    with pytest.raises(ModelLoadError, match="another tokenizer.*2 of its 4 tokens"):
        check_draft_tokenizer(tok("abcd"), tok("abdc"), "d")


def test_logprobs_are_the_targets_and_unchanged_by_speculation(tiny_pair, profile_file):
    """``SamplingParams(temperature=0.0, logprobs=k)``: each generated token's log-probability under the
    target (raw logits) and the k most likely alternatives, the same whether the token
    came from a verified tree or a one-token step, and equal to transformers'."""
    from adaserve.errors import InvalidRequestError

    target, _, hf = tiny_pair
    prompts = random_prompts(10, seed=9, lo=3, hi=30)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
    sampled = SamplingParams(max_tokens=9, logprobs=0, temperature=1.0, seed=4)
    params = [greedy] * 8 + [sampled] * 2
    runs = {}
    for pol, draft in (("ar", None), ("spec-tree:3x2", target), ("adaserve", target)):
        llm = LLM(
            model=str(target),
            draft=str(draft) if draft else None,
            no_draft=draft is None,
            policy=pol,
            kv_cache_bytes=32 << 20,
            profile=profile_file if draft else None,
        )
        runs[pol] = llm.generate(prompts, params)
        if draft:
            assert llm.engine.counters.spec_accepted_tokens > 20, pol  # paths were verified
    for i, (p, ref) in enumerate(zip(prompts, runs["ar"])):
        ref = ref.outputs[0]
        assert len(ref.logprobs) == len(ref.token_ids)
        assert (
            abs(
                ref.cumulative_logprob
                - sum(e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs))
            )
            < 1e-6
        )
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([p + ref.token_ids])).logits[0].float(), -1)
        for j, (tok, pos) in enumerate(zip(ref.token_ids, ref.logprobs)):
            want = lsm[len(p) - 1 + j]
            assert abs(pos[tok].logprob - want[tok].item()) < 1e-4
            k = params[i].logprobs
            assert top_ids(pos) == want.topk(k).indices.tolist()
            assert set(pos) == {tok, *top_ids(pos)}  # the taken token and the top k
        if params[i] is greedy:  # same tokens whatever the policy: same logprobs
            for pol in ("spec-tree:3x2", "adaserve"):
                got = runs[pol][i].outputs[0]
                assert got.token_ids == ref.token_ids, pol
                for t, a, b in zip(ref.token_ids, got.logprobs, ref.logprobs):
                    assert abs(a[t].logprob - b[t].logprob) < 1e-4, pol
                    assert top_ids(a) == top_ids(b), pol
    first = runs["ar"][0].outputs[0]
    assert first.logprobs[0][first.token_ids[0]].rank == 1  # greedy = top 1
    assert SamplingParams(temperature=0.0).logprobs is None
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(temperature=0.0, logprobs=21)


def test_prompt_logprobs_score_every_prompt_token_across_prefill_chunks(tiny_pair):
    """``SamplingParams(temperature=0.0, prompt_logprobs=k)``: each prompt token's log-probability given
    the tokens before it (the first has none), over chunked prefills, next to requests
    that did not ask (whose outputs are unchanged)."""
    target, _, hf = tiny_pair
    prompts = random_prompts(5, seed=13, lo=20, hi=70)
    asked = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, logprobs=1)
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    params = [asked, plain, asked, plain, asked]
    llm = LLM(model=str(target), no_draft=True, policy="ar", max_prefill_tokens=16)
    outs = llm.generate(prompts, params)
    ref = LLM(model=str(target), no_draft=True, policy="ar").generate(prompts, plain)
    for p, o, r, sp in zip(prompts, outs, ref, params):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        if sp is plain:
            assert o.prompt_logprobs is None and o.outputs[0].logprobs is None
            continue
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([p])).logits[0].float(), -1)
        for i, pos in enumerate(o.prompt_logprobs[1:], start=1):
            assert abs(pos[p[i]].logprob - lsm[i - 1, p[i]].item()) < 1e-4
            assert top_ids(pos) == lsm[i - 1].topk(2).indices.tolist()
        first = o.outputs[0]
        assert (
            abs(first.logprobs[0][first.token_ids[0]].logprob - lsm[-1, first.token_ids[0]].item())
            < 1e-4
        )


def top_ids(pos: dict) -> list[int]:
    """The top-k token ids of one position's vLLM-shaped logprobs, by rank."""
    return [t for t, lp in sorted(pos.items(), key=lambda e: e[1].rank or 0) if lp.rank]


def test_min_p_keeps_tokens_at_least_min_p_times_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, min_p=0.15))
    # 0.15 x 0.5 = 0.075: the last two drop, the rest renormalise
    assert torch.allclose(p, torch.tensor([[0.5, 0.3, 0.1, 0.0, 0.0]]) / 0.9)
    assert torch.equal(
        target_probs(logits, SamplingParams(temperature=1.0, min_p=1.0)).argmax(), torch.tensor(0)
    )
    with pytest.raises(Exception, match="min_p"):
        SamplingParams(temperature=0.0, min_p=1.5)


def test_pass_composition_keeps_greedy_output(tiny_pair, profile_file):
    """adaserve composing the pass (deferred relaxed prefill, decoders sitting passes
    out, width-2 exploration plans) still gives the target's greedy output under a
    mix of strict and relaxed requests."""
    target, draft, _ = tiny_pair
    prompts = random_prompts(24, seed=5, lo=20, hi=120)
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    # strict targets the tiny engine runs just behind (under this tick clock), relaxed
    # ones it runs far inside: the case in which relaxed decoders sit passes out
    strict = SLO(tpot_ms=5.0, ttft_ms=2000.0, cls="interactive")
    relaxed = SLO(tpot_ms=1e4, ttft_ms=30000.0, cls="batch")
    slos = [strict if i % 3 else relaxed for i in range(len(prompts))]
    ref, _ = run(target, None, "ar", prompts, sp)
    llm = LLM(
        model=str(target),
        draft=str(draft),
        policy="adaserve:sit_out=1:explore_every=3",
        kv_cache_bytes=32 << 20,
        profile=profile_file,
        clock=TickClock(0.001),
    )
    pol = llm.engine.policy
    plans = []
    plan = pol.plan
    pol.plan = lambda view: plans.append(plan(view)) or plans[-1]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, slo=slos)]
    assert got == ref
    assert any(p.skip for p in plans), "no decoder ever sat a pass out"
    assert any(p.state and p.state.choice.width == 2 for p in plans)
