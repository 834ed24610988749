"""Benchmark and acceptance-test harness: ``adaserve bench serve`` / ``bench sweep``.

- ``workload``: seeded workloads (arrivals, SLO classes, prompts, shifts)
- ``runner``: drive the engine in-process or an OpenAI-compatible server over HTTP
- ``metrics``: per-request records and the stable summary schema
- ``report``: result.json, summary.md and plots
- ``energy``: the documented energy model
- ``demo``: ``adaserve demo`` / ``make demo``
"""
