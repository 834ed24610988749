"""Over HTTP: the benchmark resolves the class targets with the unloaded TPOT the
server reports (the profile's, by the one definition), so that it judges requests by
the targets the server schedules for."""

from __future__ import annotations

import pytest
from server_fixtures import LiveServer, engine_config, model_pair, server_test_env

from adaserve.bench.runner import class_slos, measure_unloaded_tpot
from adaserve.core.slo import DEFAULT_CLASSES
from adaserve.hardware.model import HardwareModel, unloaded_tpot_ms
from adaserve.server import ServerConfig

_env = pytest.fixture(scope="module", autouse=True)(server_test_env)


def test_bench_uses_the_servers_unloaded_tpot(tmp_path_factory, cheap_profile, capsys):
    target, draft = model_pair(tmp_path_factory)
    srv = LiveServer(engine_config(target, draft, profile=cheap_profile), ServerConfig())
    try:
        want = unloaded_tpot_ms(HardwareModel.load(cheap_profile))
        got = measure_unloaded_tpot(srv.url)
        assert got == pytest.approx(want)
        assert "reported by the server" in capsys.readouterr().err
        names = [c.name for c in DEFAULT_CLASSES]
        bench = class_slos(names, 1.0, unloaded_tpot_ms=got)
        report = srv.http().get("/v1/slo/report").json()
        assert report["engine"]["unloaded_tpot_ms"] == pytest.approx(want)
        for n in names:
            assert bench[n].tpot_ms == pytest.approx(report["classes"][n]["targets"]["tpot_ms"])
    finally:
        srv.stop()
