"""Real concurrent processes on one embedded store: a collector-like writer, an analyzer-like
reader and a compactor, at the same time (chDB alone allows one process per data directory)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

WRITER = textwrap.dedent(
    """
    import sys
    from ranklens.store import open_store
    s = open_store(sys.argv[1])
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
    deadline = time.time() + 60
    while time.time() < deadline:
        n, seqs = s.query("SELECT count(), uniqExact(seq) FROM collectives").rows()[0]
        assert n == seqs * 100, (n, seqs)   # whole batches only: never half a commit, never a duplicate
        seen.append(int(n))
        if n == int(sys.argv[2]) * 100:
            break
    print(json.dumps(seen))
    """
)


def test_writer_reader_and_compactor_processes(tmp_path):
    url = f"embedded://{tmp_path / 'store'}"
    batches = 60
    writer = subprocess.Popen([sys.executable, "-c", WRITER, url, str(batches)], stdout=subprocess.PIPE, text=True)
    reader = subprocess.Popen([sys.executable, "-c", READER, url, str(batches)], stdout=subprocess.PIPE, text=True)
    w_out, _ = writer.communicate(timeout=120)
    r_out, _ = reader.communicate(timeout=120)
    assert writer.returncode == 0 and "writer done" in w_out
    assert reader.returncode == 0, r_out
    seen = json.loads(r_out)
    assert seen[-1] == batches * 100
    assert seen == sorted(seen)  # the reader only ever saw the store grow
    assert len(set(seen)) > 1  # it really read while the writer was writing

    from ranklens.store import open_store

    s = open_store(url)
    assert s.query("SELECT count() FROM collectives").scalar() == batches * 100
    assert len(s.parts("collectives")) < batches  # compaction happened
