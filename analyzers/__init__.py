"""Analyzers: cross-rank analysis in SQL, decisions by swappable detectors, findings out."""

from __future__ import annotations

from ranklens.analyzers.blame import BlameMatrix, compute_blame, latest_job
from ranklens.analyzers.detectors import Detection, PeerComputeDetector, PersistentBlameDetector, StragglerDetector
from ranklens.analyzers.findings import Finding, Severity, Suspect, latest_findings, save_findings
from ranklens.analyzers.straggler import find_stragglers

__all__ = [
    "BlameMatrix",
    "Detection",
    "Finding",
    "PeerComputeDetector",
    "PersistentBlameDetector",
    "Severity",
    "StragglerDetector",
    "Suspect",
    "compute_blame",
    "find_stragglers",
    "latest_findings",
    "latest_job",
    "save_findings",
]
