"""tests/_sync.py: waiting for readiness says what never happened, and gives up early when the
process that should make it happen is gone."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from tests._sync import free_port, wait_for_file, wait_for_port, wait_until


def test_returns_the_predicates_value_once_truthy():
    calls = iter([0, None, [], 7])
    assert wait_until(lambda: next(calls), 5, "the fourth call", interval_s=0.001) == 7


def test_times_out_saying_what_it_waited_for():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 0.2 s waiting for the moon\nlog tail"):
        wait_until(lambda: False, 0.2, "the moon", detail=lambda: "log tail")
    assert time.monotonic() - t0 >= 0.2


def test_gives_up_at_once_when_a_process_it_needs_exited():
    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    p.wait()
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=rf"gave up waiting for its file: pid {p.pid} exited 3"):
        wait_until(lambda: False, 60, "its file", procs=[p])
    assert time.monotonic() - t0 < 5


def test_a_process_that_did_its_part_and_exited_is_not_a_failure(tmp_path):
    marker = tmp_path / "done"
    p = subprocess.Popen([sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"])
    p.wait()  # exited, and the file is there: success, whichever the poll saw first
    assert wait_for_file(marker, 60, procs=[p]) == marker


def test_port_accepting():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        threading.Timer(0.2, s.listen).start()  # bound, listening only a moment later
        wait_for_port("127.0.0.1", port, 30)


def test_free_port_can_be_bound_and_differs_while_held():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # free: a server started by the test can take it
        s.listen()
        assert free_port() != port  # the OS does not hand out a port that is in use
        wait_for_port("127.0.0.1", port, 5)
