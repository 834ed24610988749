"""Ray processes that do not outlive the front door that started them (Linux).

``ray.init`` ties the processes it starts itself (GCS, raylet, monitor, dashboard head,
log monitor) to the starting process with ``PR_SET_PDEATHSIG``, and the workers end when
their raylet does. The raylet's two agents (``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``, about 200 MB together) do notice their raylet die, but first
try to report it to the GCS, which died too, and wait 60 s on that before they exit.

So a front door that starts a local cluster marks it: while ``ray.init`` runs, the
environment holds ``ADASERVE_RAY_OWNER=<pid>:<start time>`` (the front door's), and the
processes ``ray.init`` starts carry it in ``/proc/<pid>/environ``. (Not every Ray
process can be recognised so: ``setproctitle`` in Ray's Python processes may zero that
area, so the mark finds the roots, and the tree under them is followed.) Then:

- a watchdog (this file run as a script, stdlib only, its own session, deaf to
  SIGINT/SIGTERM/SIGHUP) follows, every ``WATCH_PERIOD_S``, the front door's marked
  children and every process under them, as (pid, start time), and keeps that set in
  a state file (``<cache>/ray/<owner>.pids``). It waits for the end of a pipe from the
  front door: when the front door exits, however it exits (``kill -9`` included), it
  kills every process of the set still running, at once, and removes the file;
- at the next start, ``reap_orphans`` kills what the state files of dead owners list,
  and the marked processes of dead owners (if the watchdog was killed too).

A process is killed only if its start time (or its mark) still matches, read again
through a pid file descriptor, so a reused pid is never hit. Elsewhere than on Linux
both do nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

MARKER = "ADASERVE_RAY_OWNER"
WATCH_PERIOD_S = 1.0
_PROC = "/proc"


def supported() -> bool:
    return sys.platform.startswith("linux") and os.path.isdir(_PROC)


def _stat(pid: int) -> tuple[int, str] | None:
    """(parent pid, start time in clock ticks since boot), or None if it is gone."""
    try:
        with open(f"{_PROC}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: count after the last ")"
    fields = stat[stat.rfind(b")") + 2 :].split()
    if len(fields) < 20 or fields[0] == b"Z":  # a zombie has already ended
        return None
    return int(fields[1]), fields[19].decode()


def _start_time(pid: int) -> str | None:
    st = _stat(pid)
    return st[1] if st else None


def _procs() -> dict[int, tuple[int, str]]:
    out = {}
    for name in os.listdir(_PROC):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                out[int(name)] = st
    return out


def owner_token(pid: int | None = None) -> str:
    """``<pid>:<start time>`` of a process (this one by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid)}"


def owner_alive(token: str) -> bool:
    pid, _, started = token.partition(":")
    try:
        return _start_time(int(pid)) == started
    except ValueError:
        return False


def _mark_of(pid: int) -> str | None:
    try:
        with open(f"{_PROC}/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:  # gone, or not ours to read
        return None
    key = MARKER.encode() + b"="
    for item in env.split(b"\0"):
        if item.startswith(key):
            return item[len(key) :].decode(errors="replace")
    return None


def marked() -> dict[int, str]:
    """{pid: owner token} of the processes (other than this one) whose environment
    still shows the mark."""
    if not supported():
        return {}
    me = os.getpid()
    out = {}
    for pid in _procs():
        if pid != me:
            mark = _mark_of(pid)
            if mark is not None:
                out[pid] = mark
    return out


def tree(token: str, procs: dict[int, tuple[int, str]] | None = None) -> dict[int, str]:
    """{pid: start time} of the owner's marked children and every process under them."""
    procs = _procs() if procs is None else procs
    owner = int(token.partition(":")[0])
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    todo = [p for p in kids.get(owner, ()) if _mark_of(p) == token]
    out: dict[int, str] = {}
    while todo:
        pid = todo.pop()
        if pid in procs and pid not in out:
            out[pid] = procs[pid][1]
            todo.extend(kids.get(pid, ()))
    return out


def _kill(pid: int, check) -> bool:
    """SIGKILL ``pid`` if ``check(pid)`` still holds (through a pid fd, so that a
    reused pid is never hit); True if it was sent."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except (AttributeError, OSError):  # no pidfd here: the plain way
        fd = None
    try:
        if not check(pid):  # gone, or the pid now names another process
            return False
        if fd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        return True
    except OSError:
        return False
    finally:
        if fd is not None:
            os.close(fd)


def kill_known(known: dict[int, str]) -> list[int]:
    """Kill the processes of ``{pid: start time}`` still running; returns their pids."""
    return [pid for pid, st in known.items() if _kill(pid, lambda p, st=st: _start_time(p) == st)]


def reap(token: str, known: dict[int, str] | None = None) -> list[int]:
    """Kill ``known`` and every process still marked with ``token``; their pids."""
    gone = kill_known(known or {})
    gone += [
        pid
        for pid, mark in marked().items()
        if mark == token and pid not in gone and _kill(pid, lambda p: _mark_of(p) == token)
    ]
    return gone


# ---------------------------------------------------------------- state files
def _state_file(state_dir: str, token: str) -> str:
    return os.path.join(state_dir, token.replace(":", "-") + ".pids")


def _write_state(path: str, known: dict[int, str]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(f"{pid} {st}\n" for pid, st in sorted(known.items()))
    os.replace(tmp, path)


def read_state(path: str) -> dict[int, str]:
    out = {}
    with contextlib.suppress(OSError), open(path) as f:
        for line in f:
            pid, _, st = line.strip().partition(" ")
            if pid.isdigit() and st:
                out[int(pid)] = st
    return out


def reap_orphans(state_dir: str | None = None) -> dict[str, list[int]]:
    """Kill what dead owners left: the processes their state files (in ``state_dir``)
    list, and the processes still marked with their token. {owner token: pids}."""
    out: dict[str, list[int]] = {}
    if not supported():
        return out
    if state_dir and os.path.isdir(state_dir):
        for name in os.listdir(state_dir):
            if not name.endswith(".pids"):
                continue
            token = name[: -len(".pids")].replace("-", ":", 1)
            if owner_alive(token):
                continue
            path = os.path.join(state_dir, name)
            killed = kill_known(read_state(path))
            if killed:
                out.setdefault(token, []).extend(killed)
            with contextlib.suppress(OSError):
                os.unlink(path)
    for pid, mark in marked().items():
        if not owner_alive(mark) and _kill(pid, lambda p, m=mark: _mark_of(p) == m):
            out.setdefault(mark, []).append(pid)
    return out


# ---------------------------------------------------------------- the watchdog
@contextlib.contextmanager
def marking(token: str):
    """The mark in this process's environment for the processes started meanwhile."""
    before = os.environ.get(MARKER)
    os.environ[MARKER] = token
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(MARKER, None)
        else:
            os.environ[MARKER] = before


def start_watchdog(token: str, state_dir: str | None = None) -> subprocess.Popen | None:
    """The watchdog of ``token``'s processes; close its ``stdin`` to have them killed
    now (the front door's exit closes it too). None where it cannot run."""
    if not supported():
        return None
    env = {k: v for k, v in os.environ.items() if k != MARKER}
    return subprocess.Popen(
        [sys.executable, "-S", "-E", os.path.abspath(__file__), "watch", token, state_dir or ""],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        start_new_session=True,  # a Ctrl-C or a signal to the front door's group: not us
    )


def stop_watchdog(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """Close the pipe (the watchdog kills what is left) and wait for it."""
    if proc is None:
        return
    with contextlib.suppress(OSError):
        if proc.stdin is not None:
            proc.stdin.close()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def _watch(token: str, state_dir: str) -> None:
    import select

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    path = _state_file(state_dir, token) if state_dir else None
    known: dict[int, str] = {}
    while True:
        procs = _procs()
        now = {p: st for p, st in known.items() if procs.get(p, (0, None))[1] == st}
        now.update(tree(token, procs))
        if now != known and path:
            with contextlib.suppress(OSError):
                _write_state(path, now)
        known = now
        ready, _, _ = select.select([sys.stdin], [], [], WATCH_PERIOD_S)
        if ready and not os.read(sys.stdin.fileno(), 1 << 16):
            break  # the front door's end is closed: it has exited, or is shutting down
    for _ in range(3):  # again, for a process started while the first pass ran
        if not reap(token, known):
            break
        known = {}
        time.sleep(0.2)
    if path:
        with contextlib.suppress(OSError):
            os.unlink(path)


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "watch":
    _watch(sys.argv[2], sys.argv[3])
