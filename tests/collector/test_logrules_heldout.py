"""The built-in log rules on labelled lines they were not tuned on (tests/data/logs_heldout), and
the grouping rule that an event never swallows a line of another class.

The held-out lines were written for issue 21 (see tests/data/logs_heldout/README.md); the tuning
split is tests/data/logs. Scores print with ``-s``; ``bench/logrules_score.py`` prints them too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ranklens.collector._scan import available_engines
from ranklens.collector.logfilter import LogFilter
from ranklens.collector.logscore import NOISE, load_labelled, predict_lines, score_rows
from ranklens.collector.rules import CLASSES
from tests.collector._ere import grep_and_python_matches

DATA = Path(__file__).parent.parent / "data"
TUNING = DATA / "logs" / "real_log_lines.jsonl"
HELDOUT = sorted((DATA / "logs_heldout").glob("heldout*_log_lines.jsonl"))
ROWS = [r for p in HELDOUT for r in load_labelled(p)]


def test_heldout_split_is_separate_from_the_tuning_split():
    assert len(HELDOUT) == 4 and len(ROWS) > 600
    tuning = {json.loads(line)["line"] for line in TUNING.read_text(encoding="utf-8").splitlines()}
    # lines inside a block may repeat fixed text ("Traceback ...", "frame #0: ..."); a standalone
    # line must not come from the tuning split
    copied = [r["line"] for r in ROWS if not r["multiline_group"] and r["line"].strip() and r["line"] in tuning]
    assert copied == ["  warnings.warn("], copied
    assert {r["label"] for r in ROWS} == set(CLASSES) - {"traceback"} | {NOISE}


@pytest.mark.parametrize("path", HELDOUT, ids=lambda p: p.stem)
def test_heldout_per_class_recall_precision_and_line_accuracy(path, capsys):
    sc = score_rows(load_labelled(path), LogFilter())
    with capsys.disabled():
        print("\n" + sc.format(path.name))
    assert sc.noise_flagged == 0, [e for e in sc.errors if e[1] == NOISE]
    assert sc.accuracy >= 0.98, sc.errors
    for klass, c in sc.by_example.items():
        assert klass in CLASSES
        assert c.predicted == c.correct, (klass, sc.errors)  # no example given a wrong class
        assert c.recall >= 0.9, (klass, c, sc.errors)


def test_tuning_split_keeps_its_scores():
    sc = score_rows(load_labelled(TUNING), LogFilter())
    assert sc.noise_flagged == 0 and sc.accuracy >= 0.99, sc.errors
    assert all(c.predicted == c.correct for c in sc.by_example.values()), sc.errors


@pytest.mark.parametrize("engine", available_engines())
def test_engines_classify_the_heldout_lines_alike(engine):
    lines = [r["line"] for r in ROWS]
    assert predict_lines(lines, LogFilter(engine=engine)) == predict_lines(lines, LogFilter(engine="re"))


@pytest.mark.skipif(shutil.which("grep") is None, reason="no grep")
def test_rules_translated_to_ere_match_the_heldout_lines_like_python(tmp_path):
    by_grep, by_python = grep_and_python_matches(tmp_path, [r["line"] for r in ROWS], lc_all="C.UTF-8")
    assert by_grep == by_python


def _events(text: str) -> list[tuple[str, int, int]]:
    sf = LogFilter().stream()
    sf.feed(text.encode(), eof=True)
    return [(e.klass, e.line_no, e.line_count) for e in sf.flush()]


WATCHDOG = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 2] Process group watchdog thread terminated with exception: [Rank 2] "
    "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=4, NumelOut=4, "
    "Timeout(ms)=60000) ran for 60010 milliseconds before timing out."
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        pytest.param(
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.\n"
            f"  what():  {WATCHDOG}\n"
            "Exception raised from checkTimeout at ProcessGroupNCCL.cpp:632 (most recent call first):\n"
            "frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f in libc10.so)\n",
            [("cuda_oom", 1, 1), ("nccl_timeout", 2, 3)],
            id="what-timeout-after-oom",
        ),
        pytest.param(
            f"[rank2]:[E1204 02:11:09.601 ProcessGroupNCCL.cpp:632] [Rank 2] {WATCHDOG}\n"
            "  what():  CUDA error: an illegal memory access was encountered\n"
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
            "might be incorrect.\n",
            [("nccl_timeout", 1, 1), ("cuda_error", 2, 2)],
            id="cuda-what-after-timeout",
        ),
        pytest.param(
            "h:1:2 [5] NCCL WARN Cuda failure 'an illegal memory access was encountered'\n"
            "Traceback (most recent call last):\n"
            '  File "t.py", line 3, in <module>\n'
            "    x.item()\n"
            "RuntimeError: CUDA error: an illegal memory access was encountered\n",
            [("nccl_error", 1, 1), ("cuda_error", 2, 4)],
            id="traceback-after-nccl-warn",
        ),
        pytest.param(
            "h:1:2 [5] NCCL WARN Net : Connection closed by remote peer h2<4242>\n"
            "Traceback (most recent call last):\n"
            '  File "t.py", line 3, in <module>\n'
            "RuntimeError: something else\n",
            [("nccl_error", 1, 1), ("traceback", 2, 3)],
            id="unclassified-traceback-is-its-own-event",
        ),
        pytest.param(
            "Traceback (most recent call last):\n"
            '  File "t.py", line 3, in <module>\n'
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3377, unhandled cuda error\n"
            "ncclUnhandledCudaError: Call to CUDA function failed.\n"
            "Last error:\n"
            "Cuda failure 'an illegal memory access was encountered'\n"
            "\n"
            "During handling of the above exception, another exception occurred:\n"
            "\n"
            "Traceback (most recent call last):\n"
            '  File "t.py", line 5, in <module>\n'
            "OSError: [Errno 28] No space left on device\n",
            [("nccl_error", 1, 9), ("storage", 10, 3)],
            id="chained-traceback-split-by-class",
        ),
        pytest.param(
            "[default2]:[rank2]: Traceback (most recent call last):\n"
            '[default2]:[rank2]:   File "t.py", line 3, in <module>\n'
            "[default2]:[rank2]:     loss.backward()\n"
            "[default2]:[rank2]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 4.00 GiB.\n"
            "W1203 08:11:00.001000 2200 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 4 "
            "closing signal SIGTERM\n",
            [("cuda_oom", 1, 4), ("rank_failure", 5, 1)],
            id="double-prefix-traceback",
        ),
        pytest.param(
            "-- Process 1 terminated with the following error:\n"
            "Traceback (most recent call last):\n"
            '  File "spawn.py", line 90, in _wrap\n'
            "OSError: [Errno 5] Input/output error\n",
            [("storage", 1, 4)],
            id="header-takes-the-class-of-its-traceback",
        ),
    ],
)
def test_an_event_never_swallows_a_line_of_another_class(text, want):
    assert _events(text) == want


def test_same_class_trailers_still_join_and_chunking_does_not_change_events():
    text = (
        "terminate called after throwing an instance of 'c10::DistBackendError'\n"
        f"  what():  {WATCHDOG}\n"
        "Exception raised from checkTimeout at ProcessGroupNCCL.cpp:632 (most recent call first):\n"
        "Fatal Python error: Aborted\n"
    )
    assert _events(text) == [("nccl_timeout", 1, 3), ("rank_failure", 4, 1)]
    data = "".join(r["line"] + "\n" for r in ROWS).encode()
    lf = LogFilter()
    whole = lf.stream()
    whole.feed(data, eof=True)
    parts = lf.stream()
    for i in range(0, len(data), 37):
        parts.feed(data[i : i + 37])
    parts.feed(b"", eof=True)
    key = [(e.klass, e.line_no, e.line_count, e.message) for e in whole.flush()]
    assert [(e.klass, e.line_no, e.line_count, e.message) for e in parts.flush()] == key


@pytest.mark.parametrize(
    ("line", "klass"),
    [
        # the agent losing its rendezvous is a rank failure, whatever store error it names
        (
            "[2025-01-09 17:20:31,000] torch.distributed.elastic.rendezvous.dynamic_rendezvous: [WARNING] The node "
            "'gpu-3_811_0' has failed to send a keep-alive heartbeat to the rendezvous 'job7' due to an error of type "
            "RendezvousConnectionError.",
            "rank_failure",
        ),
        (
            "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has "
            "failed. See inner exception for details.",
            "network",
        ),
        # a socket failure NCCL logged is NCCL's; the same words from c10d are the host network's
        ("gpu-3:811:902 [1] NCCL INFO Call to connect returned Connection refused, retrying", "nccl_error"),
        ("[W socket.cpp:601] [c10d] The client socket has failed to connect to [gpu-1]:29500 (errno: 111).", "network"),
        ("NVRM: This PCI I/O region assigned to your NVIDIA device is invalid:", "gpu_xid"),
        ("nvidia: probe of 0000:0b:00.0 failed with error -1", "gpu_xid"),
        ("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.54.15  Thu Feb 22 01:44:30 UTC 2024", None),
        ("gpu-3:811:811 [1] NCCL INFO NET/Plugin: Failed to find ncclCollNetPlugin_v8 symbol.", None),
    ],
)
def test_borderline_lines_take_the_documented_class(line, klass):
    r = LogFilter().classify_line(line)
    assert (r.klass if r else None) == klass
