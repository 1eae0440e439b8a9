"""Background processes of the testbed: start with a log file, wait for readiness, stop.

Every process gets its own session (process group), so stopping it also stops anything
it spawned, and a state file can name it by pid for `make dev-down` in another process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


class StartError(RuntimeError):
    """A testbed process exited or never became ready; the message carries its log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_ports(1)[0]


def free_ports(count: int, avoid: frozenset[int] = frozenset()) -> list[int]:
    """`count` distinct TCP ports on 127.0.0.1 that nothing listens on right now, none of
    `avoid`: every socket is held until all are picked (a port freed by one pick could
    otherwise be handed out again by the next)."""
    held: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for sock in held:
            sock.close()


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Proc:
    """One started process: its name, pid and log file."""

    name: str
    pid: int
    log: Path
    popen: subprocess.Popen[bytes] | None = None
    webhook_url: str = ""
    report_url: str = ""
    metrics_url: str = ""

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        # A zombie still answers kill(0); /proc tells it apart.
        with contextlib.suppress(OSError):
            stat = Path(f"/proc/{self.pid}/stat").read_text()
            return stat.rsplit(")", 1)[1].split()[0] != "Z"
        return True

    def fail(self, why: str) -> StartError:
        return StartError(f"{self.name} {why}\n--- last lines of {self.log} ---\n{log_tail(self.log)}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `timeout`."""
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                if not self.alive():
                    break
                time.sleep(0.05)
            if not self.alive():
                break
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=1)
        # Children of the group that outlived their leader.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


def start(
    name: str,
    argv: Sequence[str],
    log: Path,
    *,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> Proc:
    """Start `argv` in a new session with stdout and stderr going to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        try:
            popen = subprocess.Popen(
                list(argv),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as exc:
            raise StartError(f"{name} could not be started ({argv[0]}): {exc}") from exc
    return Proc(name=name, pid=popen.pid, log=log, popen=popen)


def wait_until(proc: Proc, ready: Callable[[], bool], *, timeout: float, what: str) -> None:
    """Poll `ready` until it is true; raise StartError if `proc` dies or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            code = proc.popen.poll() if proc.popen is not None else None
            raise proc.fail(f"exited (code {code}) before {what}")
        try:
            if ready():
                return
        except Exception:  # noqa: BLE001 - any failure of a probe means "not yet"
            pass
        if time.monotonic() > deadline:
            raise proc.fail(f"was not {what} after {timeout:.0f}s")
        time.sleep(0.1)
