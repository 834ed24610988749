"""Hardware model: predicted iteration time from a measured (or reduced) profile.

Profile JSON schema (``adaserve.profile/1``; written by ``adaserve profile``)::

    {
      "schema": "adaserve.profile/1",
      "device": "cpu", "dtype": "float32", "machine": "...",
      "target": {"path": "...", "params": int, "fingerprint": "..."},
      "draft":  {"path": "...", "params": int, "fingerprint": "..."} | null,
      "verify": {"tokens": [t...], "latency_ms": [ms...],          # at kv_len[0]
                 "kv_len": [k...], "kv_ms_per_token": float,       # extra ms per KV token
                 "prefill_ms_per_pair": float},   # a prefill chunk's new x cached tokens
      "draft_step": {"tokens": [t...], "latency_ms": [ms...],      # at zero KV
                     "kv_ms_per_token": float},   # a draft pass's ms per context token
      "draft_step_ms": float,                                      # one step, few tokens
      "overhead_ms": float,                                        # host work per iteration
      "overhead_ms_per_request": float,        # and per request in it (sampling, output)
      "draft_host_ms": float,                  # host work per speculating request per step
      "tree_host_ms": float,                   # and per tree verified (batch, sampling, KV)
      "logits_ms_per_row": {"target": float, "draft": float},   # the LM head, per row
      "mask_ms_per_node": float,               # a grammar mask of one tree node (host)
      "kv_bytes_per_token": {"target": int, "draft": int},
      "threads": int,                          # intra-op threads it was measured with
      "targets": {"unloaded_tpot_ms": float,   # what the class targets multiply
                  "recorded": "...", "from": "..."}   # (see adaserve.engine.profile)
    }

A reduced profile (for the simulator) may give only
``{"verify": {"tokens": [...], "latency_ms": [...]}, "draft_step_ms": X}``.
No torch here: the simulator uses this class too.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = "adaserve.profile/1"
# The context an "unloaded" request decodes at: class targets given as multiples of
# the unloaded TPOT (``SLOClass.tpot_x``) are multiples of ``unloaded_tpot_ms``.
UNLOADED_KV_TOKENS = 256.0


def unloaded_tpot_ms(profile) -> float:
    """The unloaded TPOT (ms): the one definition the server, the benchmark, the demo
    and the simulator resolve class targets with.

    ``profile`` is a ``HardwareModel`` or a profile's parsed JSON. It is one request
    decoding alone without speculation at ``UNLOADED_KV_TOKENS`` of context: the
    profiled one-token verification plus the host overhead of an iteration. A profile
    dict that records ``"unloaded_tpot_ms"`` (one rescaled to another machine speed by
    ``benchmarks/fit_host_overhead.py``, which stores the original profile's value of
    this function) gives that value, so that its targets stay the engine's; so does one
    whose ``"targets"`` record keeps the targets of the first profile measured for the
    pair on this machine (``adaserve.engine.profile``), so that re-measuring never moves them."""
    if isinstance(profile, dict):
        rec = recorded_unloaded_tpot_ms(profile)
        if rec is not None:
            return rec
        profile = HardwareModel.from_dict(profile)
    if profile.targets_tpot_ms is not None:
        return float(profile.targets_tpot_ms)
    return measured_unloaded_tpot_ms(profile)


def measured_unloaded_tpot_ms(hw: HardwareModel) -> float:
    """The unloaded TPOT this profile's own curves predict (not the recorded one)."""
    return float(
        hw.verify_latency(1, UNLOADED_KV_TOKENS) + hw.overhead_ms + hw.overhead_ms_per_request
    )


def recorded_unloaded_tpot_ms(profile: dict) -> float | None:
    """The unloaded TPOT a profile dict records for its class targets (its
    ``targets`` record, else a top-level ``unloaded_tpot_ms``), None when it records
    none."""
    rec = (profile.get("targets") or {}).get("unloaded_tpot_ms")
    if rec is None:
        rec = profile.get("unloaded_tpot_ms")
    return None if rec is None else float(rec)


@dataclass(frozen=True)
class HardwareModel:
    """Piecewise-linear latency model (milliseconds)."""

    verify_tokens: tuple[float, ...]
    verify_ms: tuple[float, ...]
    draft_tokens: tuple[float, ...]
    draft_ms: tuple[float, ...]
    kv_ms_per_token: float = 0.0
    # a draft pass attends each drafting request's context: ms per context token per
    # pass (on the CPU this grows a batch's draft step 2-3x at a few hundred tokens)
    draft_kv_ms_per_token: float = 0.0
    # a prefill chunk over a cached prefix: ms per (new token x cached token) pair, the
    # attention a prefix-cache hit still pays (``Batch.prefill_pairs``)
    prefill_ms_per_pair: float = 0.0
    overhead_ms: float = 0.0
    # the host's work per request of an iteration (its sampling, output processing and
    # bookkeeping): measured as the slope of a plain decode step's overhead in requests
    overhead_ms_per_request: float = 0.0
    draft_host_ms: float = 0.0  # host work per speculating request per draft step
    # host work per speculating request of an iteration beyond its drafting: its tree's
    # verification (batch building, sampling the nodes, moving the accepted nodes' KV)
    tree_host_ms: float = 0.0
    # the LM head per logits row: a verification computes a row for every tree node (and
    # a completing prefill's last token), a draft pass for every token it feeds but its
    # catch-up (one row per request); the curves hold one row
    logits_ms_per_row: float = 0.0
    draft_logits_ms_per_row: float = 0.0
    mask_ms_per_node: float = 0.0  # host time of one constrained tree node's grammar mask
    kv_bytes_target: int = 0
    kv_bytes_draft: int = 0
    source: str = "profile"
    # the recorded unloaded TPOT the class targets multiply (None: this profile's own)
    targets_tpot_ms: float | None = None
    targets_from: str = ""
    measured: str = ""  # when the profile was measured (its "created")
    threads: int | None = None  # the intra-op threads it was measured with

    def __post_init__(self) -> None:
        if len(self.verify_tokens) < 1 or len(self.verify_tokens) != len(self.verify_ms):
            raise ValueError("profile: verify.tokens and verify.latency_ms must match")
        if list(self.verify_tokens) != sorted(self.verify_tokens):
            raise ValueError("profile: verify.tokens must be increasing")
        if any(v <= 0 for v in self.verify_ms) or any(v <= 0 for v in self.draft_ms):
            raise ValueError("profile: latencies must be positive")
        # lookup tables, built once: the policies call these thousands of times a second
        object.__setattr__(self, "_vtab", _Table.of(self.verify_tokens, self.verify_ms))
        object.__setattr__(self, "_dtab", _Table.of(self.draft_tokens, self.draft_ms))
        object.__setattr__(self, "_vdense", np.zeros(0))  # verify ms at 0, 1, 2, ... tokens

    def steepness(self) -> float:
        """How steeply a pass's cost grows with its tokens: a 64-token verification
        over a one-token one (the CPU pair: 2.4-3.3x; the A100 70B preset: 1.5x)."""
        return float(self.verify_latency(64)) / max(float(self.verify_latency(1)), 1e-9)

    # ------------------------------------------------------------------ predictions
    def verify_latency(self, tokens: Any, kv_tokens: Any = 0.0, prefill_pairs: Any = 0.0) -> Any:
        """Predicted ms of a target pass over ``tokens`` new tokens attending ``kv_tokens``
        cached ones, whose prefill chunks pair ``prefill_pairs`` new tokens with cached
        context tokens (the sum over chunks of new x cached)."""
        kv = self.kv_ms_per_token * (
            kv_tokens if np.ndim(kv_tokens) == 0 else np.asarray(kv_tokens)
        )
        if self.prefill_ms_per_pair:
            kv = kv + self.prefill_ms_per_pair * (
                prefill_pairs if np.ndim(prefill_pairs) == 0 else np.asarray(prefill_pairs)
            )
        return self._vtab(tokens) + kv  # type: ignore[attr-defined]  # a cache a frozen dataclass sets in __post_init__ (object.__setattr__)

    def verify_table(self, top: int) -> np.ndarray:
        """``verify_latency(t)`` without the KV term for t = 0, 1, ... (at least up to
        ``top``; read-only, grown on demand): the planner's hot path indexes it instead
        of interpolating."""
        tab = self._vdense  # type: ignore[attr-defined]  # a cache a frozen dataclass sets in __post_init__ (object.__setattr__)
        if top >= len(tab):
            tab = self._vtab(np.arange(max(2 * len(tab), top + 1, 1024), dtype=float))  # type: ignore[attr-defined]  # a cache a frozen dataclass sets in __post_init__ (object.__setattr__)
            tab.flags.writeable = False
            object.__setattr__(self, "_vdense", tab)
        return tab

    def draft_latency(self, tokens: Any) -> Any:
        """Predicted ms of one batched draft step over ``tokens`` tokens."""
        return self._dtab(tokens)  # type: ignore[attr-defined]  # a cache a frozen dataclass sets in __post_init__ (object.__setattr__)

    def iteration_ms(
        self,
        verify_tokens,
        kv_tokens: float = 0.0,
        draft_depth: int = 0,
        draft_tokens_per_step: float = 0.0,
        catchup_tokens: float = 0.0,
        draft_requests: float = 0.0,
        prefill_pairs: float = 0.0,
        draft_kv_tokens: float = 0.0,
        requests: float = 0.0,
    ):
        """Predicted ms of an iteration of ``requests`` requests: draft steps +
        verification + host overhead."""
        draft = self.drafting_ms(
            draft_depth, draft_tokens_per_step, catchup_tokens, draft_requests, draft_kv_tokens
        )
        verify = self.verify_latency(verify_tokens, kv_tokens, prefill_pairs)
        return verify + draft + self.host_ms(requests)

    def host_ms(self, requests: float) -> float:
        """The host's work of an iteration of ``requests`` requests."""
        return self.overhead_ms + self.overhead_ms_per_request * requests

    def drafting_ms(
        self,
        draft_depth: int,
        draft_tokens_per_step: float = 0.0,
        catchup_tokens: float = 0.0,
        draft_requests: float = 0.0,
        draft_kv_tokens: float = 0.0,
    ) -> float:
        """Predicted ms of speculation for ``draft_requests`` requests alike, drafting
        ``draft_depth`` steps: one catch-up pass, then ``draft_depth - 1`` passes over
        ``draft_tokens_per_step`` tokens, each pass attending the requests'
        ``draft_kv_tokens`` context tokens; ``draft_passes_ms`` of those passes. 0 when
        ``draft_depth`` is 0."""
        if draft_depth <= 0:
            return 0.0
        return self.draft_passes_ms(
            catchup_tokens,
            (draft_tokens_per_step,) * (draft_depth - 1),
            draft_depth * draft_requests,
            draft_depth * draft_kv_tokens,
            draft_requests,
        )

    def draft_passes_ms(
        self,
        catchup_tokens: float,
        steps: Any,
        request_steps: float,
        kv_tokens: float,
        requests: float = 0.0,
    ) -> float:
        """Predicted ms of one step's speculation beyond the verification pass, the one
        definition of its price (the engine's stall check, the simulator's pass and the
        planner's evaluation, whose vectorised copy ``tests/test_draft_work.py`` holds
        to it): the draft's catch-up pass over ``catchup_tokens``, one pass per entry of
        ``steps`` (tokens fed), the host's tree work of ``request_steps`` (speculating
        requests x their draft depth), ``kv_tokens`` context tokens attended over all
        the passes, the host's verification of ``requests`` trees, and the draft's
        logits rows (one per request at the catch-up, one per token fed after it)."""
        tokens = np.maximum(np.array([catchup_tokens, *steps], dtype=float), 1.0)
        return (
            float(self.draft_latency(tokens).sum())
            + request_steps * self.draft_host_ms
            + kv_tokens * self.draft_kv_ms_per_token
            + requests * self.tree_host_ms
            + (requests + float(tokens[1:].sum())) * self.draft_logits_ms_per_row
        )

    def unloaded_tpot_ms(self) -> float:
        """The unloaded TPOT the class targets multiply (the module's
        ``unloaded_tpot_ms``: the one definition; the recorded one when recorded)."""
        return unloaded_tpot_ms(self)

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict, source: str = "profile") -> HardwareModel:
        """The model of a profile's parsed JSON (see the module docstring)."""
        v = d["verify"]
        if "draft_step" in d:
            dt, dm = d["draft_step"]["tokens"], d["draft_step"]["latency_ms"]
            draft_kv = float(d["draft_step"].get("kv_ms_per_token", 0.0))
        else:
            dt, dm, draft_kv = [1], [float(d["draft_step_ms"])], 0.0
        kvb = d.get("kv_bytes_per_token") or {}
        return cls(
            verify_tokens=tuple(float(x) for x in v["tokens"]),
            verify_ms=tuple(float(x) for x in v["latency_ms"]),
            draft_tokens=tuple(float(x) for x in dt),
            draft_ms=tuple(float(x) for x in dm),
            kv_ms_per_token=float(v.get("kv_ms_per_token", 0.0)),
            draft_kv_ms_per_token=draft_kv,
            prefill_ms_per_pair=float(v.get("prefill_ms_per_pair", 0.0)),
            overhead_ms=float(d.get("overhead_ms", 0.0)),
            overhead_ms_per_request=float(d.get("overhead_ms_per_request", 0.0)),
            draft_host_ms=float(d.get("draft_host_ms", 0.0)),
            tree_host_ms=float(d.get("tree_host_ms", 0.0)),
            logits_ms_per_row=float((d.get("logits_ms_per_row") or {}).get("target", 0.0)),
            draft_logits_ms_per_row=float((d.get("logits_ms_per_row") or {}).get("draft", 0.0)),
            mask_ms_per_node=float(d.get("mask_ms_per_node", 0.0)),
            kv_bytes_target=int(kvb.get("target", 0)),
            kv_bytes_draft=int(kvb.get("draft") or 0),
            source=source,
            targets_tpot_ms=recorded_unloaded_tpot_ms(d),
            targets_from=str((d.get("targets") or {}).get("from", "")),
            measured=str(d.get("created", "")),
            threads=int(d["threads"]) if d.get("threads") is not None else None,
        )

    def provenance(self) -> dict:
        """Where this profile and the class targets come from (``/v1/slo/report``, the
        dashboard and every bench summary show it)."""
        return {
            "profile": self.source,
            "measured": self.measured or None,
            "threads": self.threads,
            "unloaded_tpot_ms": round(self.unloaded_tpot_ms(), 4),
            "profile_unloaded_tpot_ms": round(measured_unloaded_tpot_ms(self), 4),
            "targets_from": self.targets_from or "this profile",
        }

    @classmethod
    def load(cls, path: str | Path) -> HardwareModel:
        """The model of a profile file; ValueError with a readable message when malformed."""
        try:
            d = json.loads(Path(path).read_text())
            return cls.from_dict(d, source=str(path))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"cannot read profile {path}: {e}") from None
        except (KeyError, TypeError) as e:
            raise ValueError(f"profile {path} lacks or mistypes {e}") from None


@dataclass(frozen=True)
class _Table:
    """Piecewise-linear latency curve: interpolation inside the points, the last
    segment's slope past the last point, the first value before the first point."""

    x: tuple[float, ...]
    y: tuple[float, ...]
    xa: np.ndarray
    ya: np.ndarray
    slope: float

    @classmethod
    def of(cls, xs, ys) -> _Table:
        x, y = tuple(float(v) for v in xs), tuple(float(v) for v in ys)
        slope = (y[-1] - y[-2]) / max(x[-1] - x[-2], 1e-9) if len(x) > 1 else 0.0
        return cls(x, y, np.asarray(x), np.asarray(y), slope)

    def __call__(self, t):
        if np.ndim(t) == 0:  # scalar: pure Python, no array round trip
            t = float(t)
            x, y = self.x, self.y
            i = bisect.bisect_right(x, t)
            if i == 0:
                return y[0]
            if i == len(x):
                return y[-1] + self.slope * (t - x[-1])
            return y[i - 1] + (y[i] - y[i - 1]) * (t - x[i - 1]) / (x[i] - x[i - 1])
        t = np.asarray(t, dtype=float)
        base = np.interp(t, self.xa, self.ya)
        return np.where(t > self.x[-1], self.y[-1] + self.slope * (t - self.x[-1]), base)
