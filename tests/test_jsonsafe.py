"""The one JSON cleaner (``adaserve.util.jsonsafe.json_safe``), used by the server's
responses, the dashboard, the front door and the bench/simulator reports."""

import json
import math

import numpy as np

from adaserve.util.jsonsafe import json_safe


def test_non_finite_become_none_and_numpy_scalars_python():
    x = {
        1: [math.nan, math.inf, -math.inf, 1.5],
        "t": (np.float64(2.5), np.float32(np.nan), np.int64(3), np.bool_(True)),
        "nested": {"a": {"b": np.float64(np.inf)}},
        "s": "text",
        "n": None,
    }
    out = json_safe(x)
    assert out == {
        "1": [None, None, None, 1.5],
        "t": [2.5, None, 3, True],
        "nested": {"a": {"b": None}},
        "s": "text",
        "n": None,
    }
    assert type(out["t"][0]) is float and type(out["t"][2]) is int and type(out["t"][3]) is bool
    json.dumps(out, allow_nan=False)  # accepted as it is


def test_finite_values_unchanged():
    x = {"a": [1, 2.0, "x", True, None], "b": {"c": -0.0}}
    assert json_safe(x) == x
    assert json.dumps(json_safe(x)) == json.dumps(x)
