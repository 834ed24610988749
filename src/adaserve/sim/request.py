"""A simulated request: the scheduler's ``SeqState`` with token counts instead of
tokens, and the statistics the simulator's records report."""

from __future__ import annotations

from adaserve.bench.workload_spec import WorkItem
from adaserve.core.seq import SeqState
from adaserve.core.slo import SLO


class SimRequest(SeqState):
    """A simulated request: token counts instead of tokens."""

    __slots__ = (
        "item",
        "target",
        "_prompt_len",
        "_max_tokens",
        "n_tokens",
        "token_times",
        "drafted",
        "verified",
        "accepted",
        "steps",
        "regime",
        "regime_pos",
        "easy_share",
    )

    def __init__(self, item: WorkItem, slo: SLO):
        super().__init__(item.idx, slo, item.arrival_s)
        self.item = item
        self.target = slo  # the SLO the request is judged against
        self._prompt_len = item.prompt_len
        self._max_tokens = item.max_tokens
        self.n_tokens = item.prompt_len
        self.token_times: list[float] = []
        self.drafted = 0
        self.verified = 0
        self.accepted = 0
        self.steps = 0
        self.regime = -1  # acceptance regime at token position regime_pos - 1 (-1: unknown)
        self.regime_pos = 0
        self.easy_share = 0.0  # per-request share of easy positions (request_spread)

    @property
    def num_tokens(self) -> int:
        return self.n_tokens

    def block_tokens(self, start: int, stop: int):
        """The item's prompt ids, then (a recorded run's outputs, else) ids no prompt
        holds: a simulated output is never found in another request's prompt."""
        ids = self.item.prompt_ids
        if ids is None:
            return None
        full = self.item.meta.get("tokens")
        if full is not None and stop <= len(full):
            return full[start:stop]
        base = -(self.rid + 1) << 24
        return [ids[i] if i < len(ids) else base - i for i in range(start, stop)]

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def max_new_tokens(self) -> int:
        return self._max_tokens
