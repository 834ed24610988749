"""adaserve: SLO-customized LLM serving with per-request speculative token trees."""

from adaserve.core.slo import SLO, SLOClass
from adaserve.sampling import SamplingParams
from adaserve.structured.params import StructuredOutputsParams

__all__ = ["LLM", "RequestOutput", "SLO", "SLOClass", "SamplingParams", "StructuredOutputsParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # the engine (and torch) load on first use: ``adaserve simulate`` and the policies
    # never need them
    if name in ("LLM", "RequestOutput"):
        from adaserve.engine import api

        return getattr(api, name)
    raise AttributeError(f"module 'adaserve' has no attribute {name!r}")
