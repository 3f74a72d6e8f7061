"""Analyzers: cross-rank analysis in SQL, decisions by swappable detectors, findings out."""

from __future__ import annotations

from ranklens._guard import require_installed_name
from ranklens.analyzers.blame import BlameMatrix, compute_blame, latest_job
from ranklens.analyzers.correlate import correlate_findings
from ranklens.analyzers.detectors import (
    Detection,
    PeerComputeDetector,
    PeerDetector,
    PersistentBlameDetector,
    StragglerDetector,
)
from ranklens.analyzers.findings import Finding, Severity, Suspect, latest_findings, save_findings
from ranklens.analyzers.links import find_slow_links
from ranklens.analyzers.straggler import find_stragglers
from ranklens.analyzers.tomography import GroupTestingDetector

require_installed_name(__name__, "ranklens.analyzers")  # not `import analyzers` from the repository root

__all__ = [
    "BlameMatrix",
    "Detection",
    "Finding",
    "GroupTestingDetector",
    "PeerComputeDetector",
    "PeerDetector",
    "PersistentBlameDetector",
    "Severity",
    "StragglerDetector",
    "Suspect",
    "compute_blame",
    "correlate_findings",
    "find_slow_links",
    "find_stragglers",
    "latest_findings",
    "latest_job",
    "save_findings",
]
