"""Draft-model tree expansion, batched over every speculating request.

Step 0 feeds each request's tokens the draft cache lacks (``tokens[draft_cached:]``,
the committed tokens up to and including the root) as one causal chunk; its last
logits give the root's children. Each later step feeds the current frontier of every
request in one batched forward: a frontier node attends to the committed prefix and
to its own ancestors among the scratch slots (``prefix_mask``). Scratch slots are the
slot indices ``C, C+1, ...`` past the committed length ``C``; they are overwritten by
the next step 0, so the draft cache needs no compaction (``draft_cached = C``, which
the step's commit carries to the scheduler).

Penalties: a request with presence / frequency / repetition penalties has each
frontier row of the draft penalised with the counts of that node's own path (as the
verifier does for the target, ``spec_decode.penalties``), so the draft proposes from
the distribution the target will be verified with. Losslessness does not need it
(sampled drafts are verified against the q they were drawn from), acceptance does.

Beam expansion: every fed node gets its top-w children (by draft probability, or w
i.i.d. samples from q in ``sample`` mode) as candidates; the w candidates with the
highest path probability form the next frontier.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from adaserve.core.tree import CandidateTree
from adaserve.kv.cache import KVCache
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.llama import LlamaModel
from adaserve.spec_decode import grammar
from adaserve.spec_decode.logits import add_logit_bias, bad_word_bans, ban_tokens, target_probs
from adaserve.spec_decode.penalties import PenaltyRows
from adaserve.spec_decode.request import Request


@dataclass
class DraftOutput:
    """Candidates of one request plus, in sample mode, the q rows of expanded nodes.

    q_rows: node index -> [V] draft distribution its children were sampled from
    fed:    number of nodes fed to the draft (scratch slots used)
    """

    tree: CandidateTree
    q_rows: dict[int, torch.Tensor]
    fed: int
    # nodes 1..forced are the grammar's forced tokens, a chain below the root that
    # no draft step proposed (the draft only read them); 0: none
    forced: int = 0
    # a constrained request's grammar mask rows of the nodes the draft expanded (node
    # index -> [W] int32), reused by the verifier
    masks: dict[int, np.ndarray] = field(default_factory=dict)


class _Growing:
    def __init__(self, root: int):
        self.tokens = [root]
        self.parents = [0]
        self.depth = [0]
        self.q = [1.0]
        self.rank = [0]
        self.logp = [0.0]
        self.fed_nodes: list[int] = []  # scratch order
        self.level_start = 1  # first node index of the newest depth level
        self.q_rows: dict[int, torch.Tensor] = {}
        self.masks: dict[int, np.ndarray] = {}

    def path(self, node: int) -> list[int]:
        """The candidate tokens from below the root down to ``node``."""
        out = []
        while node != 0:
            out.append(self.tokens[node])
            node = self.parents[node]
        return out[::-1]

    def add(self, parent: int, token: int, q: float, rank: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depth.append(self.depth[parent] + 1)
        self.q.append(q)
        self.rank.append(rank)
        self.logp.append(self.logp[parent] + math.log(max(q, 1e-30)))
        return len(self.tokens) - 1

    def ancestors(self, node: int) -> set[int]:
        out = set()
        while node != 0:
            out.add(node)
            node = self.parents[node]
        return out

    def finish(self) -> CandidateTree:
        return CandidateTree(
            tokens=np.array(self.tokens, dtype=np.int64),
            parents=np.array(self.parents, dtype=np.int64),
            depth=np.array(self.depth, dtype=np.int64),
            q=np.array(self.q, dtype=np.float64),
            rank=np.array(self.rank, dtype=np.int64),
            f=np.array(self.q, dtype=np.float64),  # replaced by the calibrator
        )


@torch.inference_mode()
def expand(
    model: LlamaModel,
    kv: KVCache,
    reqs: list[Request],
    shapes: list[tuple[int, int]],
    sample: bool = False,
    noise_std: float = 0.0,
    vocab_size: int | None = None,
    forced: list[list[int]] | None = None,
    passes: list[tuple[int, int]] | None = None,
) -> list[DraftOutput]:
    """Grow a candidate tree of depth d and width w for each request (shapes[i] = (d, w)).

    ``passes``: when given, one (tokens fed, context tokens attended) pair is appended
    per forward pass of the draft, the catch-up pass first (``core.trace.DraftWork``).

    ``forced``: per request, tokens its grammar forces after the root (may be empty).
    They become a chain below the root (q = 1) that the draft reads in its catch-up
    step, with no draft step of their own; the d levels of drafted candidates grow
    from the chain's end. The caller's reservation then covers ``len(forced[i])``
    scratch slots more.

    ``sample``: draw children i.i.d. from q for requests that do not decode greedily
    and have no seed (otherwise children are the draft's top-w: seeded requests are
    verified against a perturbed argmax, not against q).
    ``vocab_size``: the target's vocabulary when it differs from the draft's (Qwen2.5's
    0.5B has 151,936 rows, its larger siblings 152,064: padding past the same 151,665
    tokens). Draft distributions are then over the target's ids (no mass on ids the
    draft lacks, none proposed that the target lacks), and target-only ids in a
    sequence enter the draft as its last id.
    The caller guarantees each request's block table covers
    ``len(tokens) + len(forced[i]) + scratch_slots_needed(d, w)`` slots.
    """
    device = model.embed_tokens.weight.device
    window = model.cfg.sliding_window
    Vd = model.cfg.vocab_size
    Vt = vocab_size or Vd

    def forward(ids: list[int], meta: AttnMetadata, rows=None) -> torch.Tensor:
        """ids [T] -> draft logits [rows or T, Vt]."""
        x = torch.tensor(ids, dtype=torch.long, device=device)
        if Vt > Vd:
            x = x.clamp_(max=Vd - 1)
        h = model(x, meta, kv.layers)
        logits = model.logits(h if rows is None else h[rows])
        if Vt < Vd:
            return logits[:, :Vt]
        if Vt > Vd:
            return F.pad(logits, (0, Vt - Vd), value=float("-inf"))
        return logits

    forced = forced or [[] for _ in reqs]
    grows = [_Growing(r.tokens[-1]) for r in reqs]
    for r, g, chain in zip(reqs, grows, forced):
        sampled = sample and not r.params.greedy and r.params.seed is None
        for k, tok in enumerate(chain):
            g.fed_nodes.append(g.add(k, int(tok), 1.0, 0))  # in scratch slots C, C+1, ...
            if sampled:  # verified against q: the chain's q is one-hot on its token
                g.q_rows[k] = F.one_hot(torch.tensor(int(tok), device=device), Vt).float()
    # ---- step 0: catch up the draft cache (and read the forced chain); last logits ->
    # the children of the root (or of the chain's end)
    seqs, ids = [], []
    for r, chain in zip(reqs, forced):
        C, dc = len(r.tokens), r.draft_cached
        end = C + len(chain)
        assert r.table is not None  # a running request has a table
        seqs.append(SeqSpec(r.table.slots(0, dc), r.table.slots(dc, end), list(range(dc, end))))
        ids.extend(r.tokens[dc:C])
        ids.extend(int(t) for t in chain)
    meta = AttnMetadata.build(seqs, device, window)
    ends = np.cumsum([len(s.new_slots) for s in seqs]) - 1
    logits = forward(ids, meta, torch.as_tensor(ends, device=device))
    if passes is not None:
        passes.append((len(ids), sum(len(s.prefix_slots) for s in seqs)))
    # the draft cache now holds each request's len(tokens): the step's commit says so
    # (``Commit.draft_cached``), the scheduler writes it
    # nodes whose logits rows we hold
    frontier: list[list[int]] = [[len(chain)] for chain in forced]
    active = list(range(len(reqs)))
    for t in range(1, max((d for d, _ in shapes), default=0) + 1):
        if noise_std > 0:
            logits = logits + noise_std * torch.randn_like(logits)
        _add_children(logits, grows, frontier, active, reqs, shapes, sample)
        nxt_active = [i for i in active if shapes[i][0] > t]
        if not nxt_active:
            break
        # choose next frontier: top-w new nodes (depth t) by path probability
        seqs, ids, new_frontier = [], [], {}
        for i in nxt_active:
            g, w = grows[i], shapes[i][1]
            cand = range(g.level_start, len(g.tokens))  # nodes added at depth t
            chosen = sorted(sorted(cand, key=lambda n: -g.logp[n])[:w])
            new_frontier[i] = chosen
            r = reqs[i]
            C = len(r.tokens)
            n_prev = len(g.fed_nodes)
            assert r.table is not None  # a running request has a table
            prefix = r.table.slots(0, C + n_prev)
            pmask = np.ones((len(chosen), C + n_prev), dtype=bool)
            for row, node in enumerate(chosen):
                anc = g.ancestors(node)
                pmask[row, C:] = [f in anc for f in g.fed_nodes]
            new_slots = r.table.slots(C + n_prev, C + n_prev + len(chosen))
            g.fed_nodes.extend(chosen)
            seqs.append(
                SeqSpec(
                    prefix,
                    new_slots,
                    [C - 1 + g.depth[n] for n in chosen],
                    new_mask=np.eye(len(chosen), dtype=bool),
                    prefix_mask=pmask,
                )
            )
            ids.extend(g.tokens[n] for n in chosen)
        logits = forward(ids, AttnMetadata.build(seqs, device, window))
        if passes is not None:
            passes.append((len(ids), sum(len(s.prefix_slots) for s in seqs)))
        frontier = [new_frontier.get(i, []) for i in range(len(reqs))]
        active = nxt_active
    return [
        DraftOutput(g.finish(), g.q_rows, len(g.fed_nodes), len(f), g.masks)
        for g, f in zip(grows, forced)
    ]


def _penalised(logits, grows, frontier, active, reqs) -> torch.Tensor:
    """logits [F, V] of the active requests' frontier rows (request order) with each
    penalised request's rows penalised by their own paths' counts."""
    contexts, rows, row = [], [], 0
    for i in active:
        r, g = reqs[i], grows[i]
        if r.params.penalized:
            contexts.append((r.prompt_ids, r.output_ids, r.params))
            rows.append(
                [
                    (row + j, [g.tokens[a] for a in g.ancestors(node)])
                    for j, node in enumerate(frontier[i])
                ]
            )
        row += len(frontier[i])
    if not contexts:
        return logits
    return PenaltyRows.build(contexts, rows, logits.device).apply(logits)


def _biased(logits, frontier, active, reqs) -> torch.Tensor:
    """logits [F, V] with each logit_bias request's frontier rows biased (the draft
    proposes from the distribution the target is verified with)."""
    row, out = 0, logits
    for i in active:
        n = len(frontier[i])
        bias = reqs[i].params.logit_bias
        if bias and n:
            if out is logits:
                out = logits.clone()
            add_logit_bias(out, range(row, row + n), bias)
        row += n
    return out


def _banned(logits, grows, frontier, active, reqs) -> torch.Tensor:
    """logits [F, V] with the bad words' completing tokens at -inf in each frontier
    row of a request with ``bad_words`` (as the verifier bans them)."""
    bans, row = [], 0
    for i in active:
        r, g = reqs[i], grows[i]
        if r.bad_words_ids:
            out = r.output_ids
            for j, node in enumerate(frontier[i]):
                ids = bad_word_bans(out + g.path(node), r.bad_words_ids)
                if ids:
                    bans.append((row + j, ids))
        row += len(frontier[i])
    if not bans:
        return logits
    logits = logits.clone()
    ban_tokens(logits, bans)
    return logits


def _constrained(logits, grows, frontier, active, reqs) -> torch.Tensor:
    """logits [F, V] with each constrained request's frontier rows masked by the
    grammar state of that node's path (the masks are kept for the verifier)."""
    rows: list[Any] = []
    masks: list[Any] = []
    row = 0
    for i in active:
        r, g = reqs[i], grows[i]
        n = len(frontier[i])
        if r.grammar is not None and n:
            m = r.grammar.masks([g.path(node) for node in frontier[i]])
            for j, node in enumerate(frontier[i]):
                g.masks[node] = m[j]
            rows.extend(range(row, row + n))
            masks.append(m)
        row += n
    if not rows:
        return logits
    logits = logits.clone()
    grammar.apply(logits, rows, np.concatenate(masks))
    return logits


def _add_children(logits, grows, frontier, active, reqs, shapes, sample: bool) -> None:
    """Append children of each active request's frontier rows (rows in request order)."""
    logits = _biased(logits, frontier, active, reqs)  # as the target: bias, penalties, mask
    logits = _penalised(logits, grows, frontier, active, reqs)
    logits = _banned(logits, grows, frontier, active, reqs)
    logits = _constrained(logits, grows, frontier, active, reqs)
    wmax = max(shapes[i][1] for i in active)
    top = logits.softmax(-1).topk(wmax, dim=-1)
    vals, idx = top.values.tolist(), top.indices.tolist()
    row = 0
    for i in active:
        g, w = grows[i], shapes[i][1]
        n = len(frontier[i])
        g.level_start = len(g.tokens)
        # seeded requests are verified against the target's perturbed argmax, not q:
        # their best children are the draft's most likely ones, as for greedy ones
        if not sample or reqs[i].params.greedy or reqs[i].params.seed is not None:
            for node in frontier[i]:
                for k in range(w):
                    if vals[row][k] <= 0.0 and reqs[i].grammar is not None:
                        break  # fewer tokens allowed than the width
                    g.add(node, idx[row][k], vals[row][k], k)
                row += 1
            continue
        q = target_probs(logits[row : row + n], reqs[i].params)
        draws = torch.multinomial(q, w, replacement=True, generator=reqs[i].gen).tolist()
        qv = q.gather(1, torch.tensor(draws, device=q.device)).tolist()
        for j, node in enumerate(frontier[i]):
            g.q_rows[node] = q[j]
            for k in range(w):
                g.add(node, draws[j][k], qv[j][k], k)
        row += n
