"""Process helpers shared by the tracer (which writes its pid namespace into heartbeats), the node's
collector (which checks the pids it can see), the live hang analyzer and the dashboard launcher
(which stops its server)."""

from __future__ import annotations

import os
import socket
import subprocess
from typing import Any

from ranklens.config import node_name

__all__ = ["pid_alive", "pid_alive_local", "pid_namespace", "stop_process"]


def pid_namespace() -> int:
    """The inode of this process's pid namespace (0 unknown): tells the node's collector whether
    the ``pid`` in our heartbeats is one it can check."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pid_alive_local(host: str, pid: int) -> bool | None:
    """True/False when ``host`` is this machine and the pid can be checked, else None (unknown)."""
    if host not in (node_name(), socket.gethostname()) or pid <= 0:
        return None
    return pid_alive(pid)


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine (and pid namespace) runs: it exists (or exists as
    another user's) and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie (exited, not yet reaped by its launcher) is not alive
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def stop_process(proc: subprocess.Popen[Any], timeout_s: float = 10.0) -> None:
    """Stop a child: SIGTERM, then SIGKILL when it has not exited within ``timeout_s``; reaped either
    way (nothing to do when it has exited)."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
