"""The batched verifier (``VerifyBatch`` / ``verify``): greedy equals the reference walk,
stochastic is lossless (chi-square against the target), results depend only on the
request itself, and the result reaches the host in one copy."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import chi_square, chi_square_rejects, ref_penalize
from torch.overrides import TorchFunctionMode

from adaserve.core.tree import CandidateTree
from adaserve.sampling import SamplingParams
from adaserve.spec_decode.batch import VerifyBatch, compact_moves
from adaserve.spec_decode.logits import target_probs
from adaserve.spec_decode.verify import verify, verify_device


def children_lists(parents) -> list[list[int]]:
    """Children of each node, in node order (the order verification tries them)."""
    ch: list[list[int]] = [[] for _ in range(len(parents))]
    for i in range(1, len(parents)):
        ch[int(parents[i])].append(i)
    return ch


def verify_greedy(tokens, children: list[list[int]], argmax: list[int]) -> tuple[list[int], int]:
    """The greedy oracle, one tree at a time: walk the tree along the target's argmax;
    returns (accepted nodes excluding the root, bonus token)."""
    node, path = 0, []
    while True:
        want = argmax[node]
        nxt = next((c for c in children[node] if tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


GREEDY = SamplingParams(temperature=0.0)
HOT = SamplingParams(temperature=1.0)


def make_tree(tokens, parents) -> CandidateTree:
    parents = np.asarray(parents, dtype=np.int64)
    depth = np.zeros(len(parents), dtype=np.int64)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    n = len(parents)
    return CandidateTree(
        np.asarray(tokens, dtype=np.int64),
        parents,
        depth,
        np.ones(n),
        np.zeros(n, np.int64),
        np.ones(n),
    )


def random_tree(rng: np.random.Generator, vocab: int, n: int) -> CandidateTree:
    parents = [0] + [int(rng.integers(0, i)) for i in range(1, n)]
    return make_tree(rng.integers(0, vocab, n), parents)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run(trees, params, seeds, logits, q=None) -> list[tuple[list[int], int]]:
    gens = [None if s is None else gen(s) for s in seeds]
    b = VerifyBatch.build(trees, params, gens, draft_q=q)
    res = verify(b, logits)
    return list(zip(res.accepted, res.bonus))


def split(logits: torch.Tensor, trees) -> list[torch.Tensor]:
    return list(torch.split(logits, [len(t.tokens) for t in trees]))


# ---------------------------------------------------------------- greedy
def test_greedy_follows_the_argmax_child_like_the_reference_walk():
    rng = np.random.default_rng(0)
    V = 5  # a small vocabulary: duplicate sibling tokens, many matches
    trees = [random_tree(rng, V, int(rng.integers(1, 14))) for _ in range(300)]
    logits = torch.randn(sum(len(t.tokens) for t in trees), V, generator=gen(1))
    got = run(trees, [GREEDY] * len(trees), [None] * len(trees), logits)
    for t, lg, (path, bonus) in zip(trees, split(logits, trees), got):
        assert (path, bonus) == verify_greedy(
            t.tokens, children_lists(t.parents), lg.argmax(-1).tolist()
        )
    assert sum(len(p) for p, _ in got) > 100  # deep paths were walked
    assert max(len(p) for p, _ in got) >= 3


def test_greedy_takes_the_first_of_equal_siblings():
    # root's children 1, 2, 3 hold tokens 7, 3, 3; the argmax is 3: node 2, not node 3
    t = make_tree([0, 7, 3, 3, 4, 4], [0, 0, 0, 0, 3, 2])
    logits = torch.zeros(6, 8)
    logits[0, 3] = logits[2, 4] = logits[5, 1] = 1.0
    res = verify(VerifyBatch.build([t], [GREEDY], [None]), logits)
    assert res.accepted == [[2, 5]] and res.bonus == [1] and res.num_accepted == [2]
    assert res.new_tokens == [[3, 4, 1]] and res.token_rows == [[0, 2, 5]]


# ---------------------------------------------------------------- penalties
PEN = SamplingParams(
    temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.4
)


def path_tokens(t: CandidateTree, node: int) -> list[int]:
    """The candidates from the root (excluded) down to ``node`` (included)."""
    out = []
    while node != 0:
        out.append(int(t.tokens[node]))
        node = int(t.parents[node])
    return out[::-1]


def test_penalties_apply_per_node_from_its_own_path():
    """Greedy with penalties: each node's argmax is that of its row penalised with the
    prompt, the committed output and the node's own path, in a batch mixing penalised
    and plain requests (the reference walk, one tree at a time)."""
    rng = np.random.default_rng(21)
    V, R = 6, 90
    trees = [random_tree(rng, V, int(rng.integers(1, 12))) for _ in range(R)]
    params = [replace(PEN, temperature=0.0) if i % 3 else GREEDY for i in range(R)]
    hist = [
        (rng.integers(0, V, 4).tolist(), rng.integers(0, V, int(rng.integers(0, 6))).tolist())
        for _ in range(R)
    ]
    logits = 2.0 * torch.randn(sum(len(t.tokens) for t in trees), V, generator=gen(22))
    res = verify(VerifyBatch.build(trees, params, [None] * R, histories=hist), logits)
    changed = 0
    for t, lg, p, (prompt, out), path, bonus in zip(
        trees, split(logits, trees), params, hist, res.accepted, res.bonus
    ):
        want = [
            int(ref_penalize(lg[i], prompt, out + path_tokens(t, i), p).argmax())
            for i in range(len(t.tokens))
        ]
        assert (path, bonus) == verify_greedy(t.tokens, children_lists(t.parents), want)
        changed += want != lg.argmax(-1).tolist()
    assert changed > R // 3  # the penalties did change decisions
    with pytest.raises(ValueError, match="history"):
        VerifyBatch.build(trees[:1], [PEN], [None])


# ---------------------------------------------------------------- batch composition
def _mixed(rng: np.random.Generator, V: int, n: int):
    trees, params, seeds, q = [], [], [], []
    for i in range(n):
        t = random_tree(rng, V, int(rng.integers(1, 10))) if i % 5 else CandidateTree.root_only(1)
        trees.append(t)
        kind = i % 3
        params.append([GREEDY, HOT, SamplingParams(temperature=0.7, top_p=0.9)][kind])
        seeds.append(None if kind == 0 else 1000 + i)
        rows = torch.softmax(torch.randn(len(t.tokens), V, generator=gen(i)), -1)
        q.append({k: rows[k] for k in range(len(t.tokens))} if i % 2 else None)
    return trees, params, seeds, q


def test_mixed_batch_results_do_not_depend_on_the_other_requests():
    rng = np.random.default_rng(2)
    V = 7
    trees, params, seeds, q = _mixed(rng, V, 60)
    logits = torch.randn(sum(len(t.tokens) for t in trees), V, generator=gen(3))
    rows = split(logits, trees)
    batched = run(trees, params, seeds, logits, q)
    alone = [run([t], [p], [s], r, [d])[0] for t, p, s, r, d in zip(trees, params, seeds, rows, q)]
    assert batched == alone
    # another composition and order: the reversed second half, next to other requests
    others, op, osd, oq = _mixed(np.random.default_rng(9), V, 20)
    idx = list(range(59, 29, -1))
    mix_t = others[:10] + [trees[i] for i in idx] + others[10:]
    o_rows = split(torch.randn(sum(len(t.tokens) for t in others), V, generator=gen(4)), others)
    mix_logits = torch.cat(o_rows[:10] + [rows[i] for i in idx] + o_rows[10:])
    got = run(
        mix_t,
        op[:10] + [params[i] for i in idx] + op[10:],
        osd[:10] + [seeds[i] for i in idx] + osd[10:],
        mix_logits,
        oq[:10] + [q[i] for i in idx] + oq[10:],
    )
    assert got[10:40] == [batched[i] for i in idx]
    for t, lg, p, (path, bonus) in zip(trees, rows, params, batched):  # greedy ones: the walk
        if p.greedy:
            assert (path, bonus) == verify_greedy(
                t.tokens, children_lists(t.parents), lg.argmax(-1).tolist()
            )


def test_same_seed_same_tokens_other_seed_other_tokens():
    rng = np.random.default_rng(5)
    V = 9
    trees = [random_tree(rng, V, 8) for _ in range(40)]
    logits = torch.randn(320, V, generator=gen(6))
    a = run(trees, [HOT] * 40, list(range(40)), logits)
    assert a == run(trees, [HOT] * 40, list(range(40)), logits)
    assert a != run(trees, [HOT] * 40, list(range(100, 140)), logits)


def test_root_only_requests_draw_their_token_from_one_uniform():
    """A root-only stochastic request's token is the inverse CDF of the target
    distribution at ``torch.rand(1, float64)`` of its generator; greedy: the argmax."""
    V = 10
    logits = torch.randn(6, V, generator=gen(7))
    sp = SamplingParams(temperature=0.8, top_k=5)
    trees = [CandidateTree.root_only(3) for _ in range(6)]
    params = [GREEDY, sp, sp, GREEDY, sp, HOT]
    got = run(trees, params, [None, 1, 2, None, 3, 4], logits)
    for i, (path, bonus) in enumerate(got):
        assert path == []
        if params[i].greedy:
            assert bonus == int(logits[i].argmax())
            continue
        u = float(torch.rand(1, generator=gen([None, 1, 2, None, 3, 4][i]), dtype=torch.float64))
        cdf = np.cumsum(target_probs(logits[i : i + 1], params[i])[0].double().numpy())
        assert bonus == int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    assert run([], [], [], torch.zeros(0, V)) == []


def test_q_rows_are_gathered_through_the_subtree_origin():
    full = make_tree([0, 1, 2, 3, 4, 5], [0, 0, 0, 1, 1, 2])
    sub = full.subtree(np.array([0, 2, 5]))
    rows = {0: torch.full((4,), 0.25), 2: torch.tensor([0.1, 0.2, 0.3, 0.4]), 4: torch.ones(4)}
    b = VerifyBatch.build(
        [CandidateTree.root_only(0), sub], [HOT, HOT], [gen(0), gen(1)], draft_q=[rows, rows]
    )
    assert b.use_q == [False, True]  # root-only: nothing to verify against q
    assert torch.equal(b.draft_q[1], rows[0]) and torch.equal(b.draft_q[2], rows[2])
    assert not b.draft_q[0].any() and not b.draft_q[3].any()  # node 5 (a leaf) has no row


def test_build_lays_out_rows_and_edges():
    trees = [
        make_tree([0, 1, 2, 3], [0, 0, 0, 1]),
        CandidateTree.root_only(5),
        make_tree([0, 1], [0, 0]),
    ]
    b = VerifyBatch.build(trees, [HOT, GREEDY, HOT], [gen(0), None, gen(1)], first_rows=[10, 3, 40])
    assert b.cu_nodes.tolist() == [0, 4, 5, 7]
    assert b.hidden_rows.tolist() == [10, 11, 12, 13, 3, 40, 41]
    assert b.parents.tolist() == [0, 0, 0, 1, 4, 5, 5]
    assert b.max_depth == 2 and b.stochastic.tolist() == [0, 2]
    # rank 0: node 0's child 1, node 1's child 3, node 5's child 6; rank 1: node 0's child 2
    assert [(s.parent.tolist(), s.child.tolist()) for s in b.sibling_steps] == [
        ([0, 1, 5], [1, 3, 6]),
        ([0], [2]),
    ]
    with pytest.raises(ValueError, match="parents before children"):
        VerifyBatch.build([make_tree([0, 1, 2], [0, 2, 0])], [HOT], [gen(0)])


def test_compact_moves_put_the_accepted_path_after_the_root():
    # tree written at positions C-1+node (C = 10); accepted node path[j] -> position C+j
    assert compact_moves([1, 3, 4], 10) == ([12, 13], [11, 12])
    assert compact_moves([2, 3], 10) == ([11, 12], [10, 11])
    assert compact_moves([1, 2], 10) == ([], [])
    assert compact_moves([], 10) == ([], [])


# ---------------------------------------------------------------- host syncs
HOST_COPIES = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
SYNCING = {"nonzero", "argwhere", "masked_select", "unique", "repeat_interleave"}


class _Syncs(TorchFunctionMode):
    """Records the calls that copy device data to the host (or need its values to
    size a result): the ones that stall a GPU stream."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_COPIES or name in SYNCING:
            self.calls.append(name)
        if name == "to" and any(str(a) == "cpu" for a in [*args[1:], *kwargs.values()]):
            self.calls.append(name)
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put"):
            idx = args[1] if len(args) > 1 else None
            for i in idx if isinstance(idx, (tuple, list)) else [idx]:
                if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
                    self.calls.append(f"{name}[bool]")
        if name == "where" and len(args) + len(kwargs) == 1:
            self.calls.append("where(cond)")
        return func(*args, **kwargs)


def test_the_result_reaches_the_host_in_one_copy():
    rng = np.random.default_rng(8)
    V = 7
    trees, params, seeds, q = _mixed(rng, V, 30)
    params = [replace(p, repetition_penalty=1.3) if i % 4 == 1 else p for i, p in enumerate(params)]
    logits = torch.randn(sum(len(t.tokens) for t in trees), V)
    gens = [None if s is None else gen(s) for s in seeds]
    hist = [([1, 2], [3])] * 30
    b = VerifyBatch.build(trees, params, gens, draft_q=q, histories=hist)
    assert b.penalties is not None
    with _Syncs() as m:
        out = verify_device(b, logits)
    assert m.calls == [] and out.shape == (30, b.max_depth + 1)
    with _Syncs() as m:
        verify(b, logits)
    assert m.calls == ["tolist"]


# ---------------------------------------------------------------- distribution
V_SMALL = 12
PROMPT = (3, 7, 1, 4)
N_REQ = 8000
# root -> 3 children; the first two -> 2 children each (depth 2, 7 candidates)
SHAPE = [0, 0, 0, 0, 1, 1, 2, 2]


def _logits(prefix: tuple, salt: int) -> torch.Tensor:
    """A stand-in model: fixed random logits [V] for each prefix."""
    seed = salt
    for x in prefix:
        seed = (seed * 1_000_003 + x + 1) % (1 << 61)
    return 1.6 * torch.randn(V_SMALL, generator=gen(seed))


def target_logits(prefix: tuple) -> torch.Tensor:
    return _logits(prefix, 1)


def draft_logits(prefix: tuple) -> torch.Tensor:
    """Correlated with the target, so that paths of two are accepted often."""
    return 0.7 * target_logits(prefix) + 0.8 * _logits(prefix, 2)


def processed(logits: torch.Tensor, prefix: tuple, sp: SamplingParams) -> torch.Tensor:
    """The processed distribution [V] after ``prefix`` (PROMPT + output): the
    reference penalties of the output so far, then ``target_probs``."""
    out = prefix[len(PROMPT) :]
    return target_probs(ref_penalize(logits, PROMPT, out, sp)[None], sp)[0]


def exact_joint(sp: SamplingParams) -> np.ndarray:
    p1 = processed(target_logits(PROMPT), PROMPT, sp)
    p2 = torch.stack(
        [processed(target_logits(PROMPT + (x,)), PROMPT + (x,), sp) for x in range(V_SMALL)]
    )
    return (p1[:, None] * p2).double().numpy()


def sample_joint(sp: SamplingParams, sampled: bool, with_q: bool, seeded=False) -> np.ndarray:
    """Counts of the first two tokens of N_REQ requests: one batched verification of
    a depth-2 tree each, then (for those that gained one token) a root-only step.

    sampled: children drawn i.i.d. from the draft distribution q (else its top-k);
    with_q:  verify against q (the right pairing is with_q == sampled);
    seeded:  request i has ``seed=i`` (position-keyed noise; q is then unused)."""
    draft_gen = gen(12345)
    trees, qs, rows = [], [], []
    cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def at(prefix):
        if prefix not in cache:
            cache[prefix] = (
                target_logits(prefix),
                processed(draft_logits(prefix), prefix, sp),  # the draft penalised too
            )
        return cache[prefix]

    for _ in range(N_REQ):
        tokens, prefixes = [PROMPT[-1]], [PROMPT]
        nchild = np.bincount(SHAPE[1:], minlength=len(SHAPE))
        for i in range(1, len(SHAPE)):
            par = SHAPE[i]
            q = at(prefixes[par])[1]
            if sampled:
                x = int(torch.multinomial(q, 1, generator=draft_gen))
            else:
                x = int(q.topk(nchild[par]).indices[i - SHAPE.index(par, 1)])
            tokens.append(x)
            prefixes.append(prefixes[par] + (x,))
        trees.append(make_tree(tokens, SHAPE))
        rows.append(torch.stack([at(p)[0] for p in prefixes]))
        qs.append({n: at(prefixes[n])[1] for n in set(SHAPE)} if with_q else None)
    gens = [gen(i) for i in range(N_REQ)]
    ps = [replace(sp, seed=i) for i in range(N_REQ)] if seeded else [sp] * N_REQ
    hist = [(PROMPT, ())] * N_REQ
    res = verify(VerifyBatch.build(trees, ps, gens, draft_q=qs, histories=hist), torch.cat(rows))
    # speculation did its part (seeded: the mass of the children, q does not help)
    assert sum(res.num_accepted) > (0.3 if seeded else 0.4) * N_REQ
    assert sum(n == 2 for n in res.num_accepted) > 0.05 * N_REQ
    counts = np.zeros((V_SMALL, V_SMALL))
    again = [i for i, n in enumerate(res.new_tokens) if len(n) == 1]
    for n in res.new_tokens:
        if len(n) > 1:
            counts[n[0], n[1]] += 1
    if again:  # their second token: a root-only step, the same generators going on
        x1 = [res.new_tokens[i][0] for i in again]
        b = VerifyBatch.build(
            [CandidateTree.root_only(x) for x in x1],
            [ps[i] for i in again],
            [gens[i] for i in again],
            out_index=[1] * len(again),  # their second output token
            histories=[(PROMPT, (x,)) for x in x1],
        )
        res2 = verify(b, torch.stack([target_logits(PROMPT + (x,)) for x in x1]))
        for x, x2 in zip(x1, res2.bonus):
            counts[x, x2] += 1
    return counts


@pytest.mark.parametrize(
    "temperature, top_p, top_k, min_p, sampled",
    [
        (1.0, 1.0, 0, 0.0, False),
        (1.0, 0.8, 0, 0.0, False),
        (1.2, 1.0, 6, 0.0, False),
        (1.0, 1.0, 0, 0.0, True),
        (1.5, 0.9, 0, 0.0, True),
        (1.5, 1.0, 0, 0.05, True),
    ],
)
def test_batched_stochastic_verification_matches_the_target_distribution(
    temperature, top_p, top_k, min_p, sampled
):
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    probs = exact_joint(sp)
    counts = sample_joint(sp, sampled, with_q=sampled)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3f}")
    assert not chi_square_rejects(counts, probs), (stat, df, p)


def test_q_acceptance_of_top_k_children_fails_the_distribution_test():
    """Negative control: ``min(1, p/q)`` acceptance holds only for children drawn from
    q; on the draft's top-k it is not lossless. (The residual method without q is
    lossless however the children were chosen, so it makes no negative control.)"""
    sp = SamplingParams(temperature=1.0)
    probs = exact_joint(sp)
    counts = sample_joint(sp, sampled=False, with_q=True)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3g}")
    assert chi_square_rejects(counts, probs), (stat, df, p)


@pytest.mark.parametrize("sampled, seeded", [(False, False), (True, False), (True, True)])
def test_batched_verification_with_penalties_matches_the_target_distribution(sampled, seeded):
    """Presence, frequency and repetition penalties under a branching tree: the first
    two tokens have the joint distribution of the penalised target (the second token's
    row penalised with the first)."""
    probs = exact_joint(PEN)
    assert np.abs(probs - exact_joint(SamplingParams(temperature=1.0))).sum() > 0.2
    counts = sample_joint(PEN, sampled, with_q=sampled, seeded=seeded)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3f}")
    assert not chi_square_rejects(counts, probs), (stat, df, p)


def test_penalties_without_the_nodes_paths_fail_the_distribution_test(monkeypatch):
    """Negative control: penalising every node with the committed tokens only (not its
    path's candidates) is not lossless."""
    import adaserve.spec_decode.batch as vb

    monkeypatch.setattr(vb, "tree_paths", lambda parents, tokens: [[] for _ in tokens])
    probs = exact_joint(PEN)
    counts = sample_joint(PEN, sampled=False, with_q=False)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3g}")
    assert chi_square_rejects(counts, probs), (stat, df, p)


# ---------------------------------------------------------------- seeded sampling
@pytest.mark.parametrize(
    "temperature, top_p, top_k, min_p, sampled",
    [
        (1.0, 1.0, 0, 0.0, False),
        (1.2, 0.9, 6, 0.0, False),
        (1.5, 1.0, 0, 0.05, True),
    ],
)
def test_batched_seeded_verification_matches_the_target_distribution(
    temperature, top_p, top_k, min_p, sampled
):
    """Seeded requests (one seed each) verified against the perturbed argmax: the
    first two tokens have the target's joint distribution."""
    sp = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p)
    probs = exact_joint(sp)
    counts = sample_joint(sp, sampled, with_q=sampled, seeded=True)
    stat, df, p = chi_square(counts, probs)
    print(f"chi2={stat:.1f} df={df} p={p:.3f}")
    assert not chi_square_rejects(counts, probs), (stat, df, p)


def seeded_chain(sp: SamplingParams, n: int) -> list[int]:
    """Non-speculative seeded sampling with the stand-in model: token o is
    ``argmax p / E`` with the noise of ``noise_key(seed, o)``."""
    from adaserve.spec_decode.logits import noise_key, race_noise

    prefix = PROMPT
    for o in range(n):
        p = target_probs(target_logits(prefix)[None], sp)[0]
        e = race_noise([noise_key(sp.seed, o)], V_SMALL, "cpu")[0]
        prefix += (int((p / e).argmax()),)
    return list(prefix[len(PROMPT) :])


def test_seeded_tokens_do_not_depend_on_the_tree():
    """Whatever the trees (random shapes and tokens, the chain itself, nothing) and the
    batch, a seeded request's tokens are those of seeded sampling without speculation."""
    rng = np.random.default_rng(13)
    sp = SamplingParams(temperature=1.0, top_p=0.95)
    n_out = 8
    want = {s: seeded_chain(replace(sp, seed=s), n_out) for s in range(12)}
    greedy_hit = 0
    for trial in range(6):
        # 12 seeded requests, each decoding from its own progress, plus unseeded ones
        state = {s: [] for s in want}
        while any(len(v) < n_out for v in state.values()):
            trees, params, gens, rows, outs = [], [], [], [], []
            for s, got in state.items():
                if len(got) >= n_out:
                    continue
                prefix = PROMPT + tuple(got)
                kind = rng.integers(0, 3)
                if kind == 0:  # the right chain continued by random tokens
                    k = int(rng.integers(1, 5))
                    chain = want[s][len(got) : len(got) + k]
                    t = make_tree([prefix[-1]] + chain, [0] + list(range(len(chain))))
                elif kind == 1:
                    t = random_tree(rng, V_SMALL, int(rng.integers(2, 12)))
                    t.tokens[0] = prefix[-1]
                else:
                    t = CandidateTree.root_only(prefix[-1])
                pre = [prefix]
                for i in range(1, len(t.tokens)):
                    pre.append(pre[int(t.parents[i])] + (int(t.tokens[i]),))
                trees.append(t)
                params.append(replace(sp, seed=s))
                gens.append(gen(int(rng.integers(1 << 30))))  # unused by seeded requests
                rows.append(torch.stack([target_logits(x) for x in pre]))
                outs.append(len(got))
            for i in range(int(rng.integers(0, 4))):  # unseeded and greedy neighbours
                t = random_tree(rng, V_SMALL, int(rng.integers(1, 8)))
                trees.append(t)
                params.append(HOT if i % 2 else GREEDY)
                gens.append(gen(i))
                rows.append(torch.randn(len(t.tokens), V_SMALL, generator=gen(99 + i)))
                outs.append(int(rng.integers(0, 50)))
            order = rng.permutation(len(trees))
            pick = [int(i) for i in order]
            res = verify(
                VerifyBatch.build(
                    [trees[i] for i in pick],
                    [params[i] for i in pick],
                    [gens[i] for i in pick],
                    out_index=[outs[i] for i in pick],
                ),
                torch.cat([rows[i] for i in pick]),
            )
            for j, i in enumerate(pick):
                if params[i].seed is not None:
                    state[params[i].seed] += res.new_tokens[j]
                    greedy_hit += res.num_accepted[j]
        for s, got in state.items():
            assert got[:n_out] == want[s], (trial, s)
    assert greedy_hit > 50  # speculation accepted tokens along the way
    # and the noise is the seed's: other seeds give other tokens
    assert len({tuple(v) for v in want.values()}) == len(want)
