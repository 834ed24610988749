"""One request's grammar state and the masks of its token trees.

``GrammarState`` holds the backend matcher advanced over the request's committed
output. A token tree's node n predicts the token after the path root -> n, so its mask
is the matcher's mask after consuming the candidates on that path. ``masks`` walks the
nodes asked for in order, rolling the matcher back only to the common prefix of the
previous path (a depth-first order costs one consume and one rollback per edge) and
always returns the matcher to the committed state.

Rules at the edges: a node whose path the grammar does not accept, or after which the
grammar has ended, may only be followed by EOS (its mask is the EOS bits), so no row
of a constrained request is ever empty. The commit consumes the tokens the verifier
kept (``commit``); a terminated grammar ends the request.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np


class GrammarState:
    """The grammar of one request, at its committed output.

    vocab_size: the model's vocabulary (mask rows have ``ceil(vocab_size / 32)`` int32
                words, bit t of word t // 32 set when token t is allowed)
    eos_ids:    the tokens that end the output (allowed once the grammar accepts)
    """

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int], stats=None):
        self.m = matcher
        self.stats = stats  # an object with mask_s and masks totals (or None)
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_row = np.zeros(self.words, dtype=np.int32)
        for t in eos_ids:
            if 0 <= t < vocab_size:
                self.eos_row[t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
        self.committed = 0
        self.terminated = False

    def commit(self, token: int) -> bool:
        """Advance over one committed token; True while the output may go on."""
        if self.terminated:
            return False
        ok = self.m.consume(token)
        self.committed += 1
        if not ok or self.m.is_terminated():
            self.terminated = True
        return not self.terminated

    def forced(self) -> list[int]:
        """Tokens the grammar forces from the committed state (may be empty)."""
        if self.terminated:
            return []
        return self.m.forced()

    def masks(self, paths: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(paths), words] int32: the mask after each path (candidate tokens below
        the root, root excluded; an empty path is the committed state)."""
        t0 = time.perf_counter()
        out = np.empty((len(paths), self.words), dtype=np.int32)
        if self.terminated:
            out[:] = self.eos_row
            return out
        cur: list[int] = []  # tokens consumed beyond the committed state
        for i, path in enumerate(paths):
            path = [int(t) for t in path]
            common = 0
            lim = min(len(cur), len(path))
            while common < lim and cur[common] == path[common]:
                common += 1
            self.m.rollback(len(cur) - common)
            del cur[common:]
            rest = path[common:]
            if rest:
                n = self.m.try_consume(rest)
                cur += rest[:n]
                if n < len(rest):  # the grammar does not accept this path
                    out[i] = self.eos_row
                    continue
            if self.m.is_terminated():
                out[i] = self.eos_row
            else:
                self.m.fill_mask(out[i])
                if not out[i].any():
                    out[i] = self.eos_row
        self.m.rollback(len(cur))
        if self.stats is not None:
            self.stats.mask_s += time.perf_counter() - t0
            self.stats.masks += len(paths)
        return out
