"""A throwaway PostgreSQL server for tests and benchmarks: ``initdb`` + ``pg_ctl`` in a temporary directory.

The job store's PostgreSQL tests need a real server, never a mock. :class:`ThrowawayPostgres` finds the binaries
of the machine's PostgreSQL package (Debian's ``/usr/lib/postgresql/<version>/bin``, or ``PATH``), creates a
cluster in a fresh directory, starts it on a free loopback port with ``fsync`` off (the data is thrown away) and
removes everything on :meth:`stop`. PostgreSQL refuses to run as root, so as root the cluster belongs to an
unprivileged user (``postgres`` when the package created it, else ``nobody``) and the server is started through
``runuser``. When no binaries exist, :func:`find_bin_dir` returns ``None`` and :data:`INSTALL_HINT` says how to
get them.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

INSTALL_HINT = ("PostgreSQL server binaries (initdb, pg_ctl) not found; install them with "
                "`apt-get install postgresql` (or `make install` as root), or put their directory on PATH")


def find_bin_dir() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: the newest ``/usr/lib/postgresql/*/bin``, else ``PATH``."""
    def version(path: str) -> float:
        try:
            return float(Path(path).parent.name)
        except ValueError:
            return 0.0

    for cand in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=version, reverse=True):
        if (Path(cand) / "initdb").exists() and (Path(cand) / "pg_ctl").exists():
            return Path(cand)
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if initdb and pg_ctl and Path(initdb).parent == Path(pg_ctl).parent:
        return Path(initdb).parent
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ThrowawayPostgres:
    """One disposable cluster. ``start()`` returns the URL (``postgresql://omnicore@127.0.0.1:PORT/omnicore``)."""

    def __init__(self, bin_dir: Path | None = None) -> None:
        found = bin_dir or find_bin_dir()
        if found is None:
            raise FileNotFoundError(INSTALL_HINT)
        self.bin_dir = found
        self.root = Path(tempfile.mkdtemp(prefix="omnicore-pg-"))
        self.data = self.root / "data"
        self.port = _free_port()
        self.user: str | None = None  # the unprivileged owner when we run as root
        self.url = ""

    def _cmd(self, *argv: str) -> list[str]:
        if self.user is None:
            return list(argv)
        return ["runuser", "-u", self.user, "--", *argv]

    def start(self, timeout_s: float = 60.0) -> str:
        if os.geteuid() == 0:
            names = [p.pw_name for p in pwd.getpwall()]
            self.user = "postgres" if "postgres" in names else "nobody"
            pw = pwd.getpwnam(self.user)
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            os.chmod(self.root, 0o700)
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        subprocess.run(self._cmd(str(self.bin_dir / "initdb"), "-D", str(self.data), "-U", "omnicore", "-A",
                                 "trust", "-E", "UTF8", "--no-sync"),
                       check=True, capture_output=True, env=env, timeout=timeout_s)
        opts = (f"-c listen_addresses=127.0.0.1 -c port={self.port} -c unix_socket_directories={self.root} "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200 "
                "-c shared_buffers=32MB")
        subprocess.run(self._cmd(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-o", opts, "-l",
                                 str(self.root / "server.log"), "-w", "-t", str(int(timeout_s)), "start"),
                       check=True, capture_output=True, env=env, timeout=timeout_s + 10)
        self.url = f"postgresql://omnicore@127.0.0.1:{self.port}/postgres"
        self._create_db("omnicore", timeout_s)
        self.url = f"postgresql://omnicore@127.0.0.1:{self.port}/omnicore"
        return self.url

    def _create_db(self, name: str, timeout_s: float) -> None:
        import psycopg

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(f'CREATE DATABASE "{name}"')
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def new_database(self, name: str) -> str:
        """A fresh, empty database on the same server (a test that needs a clean schema); returns its URL."""
        base = self.url.rsplit("/", 1)[0]
        import psycopg

        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            conn.execute(f'CREATE DATABASE "{name}"')
        return f"{base}/{name}"

    def stop(self) -> None:
        if self.data.exists():
            subprocess.run(self._cmd(str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w",
                                     "stop"), capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ThrowawayPostgres:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
