"""tests/conftest.py lists a test that runs over the slow limit without a slow/e2e mark (issue 13)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_an_unmarked_slow_test_is_reported_not_failed(tmp_path: Path) -> None:
    (tmp_path / "test_x.py").write_text(
        "import time\n"
        "import pytest\n"
        "def test_quick():\n    pass\n"
        "def test_unmarked():\n    time.sleep(0.6)\n"
        "@pytest.mark.slow\ndef test_marked_slow():\n    time.sleep(0.6)\n"
        "@pytest.mark.e2e\ndef test_marked_e2e():\n    time.sleep(0.6)\n"
    )
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    slow: slow\n    e2e: e2e\n    server: server\nslow_test_s = 0.4\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # a warning, never a failure
    warned = [ln for ln in proc.stdout.splitlines() if ln.startswith("WARNING unmarked slow test:")]
    assert len(warned) == 1, proc.stdout
    assert "test_x.py::test_unmarked took" in warned[0]
    assert "1 test(s) over 0.4 s without a slow or e2e mark" in proc.stdout
