"""The tracer's stack dumps beside flight-recorder dumps: written from a background thread while the
training thread is blocked, read back by the post-mortem; a damaged one is skipped, never fatal."""

from __future__ import annotations

import json
import threading

from ranklens.fr_report import load_stacks, stacks_dir_of
from ranklens.tracing._stacks import write_stacks


def _blocked_here(ready: threading.Event, release: threading.Event) -> None:
    ready.set()
    release.wait()  # the training thread, waiting (as in a collective)


def test_stacks_written_from_another_thread_show_where_a_thread_waits_and_garbage_is_skipped(tmp_path):
    ready, release = threading.Event(), threading.Event()
    th = threading.Thread(target=_blocked_here, args=(ready, release), name="trainer")
    th.start()
    try:
        assert ready.wait(10)
        attempt = tmp_path / "job" / "0"
        (attempt / "fr").mkdir(parents=True)
        write_stacks(str(attempt / "stacks"), 3, "all_reduce #7 of pg 0 in flight for 30 s", 123)
    finally:
        release.set()
        th.join()
    (attempt / "stacks" / "stacks_rank_4.json").write_text('{"rank": 4, "thr')  # truncated
    (attempt / "stacks" / "stacks_rank_5.json").write_text(json.dumps({"rank": 5}))  # no threads
    d = stacks_dir_of(str(attempt / "fr"))
    assert d == attempt / "stacks"
    got = load_stacks(d)
    assert list(got) == [3]
    assert got[3]["reason"].startswith("all_reduce #7") and got[3]["ts_ns"] == 123
    trainer = next(t for t in got[3]["threads"] if t["thread"] == "trainer")
    funcs = [f["func"] for f in trainer["frames"]]
    assert "_blocked_here" in funcs, funcs
    assert stacks_dir_of(str(tmp_path)) is None  # not a tracer's fr/ folder
