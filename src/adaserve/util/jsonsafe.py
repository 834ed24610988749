"""The one JSON cleaner: a copy of a value that ``json.dumps(..., allow_nan=False)``
accepts. A neutral module (math and numpy only), so any layer may import it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def json_safe(v: Any) -> Any:
    """JSON-safe copy of ``v``: NaN and infinities become None, numpy scalars Python
    numbers, dict keys strings and tuples lists; anything else is returned as it is."""
    if isinstance(v, dict):
        return {str(k): json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    if isinstance(v, (float, np.floating)):
        f = float(v)
        return f if math.isfinite(f) else None
    if isinstance(v, np.generic):  # numpy integers, bools and the like
        return json_safe(v.item())
    return v
