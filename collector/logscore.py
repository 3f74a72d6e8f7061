"""Score the log filter on labelled lines: per-class precision and recall, per-line accuracy.

A labelled file is JSON Lines in the format of ``shared/data/logs/real_log_lines.jsonl``:
``{"line": ..., "label": ..., "source": ..., "multiline_group": null | "<id>"}``, ``label`` one of
the rule classes or ``noise`` (a line the filter must not keep). The lines are fed to one
:class:`~ranklens.collector.logfilter.StreamFilter` in file order, as a tailer would read them, and
every line gets the class of the event that covers it (``noise`` when none does).

Two views:

- **examples**: a standalone line, or a run of consecutive lines of one multi-line block that share
  a label (a traceback counts once). An example is *found* for its label when any of its lines got
  that class; a predicted class on an example of another label is a false positive.
- **lines**: every line on its own; ``accuracy`` is the share of lines whose class is their label.

Used by ``tests/collector/test_logfilter.py``, ``tests/collector/test_logrules_heldout.py`` and
``bench/logrules_score.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ranklens.collector.logfilter import LogFilter

__all__ = ["ClassScore", "Score", "load_labelled", "predict_lines", "score_rows"]

NOISE = "noise"


def load_labelled(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a labelled JSON Lines file."""
    rows = []
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not raw.strip():
            continue
        r = json.loads(raw)
        if not isinstance(r.get("line"), str) or not isinstance(r.get("label"), str):
            raise ValueError(f"{path}:{n}: a row needs string 'line' and 'label'")
        rows.append(r)
    return rows


def predict_lines(lines: Sequence[str], lf: LogFilter | None = None) -> list[str]:
    """The class the filter gives each line when they are read as one stream (``noise``: none)."""
    lf = lf or LogFilter()
    sf = lf.stream()
    events = []
    for line in lines:  # flushed line by line: a repeat is scored where it occurs, not collapsed
        sf.feed((line + "\n").encode(), now_ns=1)
        events += sf.flush()
    sf.feed(b"", now_ns=1, eof=True)
    pred = [NOISE] * len(lines)
    for ev in events + sf.flush():
        for i in range(ev.line_no - 1, min(ev.line_no - 1 + ev.line_count, len(lines))):
            pred[i] = ev.klass
    return pred


@dataclass
class ClassScore:
    """Counts for one class: ``support``/``found`` over labels, ``predicted``/``correct`` over predictions."""

    support: int = 0
    found: int = 0
    predicted: int = 0
    correct: int = 0

    @property
    def recall(self) -> float:
        return self.found / self.support if self.support else float("nan")

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else float("nan")


@dataclass
class Score:
    """The scores of one labelled set."""

    lines: int = 0
    correct_lines: int = 0
    examples: int = 0
    noise_examples: int = 0
    noise_flagged: int = 0  # benign examples that produced an event
    by_example: dict[str, ClassScore] = field(default_factory=dict)
    by_line: dict[str, ClassScore] = field(default_factory=dict)
    errors: list[tuple[int, str, str, str]] = field(default_factory=list)  # (row, label, predicted, line)

    @property
    def accuracy(self) -> float:
        return self.correct_lines / self.lines if self.lines else float("nan")

    def recall(self) -> float:
        """Example recall over all failure classes together."""
        s = sum(c.support for c in self.by_example.values())
        return sum(c.found for c in self.by_example.values()) / s if s else float("nan")

    def format(self, title: str) -> str:
        out = [
            f"{title}: {self.lines} lines, {self.examples} examples; per-line accuracy {self.accuracy:.3f}; "
            f"example recall {self.recall():.3f}; benign examples flagged {self.noise_flagged}/{self.noise_examples}",
            f"  {'class':<13} {'ex':>4} {'recall':>7} {'prec':>6}   {'lines':>5} {'recall':>7} {'prec':>6}",
        ]
        for k in sorted(set(self.by_example) | set(self.by_line)):
            e, li = self.by_example.get(k, ClassScore()), self.by_line.get(k, ClassScore())
            out.append(
                f"  {k:<13} {e.support:4d} {e.recall:7.3f} {e.precision:6.3f}   {li.support:5d} {li.recall:7.3f} "
                f"{li.precision:6.3f}"
            )
        return "\n".join(out)


def _examples(rows: Sequence[dict[str, Any]]) -> list[tuple[str, list[int]]]:
    out: list[tuple[str, list[int]]] = []
    for i, r in enumerate(rows):
        g = r.get("multiline_group")
        prev = rows[i - 1] if i else None
        if g and prev is not None and prev.get("multiline_group") == g and prev["label"] == r["label"]:
            out[-1][1].append(i)
        else:
            out.append((r["label"], [i]))
    return out


def score_rows(rows: Sequence[dict[str, Any]], lf: LogFilter | None = None) -> Score:
    """Run the filter over ``rows`` (one stream) and score it."""
    pred = predict_lines([r["line"] for r in rows], lf)
    sc = Score(lines=len(rows))
    for i, (r, p) in enumerate(zip(rows, pred, strict=True)):
        lab = r["label"]
        if p == lab:
            sc.correct_lines += 1
        else:
            sc.errors.append((i, lab, p, r["line"]))
        if lab != NOISE:
            c = sc.by_line.setdefault(lab, ClassScore())
            c.support += 1
            c.found += p == lab
        if p != NOISE:
            c = sc.by_line.setdefault(p, ClassScore())
            c.predicted += 1
            c.correct += p == lab
    exs = _examples(rows)
    sc.examples = len(exs)
    for lab, idx in exs:
        got = {pred[i] for i in idx} - {NOISE}
        if lab == NOISE:
            sc.noise_examples += 1
            sc.noise_flagged += bool(got)
        else:
            c = sc.by_example.setdefault(lab, ClassScore())
            c.support += 1
            c.found += lab in got
        for p in got:
            c = sc.by_example.setdefault(p, ClassScore())
            c.predicted += 1
            c.correct += p == lab
    return sc
