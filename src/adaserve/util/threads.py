"""How many intra-op threads the engine's forward passes use, and on which cores.

torch's default is one thread per core. On a machine whose cores are shared (another
process, or the server's own HTTP loop, tokenisers and planner), an OpenMP team whose
threads wait for a descheduled team mate spins: measured on a busy 2-core machine, a
pass took 3-18x its quiet time with 2 threads, about 1x with 1 (``docs/results/
threads.md``). So the engine keeps a reserve of cores for everything that is not the
forward pass and runs its passes on the rest, as vLLM's CPU backend reserves cores for
its API server.

The choice, in order of precedence:

1. ``--threads N`` (``EngineConfig.threads``);
2. ``$ADASERVE_NUM_THREADS``;
3. ``$OMP_NUM_THREADS``, when the user set it (the usual knob of a torch program);
4. automatic: the cores this process may run on (its CPU affinity, not the machine's
   count) less a reserve: 1 core up to 8 usable cores, 2 up to 32, then 1 in 16.
   A single usable core gets 1 thread and no reserve.

On Linux the serving loop's thread is pinned to the last ``threads`` usable cores
(``pin_current_thread``), and the OpenMP team it starts inherits that set; the first
cores are left to the reserve, and ``adaserve serve`` confines the rest of its process
there (``confine_rest``: the HTTP loop, tokenisers and the threads they start; threads
started from the serving loop's own thread share its cores). Nothing in this module
imports torch at import time (``apply`` does, when called).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass

ENV = "ADASERVE_NUM_THREADS"
# the process's usable cores before ``confine_rest`` narrowed its other threads (the
# main thread's mask, which ``usable_cores`` reads, is the reserve after it)
_before_confined: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ThreadPlan:
    """The engine's thread choice.

    threads: intra-op threads of the forward passes
    usable:  cores this process may run on
    reserve: usable cores left to the HTTP loop, tokenisers and the planner
    cores:   the cores the serving loop is pinned to (the last ``threads`` usable
             ones; empty where the OS offers no affinity)
    source:  what decided it: "--threads", ADASERVE_NUM_THREADS, OMP_NUM_THREADS or "auto"
    """

    threads: int
    usable: int
    reserve: int
    cores: tuple[int, ...]
    source: str

    def __post_init__(self) -> None:
        if not (isinstance(self.threads, int) and self.threads >= 1):
            raise ValueError("threads must be a positive integer")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["cores"] = list(self.cores)
        return d

    def describe(self) -> str:
        """One line for the start-up log."""
        pin = (
            f"; a server pins its engine thread to cores {describe_cores(self.cores)}"
            if self.cores
            else ""
        )
        return (
            f"{self.threads} intra-op thread{'s' if self.threads != 1 else ''} "
            f"({self.source}: {self.usable} usable cores, {self.reserve} reserved for the "
            f"HTTP loop, tokenisers and planner{pin})"
        )


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (its main thread's affinity mask, not the
    calling thread's: the serving loop's thread, pinned to the plan's cores, chooses
    again when it builds the engine, and must not take the reserve off a second
    time; all CPUs where the OS has no affinity call). After ``confine_rest``: the
    cores the process had before it."""
    if _before_confined is not None:
        return _before_confined
    if hasattr(os, "sched_getaffinity"):
        try:
            return tuple(sorted(os.sched_getaffinity(os.getpid())))
        except OSError:
            pass
    return tuple(range(os.cpu_count() or 1))


def auto_reserve(usable: int) -> int:
    """Cores kept from the forward passes on a machine with ``usable`` cores."""
    if usable <= 1:
        return 0
    if usable <= 8:
        return 1
    if usable <= 32:
        return 2
    return usable // 16


def _positive(text: str, what: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise ValueError(f"{what} must be a positive integer, got {text!r}")
    return v


def choose(
    requested: int | None = None,
    env: Mapping[str, str] | None = None,
    cores: tuple[int, ...] | None = None,
) -> ThreadPlan:
    """The thread plan for ``requested`` (``--threads``; None = not given), the
    environment ``env`` (default ``os.environ``) and the usable ``cores`` (default:
    this process's). ValueError for a non-positive count."""
    env = os.environ if env is None else env
    cores = usable_cores() if cores is None else tuple(cores)
    n = len(cores) or 1
    if requested is not None:
        threads, source = _positive(str(requested), "--threads"), "--threads"
    elif env.get(ENV, "").strip():
        threads, source = _positive(env[ENV].strip(), ENV), ENV
    elif env.get("OMP_NUM_THREADS", "").strip():
        threads, source = (
            _positive(env["OMP_NUM_THREADS"].strip(), "OMP_NUM_THREADS"),
            ("OMP_NUM_THREADS"),
        )
    else:
        threads, source = max(1, n - auto_reserve(n)), "auto"
    pinned = tuple(cores[-threads:]) if threads < n and cores else ()
    return ThreadPlan(threads, n, max(0, n - threads), pinned, source)


def apply(plan: ThreadPlan) -> None:
    """Set torch's intra-op threads to ``plan.threads`` (process-wide)."""
    import torch

    if torch.get_num_threads() != plan.threads:
        torch.set_num_threads(plan.threads)


def pin_current_thread(plan: ThreadPlan) -> bool:
    """Pin the calling thread (and the OpenMP team it will start) to ``plan.cores``;
    False where there is nothing to pin or the OS refuses. Only the calling thread
    moves: the rest of the process keeps its affinity."""
    if not plan.cores or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, plan.cores)  # Linux: 0 is the calling thread
    except OSError:
        return False
    return True


def process_threads() -> tuple[int, ...]:
    """The native ids of this process's threads now (empty without Linux's task list)."""
    try:
        return tuple(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return ()


def confine_rest(plan: ThreadPlan) -> tuple[int, ...]:
    """Confine every thread of this process not already within ``plan.cores`` (the
    serving loop's thread, pinned there, and the OpenMP team it started stay) to the
    reserve, the usable cores outside ``plan.cores``; threads started later inherit
    their creator's set, so those the HTTP loop starts stay in the reserve. Called from
    the pinned thread once the engine is built. Returns the reserve's cores; empty
    where nothing was pinned, nothing is left to reserve, or the OS offers no
    per-thread affinity.

    Why: on the 2-core machine, in the overload bench (server and client on one
    machine, runs alternated), the passes ran a median 1.15x their profiled time
    confined against 1.20x free, with 6% more goodput (docs/results/engine-issue30.md,
    ninth pass)."""
    global _before_confined
    if not plan.cores or not hasattr(os, "sched_setaffinity"):
        return ()
    usable = usable_cores()
    reserve = tuple(c for c in usable if c not in plan.cores)
    if not reserve:
        return ()
    own = set(plan.cores)
    rest = []
    for tid in process_threads():
        with contextlib.suppress(OSError):  # (a thread that ended meanwhile)
            if not os.sched_getaffinity(tid) <= own:
                rest.append(tid)
    if _confine_threads(reserve, tuple(rest)):
        _before_confined = usable
        return reserve
    return ()


def machine_id() -> str | None:
    """A digest of this machine's boot id (Linux): a client compares it with a server's
    to know they share cores. None where there is none."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        return None
    return hashlib.sha256(b"adaserve:" + boot.encode()).hexdigest()[:16] if boot else None


@contextlib.contextmanager
def kept_off(cores: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """Within the block, every thread of this process runs on the process's usable
    cores outside ``cores`` (one set for all: a client on the server's machine keeping
    off the engine's cores); yields them, empty where that leaves none or the OS offers
    no per-thread affinity. After it every thread has the mask it had before the block
    (one started meanwhile takes the main thread's former mask; a mask set inside the
    block is not kept), so a caller in a longer-lived process (a test, a notebook) keeps
    its cores."""
    rest = tuple(c for c in usable_cores() if c not in cores)
    if not rest or not hasattr(os, "sched_getaffinity"):
        yield ()
        return
    saved: dict[int, set[int]] = {}
    for tid in process_threads():
        with contextlib.suppress(OSError):
            saved[tid] = os.sched_getaffinity(tid)
    main = saved.get(os.getpid(), set(usable_cores()))
    done = _confine_threads(rest, tuple(saved))
    try:
        yield rest if done else ()
    finally:
        if done:
            for tid in process_threads():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, saved.get(tid, main))


def _confine_threads(cores: tuple[int, ...], tids: tuple[int, ...]) -> bool:
    """Set the affinity of the threads ``tids`` (native ids) to ``cores``; True when at
    least one was set."""
    done = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cores)
            done = True
        except OSError:  # the thread ended meanwhile, or the OS refuses
            continue
    return done


def describe_cores(cores: tuple[int, ...]) -> str:
    """``(0, 1, 2, 5)`` -> ``"0-2,5"``."""
    out, i = [], 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        out.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(out)
