"""Seeded sampling reproduces: a request's tokens are a function of its seed, prompt and
sampling params only, not of the policy, the draft, the trees, the batch or the load
(issue 22, finding 9). Its distribution is tested with the others (``test_spec.py``,
``test_verify_batch.py``)."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
from conftest import random_prompts
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env
from test_spec import run  # an engine on a fake clock, its outputs

from adaserve import LLM, SamplingParams
from adaserve.server import ServerConfig

# one torch thread and an empty adaserve cache (no stored hardware profile)
_env = pytest.fixture(scope="module", autouse=True)(server_test_env)

POLICIES = ["spec-chain:4", "spec-tree", "spec-tree:3x2", "adaserve", "dyn-tree", "smartspec"]


def generate(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def seeded_params(n: int, max_tokens: int = 16) -> list[SamplingParams]:
    kinds = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.3, top_k=40),
        SamplingParams(temperature=1.0, min_p=0.02),
    ]
    return [replace(kinds[i % 4], seed=1000 + i, max_tokens=max_tokens) for i in range(n)]


@pytest.mark.parametrize("which", ["self", "random"])
def test_seeded_output_is_the_same_under_every_policy_and_draft(tiny_pair, profile_file, which):
    """ar, chains, static and adaptive trees, with the random draft (short paths, many
    rejections) or the target as its own draft (long paths): the same tokens."""
    target, draft, _ = tiny_pair
    prompts = random_prompts(24, seed=31, lo=2, hi=40)
    params = seeded_params(len(prompts))
    ref, _ = run(target, None, "ar", prompts, params)
    assert len({tuple(r) for r in ref}) == len(ref)
    d = target if which == "self" else draft
    for pol in POLICIES:
        got, llm = run(target, d, pol, prompts, params, profile_file)
        assert got == ref, pol
        c = llm.engine.counters
        assert c.spec_draft_tokens > 0, f"{pol} never speculated"
        if which == "self":
            assert c.spec_accepted_tokens > 0, pol


def test_seeded_output_alone_equals_output_in_a_loaded_batch(tiny_pair, profile_file):
    """A seeded request alone vs. among 60 others (greedy, unseeded, other seeds, other
    lengths) and under KV pressure that preempts and recomputes requests."""
    target, draft, _ = tiny_pair
    mine = random_prompts(6, seed=32, lo=3, hi=30)
    mine_p = seeded_params(len(mine), max_tokens=24)
    _, llm = run(target, draft, "adaserve", mine[:1], mine_p[:1], profile_file)
    alone = [generate(llm, [p], [sp])[0] for p, sp in zip(mine, mine_p)]
    others = random_prompts(60, seed=33, lo=2, hi=70)
    others_p = [
        SamplingParams(temperature=0.0, max_tokens=20)
        if i % 3 == 0
        else SamplingParams(temperature=1.0, max_tokens=8 + i % 20, seed=None if i % 3 == 1 else i)
        for i in range(len(others))
    ]
    # mine in the middle of the queue, arriving with the others
    prompts = others[:30] + mine + others[30:]
    params = others_p[:30] + mine_p + others_p[30:]
    for pol, kw in [
        ("adaserve", {}),
        ("spec-tree:4x2", {"kv_cache_bytes": 640 * 16 * 40, "max_prefill_tokens": 32}),
    ]:
        got, big = run(target, draft, pol, prompts, params, profile_file, **kw)
        assert got[30:36] == alone, pol
    assert big.engine.counters.preemptions > 0  # the recompute path was taken
    # another seed gives other tokens
    other = [replace(sp, seed=sp.seed + 7) for sp in mine_p]
    assert generate(llm, mine, other) != alone


def test_seeded_choices_of_n_match_single_requests(tiny_pair, profile_file):
    """The server gives choice i of ``n`` the seed ``seed + i`` (as vLLM): choice 0 of
    ``n = 3`` is the ``n = 1`` output, choice 1 that of ``seed + 1``."""
    target, draft, _ = tiny_pair
    prompt = random_prompts(1, seed=34)[0]
    sp = SamplingParams(temperature=1.0, max_tokens=20, seed=77)
    (one,), llm = run(target, draft, "spec-tree", [prompt], [sp], profile_file)
    second = generate(llm, [prompt], [replace(sp, seed=78)])[0]
    three = generate(llm, [prompt] * 3, [replace(sp, seed=77 + j) for j in range(3)])
    assert three[0] == one and three[1] == second and len({tuple(x) for x in three}) == 3


def test_seeded_output_under_concurrent_clients_on_a_live_server(tmp_path_factory):
    """Over HTTP with real timing (the adaptive policy's trees follow the load): the
    same seeded request, idle and while other clients stream, 8 of 8 identical; choice
    0 of ``n = 3`` equals ``n = 1``."""
    target, draft = model_pair(tmp_path_factory)
    # admission off: concurrent clients on tiny-model targets would be shed, and this
    # test is about what a seed gives
    srv = LiveServer(engine_config(target, draft, policy="adaserve"), ServerConfig(admission=False))
    try:
        c = srv.client()
        body = dict(model="target", prompt="def add(a, b):", max_tokens=24, temperature=1.0)
        idle = c.completions.create(seed=5, **body).choices[0].text
        stop = threading.Event()

        def load(i):
            while not stop.is_set():
                c.completions.create(
                    model="target", prompt=f"x{i}" * (1 + i), max_tokens=16, temperature=1.0
                )

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        try:
            loaded = [c.completions.create(seed=5, **body).choices[0].text for _ in range(8)]
            n3 = c.completions.create(seed=5, n=3, **body).choices
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert loaded == [idle] * 8
        assert n3[0].text == idle and len({ch.text for ch in n3}) == 3
    finally:
        srv.stop()


def test_race_noise_is_exponential_independent_and_keyed_only():
    """The noise rows: Exp(1) (Kolmogorov-Smirnov on U = exp(-E)), uncorrelated from
    position to position and token to token, and each row a function of its key only
    (any batch, order or chunking gives the same numbers)."""
    import numpy as np
    import torch

    from adaserve.spec_decode.logits import noise_key, race_noise

    keys = [noise_key(s, o) for s in range(16) for o in range(64)]  # [1024]
    e = race_noise(keys, 1000, "cpu").double()
    assert torch.isfinite(e).all() and (e > 0).all()
    u = np.sort(np.exp(-e.numpy()).ravel())
    n = len(u)
    assert np.abs(u - (np.arange(1, n + 1) - 0.5) / n).max() < 1.63 / np.sqrt(n)  # alpha 0.01
    assert abs(float(e.mean()) - 1) < 0.005 and abs(float(e.var()) - 1) < 0.01
    a = e.numpy()
    assert abs(np.corrcoef(a[:-1].ravel(), a[1:].ravel())[0, 1]) < 0.005  # next position
    assert abs(np.corrcoef(a[:, :-1].ravel(), a[:, 1:].ravel())[0, 1]) < 0.005  # next token
    # the winner of a race with equal p is uniform over the vocabulary
    wins = np.bincount(a.argmin(-1) % 10, minlength=10)
    assert ((wins - 102.4) ** 2 / 102.4).sum() < 27.9  # chi-square df 9, alpha 0.001
    pick = list(range(len(keys) - 1, -1, -7))
    again = race_noise([keys[i] for i in pick] + [noise_key(99, 0)], 1000, "cpu")
    assert torch.equal(again[:-1], e[pick].float())
    if torch.cuda.is_available():  # integer hashing: the same numbers on the GPU
        assert torch.allclose(race_noise(keys[:8], 1000, "cuda").cpu(), e[:8].float())
