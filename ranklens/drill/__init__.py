"""Fault drills on real jobs: inject faults into a running training job, score detection.

:func:`ranklens.drill.runner.run_drill` runs one command with faults (:mod:`~ranklens.drill.faults`)
injected through ranklens' bootstrap (:mod:`~ranklens.drill.inject`, no change to the script),
watches the findings live and scores them (:mod:`~ranklens.drill.score`); suites are
:mod:`~ranklens.drill.suites`. This package's own import is light (the ranks import
``ranklens.drill.inject``): the runner is imported from its module.
"""

from ranklens.drill.faults import KINDS, DrillFault, DrillKind, parse_drill_fault

__all__ = ["KINDS", "DrillFault", "DrillKind", "parse_drill_fault"]
