"""Each request's TPOT with the engine's passes at the profile's prices, back to back
(``bench.replayed``): the per-request fidelity check of issue 30."""

from __future__ import annotations

import pytest

from adaserve.bench.metrics import RequestRecord
from adaserve.bench.replayed import replayed_line, replayed_tpot


def _passes():
    """Ten passes priced 10 ms each: 0-4 take 11 ms back to back, 5-9 take 11 ms with
    5 ms between them; pass 10 has no price."""
    out, t = [], 0.0
    for k in range(11):
        if k >= 5:
            t += 0.005
        out.append((t, t + 0.011, 10.0 if k < 10 else 0.0))
        t += 0.011
    return out


def _rec(idx: int, cls: str, passes, at: list[int], reason: str | None = "length"):
    times = [passes[k][1] for k in at]
    return RequestRecord(
        idx=idx,
        cls=cls,
        arrival_s=0.0,
        first_token_s=times[0],
        finish_s=times[-1],
        token_times_s=times,
        output_tokens=len(times),
        finish_reason=reason,
    )


def test_each_request_is_priced_over_its_own_passes():
    ps = _passes()
    recs = [
        # tokens at passes 0-4, two at pass 2 (an accepted candidate): 40 ms priced
        # against 44 measured
        _rec(0, "interactive", ps, [0, 1, 2, 2, 3, 4]),
        # passes 5-9: 40 ms priced against 44 in passes and 20 between them
        _rec(1, "batch", ps, [5, 6, 7, 8, 9]),
        _rec(2, "batch", ps, [0, 1, 2], reason=None),  # not completed: not compared
        _rec(3, "batch", ps, [8, 10]),  # a pass without a price: not compared
    ]
    recs.append(
        RequestRecord(
            4, "chat", 0.0, 0.0, 0.05, [0.0005, 0.0301], output_tokens=2, finish_reason="length"
        )  # fmt: skip
    )  # token times that are no pass's commit: not compared
    rt = replayed_tpot(recs, ps)
    assert rt is not None and rt["n"] == 2
    assert rt["speed"] == pytest.approx(1.1)
    assert rt["ratio"]["p10"] == pytest.approx(40 / 64, abs=1e-4)
    assert rt["ratio"]["p90"] == pytest.approx(40 / 44, abs=1e-4)
    # 0.909 is within 10%, 0.625 is not; at the run's speed 1.0 and 0.6875
    assert rt["within"] == 0.5 and rt["within_at_speed"] == 0.5
    assert rt["within_by_class"] == {"batch": 0.0, "interactive": 1.0}
    # the median request spent half of (0 and 20/64) of its time between passes
    assert rt["between_passes"] == pytest.approx((0 + 20 / 64) / 2, abs=1e-4)
    assert "for 50% of 2 requests" in replayed_line("adaserve", {"replayed_tpot": rt})
    # a tighter tolerance judges the same ratios
    assert replayed_tpot(recs, ps, tolerance=0.05)["within"] == 0.0


def test_nothing_to_replay_without_prices_or_tokens():
    ps = _passes()
    assert replayed_tpot([_rec(0, "chat", ps, [0, 1])], [(s, e, 0.0) for s, e, _ in ps]) is None
    assert replayed_tpot([_rec(0, "chat", ps, [3])], ps) is None
    assert replayed_tpot([], ps) is None
    assert replayed_line("ar", {}) is None
    reps = {"repeats": [{"replayed": None}, {"replayed": {"within": 0.8, "within_at_speed": 0.9}}]}
    assert (
        replayed_line("ar", reps)
        == "ar within 10% per run - / 80% of requests (at each run's speed - / 90%)"
    )
