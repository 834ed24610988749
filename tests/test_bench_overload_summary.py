"""``adaserve bench overload``'s summary, on hand-made outcomes (no server)."""

from __future__ import annotations

from adaserve.bench.overload import Outcome, summarize

TARGETS = {"interactive": {"tpot_ms": 10.0, "ttft_ms": 1000.0}, "batch": {"tpot_ms": 50.0}}


def _ok(cls: str, sent: float, first: float, last: float, tokens: int) -> Outcome:
    return Outcome(cls, sent, 200, first, first, last, tokens, True)


def test_goodput_counts_the_tokens_of_requests_within_their_slo_per_second():
    outcomes = [
        _ok("interactive", 0.0, 0.1, 0.1 + 0.009 * 9, 10),  # on pace: 10 tokens count
        _ok("interactive", 0.0, 0.1, 0.1 + 0.020 * 9, 10),  # TPOT 20 ms > 10: none
        _ok("interactive", 0.0, 1.5, 1.5 + 0.005 * 9, 10),  # TTFT 1.5 s > 1 s: none
        _ok("batch", 0.5, 0.6, 0.6 + 0.040 * 19, 20),  # on pace: 20
        Outcome("batch", 1.0, 429, 1.01, retry_after="1", reason="capacity"),
    ]
    s = summarize(outcomes, TARGETS, duration_s=2.0)
    assert s["classes"]["interactive"]["goodput_tok_s"] == 5.0
    assert s["classes"]["batch"]["goodput_tok_s"] == 10.0
    assert s["overall"]["goodput_tok_s"] == 15.0
    assert s["overall"]["admitted_attained"] == 2 and s["overall"]["shed"] == 1
    it = s["classes"]["interactive"]
    assert (it["admitted_missed_ttft"], it["admitted_missed_tpot"]) == (1, 1)
    assert abs(it["admitted_tpot_ms"]["p50"] - 9.0) < 1e-9
    # without a duration: the span from the first send to the last token
    span = max(o.last or 0.0 for o in outcomes)
    assert abs(summarize(outcomes, TARGETS)["overall"]["goodput_tok_s"] - 30 / span) < 1e-9


def test_a_served_retry_counts_as_an_admitted_request_of_its_own():
    """A client refused, then served on its retry: the retry's tokens count in goodput
    and its SLO (TTFT from its own send) in the admitted attainment; the shed count is
    of the clients' first requests."""
    refused = Outcome("batch", 1.0, 429, 1.01, retry_after="1.5", reason="capacity")
    refused.retry = _ok("batch", 2.5, 2.6, 2.6 + 0.040 * 19, 20)  # on pace from its send
    late = Outcome("interactive", 0.0, 429, 0.01, retry_after="1", reason="capacity")
    late.retry = _ok("interactive", 1.0, 2.5, 2.5 + 0.009 * 9, 10)  # TTFT 1.5 s > 1 s
    s = summarize([refused, late], TARGETS, duration_s=2.0)
    b, it = s["classes"]["batch"], s["classes"]["interactive"]
    assert (b["requests"], b["shed"], b["admitted"], b["admitted_first_try"]) == (1, 1, 1, 0)
    assert b["goodput_tok_s"] == 10.0 and b["admitted_attainment"] == 1.0
    assert it["admitted_missed_ttft"] == 1 and it["admitted_attainment"] == 0.0
    assert s["overall"]["retries_admitted"] == 2 and s["overall"]["goodput_tok_s"] == 10.0
