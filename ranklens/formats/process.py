"""Process helpers shared by the tracer (which writes its pid namespace into heartbeats), the node's
collector (which checks the pids it can see) and the live hang analyzer."""

from __future__ import annotations

import os
import socket

from ranklens.config import node_name

__all__ = ["pid_alive_local", "pid_namespace"]


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
