"""``oracle[:DxW]``: a clairvoyant upper bound on tree selection (simulator only).

Every decoding request drafts a depth-D, width-W beam tree (default 4x4); prefilling
requests get FCFS chunks of one 256-token budget per iteration (dyn-tree's default
``prefill_chunk``); there is no verification budget. Before ``select`` the simulator
reveals, per request, the nodes the target accepts when the whole tree is verified
(``ClairvoyantPolicy.reveal``), and the oracle verifies exactly those: the root and the
accepted path. It pays drafting for the full tree but verification only for accepted tokens, and
accepts exactly as many tokens as verifying the full tree would.

No real engine can know the target's path before verifying it, so the engine refuses
clairvoyant policies (``ClairvoyantPolicy``).

The prefill decision is one overridable step (``OraclePolicy._prefill``) or a function
given to the constructor (``prefill=``), so that variants with other pass compositions
are a small change: ``OraclePolicy(4, 4, prefill=compose, name="oracle:4x4:compose")``
where ``compose(view, shapes) -> {rid: prefill tokens}``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from adaserve.core.policy import BatchView, ClairvoyantPolicy, Plan, chunk_prefills
from adaserve.core.tree import CandidateTree
from adaserve.errors import AdaServeError

ORACLE_DEPTH, ORACLE_WIDTH = 4, 4  # the study's oracle:4x4
ORACLE_PREFILL_CHUNK = 256  # as AdaptiveConfig.prefill_chunk (dyn-tree's default)

# (view, rid -> (depth, width) of this iteration's trees) -> rid -> prefill tokens
PrefillFn = Callable[[BatchView, dict[int, tuple[int, int]]], dict[int, int]]


class OraclePolicy(ClairvoyantPolicy):
    """Clairvoyant selection: a DxW beam tree per decoding request, verifying exactly the
    nodes on the target's accepted path (revealed by the simulator before ``select``).

    depth, width: the beam tree's shape (>= 1 each)
    chunk:        prefill tokens per iteration, FCFS (the default ``_prefill``)
    prefill:      optional ``(view, shapes) -> {rid: tokens}`` replacing the FCFS chunks
    name:         the policy's label (default ``oracle:DxW``)
    """

    def __init__(
        self,
        depth: int = ORACLE_DEPTH,
        width: int = ORACLE_WIDTH,
        chunk: int = ORACLE_PREFILL_CHUNK,
        prefill: PrefillFn | None = None,
        name: str | None = None,
    ):
        if depth < 1 or width < 1:
            raise ValueError("oracle tree depth and width must be >= 1")
        if chunk < 1:
            raise ValueError("oracle prefill chunk must be >= 1")
        self.depth = depth
        self.width = width
        self.chunk = chunk
        self.prefill_fn = prefill
        self.name = name or f"oracle:{depth}x{width}"
        self._paths: dict[int, np.ndarray] = {}

    def _prefill(self, view: BatchView, shapes: dict[int, tuple[int, int]]) -> dict[int, int]:
        """rid -> prefill tokens this iteration: ``prefill`` when given, else FCFS chunks
        of ``chunk`` tokens. ``shapes`` are the iteration's tree shapes (the decodes that
        share the pass with the prefill)."""
        if self.prefill_fn is not None:
            return self.prefill_fn(view, shapes)
        return chunk_prefills(view, self.chunk)

    def plan(self, view: BatchView) -> Plan:
        """The iteration's plan: the DxW tree for every decoding request, the prefill of
        ``_prefill``, no budget."""
        shapes = {r.rid: (self.depth, self.width) for r in view.decoding}
        return Plan(shapes=shapes, prefill=self._prefill(view, shapes))

    def reveal(self, paths: dict[int, np.ndarray]) -> None:
        """Keep the simulator's revelation for the coming ``select``: rid -> the sorted
        node indices (root first) the target accepts when the whole tree is verified."""
        self._paths = {rid: np.asarray(p, dtype=np.int64) for rid, p in paths.items()}

    def select(
        self, view: BatchView, plan: Plan, trees: dict[int, CandidateTree]
    ) -> dict[int, np.ndarray]:
        """rid -> exactly its revealed on-path nodes (the root and the accepted path).
        Every tree needs a revelation: without one (an engine, or a caller that skipped
        ``reveal``) this is an error rather than a silent guess."""
        missing = [rid for rid in trees if rid not in self._paths]
        if missing:
            raise AdaServeError(
                f"policy {self.name!r} is clairvoyant: select needs the target's paths "
                f"revealed first (simulator only); none for requests {missing[:5]}"
            )
        paths, self._paths = self._paths, {}
        return {rid: paths[rid] for rid in trees}


def composed_prefill() -> PrefillFn:
    """A prefill function that composes the pass as ``adaserve`` does (firm prefill
    first, relaxed prefill into the on-pace decoders' slack, ``policies/composition.py``):
    the prefill of an ``adaserve`` plan for the same view. That plan prices its own
    trees rather than the oracle's, so the slack it sees is adaserve's."""
    from adaserve.policies.budgeted import AdaServePolicy

    inner = AdaServePolicy()

    def prefill(view: BatchView, shapes: dict[int, tuple[int, int]]) -> dict[int, int]:
        return inner.plan(view).prefill

    return prefill
