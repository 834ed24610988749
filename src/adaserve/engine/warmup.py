"""Start-up warm-up: every compiled kernel and pass family run once before serving.

A server says it is ready (``/health``) only once the engine has paid its first-use
costs, as vLLM captures its CUDA graphs before it serves: the planner's numba kernel
compiled or loaded from the on-disk cache for the argument types the planner passes
(``policies.plan_kernel.warm_up``), and a few real engine steps with throwaway requests
that run each family of torch calls a serving run makes: a prefill, plain decodes, a
speculative chain and a tree when the policy drafts; greedy and sampled rows, seeded
and not, penalties, ``min_tokens``, logprobs and prompt logprobs.

The throwaway steps run under a copy of the engine's policy (so its online correction
and error statistics learn nothing from cold passes) and under fixed static policies
for the chain, tree and plain families; the engine's policy object is put back, no
request is left, the statistics, calibration, admission's measurements and the drift
window start afresh, and the engine's ``seed`` stream, faults, step callback and
selection log are as before. ``tests/test_warmup.py`` checks that a mixed workload
after it compiles nothing and adds no numba specialisation.
"""

from __future__ import annotations

import copy
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from adaserve.core.slo import SLO
from adaserve.errors import AdaServeError
from adaserve.sampling import SamplingParams

if TYPE_CHECKING:
    from adaserve.core.policy import Policy
    from adaserve.engine.engine import Engine

# steps one phase may take before it is given up (its requests aborted): a phase needs
# a prefill and a handful of decodes; more means the pool cannot hold its requests
_MAX_STEPS = 200
_NEW_TOKENS = 6


@dataclass(frozen=True)
class WarmUp:
    """What ``warm_up`` did.

    seconds:         wall time it took
    steps:           engine steps it ran
    families:        pass families its steps ran: "prefill", "decode" (root only),
                     "chain" (speculative, width 1), "tree" (speculative, width > 1)
    compiles:        numba compiles it caused (``jit.compiles``; 0 when all were cached)
    specialisations: adaserve's numba functions -> specialisations held after it
    skipped:         why the engine steps were left out (None: they ran)
    """

    seconds: float
    steps: int
    families: tuple[str, ...]
    compiles: int
    specialisations: dict[str, int] = field(default_factory=dict)
    skipped: str | None = None

    def describe(self) -> str:
        """One line for the log."""
        n = sum(1 for v in self.specialisations.values() if v)
        k = sum(self.specialisations.values())
        if n:
            kernels = f"{n} numba kernel{'s' * (n != 1)} ({k} specialisation{'s' * (k != 1)}"
            kernels += f", {self.compiles} compiled now)" if self.compiles else ")"
        else:
            kernels = "no numba kernels"
        if self.steps:
            fam = ", ".join(self.families) or "none"
            passes = f"{self.steps} engine steps ({fam})"
        else:
            passes = "no engine steps"
        note = f"; {self.skipped}" if self.skipped else ""
        return f"warmed up {kernels} and {passes} in {self.seconds:.2f} s{note}"


def warm_up(engine: Engine, say: bool = True) -> WarmUp:
    """Compile or load the kernels ``engine``'s serving uses and run one of each of its
    pass families (see the module docstring); once, at start-up, before the server says
    ready. The engine steps are left out when the engine already holds requests.
    ``say``: one line on stderr. Returns what it did."""
    t0 = time.perf_counter()
    c0 = jit.compiles() if (jit := _jit()) is not None else 0
    _warm_kernels(engine)
    steps, skipped = 0, None
    families: tuple[str, ...] = ()
    if engine.has_work():
        skipped = "the engine holds requests"
    else:
        steps, families, skipped = _warm_steps(engine)
    rec = WarmUp(
        seconds=time.perf_counter() - t0,
        steps=steps,
        families=families,
        compiles=jit.compiles() - c0 if (jit := _jit()) is not None else 0,
        specialisations=jit.specialisations() if jit is not None else {},
        skipped=skipped,
    )
    if say:
        print(f"adaserve: {rec.describe()}", file=sys.stderr, flush=True)
    return rec


def _warm_kernels(engine) -> None:
    """The numba kernels of the engine's policy, with the argument types its plans pass:
    the budgeted policies' planner kernel (``policies.plan_kernel``). The simulator's
    kernels (``sim.kernels``) are on no serving path; the other policies use none."""
    adaptive = sys.modules.get("adaserve.policies.budgeted.planner")  # a budgeted policy imports it
    if adaptive is not None and isinstance(engine.policy, adaptive.BudgetedPolicy):
        from adaserve.policies import plan_kernel

        plan_kernel.warm_up()


def _jit():
    """``adaserve.util.jit`` when numba is in use in this process, else None (an engine
    whose policy plans without numba does not import it)."""
    return sys.modules.get("adaserve.util.jit")


# ---------------------------------------------------------------------- the steps
def _prompt(engine, n: int, salt: int) -> list[int]:
    """n token ids spread over the vocabulary (no special meaning; EOS is ignored)."""
    V = engine.target.cfg.vocab_size
    n = max(1, min(n, engine.max_model_len - 4 * _NEW_TOKENS))
    return [1 + (i * 7 + salt * 13) % max(1, V - 2) for i in range(n)]


def _requests(engine, mixed: bool) -> list[tuple[list[int], SamplingParams]]:
    """(prompt, params) of one phase: greedy with logprobs, prompt logprobs and
    ``min_tokens``; sampled with top-p / top-k / min-p and penalties, unseeded; sampled
    with a seed. ``mixed`` False: the first two."""
    n = _NEW_TOKENS
    out = [
        (
            _prompt(engine, 24, 0),
            SamplingParams(
                temperature=0.0,
                max_tokens=n,
                ignore_eos=True,
                logprobs=2,
                prompt_logprobs=1,
                min_tokens=2,
            ),
        ),
        (
            _prompt(engine, 9, 1),
            SamplingParams(
                temperature=0.8,
                top_p=0.9,
                top_k=16,
                min_p=0.02,
                repetition_penalty=1.1,
                presence_penalty=0.2,
                frequency_penalty=0.1,
                max_tokens=n,
                ignore_eos=True,
            ),
        ),
    ]
    if mixed:
        out.append(
            (
                _prompt(engine, 40, 2),
                SamplingParams(temperature=1.0, seed=1, max_tokens=n, ignore_eos=True),
            )
        )
    return out


def _phases(engine: Engine) -> list[tuple[Policy, bool]]:
    """(policy, mixed) of each phase: a copy of the engine's policy with every kind of
    request; when it drafts, a static tree, a static chain and plain decoding too."""
    from adaserve.policies.registry import make_policy

    policy = engine.policy
    try:
        own = copy.deepcopy(policy)
    except Exception:  # noqa: BLE001 - a policy that cannot be copied warms as itself
        own = policy
    phases = [(own, True)]
    if policy.uses_draft and engine.draft is not None:
        phases += [(make_policy(p), False) for p in ("spec-tree:3x2", "spec-chain:2", "ar")]
    return phases


def _families(trace, into: set) -> None:
    if trace is None:
        return
    if trace.prefill:
        into.add("prefill")
    for rid in trace.decode:
        nodes = trace.tree_nodes.get(rid, 0)
        if nodes == 0:
            into.add("decode")
        else:
            into.add("tree" if trace.spec.get(rid, (0, 1))[1] > 1 else "chain")


def _warm_steps(engine: Engine) -> tuple[int, tuple[str, ...], str | None]:
    """Run the phases (see ``_phases``); the engine as it was after (but its
    statistics reset). Returns (steps, families, why the steps stopped early or None)."""
    from adaserve.engine.engine import Faults

    saved_policy, saved_faults, saved_on_step = engine.policy, engine.faults, engine.on_step
    sel_log = engine._sel_log
    seeds = engine.runner._seeds  # the engine's ``seed`` stream
    seed_state = seeds.getstate() if seeds is not None else None
    steps, skipped = 0, None
    seen: set[Any] = set()
    added = []
    engine.on_step = None
    engine._sel_log = None
    engine.set_faults(Faults())
    try:
        for policy, mixed in _phases(engine):
            engine.set_policy(policy)
            for prompt, params in _requests(engine, mixed):
                try:
                    added.append(engine.add_request(prompt, params, SLO()))
                except AdaServeError as e:  # refused (a tiny pool, a short context)
                    skipped = skipped or f"a request was refused: {e}"
            n = 0
            while engine.has_work() and n < _MAX_STEPS:
                engine.step()
                n += 1
                _families(engine.last_trace, seen)
            steps += n
            if engine.has_work():
                skipped = f"a phase did not finish in {_MAX_STEPS} steps"
                break
    finally:
        for r in added:
            if not r.finished:
                engine.abort(r, "warmup")
        engine.set_policy(saved_policy)
        engine.on_step = saved_on_step
        engine._sel_log = sel_log
        if seeds is not None and seed_state is not None:
            seeds.setstate(seed_state)
    engine.step()  # no work: hands the last pass to admission, which is reset next
    engine.reset_stats()
    engine.set_faults(saved_faults)
    engine.drift.reset()
    order = ("prefill", "decode", "chain", "tree")
    return steps, tuple(f for f in order if f in seen), skipped
