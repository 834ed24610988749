"""SLO attainment has one definition (``adaserve.core.slo.slo_met``): the server's
per-request metrics (``api.slo_attained``) and the bench/simulator records
(``bench.metrics.RequestRecord.attained``) both use it, so they agree."""

import itertools
from types import SimpleNamespace

import pytest

from adaserve.bench.metrics import RequestRecord
from adaserve.core.slo import SLO, slo_met
from adaserve.engine.api import slo_attained


def test_slo_met_truth_table():
    assert slo_met(True, 50.0, 400.0, 50.0, 400.0)  # on the targets: met
    assert not slo_met(False, 10.0, 10.0, 50.0, 400.0)  # not completed
    assert not slo_met(True, 50.1, 10.0, 50.0, 400.0)  # TPOT over
    assert not slo_met(True, 10.0, 400.1, 50.0, 400.0)  # TTFT over
    assert slo_met(True, None, 10.0, 50.0, 400.0)  # one token: no TPOT to judge
    assert slo_met(True, 999.0, 999.0, None, None)  # no targets


CASES = list(
    itertools.product(
        ("stop", "length", "abort", "ttft_deadline"),  # finish reason
        (None, 20.0, 60.0),  # TPOT ms (None: one output token)
        (100.0, 500.0),  # TTFT ms
        (None, 50.0),  # TPOT target
        (None, 400.0),  # TTFT target
    )
)


@pytest.mark.parametrize("reason,tpot,ttft,tpot_t,ttft_t", CASES)
def test_server_and_bench_agree(reason, tpot, ttft, tpot_t, ttft_t):
    first = ttft / 1000.0
    n_out = 1 if tpot is None else 11
    finish = first + (0.0 if tpot is None else tpot * (n_out - 1) / 1000.0)
    rec = RequestRecord(
        idx=0,
        cls="c",
        arrival_s=0.0,
        tpot_target_ms=tpot_t,
        ttft_target_ms=ttft_t,
        prompt_tokens=4,
        output_tokens=n_out,
        first_token_s=first,
        finish_s=finish,
        finish_reason=reason,
    )
    req = SimpleNamespace(
        timing=lambda: {"tpot_ms": rec.tpot_ms, "ttft_ms": rec.ttft_ms},
        finish_reason=reason,
        slo=SLO(tpot_ms=tpot_t, ttft_ms=ttft_t),
    )
    want = slo_met(reason in ("stop", "length"), rec.tpot_ms, rec.ttft_ms, tpot_t, ttft_t)
    assert rec.attained == want
    assert slo_attained(req) == want
