"""Baseline policies with fixed behaviour: autoregressive and static speculation."""

from __future__ import annotations

from typing import Any

import numpy as np

from adaserve.core.policy import BatchView, Plan, Policy, ReqView, chunk_prefills, top_f_nodes
from adaserve.core.tree import CandidateTree

WHOLE_PROMPT_BUDGET = 8192  # `ar` prefills whole prompts (vLLM v0 style)


class AutoregressivePolicy(Policy):
    """``ar``: FCFS continuous batching, whole-prompt prefill, no speculation
    (vLLM v0 style). Base of ``ar-chunked`` and ``priority``."""

    name = "ar"
    uses_draft = False

    def __init__(self, chunk: int = 256):
        self.chunk = chunk

    def plan(self, view: BatchView) -> Plan:
        """The iteration's plan: whole prompts prefilled, FCFS."""
        return Plan(prefill=chunk_prefills(view, WHOLE_PROMPT_BUDGET))


class ChunkedAutoregressivePolicy(AutoregressivePolicy):
    """``ar-chunked``: prefill chunked to a per-iteration token budget (Sarathi-Serve),
    FCFS, no speculation."""

    name = "ar-chunked"

    def plan(self, view: BatchView) -> Plan:
        """The iteration's plan: prefill chunks of ``chunk`` tokens in view order."""
        return Plan(prefill=chunk_prefills(view, self.chunk))


class PriorityPolicy(ChunkedAutoregressivePolicy):
    """``priority``: strict classes first (admission and prefill), chunked prefill,
    no speculation."""

    name = "priority"

    def plan(self, view: BatchView) -> Plan:
        """The iteration's plan: prefill chunks, strict classes first, then the
        longest waiting."""
        return Plan(prefill=chunk_prefills(view, self.chunk, _strict_first))

    def admission_key(self, waiting: ReqView) -> tuple[Any, ...]:
        """The admission sort key: strict classes first, then the longest waiting."""
        return _strict_first(waiting)


def _strict_first(r: ReqView) -> tuple[Any, ...]:
    """The order of ``priority``: class rank, then the longest waiting first."""
    return (r.rank, -r.waited_ms)


AUTOREGRESSIVE_POLICIES: dict[str, type[AutoregressivePolicy]] = {
    p.name: p for p in (AutoregressivePolicy, ChunkedAutoregressivePolicy, PriorityPolicy)
}


class StaticSpecPolicy(Policy):
    """``spec-chain:K``: a chain of K draft tokens per request (vLLM speculative decoding).
    ``spec-tree[:DxW[:N]]``: a static tree per request, the N best candidates of a
    depth-D width-W beam tree, no global budget (SpecInfer). Default 5x3, N = 23."""

    def __init__(self, name: str, depth: int, width: int, max_nodes: int | None, chunk: int = 256):
        if depth < 1 or width < 1:
            raise ValueError("speculation depth and width must be >= 1")
        self.name = name
        self.depth = depth
        self.width = width
        self.max_nodes = max_nodes
        self.chunk = chunk

    def plan(self, view: BatchView) -> Plan:
        """The iteration's plan: the fixed shape for every decoding request, chunked
        prefill, no budget."""
        return Plan(
            shapes={r.rid: (self.depth, self.width) for r in view.decoding},
            prefill=chunk_prefills(view, self.chunk),
        )

    def select(
        self, view: BatchView, plan: Plan, trees: dict[int, CandidateTree]
    ) -> dict[int, np.ndarray]:
        """rid -> every node of its tree, or the root and its ``max_nodes`` best."""
        if self.max_nodes is None:
            return super().select(view, plan, trees)
        return {rid: top_f_nodes(t, self.max_nodes) for rid, t in trees.items()}
