"""``adaserve serve``: run the OpenAI-compatible server (also ``python -m adaserve.server``).

Start-up order: read the TOML config, build the engine on its thread (a bad checkpoint
fails here, with one line, before any port is bound), then serve with uvicorn. On
SIGINT/SIGTERM new requests get 503 (the listener stays open while requests are in
flight, then closes), in-flight requests get ``shutdown_grace_s`` to finish and are
then cancelled with a ``server_shutdown`` error; the process exits 0. A second
SIGINT forces the exit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from adaserve.config import EngineConfig
from adaserve.core.config import ADMISSION_CHECKS
from adaserve.errors import AdaServeError, InvalidRequestError, ModelLoadError
from adaserve.ledger.config import UsageConfigError
from adaserve.server.config import (
    ConfigError,
    ServerConfig,
    Tenant,
    check_against_classes,
    engine_config_for_server,
    key_digest,
    load_config,
)
from adaserve.text.chat_template import load_template_arg
from adaserve.util import cli_args, threads

log = logging.getLogger("adaserve.server")

CLI_TENANT = "api-key"  # the tenant of --api-key keys


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``adaserve serve`` (flags override the config file); vLLM's names
    where the concept exists (docs/cli.md has the mapping)."""
    p.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="target checkpoint directory, as vllm serve MODEL (default: the shipped model)",
    )
    p.add_argument("--model", help="the same as MODEL")
    p.add_argument(
        "--draft",
        help="draft checkpoint directory (default: the shipped draft when no MODEL is "
        "given; with a MODEL, no draft and no speculation unless --draft is given)",
    )
    p.add_argument("--no-draft", action="store_true", help="serve without speculation")
    p.add_argument("--policy", help="scheduling policy (default: adaserve)")
    p.add_argument("--host", help="bind address (default: 127.0.0.1)")
    p.add_argument("--port", type=cli_args.port, help="port (default: 8000)")
    p.add_argument("--config", help="TOML file: server, engine, classes, tenants, service_tiers")
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY[,KEY...]",
        help="require one of these API keys (repeatable or comma-separated; also "
        "$ADASERVE_API_KEY); they form an admin tenant beside the config file's tenants",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="model id in /v1/models and responses; more names are aliases (vLLM's)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=cli_args.int_at_least(1),
        default=None,
        help="1 (tensor parallelism is not implemented; --replicas N scales out)",
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted for vLLM scripts: the supported families need no remote code",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='vLLM\'s: {"method": "draft_model", "model": DIR, "num_speculative_tokens": K} '
        "= --draft DIR --policy spec-chain:K (an explicit --policy wins)",
    )
    p.add_argument(
        "--admission",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="admission control: 429 at once for a request whose class's promise cannot be "
        "kept (default on; --no-admission queues everything)",
    )
    p.add_argument(
        "--admission-check",
        choices=ADMISSION_CHECKS,
        default=None,
        help="how admission judges a request's TPOT: planner (the policy's planner "
        "forecasts the pass over its life), paces (the measured class paces) or auto "
        "(the default: the planner, and the paces too where the profile's pass cost is "
        "steep, as on a CPU)",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="automatic prefix caching: a prompt's cached prefix of full KV blocks is "
        "reused, not recomputed (default on, as vLLM; tenants never share blocks unless "
        "their prefix_cache_group says so)",
    )
    p.add_argument(
        "--prefix-cache-eviction",
        choices=["lru", "slo"],
        default=None,
        help="which cached block goes first when the pool is full: lru (vLLM's, the "
        "default) or slo (blocks the strictest classes used are kept longer)",
    )
    p.add_argument(
        "--uvicorn-log-level",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        default=None,
        help="uvicorn's own log level (default: --log-level)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template file (or the template itself) instead of the model's",
    )
    p.add_argument(
        "--generation-config",
        metavar="auto|vllm|DIR",
        help="default sampling parameters: auto (default) from the model's "
        "generation_config.json, vllm for none, or a directory holding one",
    )
    p.add_argument(
        "--strict-fields",
        action="store_true",
        help="reject requests with unknown fields (400) instead of ignoring them",
    )
    p.add_argument(
        "--structured-outputs-backend",
        choices=("auto", "llguidance", "xgrammar"),
        default=None,
        help="grammar library of response_format / structured_outputs / tool calls "
        "(auto: llguidance)",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='serve tool_choice "auto": the model decides, --tool-call-parser reads its calls',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=("hermes", "qwen", "llama3_json", "mistral"),
        default=None,
        help="how tool calls are read from the model's text (tool_choice auto)",
    )
    p.add_argument("--device", help="cpu or cuda[:N]")
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
        help="auto (default: float32 on CPU, the checkpoint's half precision on CUDA)",
    )
    p.add_argument("--seed", type=cli_args.int_at_least(0), help="seed of unseeded sampling")
    p.add_argument(
        "--threads",
        type=cli_args.int_at_least(1),
        help="intra-op threads of the forward passes (default: $ADASERVE_NUM_THREADS, "
        "$OMP_NUM_THREADS, else the usable cores less a reserve for the HTTP loop)",
    )
    p.add_argument(
        "--reprofile",
        action="store_true",
        help="measure the hardware profile now and adopt it, even when slower than the "
        "stored one's spread, with new class targets",
    )
    p.add_argument(
        "--kv-cache-bytes",
        "--kv-cache-memory-bytes",  # vLLM's name
        dest="kv_cache_bytes",
        type=cli_args.byte_size,
        metavar="SIZE",
        help="KV pool size, target + draft (e.g. 512M, 2GiB; default on CPU: a quarter of "
        "the free RAM, at most 4 GiB; on CUDA: what --gpu-memory-utilization leaves)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=cli_args.fraction,
        help="share of the GPU's memory the engine may fill, weights + KV + activations "
        "(default 0.9; sizes the KV pool on CUDA, no effect on CPU)",
    )
    p.add_argument(
        "--max-num-seqs", type=cli_args.int_at_least(1), help="most requests in the running batch"
    )
    p.add_argument(
        "--max-model-len",
        type=cli_args.human_int,
        help="context length (e.g. 2048, 4k; default and maximum: the model's)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=cli_args.nonneg_float,
        help="seconds in-flight requests may finish",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=cli_args.positive_float,
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    p.add_argument(
        "--header-timeout",
        type=cli_args.positive_float,
        help="seconds a request's line and headers may take to arrive (default 10)",
    )
    p.add_argument(
        "--body-timeout",
        type=cli_args.positive_float,
        help="seconds a request's body may take to arrive after its headers (default 60)",
    )
    p.add_argument(
        "--max-connections",
        type=cli_args.int_at_least(1),
        help="open connections beyond this get 503 (default 1000)",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        help="seconds between two stats log lines (default 10)",
    )
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log line")
    p.add_argument(
        "--replicas",
        type=int,
        help="serve N engine replicas on Ray Serve behind this one address (needs the "
        "`ray` extra: pip install 'adaserve[ray]')",
    )
    p.add_argument(
        "--ray-address",
        help="with --replicas: an existing Ray cluster (default: start a local one)",
    )
    p.add_argument(
        "--ray-bind-host",
        metavar="HOST",
        help="with --replicas and no --ray-address: where the local Ray cluster listens "
        "(default 127.0.0.1, loopback only; 0.0.0.0: Ray's defaults, every interface)",
    )
    p.add_argument(
        "--router",
        default="slo",
        choices=["slo", "p2c", "rr"],
        help="with --replicas: SLO-aware (default), Ray Serve's power of two choices, "
        "or round robin",
    )
    p.add_argument(
        "--usage-db",
        metavar="URL",
        help="the usage ledger: a SQLite path (or sqlite:////abs/path.db), a postgresql:// URL, or "
        "'none' (in memory only, lost on restart); default: usage.db in $ADASERVE_DATA, "
        "else $XDG_DATA_HOME/adaserve ([usage] db in the config)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _model_of(args) -> str | None:
    tag, flag = getattr(args, "model_tag", None), args.model
    if tag and flag and tag != flag:
        raise ConfigError(f"the model is given twice: {tag!r} and --model {flag!r}")
    return tag or flag


def _speculative(args) -> tuple[str | None, str | None]:
    """(draft, policy) of ``--speculative-config`` (None, None without it)."""
    raw = getattr(args, "speculative_config", None)
    if not raw:
        return None, None
    try:
        spec = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ConfigError("--speculative-config must be a JSON object")
    method = spec.get("method", "draft_model")
    if method != "draft_model":
        raise ConfigError(
            f"--speculative-config: method {method!r} is not supported (draft_model only)"
        )
    model = spec.get("model")
    if not isinstance(model, str) or not model:
        raise ConfigError('--speculative-config needs "model": the draft checkpoint')
    k = spec.get("num_speculative_tokens", 4)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 16:
        raise ConfigError("--speculative-config: num_speculative_tokens must be 1-16")
    return model, f"spec-chain:{k}"


def _cli_tenant(args, cfg: ServerConfig) -> Tenant | None:
    """The tenant of ``--api-key`` / ``$ADASERVE_API_KEY`` / ``$VLLM_API_KEY`` keys
    (None without any)."""
    raw = list(args.api_key or [])
    for var in ("ADASERVE_API_KEY", "VLLM_API_KEY"):
        env = os.environ.get(var)
        if env:
            raw.append(env)
    keys = [k.strip() for v in raw for k in v.split(",") if k.strip()]
    if not keys:
        if raw:
            raise ConfigError("--api-key: no key given")
        return None
    if any(t.name == CLI_TENANT for t in cfg.tenants):
        raise ConfigError(f"tenant name {CLI_TENANT!r} is taken by --api-key keys")
    return Tenant(CLI_TENANT, key_digests=tuple(dict.fromkeys(map(key_digest, keys))), admin=True)


def _check_model_len(ecfg: EngineConfig) -> None:
    """--max-model-len above the model's context: an error before the engine loads (the
    engine checks it too), as vLLM refuses it rather than clamping."""
    if ecfg.max_model_len is None:
        return
    from adaserve.models.config import ModelConfig
    from adaserve.util import paths

    d = Path(ecfg.model) if ecfg.model else paths.DEFAULT_TARGET
    if not (d / "config.json").is_file():
        return  # the engine reports the missing checkpoint
    n = ModelConfig.from_dir(d).max_position_embeddings
    if ecfg.max_model_len > n:
        raise ConfigError(
            f"--max-model-len {ecfg.max_model_len} is larger than the model's context "
            f"(max_position_embeddings={n} in {d / 'config.json'})"
        )


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def build_configs(args) -> tuple[EngineConfig, ServerConfig]:
    """Engine and server configuration from the file and the flags (flags win)."""
    cfg = load_config(args.config) if args.config else ServerConfig()
    if getattr(args, "admission", None) is not None:  # the engine's config follows it
        cfg = dataclasses.replace(cfg, admission=args.admission)
    kw = dict(cfg.engine)
    if isinstance(kw.get("kv_cache_bytes"), str):  # "2GiB" in the TOML file
        try:
            kw["kv_cache_bytes"] = cli_args.parse_byte_size(kw["kv_cache_bytes"])
        except ValueError as e:
            raise ConfigError(f"engine.kv_cache_bytes: {e}") from None
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None and tp != 1:
        raise ConfigError(
            f"--tensor-parallel-size {tp}: tensor parallelism is not implemented; serve "
            "with 1 (--replicas N runs N engines)"
        )
    spec_draft, spec_policy = _speculative(args)
    if spec_draft and args.draft and args.draft != spec_draft:
        raise ConfigError("the draft is given twice: --draft and --speculative-config")
    flags = {
        "model": _model_of(args),
        "draft": args.draft or spec_draft,
        "policy": args.policy or spec_policy,
        "device": args.device,
        "dtype": _DTYPE_ALIASES.get(args.dtype, args.dtype),
        "kv_cache_bytes": args.kv_cache_bytes,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "generation_config": getattr(args, "generation_config", None),
        "seed": getattr(args, "seed", None),
        "threads": getattr(args, "threads", None),
        "structured_outputs_backend": getattr(args, "structured_outputs_backend", None),
        "enable_prefix_caching": getattr(args, "enable_prefix_caching", None),
        "prefix_cache_eviction": getattr(args, "prefix_cache_eviction", None),
        "admission_check": getattr(args, "admission_check", None),
    }
    kw.update({k: v for k, v in flags.items() if v is not None})
    if getattr(args, "reprofile", False):
        kw["reprofile"] = True
    try:
        threads.choose(kw.get("threads"))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if args.no_draft:
        kw["no_draft"] = True
    if cfg.classes is not None:
        kw["classes"] = cfg.classes
        names = [c.name for c in cfg.classes]
        if kw.get("default_class") not in names:
            kw["default_class"] = cfg.default_class or names[0]
    try:
        ecfg = engine_config_for_server(EngineConfig(**kw), cfg)
    except TypeError as e:
        raise ConfigError(f"engine: {e}") from None
    except InvalidRequestError as e:
        raise ConfigError(f"engine: {e}") from None
    check_against_classes(cfg, ecfg.classes)
    repl: dict = {}
    if args.host is not None:
        repl["host"] = args.host
    if args.port is not None:
        repl["port"] = args.port
    if args.served_model_name:
        names = args.served_model_name
        if isinstance(names, str):
            names = [names]
        repl["model_name"] = names[0]
        repl["model_aliases"] = tuple(n for n in names[1:] if n != names[0])
    elif cfg.model_name is None and (given := _model_of(args)):
        # vLLM's served model id: the model as given (a client that loads the tokenizer
        # by the id, as vLLM's benchmark client does, then finds it); its directory's
        # name is accepted too
        repl["model_name"] = given
        base = Path(given.rstrip("/")).name
        if base and base != given:
            repl["model_aliases"] = (*cfg.model_aliases, base)

    if args.shutdown_grace is not None:
        repl["shutdown_grace_s"] = args.shutdown_grace
    if getattr(args, "strict_fields", False):
        repl["strict_fields"] = True
    if getattr(args, "chat_template", None):
        repl["chat_template"] = args.chat_template
    if getattr(args, "enable_auto_tool_choice", False):
        if not getattr(args, "tool_call_parser", None):
            raise ConfigError("--enable-auto-tool-choice needs --tool-call-parser")
        repl["enable_auto_tool_choice"] = True
    if getattr(args, "tool_call_parser", None):
        repl["tool_call_parser"] = args.tool_call_parser
    for flag, key in (
        ("timeout_keep_alive", "timeout_keep_alive_s"),
        ("header_timeout", "header_timeout_s"),
        ("body_timeout", "body_timeout_s"),
        ("max_connections", "max_connections"),
        ("log_stats_interval", "log_stats_interval_s"),
    ):
        if getattr(args, flag) is not None:
            repl[key] = getattr(args, flag)
    if getattr(args, "usage_db", None) is not None:
        try:
            repl["usage"] = dataclasses.replace(cfg.usage, db=args.usage_db)
        except UsageConfigError as e:
            raise ConfigError(f"--usage-db: {e}") from None
    tenant = _cli_tenant(args, cfg)
    if tenant is not None:
        repl["tenants"] = (*cfg.tenants, tenant)
    if getattr(args, "disable_log_stats", False):
        repl["log_stats"] = False
    if repl:
        cfg = dataclasses.replace(cfg, **repl)
    return ecfg, cfg


def run(args, replicas=None) -> int:
    """Serve until SIGINT/SIGTERM; 0 on a clean shutdown, 1 if start-up fails, 2 on a
    configuration error. ``replicas(args, ecfg, cfg)`` serves ``--replicas`` (the
    cluster's ``serve_app.run_replicas``, handed down by ``adaserve serve``: the server
    imports nothing of the cluster above it)."""
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(levelname)s %(name)s: %(message)s",
    )
    if getattr(args, "trust_remote_code", False):
        print(
            "adaserve serve: --trust-remote-code has no effect: the supported families "
            "(Llama, Qwen2, Mistral) load without remote code",
            file=sys.stderr,
        )
    try:
        ecfg, cfg = build_configs(args)
        _check_model_len(ecfg)
        if cfg.chat_template is not None:  # a bad template fails before the engine loads
            from adaserve.text.chat_template import ChatTemplate

            ChatTemplate({"default": load_template_arg(cfg.chat_template)}).check()
    except (ConfigError, InvalidRequestError, ModelLoadError) as e:
        print(f"adaserve serve: {e}", file=sys.stderr)
        return 2
    if args.gpu_memory_utilization is not None and not ecfg.device.startswith("cuda"):
        print(
            "adaserve serve: note: --gpu-memory-utilization sizes the KV pool on CUDA only; "
            "on CPU the pool is --kv-cache-bytes (default: a quarter of the free RAM, at "
            "most 4 GiB)",
            file=sys.stderr,
        )
    if cfg.usage.enabled:  # a database that cannot be opened fails before the model loads
        from adaserve.ledger import open_store

        try:
            open_store(cfg.usage).close()
        except Exception as e:
            print(
                f"adaserve serve: cannot open the usage ledger: {e} (--usage-db PATH|URL "
                "names another; --usage-db none serves without one)",
                file=sys.stderr,
            )
            return 1
    if getattr(args, "replicas", None) is not None or getattr(args, "ray_address", None):
        if replicas is None:
            print("adaserve serve: --replicas needs the cluster runner", file=sys.stderr)
            return 2
        return replicas(args, ecfg, cfg)
    # the app (FastAPI, the engine, torch) is imported once the configuration is valid
    from adaserve.server.app import create_app
    from adaserve.server.engine_loop import EngineLoop
    from adaserve.server.http_runtime import make_server

    # one engine, in a process it owns: the rest of the process keeps off its cores
    confine = True if cfg.confine_threads is None else cfg.confine_threads
    eloop = EngineLoop.for_server(ecfg, dataclasses.replace(cfg, confine_threads=confine))
    try:
        eloop.start()
    except Exception as e:  # one line, not a traceback
        msg = str(e) if isinstance(e, AdaServeError) else f"{type(e).__name__}: {e}"
        print(f"adaserve serve: cannot start the engine: {msg}", file=sys.stderr)
        return 1
    app = create_app(eloop, cfg)
    try:  # the usage ledger opens (and migrates) before any port is bound
        app.state.adaserve.open_ledger()
    except Exception as e:
        print(f"adaserve serve: cannot open the usage ledger: {e}", file=sys.stderr)
        eloop.stop()
        return 1
    server = make_server(app, cfg, getattr(args, "uvicorn_log_level", None) or args.log_level)
    mode = (
        "open local mode (no API keys configured)"
        if cfg.open_mode
        else f"{len(cfg.tenants)} tenant(s)"
    )
    print(
        f"adaserve: serving {app.state.adaserve.model_name} on http://{cfg.host}:{cfg.port} "
        f"(policy {eloop.ready_info.policy}; {mode})",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run()
    finally:
        eloop.stop()
    return 0 if server.started else 1


def main(argv: list[str] | None = None, replicas=None) -> int:
    p = cli_args.Parser(
        prog="adaserve serve", description="OpenAI-compatible server with per-request SLOs"
    )
    add_arguments(p)
    return run(p.parse_args(argv), replicas)
