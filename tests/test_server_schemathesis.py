"""A bounded schemathesis run against /openapi.json: no input makes the server answer 5xx,
and every 4xx carries an OpenAI-style error body."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env

from adaserve.server import ServerConfig

BUDGET_S = 30.0
EXAMPLES = 40

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    target, _ = model_pair(tmp_path_factory)
    # a short context keeps every valid generated request cheap
    s = LiveServer(engine_config(target, max_model_len=48), ServerConfig(model_name="m"))
    yield s
    s.stop()


def test_fuzzed_requests_never_get_5xx(srv):
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    # the operations that take input (a body or parameters): the budget goes to them, not
    # to GETs such as /version or /ping that have nothing to fuzz
    ops = [
        op
        for op in (r.ok() for r in schema.get_all_operations())
        if list(op.iter_parameters()) or op.get_request_payload_content_types()
    ]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions"}
    deadline = time.monotonic() + BUDGET_S
    per_op = BUDGET_S / (2 * len(ops))
    seen: dict[int, int] = {}
    failures = []

    def run(op, mode, stop_at: float) -> None:
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
        @given(case=op.as_strategy(mode))
        def check(case):
            if time.monotonic() > stop_at:
                return
            resp = case.call(base_url=srv.url, timeout=30)
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            if resp.status_code >= 500:
                failures.append((case.method, case.path, case.body, resp.status_code))
            elif resp.status_code >= 400:
                err = resp.json()["error"]
                assert {"message", "type", "param", "code"} <= set(err)

        try:
            check()
        except Unsatisfiable:  # nothing to negate (e.g. GET without parameters)
            assert mode == GenerationMode.NEGATIVE

    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            run(op, mode, min(deadline, time.monotonic() + per_op))
    assert not failures, failures[:5]
    assert sum(seen.values()) >= 20, seen
    assert any(200 <= c < 300 for c in seen) and any(400 <= c < 500 for c in seen), seen
