"""adaserve: SLO-customized LLM serving with per-request speculative token trees."""

from adaserve.api import LLM, RequestOutput
from adaserve.sampling import SamplingParams
from adaserve.slo import SLO, SLOClass

__all__ = ["LLM", "RequestOutput", "SLO", "SLOClass", "SamplingParams"]
__version__ = "0.1.0"
