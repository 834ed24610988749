"""``adaserve serve --replicas N``: N engine replicas as one Ray Serve deployment
behind one OpenAI-compatible front door.

``Cluster`` connects to Ray (``--ray-address``; without it a local cluster is started
here, replicas taking no CPU reservation so that several fit a small machine), starts
the shared ``Ledger`` actor, and deploys ``EngineReplica`` with the request router
chosen by ``--router``:

- ``slo`` (default): ``ray_router.AdaServeRequestRouter`` deciding with
  ``routing.make_router("slo")`` on the replicas' reported headroom;
- ``p2c``: Ray Serve's own default router (power of two choices on queue length);
- ``rr``: ``AdaServeRequestRouter`` with ``routing``'s round robin.

A local cluster listens on loopback only (``bind_host``, ``--ray-bind-host``; see
``init_local_ray``), and its processes do not outlive the front door (``reaper``).

Ray Serve's HTTP proxy stays off: the front door (``front_door.FrontDoor``) is served
by the single server's uvicorn set-up on ``--host``/``--port`` and reaches the replicas
through a ``DeploymentHandle``. Ray Serve replaces a replica that dies (its health
check is the engine thread). On SIGINT/SIGTERM the front door refuses new requests,
every replica drains (``shutdown_grace_s``), then the application is deleted.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

from adaserve.config import EngineConfig
from adaserve.server.config import ServerConfig
from adaserve.util.paths import cache_dir

log = logging.getLogger("adaserve.cluster")

ROUTERS = ("slo", "p2c", "rr")
NAMESPACE = "adaserve"
LOOPBACK = "127.0.0.1"
_LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
_ANY_HOST = ("0.0.0.0", "::", "*")
# Ray 2.60 (``ray_constants.ENABLE_RAY_CLUSTER``): off, a node's address is loopback
_CLUSTERS_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None and (
        importlib.util.find_spec("ray.serve") is not None
    )


def local_ray_kwargs(bind_host: str | None) -> dict:
    """``ray.init`` options for a local cluster bound to ``bind_host``: loopback
    (the default), Ray's own defaults (``0.0.0.0``/``::``: every interface), or an
    address to advertise (Ray's servers then listen on every interface too)."""
    host = (bind_host or LOOPBACK).strip()
    if host in _ANY_HOST:
        return {}
    if host in _LOOPBACK_NAMES:
        host = LOOPBACK
    return {"_node_ip_address": host, "dashboard_host": LOOPBACK}


@contextlib.contextmanager
def _loopback_node(on: bool):
    """While on: Ray takes a loopback node address as given. Ray 2.60's ``ray.init``
    turns ``_node_ip_address="127.0.0.1"`` into the machine's routable address unless
    multi-node clusters are off (``ray_constants.ENABLE_RAY_CLUSTER``, from
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER``, as on macOS and Windows); with the node at
    127.0.0.1 every gRPC server (GCS, raylet, object manager, each worker) binds
    loopback (Ray's C++ servers listen on all interfaces unless the node address is
    exactly 127.0.0.1), and so do the agents, their metrics export and the dashboard."""
    if not on:
        yield
        return
    from ray._private import ray_constants

    saved, env = ray_constants.ENABLE_RAY_CLUSTER, os.environ.get(_CLUSTERS_ENV)
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ[_CLUSTERS_ENV] = "0"  # the processes ray.init starts read it too
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if env is None:
            os.environ.pop(_CLUSTERS_ENV, None)
        else:
            os.environ[_CLUSTERS_ENV] = env


def init_local_ray(bind_host: str | None = LOOPBACK, **kw):
    """Start a local Ray cluster as ``adaserve serve --replicas`` does: bound to
    ``bind_host`` (``local_ray_kwargs``), its processes marked as this process's and
    watched (``reaper``: they are killed when this process exits, however it exits;
    the watchdog's state in ``<cache>/ray``), after killing what a dead front door
    left. Returns the watchdog (``Popen`` or None),
    for ``reaper.stop_watchdog`` once ``ray.shutdown`` has run."""
    import ray

    from adaserve.cluster import reaper

    try:
        state_dir = str(cache_dir() / "ray")
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
    except OSError:  # no cache folder: the marks alone
        state_dir = None
    left = reaper.reap_orphans(state_dir)
    for owner, pids in left.items():
        log.warning(
            "killed %d Ray process(es) left by a dead front door (pid %s)",
            len(pids),
            owner.partition(":")[0],
        )
    token = reaper.owner_token()
    watchdog = reaper.start_watchdog(token, state_dir)
    opts = local_ray_kwargs(bind_host)
    try:
        with reaper.marking(token), _loopback_node(opts.get("_node_ip_address") == LOOPBACK):
            ray.init(**opts, **kw)
    except BaseException:
        reaper.stop_watchdog(watchdog)
        raise
    return watchdog


class Cluster:
    """A running deployment of ``replicas`` engine replicas (``start`` / ``shutdown``)."""

    def __init__(
        self,
        ecfg: EngineConfig,
        cfg: ServerConfig,
        replicas: int,
        *,
        router: str = "slo",
        ray_address: str | None = None,
        bind_host: str | None = LOOPBACK,
        app_name: str = "adaserve",
        seed: int = 0,
        stats_period_s: float = 0.25,
        max_ongoing_requests: int = 1024,
    ):
        if replicas < 1:
            raise ValueError("--replicas must be at least 1")
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r}; known: {', '.join(ROUTERS)}")
        self.ecfg, self.cfg = ecfg, cfg
        self.replicas = replicas
        self.router = router
        self.ray_address = ray_address
        self.bind_host = bind_host
        self.app_name = app_name
        self.seed = seed
        self.stats_period_s = stats_period_s
        self.max_ongoing_requests = max_ongoing_requests
        self.ledger: Any = None
        self.handle: Any = None
        self._owns_ray = False
        self._watchdog = None

    @property
    def ledger_name(self) -> str:
        return f"{self.app_name}-ledger"

    def start(self):
        """Connect, start the ledger and the replicas; returns the engine handle."""
        import ray
        from ray import serve

        from adaserve.cluster.ledger import Ledger

        if not ray.is_initialized():
            src = str(Path(__file__).resolve().parents[2])  # the dir holding `adaserve`
            env = {"PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
            kw: dict[str, Any] = dict(
                namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING
            )
            if self.ray_address:
                ray.init(address=self.ray_address, **kw)
            else:
                # Ray nices its workers (15) by default; the replicas are the servers here,
                # and on a busy machine a niced engine starves (before ray.init starts it)
                os.environ.setdefault("RAY_worker_niceness", "0")
                self._watchdog = init_local_ray(
                    self.bind_host,
                    num_cpus=max(2, os.cpu_count() or 2),
                    runtime_env={"env_vars": env},
                    **kw,
                )
            self._owns_ray = True
        ledger_cls = ray.remote(num_cpus=0)(Ledger)
        self.ledger = ledger_cls.options(
            name=self.ledger_name, namespace=NAMESPACE, get_if_exists=True, lifetime=None
        ).remote(self.cfg.tenants)
        serve.start(proxy_location="Disabled")
        app = self._deployment().bind(
            self.ecfg, self.cfg, self.ledger_name, NAMESPACE, self.stats_period_s
        )
        self.handle = serve.run(app, name=self.app_name, route_prefix=None)
        return self.handle

    def _deployment(self):
        from ray import serve
        from ray.serve.config import RequestRouterConfig

        from adaserve.cluster.replica import EngineReplica

        if self.router == "p2c":
            rrc = RequestRouterConfig(
                request_routing_stats_period_s=self.stats_period_s,  # type: ignore[arg-type]  # ray's stubs type these fields as dicts
                request_routing_stats_timeout_s=5.0,  # type: ignore[arg-type]  # ray's stubs type these fields as dicts
            )
        else:
            from adaserve.cluster.ray_router import AdaServeRequestRouter

            rrc = RequestRouterConfig(
                request_router_class=AdaServeRequestRouter,  # type: ignore[arg-type]  # ray's stubs type these fields as dicts
                request_router_kwargs={
                    "router": self.router,
                    "seed": self.seed,
                    "default_class": self.ecfg.default_class,
                },
                request_routing_stats_period_s=self.stats_period_s,  # type: ignore[arg-type]  # ray's stubs type these fields as dicts
                request_routing_stats_timeout_s=5.0,  # type: ignore[arg-type]  # ray's stubs type these fields as dicts
            )
        return serve.deployment(
            EngineReplica,
            name="engine",
            num_replicas=self.replicas,
            max_ongoing_requests=self.max_ongoing_requests,
            ray_actor_options={"num_cpus": 0},
            graceful_shutdown_timeout_s=self.cfg.shutdown_grace_s + 5.0,
            graceful_shutdown_wait_loop_s=0.5,
            health_check_period_s=2.0,
            health_check_timeout_s=30.0,
            request_router_config=rrc,
        )

    def shutdown(self) -> None:
        """Delete the application (Ray Serve drains every replica), the ledger, and
        the local Ray cluster if this process started it."""
        import ray
        from ray import serve

        from adaserve.cluster import reaper

        if not ray.is_initialized():
            reaper.stop_watchdog(self._watchdog)
            self._watchdog = None
            return
        try:
            serve.delete(self.app_name)
            serve.shutdown()
        except Exception:
            log.exception("stopping the Serve application failed")
        if self.ledger is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.ledger)
        if self._owns_ray:
            ray.shutdown()
        # what ray.shutdown left (an agent still exiting): killed now
        reaper.stop_watchdog(self._watchdog)
        self._watchdog = None


def run(args, ecfg: EngineConfig, cfg: ServerConfig) -> int:
    """Serve ``args.replicas`` replicas until SIGINT/SIGTERM (``server.cli.run``)."""
    from adaserve.cluster.front_door import FrontDoor
    from adaserve.server.engine_loop import model_name_of
    from adaserve.server.http_runtime import make_server

    cluster = Cluster(
        ecfg,
        cfg,
        args.replicas,
        router=args.router,
        ray_address=args.ray_address,
        bind_host=getattr(args, "ray_bind_host", None) or LOOPBACK,
    )
    try:
        handle = cluster.start()
    except Exception as e:  # one line, not a traceback
        print(
            f"adaserve serve: cannot start the replicas: {type(e).__name__}: {e}", file=sys.stderr
        )
        cluster.shutdown()
        return 1
    name = cfg.model_name or model_name_of(ecfg)
    front = FrontDoor(handle, cluster.ledger, cfg, name)
    server = make_server(front, cfg, args.log_level)
    where = (
        f"Ray at {args.ray_address}"
        if args.ray_address
        else f"a local Ray cluster on {cluster.bind_host}"
    )
    print(
        f"adaserve: serving {name} on http://{cfg.host}:{cfg.port} with {args.replicas} "
        f"replica(s) on {where} (router {args.router})",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.run()
    finally:
        cluster.shutdown()
    return 0 if server.started else 1


def run_replicas(args, ecfg: EngineConfig, cfg: ServerConfig) -> int:
    """``adaserve serve --replicas N``: checks, then ``run``."""
    if args.replicas is None:
        print("adaserve serve: --ray-address needs --replicas N", file=sys.stderr)
        return 2
    if args.replicas < 1:
        print("adaserve serve: --replicas must be at least 1", file=sys.stderr)
        return 2
    if not ray_available():
        print(
            "adaserve serve: --replicas needs Ray Serve, which is not installed "
            "(pip install 'adaserve[ray]')",
            file=sys.stderr,
        )
        return 2
    return run(args, ecfg, cfg)
