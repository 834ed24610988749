"""The bench's runtime backends: the in-process engine and an OpenAI-compatible HTTP
server. A backend has ``policies``, ``workload(spec)``, ``run(spec, items, policy,
progress)`` and ``config()`` (the simulator's is ``sim.backend.SimBackend``)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from adaserve.bench.extras import class_energy, classes_of, energy_model, run_extra, strict_class
from adaserve.bench.metrics import shift_convergence, summarize
from adaserve.bench.options import parse_policies
from adaserve.bench.runner import (
    EngineFactory,
    class_ranks,
    class_slos,
    measure_unloaded_tpot,
    off_server_cores,
    run_http,
    run_in_process,
)
from adaserve.bench.workload import build_workload
from adaserve.bench.workload_spec import WorkloadSpec
from adaserve.core.slo import DEFAULT_CLASSES


class InProcessBackend:
    """Builds the engine once; runs one policy on one workload."""

    def __init__(self, args):
        from adaserve.config import EngineConfig

        self.args = args
        self.cfg = EngineConfig(
            model=args.model,
            draft=args.draft,
            no_draft=args.no_draft,
            policy="adaserve",
            device=args.device,
            dtype=args.dtype,
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_seqs=args.max_num_seqs,
            profile=args.profile,
            admission=args.admission,
            enable_prefix_caching=args.enable_prefix_caching,
            prefix_cache_eviction=args.prefix_cache_eviction,
        )
        self.classes = self.cfg.classes
        self.factory = EngineFactory(self.cfg)
        self.policies = parse_policies(args.policies)
        from adaserve.policies.registry import check_servable

        for p in self.policies:  # before the models load
            check_servable(p)
        self.engine = self.factory(self.policies[0])
        # start-up state out of the collector's reach, as a server does (``util.gc_heap``)
        from adaserve.util.gc_heap import freeze_startup_heap

        freeze_startup_heap()
        self.energy = energy_model(args)

    def workload(self, spec: WorkloadSpec):
        eng = self.engine
        return build_workload(spec, tokenizer=eng.tokenizer, vocab_size=eng.target.cfg.vocab_size)

    def run(self, spec: WorkloadSpec, items, policy: str, progress: bool):
        slos = class_slos(classes_of(spec, items), spec.slo_scale, engine=self.engine)
        records, tl = run_in_process(self.factory, policy, items, spec, progress, slos=slos)
        strict = strict_class(spec, self.classes)
        eng = self.engine
        summary = summarize(
            records,
            tl.info["duration_s"],
            run_extra(tl, records, spec, strict, self.energy, self.args.convergence_window),
            flops_per_token=(eng.flops_per_token_target, eng.flops_per_token_draft),
            class_extra=class_energy(tl, records, self.energy),
        )
        return summary, records, tl, slos

    def config(self) -> dict:
        eng = self.engine
        return {
            "mode": "in-process",
            "policies": self.policies,
            "model": str(eng.model_dir),
            "draft": str(eng.draft_dir) if eng.draft_dir else None,
            "device": self.cfg.device,
            "dtype": str(eng.dtype).removeprefix("torch."),
            "kv_pool_bytes": eng.allocator.num_blocks * self.cfg.block_size * eng.kv_bytes_per_slot,
            "max_num_seqs": self.cfg.max_num_seqs,
            "prefix_caching": self.cfg.enable_prefix_caching,
            "admission": self.cfg.admission,
            "unloaded_tpot_ms": eng.unloaded_tpot_ms(),
            # where the class targets and the profile come from, and the threads
            "targets": eng.hw.provenance() if eng.hw is not None else None,
            "threads": eng.thread_plan.as_dict(),
            "energy_model": self.energy.as_dict(),
        }


class HttpBackend:
    """Runs workloads against a server; class targets from the unloaded TPOT."""

    def __init__(self, args):
        from adaserve.text.tokenizer import load_tokenizer
        from adaserve.util import paths

        self.args = args
        self.policies = [args.label]
        self.classes = DEFAULT_CLASSES
        tok_dir = args.tokenizer or args.model
        if tok_dir is None and paths.DEFAULT_TARGET.is_dir():
            tok_dir = paths.DEFAULT_TARGET
        self.tokenizer = load_tokenizer(tok_dir) if tok_dir else None
        self.vocab_size = None
        if self.tokenizer is None and tok_dir:
            self.vocab_size = vocab_of(tok_dir)
        self.unloaded = args.unloaded_tpot_ms
        if self.unloaded is None:
            self.unloaded = measure_unloaded_tpot(args.base_url, api_key=args.api_key)
        self.energy = None

    def workload(self, spec: WorkloadSpec):
        return build_workload(spec, tokenizer=self.tokenizer, vocab_size=self.vocab_size)

    def run(self, spec: WorkloadSpec, items, policy: str, progress: bool):
        slos = class_slos(classes_of(spec, items), spec.slo_scale, unloaded_tpot_ms=self.unloaded)
        # on the server's machine, the client keeps off its engine's cores during the run
        with off_server_cores(self.args.base_url, api_key=self.args.api_key) as note:
            if note and progress:
                print(f"adaserve bench: {note}", file=sys.stderr)
            t0 = time.perf_counter()
            records = run_http(
                self.args.base_url,
                items,
                spec,
                self.args.concurrency,
                slos=slos,
                model=self.args.model_name,
                send_priority=not self.args.no_priority,
                ranks=class_ranks(DEFAULT_CLASSES),
                progress=progress,
                api_key=self.args.api_key,
            )
        wall = time.perf_counter() - t0
        ends = [r.finish_s for r in records if r.finish_s is not None]
        duration = max(ends) if ends else wall
        strict = strict_class(spec, DEFAULT_CLASSES)
        extra: dict[str, Any] = {"wall_s": wall}
        if spec.shifts:
            conv = shift_convergence(
                records,
                [s.at_s for s in spec.shifts],
                strict,
                duration,
                window_s=self.args.convergence_window,
            )
            extra["shifts"] = [
                {"change": s.change, "strict_class": strict, **c} for s, c in zip(spec.shifts, conv)
            ]
        return summarize(records, duration, extra), records, None, slos

    def config(self) -> dict:
        return {
            "mode": "http",
            "base_url": self.args.base_url,
            "policies": self.policies,
            "priority_sent": not self.args.no_priority,
            "concurrency": self.args.concurrency,
            "unloaded_tpot_ms": self.unloaded,
        }


def vocab_of(path) -> int | None:
    import json

    try:
        return int(json.loads((Path(path) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError):
        return None


def backend_for(args):
    return HttpBackend(args) if args.base_url else InProcessBackend(args)
