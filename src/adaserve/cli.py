"""``adaserve`` command line: one subcommand per job."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from adaserve import __version__
from adaserve.errors import AdaServeError
from adaserve.util import cli_args

if TYPE_CHECKING:
    from adaserve.sampling import SamplingParams


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target checkpoint directory (default: shipped pair)")
    g = p.add_mutually_exclusive_group()
    g.add_argument(
        "--draft",
        help="draft checkpoint directory (default: the shipped draft without --model; "
        "with --model, no draft, so no speculation, unless --draft is given)",
    )
    g.add_argument("--no-draft", action="store_true", help="run without a draft model")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: float32 on CPU, the checkpoint's half precision on CUDA",
    )


def _sampling_from_args(args) -> SamplingParams:
    """The flags over the model's generation_config.json defaults (unless
    ``--generation-config vllm``) over greedy decoding."""
    from adaserve.sampling import SamplingParams
    from adaserve.text.generation_config import sampling_defaults
    from adaserve.util import paths

    model_dir = args.model or paths.DEFAULT_TARGET
    kw = sampling_defaults(model_dir, args.generation_config)
    kw.pop("max_tokens", None)  # --max-tokens has its own default
    kw.setdefault("temperature", 0.0)  # this command is greedy unless told otherwise
    for name in ("temperature", "top_p", "top_k"):
        v = getattr(args, name)
        if v is not None:
            kw[name] = v
    return SamplingParams(
        **kw,
        max_tokens=args.max_tokens,
        seed=args.seed,
        stop=args.stop or None,
        logprobs=args.logprobs,
    )


def _logprob_rows(out) -> list[dict] | None:
    """Per generated token: its id, logprob and the top k as [id, logprob] by rank (the
    taken token may be outside them)."""
    if out.logprobs is None:
        return None
    return [
        {
            "token_id": t,
            "logprob": pos[t].logprob,
            "top": [
                [i, lp.logprob]
                for i, lp in sorted(pos.items(), key=lambda e: e[1].rank or 0)
                if lp.rank is not None
            ],
        }
        for t, pos in zip(out.token_ids, out.logprobs)
    ]


def _print_logprobs(out) -> None:
    """One line per generated token: index, token, logprob, the K likeliest."""
    print("# token logprobs (index, id, logprob, top alternatives as id:logprob)")
    for i, row in enumerate(_logprob_rows(out) or []):  # the caller checked
        top = " ".join(f"{tid}:{lp:.4f}" for tid, lp in row["top"])
        print(f"{i}\t{row['token_id']}\t{row['logprob']:.4f}\t{top}")


def _cmd_generate(args) -> int:
    from adaserve import LLM

    if args.model is not None and not args.draft and not args.no_draft:
        print(
            "adaserve generate: no --draft given with --model: speculation is off "
            "(pass --draft DIR to speculate, --no-draft to silence this)",
            file=sys.stderr,
        )
    sp = _sampling_from_args(args)
    llm = LLM(
        model=args.model,
        draft=args.draft,
        no_draft=args.no_draft,
        policy=args.policy,
        device=args.device,
        dtype=args.dtype,
    )
    prompt: str | list[int] = args.prompt
    if args.token_ids:
        try:
            prompt = [int(x) for x in args.prompt.replace(",", " ").split()]
        except ValueError:
            raise AdaServeError(
                "--token-ids expects integers separated by spaces or commas"
            ) from None
    out = llm.generate([prompt], sp, slo=args.slo_class, use_tqdm=False)[0].outputs[0]
    m = out.metrics
    if args.json:
        stats = {
            "steps": m["steps"],
            "drafted_tokens": m["drafted_tokens"],
            "accepted_tokens": m["accepted_tokens"],
            "tokens_per_step": m["tokens_per_step"],
            "verified_tokens": m["verified_tokens"],
            "accepted_by_depth": m["accepted_by_depth"],
        }
        print(
            json.dumps(
                {
                    "text": out.text,
                    "token_ids": out.token_ids,
                    "finish_reason": out.finish_reason,
                    "logprobs": _logprob_rows(out),
                    "stats": stats,
                    "metrics": {k: m[k] for k in ("ttft_ms", "tpot_ms", "e2e_ms", "policy")},
                }
            )
        )
    else:
        print(out.text if out.text is not None else " ".join(map(str, out.token_ids)))
        if out.logprobs is not None:
            _print_logprobs(out)
        print(
            f"[{len(out.token_ids)} tokens, {m['steps']} steps, "
            f"{m['tokens_per_step']:.2f} tokens/step, policy {m['policy']}]",
            file=sys.stderr,
        )
    return 0


def _shape_dirs(shapes: str, root) -> tuple[str, str | None, dict]:
    """Config-only checkpoint directories under ``root`` for ``TARGET[:DRAFT]``, named
    as the simulator's model table names them; returns (target dir, draft dir, names)."""
    from adaserve.sim import presets

    names = [n.strip() for n in shapes.split(":")]
    if len(names) > 2 or not all(names):
        raise AdaServeError("--shapes takes TARGET or TARGET:DRAFT")
    dirs = []
    for n in names:
        try:
            spec = presets.MODELS[presets.lookup(presets.MODELS, n, "model shape")]
        except ValueError as e:
            raise AdaServeError(str(e)) from None
        d = Path(root) / spec.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(spec.hf_config(), indent=1))
        dirs.append(str(d))
    shape = {"target": Path(dirs[0]).name, "draft": Path(dirs[1]).name if len(dirs) > 1 else None}
    return dirs[0], dirs[1] if len(dirs) > 1 else None, shape


def _profile_kv_bytes(model: str | None, draft: str | None, dtype: str, device: str) -> int:
    """KV pool for profiling: 4,096 token slots of the pair (at least 64 MiB), room for
    the step and draft-host measurements whatever the models' size."""
    from adaserve.models.config import ModelConfig
    from adaserve.models.loader import resolve_dtype
    from adaserve.util import paths

    esize = resolve_dtype(dtype, device).itemsize
    per_slot = ModelConfig.from_dir(model or paths.DEFAULT_TARGET).kv_bytes_per_token(esize)
    d = draft or (paths.DEFAULT_DRAFT if model is None else None)
    if d is not None and Path(d).is_dir():
        per_slot += ModelConfig.from_dir(d).kv_bytes_per_token(esize)
    return max(64 << 20, 4096 * per_slot)


def _cmd_profile(args) -> int:
    import tempfile

    from adaserve.config import EngineConfig
    from adaserve.engine import build_engine
    from adaserve.engine.profile import profile_engine

    model, draft, no_draft, shapes = args.model, args.draft, args.no_draft, None
    with tempfile.TemporaryDirectory() as tmp:
        if args.shapes:
            if args.model or args.draft:
                raise AdaServeError("give --shapes or --model/--draft, not both")
            if args.out is None:
                raise AdaServeError("--shapes needs --out (its profile is not the server's)")
            model, draft, shapes = _shape_dirs(args.shapes, tmp)
            no_draft = no_draft or draft is None
        eng = build_engine(
            EngineConfig(
                model=model,
                draft=draft,
                no_draft=no_draft,
                policy="ar",
                device=args.device,
                dtype=args.dtype,
                auto_profile=False,
                kv_cache_bytes=_profile_kv_bytes(
                    model, None if no_draft else draft, args.dtype, args.device
                ),
                random_weights=args.random_weights or shapes is not None,
                threads=args.threads,
            )
        )
        if args.out is None:  # the server's cache, by the adoption rule
            return _profile_into_cache(eng, args)
        prof = profile_engine(eng, reps=args.reps)
    if shapes is not None:
        prof["shapes"] = shapes
        prof["target"]["path"] = None
        if prof["draft"] is not None:
            prof["draft"]["path"] = None
    if args.random_weights or shapes is not None:
        prof["random_weights"] = True
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(prof, indent=1) + "\n")
    v = prof["verify"]
    print(f"wrote {args.out}")
    for t, ms in zip(v["tokens"], v["latency_ms"]):
        print(f"  verify {t:4d} tokens: {ms:7.2f} ms")
    if prof.get("draft_step"):
        for t, ms in zip(prof["draft_step"]["tokens"], prof["draft_step"]["latency_ms"]):
            print(f"  draft  {t:4d} tokens: {ms:7.2f} ms")
    return 0


def _profile_into_cache(eng, args) -> int:
    """``adaserve profile`` without ``--out``: measure, then adopt into the cache the
    server reads (kept out when slower than the stored spread, unless --reprofile)."""
    from adaserve.engine import profile

    path = profile.cached_profile_path(eng)
    prof = profile.measure_checked(eng, reps=args.reps)
    used, why = profile.adopt(eng, prof, path, args.reprofile)
    print(why)
    t = used.get("targets") or profile.attach_targets(eng, used)
    print(
        f"class targets multiply an unloaded TPOT of {t['unloaded_tpot_ms']:.4g} ms ({t['from']})"
    )
    print("a running server takes it with POST /v1/admin/profile (admin key)")
    return 0 if used is prof else 3


def _delegate(module: str, fn: str):
    import importlib

    try:
        return getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise AdaServeError(f"this build lacks {module}.{fn}: {e}") from None


def _attach(module: str, fn: str, parser: argparse.ArgumentParser) -> None:
    """Let ``module.fn`` add its arguments (skipped when that part is not installed)."""
    with contextlib.suppress(AdaServeError):
        _delegate(module, fn)(parser)


def build_parser() -> argparse.ArgumentParser:
    p = cli_args.Parser(
        prog="adaserve", description="SLO-customized LLM serving with speculative token trees"
    )
    p.add_argument("--version", action="version", version=f"adaserve {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate from one prompt")
    _add_model_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--token-ids", action="store_true", help="the prompt is token ids")
    g.add_argument("--max-tokens", type=cli_args.int_at_least(1), default=64)
    g.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="default: the model's generation_config.json, else 0 (greedy)",
    )
    g.add_argument("--top-p", type=float, default=None, help="default: generation_config, else 1")
    g.add_argument("--top-k", type=int, default=None, help="default: generation_config, else 0")
    g.add_argument("--seed", type=cli_args.int_at_least(0))
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), "
        "or a directory holding one",
    )
    g.add_argument("--policy", default="adaserve")
    g.add_argument("--slo-class", default=None, help="SLO class (default: chat)")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument(
        "--logprobs",
        type=cli_args.int_at_least(0),
        default=None,
        metavar="K",
        help="each token's logprob under the target and the K likeliest (a table after "
        "the text, or in the --json object)",
    )
    g.set_defaults(func=_cmd_generate)

    pr = sub.add_parser("profile", help="measure the pair's latencies (hardware profile)")
    _add_model_args(pr)
    pr.add_argument(
        "--out",
        help="profile JSON file to write (default: adopt it into the cache the server "
        "reads, unless it is slower than the stored one's spread)",
    )
    pr.add_argument("--reps", type=cli_args.int_at_least(1), default=5)
    pr.add_argument(
        "--threads",
        type=cli_args.int_at_least(1),
        help="intra-op threads to measure with (default: as the server chooses them)",
    )
    pr.add_argument(
        "--reprofile",
        action="store_true",
        help="adopt the measurement even when slower than the stored spread, with new "
        "class targets",
    )
    pr.add_argument(
        "--shapes",
        metavar="TARGET[:DRAFT]",
        help="profile random-weight models of these shapes (the simulator's model table: "
        "e.g. Llama-3.1-8B:Llama-3.2-1B) instead of checkpoints",
    )
    pr.add_argument(
        "--random-weights",
        action="store_true",
        help="--model/--draft directories need only config.json; weights are random",
    )
    pr.set_defaults(func=_cmd_profile)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _attach("adaserve.server.cli", "add_arguments", s)
    s.set_defaults(
        func=lambda a: _delegate("adaserve.server.cli", "run")(
            a, _delegate("adaserve.cluster.serve_app", "run_replicas")
        )
    )

    u = sub.add_parser("usage", help="read the usage ledger (totals, rows, reports)")
    _attach("adaserve.ledger.cli", "add_arguments", u)
    u.set_defaults(func=lambda a: _delegate("adaserve.ledger.cli", "run")(a))

    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench_cmd", required=True)
    for name in ("serve", "sweep"):
        bp = bsub.add_parser(name, help=f"bench {name}")
        _attach("adaserve.bench.cli", f"add_{name}_arguments", bp)
        bp.set_defaults(func=lambda a, n=name: _delegate("adaserve.bench.cli", f"run_{n}")(a))
    ov = bsub.add_parser("overload", help="drive a live server past capacity: sheds, answers")
    _attach("adaserve.bench.overload", "add_arguments", ov)
    ov.set_defaults(func=lambda a: _delegate("adaserve.bench.overload", "run")(a))
    sc = bsub.add_parser("scheduler", help="selection decision time")
    sc.add_argument("--requests", type=int, default=256)
    sc.add_argument("--candidates", type=int, default=64)
    sc.add_argument("--iterations", type=int, default=200)
    sc.add_argument(
        "--prefilling",
        type=int,
        default=0,
        help="of --requests, how many are relaxed prompts still prefilling (the pass "
        "composition's work)",
    )
    sc.add_argument("--json", action="store_true")
    sc.set_defaults(func=lambda a: _delegate("adaserve.bench.scheduler", "run")(a))

    sm = sub.add_parser("simulate", help="GPU-scale discrete-event simulation")
    _attach("adaserve.sim.cli", "add_arguments", sm)
    sm.set_defaults(func=lambda a: _delegate("adaserve.sim.cli", "run")(a))

    t = sub.add_parser("train", help="train the default model pair", add_help=False)
    t.add_argument("rest", nargs=argparse.REMAINDER)
    t.set_defaults(func=lambda a: _delegate("adaserve.train.cli", "main")(a.rest))

    d = sub.add_parser("demo", help="serve the shipped pair and drive a mixed-SLO workload")
    d.add_argument(
        "--duration",
        type=cli_args.positive_float,
        default=20.0,
        help="seconds of arrivals per policy (20)",
    )
    d.add_argument("--port", type=cli_args.port, default=0)
    d.add_argument(
        "--baseline",
        default=None,
        help="the policy served beside adaserve, same workload and targets (default "
        "spec-chain:4: vLLM's speculative decoding with a 4-token draft chain; ar-chunked is "
        "vLLM's continuous batching with chunked prefill, no speculation)",
    )
    d.add_argument(
        "--out", metavar="DIR", help="where the full report goes (default: a new temporary folder)"
    )
    d.add_argument(
        "--record-targets",
        action="store_true",
        help="measure the pair's hardware profile anew and record the class targets from "
        "it (refused when the machine is measured as busy; docs/caches.md)",
    )
    d.set_defaults(func=lambda a: _delegate("adaserve.bench.demo", "run")(a))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["train"]:
            # argparse's REMAINDER drops a leading "--option" inside a subparser, so the
            # train command (which owns its own parser) is dispatched before parsing.
            return int(_delegate("adaserve.train.cli", "main")(argv[1:]) or 0)
        parser = build_parser()
        args = parser.parse_args(argv)
        return int(args.func(args) or 0)
    except AdaServeError as e:
        print(f"adaserve: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader of stdout left (``adaserve simulate --list-presets | head``): not
        # an error of ours; exit quietly, as a command killed by SIGPIPE
        cli_args.quiet_broken_pipe()
        return 141


if __name__ == "__main__":
    sys.exit(main())
