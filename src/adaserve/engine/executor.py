"""The engine's executor: runs a ``SchedulerOutput`` on the models and returns its
``StepOutcome`` (``core.step``).

    speculate (draft trees, calibrated f) -> select (policy.select) -> the verified
    trees (their KV through ``Scheduler.reserve_tree``) -> verify (one target forward,
    lossless acceptance) -> tokens appended (``OutputProcessor``)

Grammar-forced tokens ride as a chain below a constrained request's root.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from adaserve.core.stalls import Probe
from adaserve.core.step import Batch, DraftWork, SchedulerOutput, StepInputs, StepOutcome
from adaserve.core.tree import CandidateTree, scratch_slots_needed
from adaserve.engine.verification import accept
from adaserve.hardware.drift import predicted_pass_ms
from adaserve.spec_decode.draft import DraftOutput
from adaserve.spec_decode.request import Request

if TYPE_CHECKING:
    from adaserve.engine.engine import Engine

# forced tokens one tree carries at most (a long literal is forced over several steps)
MAX_FORCED = 32


class EngineExecutor:
    """Executes the engine's passes (the engine's parts, read through ``engine``: its
    calibrator is replaced between runs)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._probe: Probe | None = None
        self._caught: dict[int, int] = {}  # rid -> the draft cache after its catch-up
        self._chains: dict[int, int] = {}  # rid -> forced chain of a request not drafted
        # the last pass's verified trees and accepted candidates (the selection log)
        self.trees: dict[int, CandidateTree] = {}
        self.accepted: dict[int, int] = {}

    def prepare(self) -> StepInputs:
        """Probe the pass (stalls); the calibrated acceptance, and what masks cost on
        this run once enough were timed."""
        e = self.engine
        self._probe = e.stalls.begin()
        return StepInputs(
            tuple(e.calibrator.acceptance_by_rank()),
            e.runner.draft is not None,
            e.structured.mask_ms_per_node(),
        )

    def execute(self, out: SchedulerOutput) -> StepOutcome:
        e = self.engine
        batch, view, plan = out.batch, out.view, out.plan
        assert batch is not None and view is not None and plan is not None  # out.runs
        drafts = self._speculate(batch)  # --- speculate
        selected = {}  # --- select
        if drafts:
            selected = e.policy.select(view, plan, {rid: d.tree for rid, d in drafts.items()})
        trees = self._verified_trees(batch, drafts, selected)
        vpass = e.runner.verify_forward(batch, trees, drafts)  # --- verify
        paced = getattr(e.clock, "pass_ran", None)  # a ``PacedClock``: modelled time
        if paced is not None:
            paced(pass_tokens(batch, trees))
        result = accept(vpass)
        self._count_forced(drafts, trees, result)
        e.runner.move_target_slots(result.moves_src, result.moves_dst)
        now = e.clock.now()  # --- commit (tokens; the scheduler applies the rest)
        for r, p, lsm in vpass.prompt_rows if vpass is not None else ():
            e.output.record_prompt_logprobs(r, p, lsm)
        commits, accepted = e.output.commit(batch, trees, result, e.calibrator, now)
        if drafts:  # the draft's cache caught up on each drafting request's tokens
            commits = [
                replace(c, draft_cached=self._caught[c.seq.rid]) if c.seq.rid in drafts else c
                for c in commits
            ]
        self.trees, self.accepted = trees, accepted
        tokens = pass_tokens(batch, trees)
        work = self._draft_work(batch, drafts)
        c = e.counters
        c.model_time_s += e.runner.model_time_s
        e.runner.model_time_s = 0.0
        c.step_time_s += now - out.t_start
        predicted, stall = 0.0, None
        if e.hw is not None:  # the pass against the profile's prediction
            predicted = predicted_pass_ms(
                e.hw,
                tokens,
                out.kv_tokens,
                out.prefill_pairs,
                work,
                len(batch.prefill) + len(batch.decode),
                sum(len(trees[r.rid].tokens) for r in batch.decode)
                + sum(r.num_cached + n == r.num_tokens for r, n in batch.prefill),
            )
            assert self._probe is not None  # ``prepare`` began it
            stall = e.stalls.end(self._probe, predicted, (now - out.t_start) * 1000)
        return StepOutcome(
            t_end=now,
            ms=(now - out.t_start) * 1000,
            commits=tuple(commits),
            tree_nodes={rid: len(t.tokens) - 1 for rid, t in trees.items()},
            accepted=accepted,
            expected={
                rid: float(trees[rid].f[1:].sum())
                for rid in drafts
                if rid in trees and trees[rid].num_candidates
            },
            tokens=tokens,
            draft=work,
            predicted_ms=predicted,
            stall=stall,
        )

    def _draft_work(self, batch: Batch, drafts) -> DraftWork:
        """The draft's passes as its drafter ran them (``DraftWork``)."""
        passes = self.engine.runner.draft_passes
        if not (drafts and passes):
            return DraftWork()
        return DraftWork(
            catchup=passes[0][0],
            steps=tuple(n for n, _ in passes[1:]),
            kv_tokens=sum(kv for _, kv in passes),
            request_steps=sum(d for _, (d, _) in batch.spec),
            drafted=sum(d.tree.num_candidates for d in drafts.values()),
            requests=len(batch.spec),
        )

    def _speculate(self, batch: Batch) -> dict[int, DraftOutput]:
        """Draft a tree per speculating request; the calibrator sets each node's f.

        A constrained request whose grammar forces the next tokens gets them as a chain
        below its root (no draft step; f = 1, the calibrated estimates of the drafted
        nodes below it taken relative to the chain's end), when the pool holds them."""
        e = self.engine
        # what the draft's cache holds after its catch-up (``Commit.draft_cached``)
        self._caught = {r.rid: len(r.tokens) for r, _ in batch.spec}
        forced = [self._forced(r, shape) for r, shape in batch.spec]
        drafts = e.runner.draft_trees(batch.spec, e.faults.draft_noise, forced)
        for r, _ in batch.spec:
            d = drafts[r.rid]
            tree = d.tree
            e.calibrator.apply(tree)
            if d.forced:
                k = d.forced
                tree.f[k + 1 :] /= max(tree.f[k], 1e-12)
                tree.f[: k + 1] = 1.0
                e.structured.forced_tokens += k
            drafted = tree.num_candidates - d.forced
            r.stats.drafted_tokens += drafted
            e.counters.drafted_tokens += drafted
        return drafts

    def _forced(self, r: Request, shape: tuple[int, int]) -> list[int]:
        """The tokens ``r``'s grammar forces next (none without a grammar, or when the
        KV pool cannot hold them beside the drafted tree)."""
        if r.grammar is None:
            return []
        chain = r.grammar.forced()[: self._chain_room(r)]
        room = len(chain) + scratch_slots_needed(*shape) + 1
        if chain and not self.engine.scheduler.reserve_tree(r, room):
            return []
        return chain

    def _chain_room(self, r: Request) -> int:
        """Forced tokens ``r`` may still take: within ``MAX_FORCED``, and with the
        bonus token after them within its output budget and the model's context (the
        chain goes first; drafted levels past the budget are cut at the commit, as
        without a chain)."""
        left = min(
            self.engine.runner.max_model_len - len(r.tokens), r.max_new_tokens - r.num_output
        )
        return max(0, min(MAX_FORCED, left - 1))

    def _count_forced(self, drafts, trees, result) -> None:
        """Forced tokens the target accepted (for the share they contribute)."""
        chains = {rid: d.forced for rid, d in drafts.items() if d.forced}
        chains.update(self._chains)
        for rid, k in chains.items():
            if rid not in result.accepted:
                continue
            t = trees[rid]
            origin = t.origin if t.origin is not None else np.arange(len(t.tokens))
            path = result.accepted[rid].path
            self.engine.structured.forced_accepted += sum(1 for n in path if 1 <= origin[n] <= k)

    def _verified_trees(
        self,
        batch: Batch,
        drafts: dict[int, DraftOutput],
        selected: dict[int, np.ndarray],
    ) -> dict[int, CandidateTree]:
        """The subtree each decoding request verifies (root only when not speculating,
        or when the pool cannot hold the selected nodes)."""
        out: dict[int, CandidateTree] = {}
        self._chains = {}
        for r in batch.decode:
            d = drafts.get(r.rid)
            root = CandidateTree.root_only(r.tokens[-1])
            if d is None:
                out[r.rid] = self._forced_chain(r) or root
                continue
            nodes = np.asarray(selected.get(r.rid, np.zeros(1, dtype=np.int64)))
            ok = self.engine.scheduler.reserve_tree(r, len(nodes))
            out[r.rid] = d.tree.subtree(nodes) if ok else root
        return out

    def _forced_chain(self, r: Request) -> CandidateTree | None:
        """A constrained request the planner did not speculate this step still gets the
        tokens its grammar forces, as a chain below its root (verification only), when
        the policy drafts at all (``ar`` stays plain decoding: the baseline)."""
        e = self.engine
        if r.grammar is None or not e.policy.uses_draft:
            return None
        chain = r.grammar.forced()[: self._chain_room(r)]
        if not chain or not e.scheduler.reserve_tree(r, len(chain) + 1):
            return None
        k = len(chain)
        self._chains[r.rid] = k
        e.structured.forced_tokens += k
        return CandidateTree(
            tokens=np.array([r.tokens[-1], *chain], dtype=np.int64),
            parents=np.maximum(np.arange(k + 1) - 1, 0),
            depth=np.arange(k + 1),
            q=np.ones(k + 1),
            rank=np.zeros(k + 1, dtype=np.int64),
            f=np.ones(k + 1),
        )


def pass_tokens(batch: Batch, trees: dict[int, CandidateTree]) -> int:
    """Target tokens of the verification pass: prefill chunks and every verified tree
    (root included)."""
    return sum(n for _, n in batch.prefill) + sum(len(t.tokens) for t in trees.values())
