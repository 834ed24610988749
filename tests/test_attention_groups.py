"""Attention groups: a batch of short query runs (decodes, token trees) of very different
lengths and histories is split so that no request pays for the largest one's padding;
the split changes no output."""

from __future__ import annotations

import random

import pytest
import torch

from adaserve.kv.cache import KVCache
from adaserve.models import attention
from adaserve.models.attention import AttnMetadata, SeqSpec, _partition
from adaserve.models.loader import load_model


def _batch(qs, ls) -> list[SeqSpec]:
    seqs, base = [], 0
    for q, c in zip(qs, ls):
        seqs.append(
            SeqSpec(list(range(base, base + c)), list(range(base + c, base + c + q)),
                    list(range(c, c + q)))
        )  # fmt: skip
        base += c + q
    return seqs


def test_partition_covers_each_sequence_once_in_batch_order():
    rng = random.Random(0)
    qs = [rng.choice([1, 1, 2, 5, 8, 16, 24, 32]) for _ in range(40)]
    ls = [rng.randint(20, 1500) for _ in range(40)]
    seqs = _batch(qs, ls)
    groups = _partition(seqs, list(range(40)))
    assert sorted(i for g in groups for i in g) == list(range(40))
    assert all(g == sorted(g) for g in groups)
    assert len(groups) > 1  # heterogeneous: split

    # the padded work of the split is far below one group's
    def padded(g):
        return len(g) * max(qs[i] for i in g) * max(ls[i] + qs[i] for i in g)

    assert sum(padded(g) for g in groups) < 0.5 * padded(list(range(40)))
    # alike sequences stay one group
    assert len(_partition(_batch([5] * 16, [400] * 16), list(range(16)))) == 1
    assert _partition(seqs, []) == [] and _partition(seqs, [3]) == [[3]]


@pytest.mark.parametrize("seed", [0, 1])
def test_split_groups_attend_as_one(tiny_pair, monkeypatch, seed):
    """The same forward with the batch split (the default) and as one padded group:
    the same hidden states, so greedy output cannot change."""
    target, _, _ = tiny_pair
    model = load_model(target, torch.device("cpu"), torch.float32, False)
    rng = random.Random(seed)
    qs = [rng.choice([1, 2, 3, 8, 16]) for _ in range(12)]
    ls = [rng.randint(1, 200) for _ in range(12)]
    seqs = _batch(qs, ls)
    kv = KVCache(model.cfg, sum(qs) + sum(ls) + 16, torch.device("cpu"), torch.float32)
    torch.manual_seed(seed)
    for layer in kv.layers:  # a random cached context
        for t in layer:
            t.normal_()
    ids = torch.randint(0, model.cfg.vocab_size, (sum(qs),))
    outs = {}
    for cost in (attention.GROUP_COST_PAIRS, 10**12):
        monkeypatch.setattr(attention, "GROUP_COST_PAIRS", cost)
        meta = AttnMetadata.build(seqs, torch.device("cpu"))
        with torch.inference_mode():
            outs[cost] = (
                model(ids, meta, [tuple(t.clone() for t in lyr) for lyr in kv.layers]),
                len(meta.groups),
            )
    (split, n_split), (one, n_one) = outs.values()
    assert n_one == 1 and n_split > 1
    torch.testing.assert_close(split, one, rtol=1e-4, atol=1e-4)
