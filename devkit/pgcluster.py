"""A throwaway PostgreSQL cluster for tests, benches and the dev stack: initdb + pg_ctl on a temp dir.

Role: the machine's PostgreSQL server binaries (``pg_config --bindir``, or ``pg_ctl`` on PATH) run a
private cluster on a free loopback port with trust authentication on 127.0.0.1 only and its socket in
its own directory, a fresh folder in the system temp dir (a pytest tmp dir is not reachable by another
user), removed by ``stop``. ``initdb`` refuses to run as root, so as root the cluster is owned and run by the
``postgres`` OS user (``runuser``). Only the cluster started here is ever stopped (``pg_ctl stop -m fast``
on its data dir).

    cluster = PgCluster.start()             # PgUnavailable when the binaries are missing
    url = cluster.create_database("t1")     # postgresql://postgres@127.0.0.1:PORT/t1
    cluster.stop()
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.procs import free_port


class PgUnavailable(RuntimeError):
    """No PostgreSQL server binaries on this machine (or no ``postgres`` user to run them as root)."""


def pg_bindir() -> Path:
    """The folder of ``initdb``/``pg_ctl``; PgUnavailable when there is none."""
    candidates = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        candidates.append(Path(out))
    if shutil.which("pg_ctl"):
        candidates.append(Path(shutil.which("pg_ctl") or "").resolve().parent)
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for d in candidates:
        if (d / "initdb").exists() and (d / "pg_ctl").exists():
            return d
    raise PgUnavailable("PostgreSQL server binaries (initdb, pg_ctl) not found; install Debian's postgresql")


@dataclass
class PgCluster:
    data_dir: Path
    port: int
    bindir: Path
    as_user: str | None
    host: str = "127.0.0.1"

    @classmethod
    def start(cls, *, fsync: bool = True, host: str = "127.0.0.1") -> PgCluster:
        """Create and start a cluster listening on ``host`` (a loopback address); ``fsync=False`` for tests and
        benches that never crash the host."""
        bindir = pg_bindir()
        as_user = None
        if os.geteuid() == 0:
            if not shutil.which("runuser"):
                raise PgUnavailable("running as root without runuser: cannot start initdb as postgres")
            try:
                import pwd

                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise PgUnavailable("running as root and there is no postgres OS user for initdb") from None
            as_user = "postgres"
        base_dir = Path(tempfile.mkdtemp(prefix="hindsight-pg-"))
        data_dir = base_dir / "pgdata"
        if as_user:
            os.chown(base_dir, pw.pw_uid, pw.pw_gid)
            base_dir.chmod(0o700)
        cluster = cls(data_dir=data_dir, port=free_port(), bindir=bindir, as_user=as_user, host=host)
        cluster._run(
            [
                str(bindir / "initdb"),
                "-D",
                str(data_dir),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--no-instructions",
            ]
        )
        with (data_dir / "pg_hba.conf").open("w") as f:  # trust on loopback only, nothing else
            f.write(f"local all all trust\nhost all all 127.0.0.1/32 trust\nhost all all {host}/32 trust\n")
        opts = (
            f"-c listen_addresses={host} -c port={cluster.port} -c unix_socket_directories={base_dir} "
            f"-c max_connections=200 -c fsync={'on' if fsync else 'off'}"
        )
        cluster._run(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(data_dir),
                "-o",
                opts,
                "-l",
                str(base_dir / "postgres.log"),
                "-w",
                "-t",
                "60",
                "start",
            ]
        )
        return cluster

    def _run(self, cmd: list[str]) -> None:
        if self.as_user:
            cmd = ["runuser", "-u", self.as_user, "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{dbname}"

    def create_database(self, dbname: str) -> str:
        """A new empty database; returns its URL."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{dbname}"')
        return self.url(dbname)

    def postmaster_pid(self) -> int:
        """The server's PID (first line of ``postmaster.pid``)."""
        return int((self.data_dir / "postmaster.pid").read_text().split()[0])

    def restart(self) -> None:
        """``pg_ctl restart -m fast``: every connection is cut, the server is back when this returns."""
        log = str(self.data_dir.parent / "postgres.log")  # the server's output, never pg_ctl's (piped) stdout
        self._run(
            [
                str(self.bindir / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-l",
                log,
                "-m",
                "fast",
                "-w",
                "-t",
                "60",
                "restart",
            ]
        )

    def stop(self) -> None:
        try:
            self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "-m", "fast", "-w", "stop"])
        finally:
            shutil.rmtree(self.data_dir.parent, ignore_errors=True)
