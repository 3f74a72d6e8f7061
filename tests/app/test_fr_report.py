"""ranklens.fr_report: the flight-recorder post-mortem without the CLI (the CLI only prints it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ranklens.cli import cli
from ranklens.errors import IngestError
from ranklens.fr_report import analyze_dumps

DESYNC = Path(__file__).parent.parent / "data" / "flight_recorder" / "desync" / "fr_pickle"


def _stored_findings(store) -> int:
    return store.query("SELECT count() FROM findings").rows()[0][0]


def test_the_report_is_what_the_cli_prints(tmp_path):
    report = analyze_dumps(str(DESYNC))
    assert [d.rank for d in report.dumps] == [0, 1, 2, 3] and report.world_size == 4
    [f] = report.findings
    assert f.kind == "desync" and [s.rank for s in f.suspects] == [2]
    text = report.to_text()
    assert "Pending collectives:" in text and "never entered 2" in text and "[CRITICAL] desync" in text
    r = CliRunner().invoke(cli, ["analyze", "--flight-recorder", str(DESYNC)], catch_exceptions=False)
    assert r.exit_code == 0 and r.stdout == text + "\n"
    r = CliRunner().invoke(cli, ["analyze", "--flight-recorder", str(DESYNC), "--json"], catch_exceptions=False)
    out, expected = json.loads(r.stdout), json.loads(json.dumps(report.to_json(), default=str))
    for a, b in zip(out["findings"], expected["findings"], strict=True):
        a.pop("updated_ns"), b.pop("updated_ns")  # stamped when the finding is made
    assert out == expected


def test_no_readable_dump_raises_before_the_store_is_opened(tmp_path):
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "fr_trace_rank_0").write_bytes(b"\x80\x04not a pickle")
    opened = []
    with pytest.raises(IngestError, match="fr_trace_rank_0"):
        analyze_dumps(str(tmp_path / "fr"), open_store=lambda: opened.append(1))
    assert opened == []


def test_findings_are_saved_only_from_complete_input(tmp_path, embedded_store):
    report = analyze_dumps(str(DESYNC), open_store=lambda: embedded_store, save=False)
    assert report.findings and _stored_findings(embedded_store) == 0
    fr = shutil.copytree(DESYNC, tmp_path / "fr")
    (fr / "fr_trace_rank_0").write_bytes((fr / "fr_trace_rank_0").read_bytes()[:1000])  # truncated
    report = analyze_dumps(str(fr), open_store=lambda: embedded_store)
    [u] = report.unreadable
    assert u.rank == 0 and report.findings and _stored_findings(embedded_store) == 0
    assert "unreadable dump of rank 0" in report.to_text()
    report = analyze_dumps(str(DESYNC), job_id="j", attempt=2, open_store=lambda: embedded_store)
    assert (report.job_id, report.attempt) == ("j", 2) and _stored_findings(embedded_store) == len(report.findings)
