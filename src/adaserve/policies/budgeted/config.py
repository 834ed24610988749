"""The budgeted policies' knobs (``AdaptiveConfig``) and the planner's fixed grids."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from adaserve.core.config import STEEP

DEPTHS = (0, 1, 2, 3, 4, 5, 6, 8)  # the draft depths a plan evaluates (0 = no speculation)
EXTRAS = np.array([0, 4, 8, 16, 32, 64, 128, 256, 512])  # goodput-phase sizes tried


@dataclass(frozen=True)
class AdaptiveConfig:
    """Knobs of the budgeted policies (validated)."""

    max_depth: int = 8
    max_width: int = 4
    node_cap: int = 48  # max candidates selected for one request
    prefill_chunk: int = 256
    # ``adaserve``: move a request no tree can bring within its target (judged over its
    # remaining output) to its class's looser class after degrade_after such plans in a
    # row. Off: on the reference experiment it changed attainment by -1.1 to +0.3
    # points at 2-4 req/s (docs/results/pass-composition.md)
    degrade: bool = False
    degrade_after: int = 16  # consecutive infeasible iterations before degrading
    max_budget: int = 1024  # verification tokens per pass, hard ceiling
    # plan to beat each TPOT target by this fraction: iteration times on a shared CPU
    # (and acceptance) vary, and a plan aimed exactly at the target misses half the time
    slo_margin: float = 0.15
    # margin_auto: once margin_warmup passes are measured, the margin is margin_floor
    # plus twice the spread (std) of measured / predicted pass time, at most
    # margin_max: as small as the prediction is good (docs/results/pass-composition.md)
    margin_auto: bool = True
    margin_floor: float = 0.0
    margin_max: float = 0.3
    margin_warmup: int = 32
    # consider trees wider than a chain only when the calibrated acceptance of a
    # second-ranked child reaches this (0 = always consider them)
    min_sibling_acceptance: float = 0.2
    # A(r) makes up a TPOT deficit within this many output tokens (or by the end of the
    # output, if sooner); 0 = within this iteration, the paper's form
    catch_up_tokens: int = 16
    # among the shapes that meet the most requirements, take the cheapest (shallowest,
    # then narrowest) whose predicted rate is within this fraction of the best one's
    # (0 = the highest predicted rate; 0.03 was 2 points worse on the A100 preset at
    # 10 req/s and within noise on the CPU profile: docs/results/shape-choice.md)
    rate_tolerance: float = 0.0
    # ``adaserve``: compose the pass (policies/composition.py): prefill of classes of rank
    # >= defer_rank runs only into the on-pace decoders' slack until its latest start
    # (a request without a TTFT target is treated as one of no_ttft_defer_ms)
    compose: bool = True
    defer_rank: int = 1
    no_ttft_defer_ms: float = 30000.0
    # ``adaserve``: every explore_every-th plan that would consider chains only drafts
    # width-2 trees instead, so the calibrator keeps learning how often second-ranked
    # children are accepted (chains alone teach it nothing about them); 0 = never
    explore_every: int = 256
    # ``adaserve``, on steep hardware (``sit_out_steepness``): plan with the calibrated
    # acceptance scaled by the decoders' own drafts' confidence where it is below the
    # mean request's (``own_acceptance``): a request whose prompt the draft does not
    # follow gets shorter trees, or none, where a pass's tokens are dear and speculation
    # costs it more than it gains. Not on the A100 reference (steepness 1.5), where a
    # tree is nearly free and it cost 1.1 points at 3x capacity (95.8 -> 94.7% strict;
    # docs/results/engine-issue30.md, eighth pass). Off: the calibrated mean only
    request_acceptance: bool = True
    # ``adaserve``: relaxed decoders well inside their target sit a pass out while a
    # strict decoder is short of its requirement (``_sit_out``). Off: on the reference
    # experiment it cost 0.9 / 1.3 points at 2 / 3 req/s (the relaxed requests stay
    # longer; docs/results/pass-composition.md)
    sit_out: bool = False
    # ... and automatically where a pass's cost grows steeply with its tokens: when the
    # profile's 64-token verification costs at least this many one-token ones (the CPU
    # pair: 2.4-3.3x; the A100 70B preset: 1.5x); there a relaxed decoder's token is
    # dear to the strict ones, and every class's prefill is soft until its latest start
    # (``_defer_rank``). 0 = never automatically (``core.config.STEEP``;
    # docs/results/engine-issue30.md)
    sit_out_steepness: float = STEEP
    min_slack_tokens: int = 0  # soft prefill smaller than this waits (0: any slack is used)
    # power as a constraint (hardware/power.py; needs the view's PowerModel): shapes whose
    # predicted power (W, the deployment's) exceeds power_cap_w, or whose predicted
    # energy per expected accepted token (J) exceeds energy_per_token_j, are not
    # options; depth 0 always is (a plan whose depth 0 exceeds them notes
    # fallback="power_cap" / "energy_budget"). 0 = off
    power_cap_w: float = 0.0
    energy_per_token_j: float = 0.0

    def __post_init__(self) -> None:
        if not 1 <= self.max_depth <= 16 or not 1 <= self.max_width <= 8:
            raise ValueError("max_depth must be in [1, 16] and max_width in [1, 8]")
        if not 0.0 <= self.min_sibling_acceptance <= 1.0:
            raise ValueError("min_sibling_acceptance must be in [0, 1]")
        if self.catch_up_tokens < 0:
            raise ValueError("catch_up_tokens must be >= 0")
        if not 0.0 <= self.slo_margin < 0.9:
            raise ValueError("slo_margin must be in [0, 0.9)")
        if not 0.0 <= self.margin_floor <= self.margin_max < 0.9 or self.margin_warmup < 1:
            raise ValueError("need 0 <= margin_floor <= margin_max < 0.9 and margin_warmup >= 1")
        if not 0.0 <= self.rate_tolerance < 1.0:
            raise ValueError("rate_tolerance must be in [0, 1)")
        if not (math.isfinite(self.sit_out_steepness) and self.sit_out_steepness >= 0):
            raise ValueError("sit_out_steepness must be >= 0 (0 = never automatically)")
        if self.node_cap < 1 or self.prefill_chunk < 1 or self.max_budget < 1:
            raise ValueError("node_cap, prefill_chunk and max_budget must be positive")
        if self.explore_every < 0:
            raise ValueError("explore_every must be >= 0")
        if self.degrade_after < 1:
            raise ValueError("degrade_after must be >= 1")
        if self.defer_rank < 0 or not self.no_ttft_defer_ms > 0 or self.min_slack_tokens < 0:
            raise ValueError(
                "defer_rank and min_slack_tokens must be >= 0 and no_ttft_defer_ms positive"
            )
        for v in (self.power_cap_w, self.energy_per_token_j):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError("power_cap_w and energy_per_token_j must be >= 0 (0 = off)")
