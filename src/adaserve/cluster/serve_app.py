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

from adaserve.config import EngineConfig
from adaserve.server.config import ServerConfig

log = logging.getLogger("adaserve.cluster")

ROUTERS = ("slo", "p2c", "rr")
NAMESPACE = "adaserve"


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None and (
        importlib.util.find_spec("ray.serve") is not None
    )


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
        self.app_name = app_name
        self.seed = seed
        self.stats_period_s = stats_period_s
        self.max_ongoing_requests = max_ongoing_requests
        self.ledger = None
        self.handle = None
        self._owns_ray = False

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
            kw = dict(namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING)
            if self.ray_address:
                ray.init(address=self.ray_address, **kw)
            else:
                # Ray nices its workers (15) by default; the replicas are the servers here,
                # and on a busy machine a niced engine starves (before ray.init starts it)
                os.environ.setdefault("RAY_worker_niceness", "0")
                ray.init(num_cpus=max(2, os.cpu_count() or 2), runtime_env={"env_vars": env}, **kw)
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
                request_routing_stats_period_s=self.stats_period_s,
                request_routing_stats_timeout_s=5.0,
            )
        else:
            from adaserve.cluster.ray_router import AdaServeRequestRouter

            rrc = RequestRouterConfig(
                request_router_class=AdaServeRequestRouter,
                request_router_kwargs={
                    "router": self.router,
                    "seed": self.seed,
                    "default_class": self.ecfg.default_class,
                },
                request_routing_stats_period_s=self.stats_period_s,
                request_routing_stats_timeout_s=5.0,
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

        if not ray.is_initialized():
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


def run(args, ecfg: EngineConfig, cfg: ServerConfig) -> int:
    """Serve ``args.replicas`` replicas until SIGINT/SIGTERM (``server.cli.run``)."""
    from adaserve.cluster.front_door import FrontDoor
    from adaserve.server.cli import make_server
    from adaserve.server.engine_loop import model_name_of

    cluster = Cluster(ecfg, cfg, args.replicas, router=args.router, ray_address=args.ray_address)
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
    where = f"Ray at {args.ray_address}" if args.ray_address else "a local Ray cluster"
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
