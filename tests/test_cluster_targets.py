"""Issue 36 item 9: one set of class targets behind ``--replicas``. The ledger actor
keeps the first record a replica offers; a replica whose own differs (another
machine, another cache) adopts the deployment's before it serves."""

from __future__ import annotations

import pytest

from adaserve.cluster.ledger import Ledger
from adaserve.cluster.targets import adopt, own_record
from adaserve.config import EngineConfig
from adaserve.engine import Engine
from adaserve.hardware.model import HardwareModel

KV = 8 * 2**20


def test_the_ledger_keeps_the_first_record_offered():
    led = Ledger(())
    a = {"unloaded_tpot_ms": 8.0, "from": "profile A"}
    b = {"unloaded_tpot_ms": 20.0, "from": "profile B"}
    assert led.targets("r1", a) == {**a, "replica": "r1"}
    assert led.targets("r2", b) == {**a, "replica": "r1"}  # the second gets the first
    assert led.targets("r3", None) == {**a, "replica": "r1"}
    assert Ledger(()).targets("r1", None) is None  # no profile anywhere: nothing to share


def test_a_replica_adopts_the_deployment_s_targets(tiny_pair, cheap_profile):
    target, _, _ = tiny_pair
    eng = Engine(EngineConfig(model=str(target), no_draft=True, policy="ar", kv_cache_bytes=KV))
    eng.set_hardware(HardwareModel.load(cheap_profile))
    own = own_record(eng)
    assert own is not None and own["unloaded_tpot_ms"] == pytest.approx(eng.unloaded_tpot_ms())
    strict = eng.cfg.classes[0].name
    before = eng.class_slo(strict).tpot_ms
    # this replica's own record: nothing changes
    assert not adopt(eng, {**own, "replica": "me"})
    # another machine's record, twice as slow: this replica judges by it from now on
    rec = {"unloaded_tpot_ms": 2 * own["unloaded_tpot_ms"], "from": "its profile", "replica": "r0"}
    assert adopt(eng, rec)
    assert eng.unloaded_tpot_ms() == pytest.approx(rec["unloaded_tpot_ms"])
    assert eng.scheduler.hw is eng.hw
    assert eng.class_slo(strict).tpot_ms == pytest.approx(2 * before)
    prov = eng.hw.provenance()["targets_from"]
    assert "deployment" in prov and "r0" in prov
