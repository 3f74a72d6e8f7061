"""The image's container, started the way docker starts it, in a network namespace of its own
(``unshare --net``: loopback only, like ``docker run --network none``). Run as root by
tests/app/test_deploy_docker.py; prints one JSON object with what it saw.

    python tests/app/_image_smoke.py SPEC.json

SPEC: ``argv`` (ENTRYPOINT + CMD, resolved), ``env``, ``uid``, ``gid``, ``health`` (the
HEALTHCHECK's command, resolved), ``metrics_url``, ``stop_signal``, ``ready_timeout_s``,
``stop_timeout_s``, ``log``, ``wait_for`` (a string the scrape shows once the GPUs are sampled).
"""

from __future__ import annotations

import errno
import fcntl
import json
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """A new network namespace starts with ``lo`` down (``ip link set lo up``, without iproute2)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def outside_reachable() -> str:
    """How a connection to an outside address fails here (TEST-NET-1: never a real host)."""
    try:
        socket.create_connection(("192.0.2.1", 80), timeout=2).close()
    except OSError as e:
        return errno.errorcode.get(e.errno or 0, str(e))
    return "connected"


def as_user(spec: dict, argv: list[str], **kw) -> subprocess.Popen:
    # the container's process: its uid/gid, no supplementary groups, cwd / (docker's default WORKDIR)
    return subprocess.Popen(argv, env=spec["env"], user=spec["uid"], group=spec["gid"], extra_groups=[], cwd="/", **kw)


def health(spec: dict) -> int:
    p = as_user(spec, spec["health"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p.wait(timeout=30)


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    out: dict = {}
    loopback_up()
    out["outside"] = outside_reachable()
    with open(spec["log"], "wb") as log:
        proc = as_user(spec, spec["argv"], stdout=log, stderr=subprocess.STDOUT)
    t0 = time.monotonic()
    metrics = None
    while time.monotonic() - t0 < spec["ready_timeout_s"] and proc.poll() is None:
        try:  # readiness: the endpoint answers (each try blocks up to 1 s; no fixed sleep decides)
            with urllib.request.urlopen(spec["metrics_url"], timeout=1) as r:
                metrics = r.read().decode()
            break
        except OSError:
            time.sleep(0.1)
    out["ready_s"] = round(time.monotonic() - t0, 2)
    out["metrics"] = metrics
    out["exited_early"] = proc.poll()
    if metrics is not None:
        out["health_up"] = health(spec)
        # GPU series come with the first sampling tick: scrape until spec["wait_for"] shows up
        t1 = time.monotonic()
        while spec["wait_for"] not in metrics and time.monotonic() - t1 < spec["ready_timeout_s"]:
            time.sleep(0.1)
            with urllib.request.urlopen(spec["metrics_url"], timeout=5) as r:
                metrics = r.read().decode()
        out["metrics"] = metrics
    t2 = time.monotonic()
    proc.send_signal(getattr(signal, spec["stop_signal"]))
    try:
        out["rc"] = proc.wait(timeout=spec["stop_timeout_s"])
    except subprocess.TimeoutExpired:
        proc.kill()
        out["rc"] = f"still running {spec['stop_timeout_s']} s after {spec['stop_signal']}"
        proc.wait()
    out["stop_s"] = round(time.monotonic() - t2, 2)
    out["health_down"] = health(spec)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
