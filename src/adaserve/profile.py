"""``adaserve profile``: measure the pair's latencies with the engine's own forward code."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from adaserve.kv.cache import KVCache
from adaserve.models.attention import AttnMetadata, SeqSpec
from adaserve.models.llama import LlamaModel
from adaserve.sched.hardware import SCHEMA, HardwareModel
from adaserve.sched.profile_stats import (
    PointStats,
    SanityLimits,
    check_profile,
    summarize,
    time_points,
)

VERIFY_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DRAFT_TOKENS = (1, 4, 16, 64, 256)
KV_LENS = (64, 512)
# one sequence's prefill chunk of N new tokens over C cached ones: the attention of every
# new token over the cached context (N x C pairs), which a prefix-cache hit leaves to pay
PREFILL_CHUNKS = (64, 256)
PREFILL_CTX = (0, 1024)
# Part of the cache key: bump when the forward code's speed changes (e.g. the paged
# attention kernel), so that cached profiles measured with the old code are not reused.
FORWARD_VERSION = 4


def fingerprint(path: str | Path | None) -> str:
    """Stable identity of a checkpoint: hash of its config and weight file sizes."""
    if path is None:
        return "none"
    p = Path(path)
    h = hashlib.sha1()
    cfg = p / "config.json"
    if cfg.is_file():
        h.update(cfg.read_bytes())
    for f in sorted(p.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def profile_key(target: str | Path, draft: str | Path | None, device: str, dtype: str) -> str:
    machine = f"{platform.machine()}-{torch.get_num_threads()}t"
    fp = f"{fingerprint(target)}-{fingerprint(draft)}"
    return f"{fp}-{device}-{dtype}-{machine}-f{FORWARD_VERSION}"


def _forward_timer(model: LlamaModel, kv: KVCache, n_tokens: int, ctx: int):
    """A function timing (ms) one paged forward: ``n_tokens`` new tokens split over up
    to 8 sequences (tree-shaped: each attends ``ctx`` cached tokens + causal new tokens)."""
    device = model.embed_tokens.weight.device
    n_seq = min(8, n_tokens)
    per = [n_tokens // n_seq + (1 if i < n_tokens % n_seq else 0) for i in range(n_seq)]
    seqs, base = [], 0
    for q in per:
        seqs.append(
            SeqSpec(
                list(range(base, base + ctx)),
                list(range(base + ctx, base + ctx + q)),
                list(range(ctx, ctx + q)),
            )
        )
        base += ctx + q
    if base > kv.num_slots:
        raise ValueError("profile cache too small")
    ids = torch.randint(0, model.cfg.vocab_size, (n_tokens,), device=device)

    def once() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            meta = AttnMetadata.build(seqs, device, model.cfg.sliding_window)
            h = model(ids, meta, kv.layers)
            model.logits(h[-n_seq:]).argmax(-1).tolist()  # include the host sync
            return (time.perf_counter() - t0) * 1000

    return once


def _prefill_timer(model: LlamaModel, kv: KVCache, n_tokens: int, ctx: int):
    """A function timing (ms) one paged forward of a single sequence: a prefill chunk
    of ``n_tokens`` new tokens attending ``ctx`` cached ones."""
    device = model.embed_tokens.weight.device
    if ctx + n_tokens > kv.num_slots:
        raise ValueError("profile cache too small")
    seq = SeqSpec(
        list(range(ctx)), list(range(ctx, ctx + n_tokens)), list(range(ctx, ctx + n_tokens))
    )
    ids = torch.randint(0, model.cfg.vocab_size, (n_tokens,), device=device)

    def once() -> float:
        with torch.inference_mode():
            t0 = time.perf_counter()
            meta = AttnMetadata.build([seq], device, model.cfg.sliding_window)
            h = model(ids, meta, kv.layers)
            model.logits(h[-1:]).argmax(-1).tolist()
            return (time.perf_counter() - t0) * 1000

    return once


def fit_prefill_pairs(points: dict[tuple[int, int], float], per_kv: float) -> float:
    """ms per (new token x cached token) pair of a prefill chunk over a cached prefix,
    from ``points`` {(new, cached): ms}: what a chunk over ``cached`` tokens costs beyond
    the same chunk over none and the per-sequence KV term, per pair (median over the
    measured shapes, >= 0)."""
    fits = []
    for (n, ctx), ms in points.items():
        base = points.get((n, 0))
        if ctx > 0 and n > 0 and base is not None:
            fits.append((ms - base - per_kv * ctx) / (n * ctx))
    return max(0.0, statistics.median(fits)) if fits else 0.0


def _time_forwards(
    model: LlamaModel, kv: KVCache, sizes, ctx: int, reps: int, progress=None, timer=None
) -> PointStats:
    """Per pass size: the monotone median ms and the spread (``PointStats``). The sizes
    are timed round-robin after one warm-up each (``profile_stats.time_points``), so a
    burst of noise on a shared machine spreads over every size instead of landing on
    one; the medians are then made non-decreasing in the size (a suffix minimum: a
    larger pass never costs less), which removes the remaining spikes. ``timer``
    (default ``_forward_timer``) makes the timing function of one size."""
    timer = timer or _forward_timer
    return summarize(
        time_points([_ticking(timer(model, kv, n, ctx), progress) for n in sizes], reps)
    )


def _ticking(fn, progress):
    """``fn`` (a timing function), calling ``progress()`` after each call when given."""
    if progress is None:
        return fn

    def once() -> float:
        ms = fn()
        progress()
        return ms

    return once


def profile_calls(reps: int, has_draft: bool) -> int:
    """Timed forward passes of one ``measure`` (warm-ups included): a progress bar's total."""
    points = len(KV_LENS) * len(VERIFY_TOKENS) + len(PREFILL_CHUNKS) * len(PREFILL_CTX)
    points += len(DRAFT_TOKENS) if has_draft else 0
    return points * (reps + 1)


def measure(
    target: LlamaModel,
    draft: LlamaModel | None,
    reps: int = 5,
    verify_tokens=VERIFY_TOKENS,
    draft_tokens=DRAFT_TOKENS,
    kv_lens=KV_LENS,
    progress=None,
    timer=None,
    prefill_timer=None,
) -> dict:
    """Measure verification and draft-step latencies and the cost of a prefill chunk
    over a cached prefix; returns a profile dict with each curve's spread (raw
    medians, p10, p90) and the roofline check's findings under ``"sanity"``.
    ``timer`` / ``prefill_timer`` replace the forward timers (tests inject fake
    timings; ``timer`` alone stands for both)."""
    dtype = target.embed_tokens.weight.dtype
    device = target.embed_tokens.weight.device
    slots = 8 * (max(kv_lens) + max(verify_tokens) + max(draft_tokens)) + 64
    kv_t = KVCache(target.cfg, slots, device, dtype)
    stats = {}
    for ctx in kv_lens:
        stats[ctx] = _time_forwards(target, kv_t, verify_tokens, ctx, reps, progress, timer)
    lat = {ctx: list(st.median) for ctx, st in stats.items()}
    k0, k1 = kv_lens[0], kv_lens[-1]
    # extra cost per attended KV token, averaged over pass sizes (>= 0)
    n_seqs = [min(8, n) for n in verify_tokens]
    per_kv = 0.0
    if k1 > k0:
        per_kv = statistics.mean(
            (b - a) / (s * (k1 - k0)) for a, b, s in zip(lat[k0], lat[k1], n_seqs)
        )
    per_kv = max(0.0, per_kv)
    shapes = [(n, c) for n in PREFILL_CHUNKS for c in PREFILL_CTX]
    ptimer = prefill_timer or timer or _prefill_timer
    pst = summarize(
        time_points([_ticking(ptimer(target, kv_t, n, c), progress) for n, c in shapes], reps)
    )
    prefill_points = dict(zip(shapes, (float(v) for v in pst.raw_median)))
    per_pair = fit_prefill_pairs(prefill_points, per_kv)
    esize = torch.tensor([], dtype=dtype).element_size()
    out = {
        "schema": SCHEMA,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "machine": f"{platform.machine()} {platform.processor()} threads={torch.get_num_threads()}",
        "threads": torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "target": {"params": target.cfg.num_parameters()},
        "draft": None,
        "bytes_per_param": esize,
        "verify": {
            "tokens": list(verify_tokens),
            # at zero KV: the KV share measured at kv_lens[0] is taken out
            "latency_ms": [max(1e-3, v - per_kv * s * k0) for v, s in zip(lat[k0], n_seqs)],
            "kv_len": [k0, k1],
            "kv_ms_per_token": per_kv,
            "latency_ms_by_kv_per_seq": {str(k): lat[k] for k in kv_lens},
            # the measurement behind each curve: medians before the monotone
            # correction, the 10th / 90th percentiles, repeats per point
            "spread_by_kv": {str(k): stats[k].spread() for k in kv_lens},
            # a prefill chunk's new tokens attending a cached prefix: ms per pair
            "prefill_ms_per_pair": per_pair,
            "prefill_by_ctx": {f"{n}x{c}": round(ms, 4) for (n, c), ms in prefill_points.items()},
        },
        "overhead_ms": 0.3,  # replaced by a measured value in profile_engine
        "kv_bytes_per_token": {"target": target.cfg.kv_bytes_per_token(esize), "draft": 0},
    }
    if draft is not None:
        kv_d = KVCache(draft.cfg, slots, device, dtype)
        dst = _time_forwards(draft, kv_d, draft_tokens, kv_lens[0], reps, progress, timer)
        dl = list(dst.median)
        out["draft"] = {"params": draft.cfg.num_parameters()}
        out["draft_step"] = {"tokens": list(draft_tokens), "latency_ms": dl, "spread": dst.spread()}
        out["draft_step_ms"] = dl[0]
        out["kv_bytes_per_token"]["draft"] = draft.cfg.kv_bytes_per_token(esize)
    else:
        out["draft_step_ms"] = 1e-3
    out["sanity"] = check_profile(out, SanityLimits.for_device(str(device)))
    return out


def measure_step_overhead(engine, new_tokens: int = 24) -> list[float]:
    """Measured ms of each plain decode step of a single request (``new_tokens``
    steps without speculation, the first two dropped as warm-up): the engine's whole
    iteration, forward pass, scheduling, metadata and sampling included. The host
    overhead is their median less the profiled one-token verification."""
    from adaserve.sampling import SamplingParams
    from adaserve.sched.static import AutoregressivePolicy
    from adaserve.slo import SLO

    saved = engine.policy
    engine.set_policy(AutoregressivePolicy())
    try:
        prompt = [i % engine.target.cfg.vocab_size for i in range(1, 33)]
        r = engine.add_request(
            prompt, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True), SLO()
        )
        times = []
        while not r.finished:
            t0 = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        engine.set_policy(saved)
    return times[2:] if len(times) > 3 else times


def measure_draft_host(engine, requests: int = 8, depth: int = 4, width: int = 2) -> float:
    """Host ms per speculating request per draft step: a real tree expansion of
    ``requests`` requests minus the profiled forward passes it ran."""
    from adaserve.core.blocks import BlockTable
    from adaserve.core.tree import scratch_slots_needed
    from adaserve.sampling import SamplingParams
    from adaserve.slo import SLO
    from adaserve.spec_decode.draft import expand

    if engine.draft is None:
        return 0.0
    V = engine.target.cfg.vocab_size
    reqs = [  # not queued: as if prefilled, with blocks of their own
        engine.new_request(
            [(7 * i + j) % V for j in range(24)], SamplingParams(temperature=0.0), SLO()
        )
        for i in range(requests)
    ]
    for r in reqs:
        r.table = BlockTable(engine.allocator)
        r.table.ensure(len(r.tokens) + scratch_slots_needed(depth, width))
    times = []
    for _ in range(4):
        for r in reqs:
            r.draft_cached = 0
        t0 = time.perf_counter()
        expand(engine.draft, engine.kv_draft, reqs, [(depth, width)] * requests, vocab_size=V)
        times.append((time.perf_counter() - t0) * 1000)
    for r in reqs:
        r.table.release()
    return statistics.median(times[1:])


# the schema whose masks the profile times (objects, strings, numbers, an enum array)
MASK_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "id": {"type": "integer"},
        "score": {"type": "number"},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}},
    },
    "required": ["name", "id", "score", "tags"],
}


def measure_mask(engine, n: int = 300) -> float | None:
    """Median host ms of one tree node's grammar mask (the engine's backend, a JSON
    schema, walked by random allowed tokens); None without a tokenizer."""
    import random

    import numpy as np

    from adaserve.structured.params import StructuredOutputsParams

    so = getattr(engine, "structured", None)
    if so is None or engine.tokenizer is None:
        return None
    spec = StructuredOutputsParams(json=MASK_SCHEMA)
    saved = (so.mask_s, so.masks)
    try:
        st = so.state_for(spec)
        rng = random.Random(0)
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            m = st.masks([[]])
            times.append((time.perf_counter() - t0) * 1000)
            ok = np.flatnonzero(np.unpackbits(m[0].view(np.uint8), bitorder="little"))
            ok = ok[ok < so.vocab_size]
            if not len(ok) or not st.commit(int(rng.choice(list(ok)))):
                st = so.state_for(spec)
    except Exception:  # a backend that cannot load here: the profile goes without
        return None
    finally:
        so.mask_s, so.masks = saved
    return statistics.median(times)


# a profile whose measurement got less than this share of its threads' cores was taken
# on a busy machine: it may serve the run, but it does not record the class targets
BUSY_CPU_SHARE = 0.8
# too short a measurement says nothing about the machine (injected timers in tests)
_SHARE_MIN_WALL_S = 0.5


def cpu_share(cpu_s: float, wall_s: float, threads: int) -> float | None:
    """The share of its ``threads`` cores a measurement got: process CPU seconds over
    wall seconds x threads (None for a measurement too short to tell)."""
    if wall_s < _SHARE_MIN_WALL_S:
        return None
    return round(min(1.0, cpu_s / (wall_s * max(1, threads))), 3)


def busy_reason(prof: dict) -> str | None:
    """Why ``prof`` was measured on a busy machine (None: it was not, or not known)."""
    share = prof.get("cpu_share")
    if share is not None and share < BUSY_CPU_SHARE:
        return (
            f"the machine was busy while it was measured (it got {100 * share:.0f}% of "
            f"its {prof.get('threads', 1)} core{'s' if prof.get('threads', 1) != 1 else ''})"
        )
    return None


def profile_engine(engine, reps: int = 5, timer=None, progress=None) -> dict:
    """Profile the engine's loaded pair and annotate it with paths and fingerprints,
    and with the share of its cores the measurement got (``cpu_share``). ``progress``
    is called after each timed forward pass (``profile_calls`` in all)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    prof = measure(engine.target, engine.draft, reps=reps, timer=timer, progress=progress)
    steps = measure_step_overhead(engine)
    # (injected timers measure nothing of the machine: no share)
    prof["cpu_share"] = (
        cpu_share(time.process_time() - cpu0, time.perf_counter() - wall0, torch.get_num_threads())
        if timer is None
        else None
    )
    step = statistics.median(steps)
    one = float(HardwareModel.from_dict(prof).verify_latency(1, 40))
    prof["overhead_ms"] = round(max(0.0, step - one), 3)
    prof["decode_step_ms"] = round(step, 3)
    st = summarize([steps])
    prof["decode_step_spread"] = {"p10_ms": round(st.p10[0], 4), "p90_ms": round(st.p90[0], 4)}
    if engine.draft is not None:
        n, d, w = 8, 4, 2
        total = measure_draft_host(engine, n, d, w)
        hw = HardwareModel.from_dict(prof)
        forwards = float(hw.draft_latency(n * 24) + (d - 1) * hw.draft_latency(n * w))
        prof["draft_host_ms"] = round(max(0.0, (total - forwards) / (n * d)), 4)
    mask = measure_mask(engine)
    if mask is not None:
        prof["mask_ms_per_node"] = round(mask, 5)
    prof["target"].update(path=str(engine.model_dir), fingerprint=fingerprint(engine.model_dir))
    if prof["draft"] is not None:
        prof["draft"].update(path=str(engine.draft_dir), fingerprint=fingerprint(engine.draft_dir))
    plan = getattr(engine.runner, "thread_plan", None)
    if plan is not None:
        prof["thread_plan"] = plan.as_dict()
    # the checks that need the whole iteration (the step overhead against the pass)
    prof["sanity"] = check_profile(prof, SanityLimits.for_device(str(engine.cfg.device)))
    return prof


def cached_profile_path(engine) -> Path:
    from adaserve.paths import cache_root

    dtype = str(engine.dtype).removeprefix("torch.")
    key = profile_key(engine.model_dir, engine.draft_dir, engine.cfg.device, dtype)
    return cache_root() / "profiles" / f"{key}.json"


def targets_path(engine) -> Path:
    """Where the class targets of the engine's pair on this machine are recorded: one
    record per pair, device, dtype and CPU architecture, whatever the thread count, so
    that every profile measured here (and the bench, the demo and the simulator fed
    one) is judged by the same targets."""
    dtype = str(engine.dtype).removeprefix("torch.")
    return targets_path_for(engine.model_dir, engine.draft_dir, engine.cfg.device, dtype)


def targets_path_for(model_dir, draft_dir, device: str = "cpu", dtype: str = "float32") -> Path:
    """``targets_path`` of a pair named by its directories."""
    from adaserve.paths import cache_root

    fp = f"{fingerprint(model_dir)}-{fingerprint(draft_dir)}"
    return cache_root() / "targets" / f"{fp}-{device}-{dtype}-{platform.machine()}.json"


def _say(msg: str) -> None:
    """One line on stderr: what the profiler measures, where it caches, what it found."""
    print(f"adaserve: {msg}", file=sys.stderr, flush=True)


def _what(engine, reps: int) -> str:
    pair = str(engine.model_dir) + (f" + draft {engine.draft_dir}" if engine.draft_dir else "")
    return (
        f"verify {VERIFY_TOKENS[0]}-{VERIFY_TOKENS[-1]} tokens at KV {'/'.join(map(str, KV_LENS))}"
        f"{', draft steps' if engine.draft is not None else ''}, {reps} interleaved repeats, "
        f"{torch.get_num_threads()} threads, on {engine.cfg.device} ({pair})"
    )


def _flags(prof: dict) -> list[str]:
    s = prof.get("sanity") or {}
    return list(s.get("impossible", [])) + list(s.get("suspicious", []))


def measure_checked(engine, reps: int = 3, timer=None) -> dict:
    """``profile_engine``, measured once more with twice the repeats when the first
    result fails the sanity check (``profile_stats.check_profile``); the one with
    fewer findings is returned, its findings said on stderr. A progress bar of the
    timed passes goes to stderr when it is a terminal."""
    from tqdm.auto import tqdm

    total = profile_calls(reps, engine.draft is not None)
    with tqdm(total=total, desc="adaserve: profile", unit="pass", disable=None) as bar:
        prof = profile_engine(engine, reps=reps, timer=timer, progress=bar.update)
    if _flags(prof):
        for f in _flags(prof):
            _say(f"profile check: {f}")
        _say(f"measuring the profile again with {2 * reps} repeats")
        again = profile_engine(engine, reps=2 * reps, timer=timer)
        if len(_flags(again)) <= len(_flags(prof)):
            prof = again
        for f in _flags(prof):
            _say(f"profile check (kept): {f}")
    return prof


def _record_targets(rec: dict, path: Path, replace: bool) -> dict:
    """Write the targets record ``rec`` at ``path`` and return the record in force: with
    ``replace`` (``--reprofile``) this one; else the first writer's, so that engines
    that profile at once (``--replicas N`` on a fresh machine) all take one record."""
    if replace:
        _write(rec, path)
        return rec
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rec, indent=1) + "\n")
        try:
            os.link(tmp, path)  # atomic, and fails where another process recorded first
        except FileExistsError:
            raise
        except OSError:  # no hard links on this filesystem: the last writer wins
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return rec
    except FileExistsError:
        try:
            first = json.loads(path.read_text())
            float(first["unloaded_tpot_ms"])
        except (OSError, ValueError, KeyError, TypeError):
            _write(rec, path)
            return rec
        _say(f"another engine recorded the class targets first ({path}); using them")
        return first
    except OSError as e:
        _say(f"cannot write the targets record {path} ({e}); it serves this run only")
        return rec


def _write(obj: dict, path: Path) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(obj, indent=1) + "\n")
        tmp.replace(path)
    except OSError as e:
        _say(f"cannot write the profile cache {path} ({e}); it serves this run only")
        return False
    return True


def _save(prof: dict, path: Path) -> bool:
    """Write ``prof`` to the cache unless a check flagged it (then it serves this run
    only and is measured again on the next start)."""
    if (prof.get("sanity") or {}).get("impossible"):
        _say(f"not caching an impossible profile (faster than the roofline allows): {path}")
        return False
    if _flags(prof):
        _say(f"not caching a profile that failed its checks (measured under load?): {path}")
        return False
    return _write(prof, path)


# ---------------------------------------------------------------------- trust
def slower_than_spread(old: dict, new: dict) -> list[str]:
    """Why ``new`` is slower than the stored profile ``old`` allows ([] when it is not):
    more than half of the points both profiles measured have a new median above the
    stored 90th percentile. A profile without a stored spread cannot be judged ([])."""
    pairs = []
    ov, nv = old.get("verify") or {}, new.get("verify") or {}
    for kv, osp in (ov.get("spread_by_kv") or {}).items():
        nsp = (nv.get("spread_by_kv") or {}).get(kv)
        if nsp and ov.get("tokens") == nv.get("tokens"):
            for t, p90, med in zip(ov["tokens"], osp["p90_ms"], nsp["raw_median_ms"]):
                pairs.append((f"verify {t} tokens at KV {kv}", p90, med))
    od, nd = old.get("draft_step") or {}, new.get("draft_step") or {}
    if od.get("spread") and nd.get("spread") and od.get("tokens") == nd.get("tokens"):
        for t, p90, med in zip(od["tokens"], od["spread"]["p90_ms"], nd["spread"]["raw_median_ms"]):
            pairs.append((f"draft {t} tokens", p90, med))
    if old.get("decode_step_spread") and new.get("decode_step_ms") is not None:
        pairs.append(
            ("decode step", old["decode_step_spread"]["p90_ms"], float(new["decode_step_ms"]))
        )
    if not pairs:
        return []
    slow = [(n, p90, m) for n, p90, m in pairs if m > p90]
    if 2 * len(slow) <= len(pairs):
        return []
    worst = max(slow, key=lambda x: x[2] / max(x[1], 1e-9))
    return [
        f"{len(slow)} of {len(pairs)} points are slower than the stored profile's 90th "
        f"percentile (worst: {worst[0]}, {worst[2]:.3g} ms against {worst[1]:.3g} ms)"
    ]


def check_threads(prof: dict, where: str) -> None:
    """ValueError when ``prof`` was measured with another intra-op thread count than
    this process runs; a profile that records none is used, and said so."""
    rec = prof.get("threads")
    now = torch.get_num_threads()
    if rec is None:
        _say(f"the hardware profile {where} records no thread count; using it with {now}")
        return
    if int(rec) != now:
        raise ValueError(
            f"the hardware profile {where} was measured with {rec} intra-op threads, but "
            f"this engine runs {now}: start with --threads {rec}, or measure one for "
            f"{now} threads (adaserve profile --threads {now})"
        )


def attach_targets(engine, prof: dict, reprofile: bool = False) -> dict:
    """Give ``prof`` the pair's targets record (``targets_path``): the stored one, so
    that a re-measurement never moves the class targets; with ``reprofile``, or when
    none is stored, one made from this profile and stored. Returns the record."""
    from adaserve.sched.hardware import HardwareModel, measured_unloaded_tpot_ms

    path = targets_path(engine)
    rec = None
    busy = busy_reason(prof)
    if path.is_file() and (not reprofile or busy):
        try:
            rec = json.loads(path.read_text())
            float(rec["unloaded_tpot_ms"])
        except (OSError, ValueError, KeyError, TypeError):
            _say(f"the targets record {path} is unreadable; recording new targets")
            rec = None
        if rec is not None and reprofile:
            _say(f"kept the targets record {path}: {busy}; record them on a quiet machine")
    if rec is None:
        own = measured_unloaded_tpot_ms(HardwareModel.from_dict({**prof, "targets": None}))
        rec = {
            "unloaded_tpot_ms": round(own, 4),
            "recorded": prof.get("created") or time.strftime("%Y-%m-%dT%H:%M:%S"),
            "threads": prof.get("threads"),
            "machine": prof.get("machine"),
            "from": f"the profile measured {prof.get('created')} with "
            f"{prof.get('threads')} thread{'' if prof.get('threads') == 1 else 's'} "
            f"on {prof.get('machine')}",
            "record": str(path),
        }
        if busy:
            rec["from"] += f" (not recorded: {busy})"
            _say(f"class targets not recorded: {busy}; a start on a quiet machine records them")
        elif not (prof.get("sanity") or {}).get("impossible"):
            rec = _record_targets(rec, path, replace=reprofile)
    prof["targets"] = rec
    return rec


def _load_file(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
        HardwareModel.from_dict(raw)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read profile {path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"profile {path} lacks or mistypes {e}") from None
    return raw


def adopt(engine, new: dict, path: Path, reprofile: bool = False) -> tuple[dict, str]:
    """(the profile to use, why) of a fresh measurement ``new`` against the one
    stored at ``path``: the stored one is kept when the new one failed its checks, or
    is slower than the stored spread (``slower_than_spread``; measured while the
    machine was busy), unless ``reprofile``. An adopted profile is written there."""
    old = None
    if path.is_file():
        with contextlib.suppress(ValueError):
            old = _load_file(path)
    if old is not None and not reprofile:
        if _flags(new) and not _flags(old):
            return old, "the new measurement failed its checks; kept the stored profile"
        slow = slower_than_spread(old, new)
        if slow:
            return old, f"kept the stored profile: {slow[0]} (--reprofile adopts it)"
    rec = attach_targets(engine, new, reprofile)
    busy = busy_reason(new)
    saved = not busy and _save(new, path)
    if busy:  # serves this run; a later start on a quiet machine measures again
        why = f"not cached: {busy}"
    else:
        why = f"cached in {path} (later starts load it)" if saved else "not cached"
    from adaserve.sched.hardware import measured_unloaded_tpot_ms

    own = measured_unloaded_tpot_ms(HardwareModel.from_dict({**new, "targets": None}))
    if own < 0.8 * float(rec["unloaded_tpot_ms"]):
        why += (
            f"; the class targets come from a profile {float(rec['unloaded_tpot_ms']) / own:.2f}x "
            "slower (measured under load?): --reprofile on a quiet machine records new ones"
        )
    return new, why


def load_or_profile(
    engine, auto: bool, timer=None, reprofile: bool | None = None
) -> HardwareModel | None:
    """The engine's hardware model: explicit file, cached profile, or (auto) measure
    now. A profile measured with other threads is refused (explicit file) or not
    looked at (the cache key holds the thread count); a cached profile the checks
    flagged is measured again (when auto) and the better one kept (``adopt``). Every
    profile carries the pair's targets record (``attach_targets``)."""
    reprofile = bool(engine.cfg.reprofile if reprofile is None else reprofile)
    if engine.cfg.profile:
        where = engine.cfg.profile
        raw = _load_file(Path(where))
        check_threads(raw, where)
        _say(f"using the hardware profile {where}")
        _own_targets(raw, where)
        return HardwareModel.from_dict(raw, source=str(where))
    path = cached_profile_path(engine)
    raw = None
    if path.is_file():
        try:
            raw = _load_file(path)
            check_threads(raw, str(path))
        except ValueError as e:
            _say(f"{e}; measuring again")
            raw = None
    if raw is not None and auto and _flags(raw):
        _say(f"the cached hardware profile {path} was flagged; measuring again")
    if raw is not None and not (auto and _flags(raw)) and not (auto and reprofile):
        _say(f"using the cached hardware profile {path} (measured {raw.get('created')})")
        attach_targets(engine, raw, False)
        return HardwareModel.from_dict(raw, source=str(path))
    if not auto:
        if raw is not None:
            attach_targets(engine, raw, False)
            return HardwareModel.from_dict(raw, source=str(path))
        return None
    reps = 3
    _say(
        f"measuring the hardware profile: {_what(engine, reps)}; caching it in {path} "
        "(once per machine, model pair, device, dtype and thread count)"
    )
    t0 = time.perf_counter()
    prof = measure_checked(engine, reps=reps, timer=timer)
    prof, why = adopt(engine, prof, path, reprofile)
    if "targets" not in prof:
        attach_targets(engine, prof, False)
    _say(f"measured the hardware profile in {time.perf_counter() - t0:.1f} s; {why}")
    t = prof["targets"]
    _say(f"class targets multiply an unloaded TPOT of {t['unloaded_tpot_ms']:.4g} ms ({t['from']})")
    return HardwareModel.from_dict(prof, source=str(path))


def _own_targets(raw: dict, where) -> None:
    """An explicitly named profile without a targets record takes its own unloaded
    TPOT as the class targets' base (in place)."""
    if (raw.get("targets") or {}).get("unloaded_tpot_ms") is None:
        raw["targets"] = {
            "unloaded_tpot_ms": HardwareModel.from_dict(raw).unloaded_tpot_ms(),
            "from": f"the profile {where}",
        }


def reload_profile(engine) -> HardwareModel:
    """The admin action: the engine's profile read again from its file (explicit, or
    the cache: what ``adaserve profile`` last adopted), with the pair's targets record.
    ValueError, saying why, when there is none, it is unreadable, or it was measured
    with another thread count; the engine then keeps the profile it has."""
    where = Path(engine.cfg.profile) if engine.cfg.profile else cached_profile_path(engine)
    if not where.is_file():
        raise ValueError(f"no hardware profile at {where}: measure one with `adaserve profile`")
    raw = _load_file(where)
    check_threads(raw, str(where))
    if engine.cfg.profile:
        _own_targets(raw, where)
    else:
        attach_targets(engine, raw, False)
    _say(f"reloaded the hardware profile {where} (measured {raw.get('created')})")
    return HardwareModel.from_dict(raw, source=str(where))


def log_drift(engine) -> None:
    """Say on stderr that the machine has drifted from the profile (reported, never
    re-measured inside the serving loop)."""
    d = engine.drift
    _say(
        f"measured iteration times are {d.median():.2f}x the profile's over the last "
        f"{d.cfg.window} steps (outside [{d.cfg.low:g}, {d.cfg.high:g}]): the online "
        "correction follows live passes; for a fresh profile run `adaserve profile` "
        "and POST /v1/admin/profile"
    )
