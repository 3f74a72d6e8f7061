"""Real concurrent processes on one embedded store: a collector-like writer, an analyzer-like
reader and a compactor, at the same time (chDB alone allows one process per data directory)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

WRITER = textwrap.dedent(
    """
    import os, sys, time
    from ranklens.store import open_store
    s = open_store(sys.argv[1])
    deadline = time.monotonic() + 300
    while not os.path.exists(sys.argv[3]):  # the reader is reading: now write under its eyes
        assert time.monotonic() < deadline, "the reader never said it was ready"
        time.sleep(0.01)
    for b in range(int(sys.argv[2])):
        s.write("collectives", [
            {"job_id": "j", "rank": r, "pg": "0", "seq": b, "op": "all_reduce",
             "enter_ns": 10**18 + b * 10 + r}
            for r in range(100)
        ])
        if b % 10 == 9:
            s.compact(min_parts=4)
    print("writer done")
    """
)

READER = textwrap.dedent(
    """
    import json, sys, time
    from ranklens.store import open_store
    s = open_store(sys.argv[1])
    seen = []
    ready = sys.argv[3]
    deadline = time.time() + 300  # readiness only: until the writer is done, on a loaded machine too
    while time.time() < deadline:
        n, seqs = s.query("SELECT count(), uniqExact(seq) FROM collectives").rows()[0]
        assert n == seqs * 100, (n, seqs)   # whole batches only: never half a commit, never a duplicate
        seen.append(int(n))
        if len(seen) == 1:
            open(ready, "w").close()
        if n == int(sys.argv[2]) * 100:
            break
    print(json.dumps(seen))
    """
)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_writer_reader_and_compactor_processes(tmp_path):
    from ranklens.store import open_store

    url = f"embedded://{tmp_path / 'store'}"
    open_store(url)  # exists before either process starts: the reader's first query sees an empty store
    batches = 60
    ready = str(tmp_path / "reader-ready")
    # the writer starts writing once the reader has read once: "it really read while the writer was
    # writing" below holds however late the scheduler starts the reader
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, url, str(batches), ready], stdout=subprocess.PIPE, text=True
    )
    reader = subprocess.Popen(
        [sys.executable, "-c", READER, url, str(batches), ready], stdout=subprocess.PIPE, text=True
    )
    w_out, _ = writer.communicate(timeout=400)
    r_out, _ = reader.communicate(timeout=400)
    assert writer.returncode == 0 and "writer done" in w_out
    assert reader.returncode == 0, r_out
    seen = json.loads(r_out)
    assert seen[-1] == batches * 100
    assert seen == sorted(seen)  # the reader only ever saw the store grow
    assert len(set(seen)) > 1  # it really read while the writer was writing

    s = open_store(url)
    assert s.query("SELECT count() FROM collectives").scalar() == batches * 100
    assert len(s.parts("collectives")) < batches  # compaction happened
