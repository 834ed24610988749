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

# the measurements; ``profile_engine`` calls them through this module (tests replace them)
from adaserve.engine.profiler import (  # noqa: F401  (fit_prefill_pairs: re-exported)
    HOST_REQUESTS,
    KV_LENS,
    VERIFY_TOKENS,
    fit_prefill_pairs,
    forward_now_ms,
    measure,
    measure_draft_host,
    measure_mask,
    measure_request_overhead,
    measure_step_overhead,
    measure_tree_host,
    profile_calls,
)
from adaserve.hardware.model import HardwareModel
from adaserve.hardware.profile_stats import SanityLimits, check_profile, summarize

# Part of the cache key: bump when the forward code's speed changes (e.g. the paged
# attention kernel), so that cached profiles measured with the old code are not reused
# (5: the draft's passes are measured at two context lengths, as verification is; 6: the
# host's work per request and per speculating request's tree is measured; 7: the curves
# hold one logits row, the LM head is priced per row).
FORWARD_VERSION = 7


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
    hw = HardwareModel.from_dict(prof)
    if timer is not None:  # injected timers measure nothing of the machine
        one, per_request = float(hw.verify_latency(1, 40)), 0.0
    else:
        # the overheads against forwards timed beside the steps, not the curve timed
        # seconds before at another speed of the machine (``forward_now_ms``)
        one = forward_now_ms(engine.target, 1, 40)
        many = forward_now_ms(engine.target, HOST_REQUESTS, 40)
        shift = many - float(hw.verify_latency(HOST_REQUESTS, HOST_REQUESTS * 40))
        # the host's work per request of a step (sampling, output): its slope from 1
        # to HOST_REQUESTS requests decoding
        per_request = measure_request_overhead(engine, hw, step - one, shift_ms=shift)
    prof["overhead_ms"] = round(max(0.0, step - one - per_request), 3)
    prof["overhead_ms_per_request"] = round(per_request, 4)
    prof["decode_step_ms"] = round(step, 3)
    st = summarize([steps])
    prof["decode_step_spread"] = {"p10_ms": round(st.p10[0], 4), "p90_ms": round(st.p90[0], 4)}
    if engine.draft is not None:
        n, d, w = 8, 4, 2
        total = measure_draft_host(engine, n, d, w)
        hw = HardwareModel.from_dict(prof)
        # the expansion's forward passes (``measure_draft_host``: n requests of 24
        # tokens, the draft's cache empty): the catch-up over all their tokens, then
        # d - 1 passes of n x w frontier tokens, pass t attending 24 + w (t - 1) each
        kv = sum(n * (24 + w * t) for t in range(d - 1))
        forwards = hw.draft_passes_ms(n * 24, (n * w,) * (d - 1), 0, kv)
        prof["draft_host_ms"] = round(max(0.0, (total - forwards) / (n * d)), 4)
        # each speculating request's tree verified on the host, beyond the passes
        # (injected timers measure nothing of the machine)
        tree = measure_tree_host(engine, HardwareModel.from_dict(prof)) if timer is None else 0.0
        prof["tree_host_ms"] = round(tree, 4)
    mask = measure_mask(engine)
    if mask is not None:
        prof["mask_ms_per_node"] = round(mask, 5)
    prof["target"].update(path=str(engine.model_dir), fingerprint=fingerprint(engine.model_dir))
    if prof["draft"] is not None:
        prof["draft"].update(path=str(engine.draft_dir), fingerprint=fingerprint(engine.draft_dir))
    plan = engine.runner.thread_plan
    if plan is not None:
        prof["thread_plan"] = plan.as_dict()
    # the checks that need the whole iteration (the step overhead against the pass)
    prof["sanity"] = check_profile(prof, SanityLimits.for_device(str(engine.cfg.device)))
    return prof


def cached_profile_path(engine) -> Path:
    from adaserve.util.paths import cache_root

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
    from adaserve.util.paths import cache_root

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
        bar.total = bar.n  # imprecise points took repeats beyond ``profile_calls``
        bar.refresh()
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
    from adaserve.hardware.model import HardwareModel, measured_unloaded_tpot_ms

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
    from adaserve.hardware.model import measured_unloaded_tpot_ms

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
    raw: dict | None  # the profile read (None: none usable)
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
