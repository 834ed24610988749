"""The tokenizer threads are shared fairly: another tenant's job waits for the jobs
already running, not for a flooding tenant's queue (``server.fair_pool``)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from adaserve.server.fair_pool import FairPool, current_tenant


def _run_as(pool: FairPool, tenant: str, fn, *args):
    async def job():
        current_tenant.set(tenant)
        return await pool.run(fn, *args)

    return asyncio.ensure_future(job())


def test_tenants_take_turns_and_a_flood_does_not_queue_another_tenant():
    async def main():
        pool = FairPool(1, "test-fair")
        gate = threading.Event()
        order: list[str] = []

        def work(name: str) -> str:
            gate.wait(10)
            order.append(name)
            return name

        flood = [_run_as(pool, "flood", work, f"f{i}") for i in range(5)]
        await asyncio.sleep(0)  # the flood is queued first
        victim = _run_as(pool, "victim", work, "v")
        more = _run_as(pool, "flood", work, "f5")
        while pool.waiting() < 6:
            await asyncio.sleep(0.001)
        gate.set()
        results = await asyncio.gather(*flood, victim, more)
        pool.shutdown()
        return order, results

    order, results = asyncio.run(main())
    # f0 was running when the victim came; the victim goes next, then the flood in order
    assert order == ["f0", "v", "f1", "f2", "f3", "f4", "f5"]
    assert results == ["f0", "f1", "f2", "f3", "f4", "v", "f5"]


def test_errors_and_cancellation_free_the_thread():
    async def main():
        pool = FairPool(1, "test-fair")
        gate = threading.Event()

        def boom():
            raise ValueError("bad text")

        def blocked():
            gate.wait(10)
            return 1

        with pytest.raises(ValueError, match="bad text"):
            await pool.run(boom)
        first = _run_as(pool, "a", blocked)
        cancelled = _run_as(pool, "a", blocked)
        await asyncio.sleep(0.01)
        cancelled.cancel()  # gone while waiting: it never runs
        gate.set()
        assert await first == 1
        assert await pool.run(lambda: 7) == 7
        assert pool.running == 0 and pool.waiting() == 0
        pool.shutdown()

    asyncio.run(main())
