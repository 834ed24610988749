"""One set of class targets behind ``--replicas``: recorded once for the deployment.

Class targets are multiples of an unloaded TPOT. A single server takes it from the
pair's targets record on its machine (``profile.attach_targets``); replicas on other
machines (or with other caches) would each take their own, and judge one class by
different targets. So each replica, once its engine is up, offers its own record to
the service's ledger actor (``Ledger.targets``), which keeps the first it is offered
and hands that one to every replica; a replica whose own differs adopts the
deployment's (``adopt``) before it serves, and says so in its provenance
(``/v1/slo/report``, the dashboard).
"""

from __future__ import annotations

import dataclasses
import logging

log = logging.getLogger("adaserve.cluster")


def own_record(engine) -> dict | None:
    """The record of the class targets ``engine`` judges by (None without a profile):
    ``{"unloaded_tpot_ms", "from"}``."""
    hw = engine.hw
    if hw is None:
        return None
    return {"unloaded_tpot_ms": float(hw.unloaded_tpot_ms()), "from": hw.targets_from or hw.source}


def adopt(engine, record: dict) -> bool:
    """Judge by the deployment's ``record`` (``Ledger.targets``'s answer) from the next
    step; False when it is the engine's own already (nothing changes)."""
    hw = engine.hw
    if hw is None:
        return False
    tpot = float(record["unloaded_tpot_ms"])
    if abs(tpot - float(hw.unloaded_tpot_ms())) <= 1e-9:
        return False
    where = f"the deployment's record (replica {record.get('replica', '?')}: {record['from']})"
    engine.set_hardware(dataclasses.replace(hw, targets_tpot_ms=tpot, targets_from=where))
    log.info(
        "class targets: unloaded TPOT %.4g ms from %s (this replica's own: %.4g ms)",
        tpot,
        where,
        float(hw.unloaded_tpot_ms()),
    )
    return True
