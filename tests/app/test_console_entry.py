"""The console script's fast path for ``ranklens logs classify`` (ranklens._entry): the same
output, messages and exit codes as the click command, without importing click (issue 18)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ranklens._entry import fast_logs_classify_args

LOG = (
    "ok\n"
    "2024-05-08 08:00:01,123 [rank3]: RuntimeError: CUDA error: an illegal memory access was encountered\n"
    "\x1b[31mNCCL WARN NET/IB : Got completion from peer 10.0.0.2 with error 12\x1b[0m\n"
    "[rank1]: Traceback (most recent call last):\n"
    '[rank1]:   File "train.py", line 3, in <module>\n'
    "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    "ok\n" * 3
)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    log = tmp_path / "rank.log"
    log.write_text(LOG)
    rules = tmp_path / "rules.toml"
    rules.write_text('[[rules]]\nname = "ok_line"\nclass = "benign"\npattern = "^ok$"\nseverity = "info"\n')
    bad = tmp_path / "bad.toml"
    bad.write_text("[filter\n")
    return {"log": log, "rules": rules, "bad": bad, "dir": tmp_path}


def test_only_plain_command_lines_take_the_fast_path(files):
    log, rules = str(files["log"]), str(files["rules"])
    assert fast_logs_classify_args(["logs", "classify", log]) == ([log], None, False)
    assert fast_logs_classify_args(["logs", "classify", "--json", log, log]) == ([log, log], None, True)
    assert fast_logs_classify_args(["logs", "classify", "--rules", rules, log]) == ([log], rules, False)
    assert fast_logs_classify_args(["logs", "classify", f"--rules={rules}", log, "--json"]) == ([log], rules, True)
    for argv in (
        ["logs", "classify"],  # no file: click's usage error
        ["logs", "classify", "--help", log],
        ["logs", "classify", "-h"],
        ["logs", "classify", "--json", "--json", log],
        ["logs", "classify", "--rules", rules, "--rules", rules, log],
        ["logs", "classify", "--rules"],
        ["logs", "classify", "--", log],
        ["logs", "classify", "--verbose", log],
        ["logs", "classify", str(files["dir"] / "missing.log")],
        ["logs", "classify", str(files["dir"])],  # a directory
        ["logs", "classify", "--rules", str(files["dir"] / "missing.toml"), log],
        ["logs", log],
        ["analyze", "--json"],
        [],
    ):
        assert fast_logs_classify_args(argv) is None, argv


def _run(module: str, args: list[str]) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def _same_json(a: str, b: str) -> bool:
    def norm(text: str) -> list[dict]:
        rows = [json.loads(line) for line in text.splitlines()]
        for r in rows:  # a line without a time of its own takes the time it was read
            r.pop("ts_ns")
        return rows

    return norm(a) == norm(b)


@pytest.mark.parametrize(
    "case",
    ["text", "json", "rules", "bad_rules", "missing_file", "help"],
)
def test_the_fast_path_prints_what_the_click_command_prints(files, case):
    log = str(files["log"])
    args = {
        "text": ["logs", "classify", log],
        "json": ["logs", "classify", "--json", log],
        "rules": ["logs", "classify", "--rules", str(files["rules"]), log],
        "bad_rules": ["logs", "classify", "--rules", str(files["bad"]), log],
        "missing_file": ["logs", "classify", str(files["dir"] / "missing.log")],
        "help": ["logs", "classify", "--help"],
    }[case]
    fast = _run("ranklens._entry", args)
    slow = _run("ranklens.cli", args)
    assert fast[0] == slow[0] and fast[2] == slow[2], (fast, slow)
    if case == "json":
        assert _same_json(fast[1], slow[1]) and fast[1].count("\n") == 3
    else:
        assert fast[1] == slow[1]
    if case == "text":
        assert "\x1b" not in fast[1] and "nccl_error" in fast[1] and fast[2] == "(3 events kept)\n"
    if case == "bad_rules":
        assert fast[0] == 2 and fast[2].startswith("ranklens: error: ")


def test_the_fast_path_does_not_import_click(files):
    plain = files["dir"] / "plain.log"
    plain.write_text(LOG.replace("\x1b[31m", "").replace("\x1b[0m", ""))  # a styled line goes to click.echo
    # -X importtime names every module imported, also in a process that ends with os._exit
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "ranklens._entry", "logs", "classify", str(plain)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}
    assert "ranklens.collector.logfilter" in imported  # the probe works
    assert not {m for m in imported if m.split(".")[0] in ("click", "numpy", "pyarrow") or m == "ranklens.cli"}
    assert "cuda_error" in p.stdout and p.stderr.rstrip().endswith("(3 events kept)")


def test_a_reader_that_stops_early_gets_click_s_quiet_exit(files):
    """`ranklens logs classify big.log | head -1`: no traceback, exit 1, as the click command."""
    big = files["dir"] / "big.log"
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
    big.write_text(  # 20,000 distinct error lines (no repeats to collapse): more than a pipe holds
        "".join(
            f"[rank{i % 8}]: RuntimeError: CUDA error: an illegal memory access near "
            f"{' '.join(words[(i + k) % 10] for k in range(i % 7 + 1))} {words[i % 10]}{i // 10 % 10}\nok\n"
            for i in range(20_000)
        )
    )
    codes = []
    for module in ("ranklens._entry", "ranklens.cli"):
        p = subprocess.Popen(
            [sys.executable, "-m", module, "logs", "classify", "--json", str(big)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert p.stdout is not None and p.stdout.readline().startswith(b"{")
        p.stdout.close()  # the reader is gone
        _, err = p.communicate(timeout=120)
        codes.append(p.returncode)
        assert b"Traceback" not in err, (module, err.decode())
    assert codes == [1, 1]
