"""The torch engine: ``Engine`` (the loop), ``ModelRunner`` (models, KV tensors,
forwards), ``OutputProcessor`` (commit, stop rules, logprobs), ``build_engine``."""

from adaserve.engine.engine import Engine, Faults, build_engine

__all__ = ["Engine", "Faults", "build_engine"]
