"""OpenAI-compatible HTTP server with per-request SLOs, tenants, quotas and metrics.

``create_app(engine_or_config, server_config)`` builds the FastAPI app;
``adaserve serve`` / ``python -m adaserve.server`` run it (see docs/server.md).
"""

from adaserve.server.config import ServerConfig, load_config, parse_config

__all__ = ["ServerConfig", "create_app", "load_config", "parse_config"]


def __getattr__(name: str):
    # the app (FastAPI, the engine, torch) loads on first use, not with the CLI's parser
    if name == "create_app":
        from adaserve.server.app import create_app

        return create_app
    raise AttributeError(f"module 'adaserve.server' has no attribute {name!r}")
