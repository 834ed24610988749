"""A throwaway PostgreSQL server for the ledger tests: Debian's ``postgresql`` package
(``.ci/run`` installs it), ``initdb`` into a fresh folder and ``pg_ctl start`` on a
free loopback port, run as the ``postgres`` user when the tests run as root (initdb
refuses root). ``stop``/``start`` take the server down and back for the spool tests."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def pg_bin() -> Path | None:
    """The newest ``/usr/lib/postgresql/N/bin`` with initdb and pg_ctl (None: none)."""
    root = Path("/usr/lib/postgresql")
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if (d / "bin" / "initdb").exists() and (d / "bin" / "pg_ctl").exists():
                with contextlib.suppress(ValueError):
                    found.append((float(d.name), d / "bin"))
    if found:
        return max(found)[1]
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def why_no_postgres() -> str | None:
    """Why a PostgreSQL server cannot be run here (None: it can)."""
    if pg_bin() is None:
        return "PostgreSQL is not installed (Debian: apt-get install postgresql; .ci/run does)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root without a 'postgres' user to run initdb as"
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        return "psycopg 3 is not installed (pip install 'adaserve[postgres]')"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PgServer:
    def __init__(self):
        self.bin = pg_bin()
        self.root = Path(tempfile.mkdtemp(prefix="adaserve-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.as_postgres = os.geteuid() == 0
        if self.as_postgres:
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
        self._run(
            [str(self.bin / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust"]
            + ["--no-sync", "-E", "UTF8"]
        )
        self.start()

    def _run(self, argv: list[str]) -> None:
        if self.as_postgres:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stdout}\n{r.stderr}")

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", opts, "-w", "-t", "60"]
            + ["-l", str(self.root / "log"), "start"]
        )

    def stop(self) -> None:
        self._run([str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"])

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{db}"

    def new_database(self) -> str:
        """A fresh empty database; its URL."""
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
