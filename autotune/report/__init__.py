"""report: a study as one self-contained HTML page of plots (`autotune report`).

Owns what the page shows, read from the study (view.py: every trial's outcome and figures, the
headline), the memory model beside the measured peaks (estimates.py), the plots (figures.py:
memory and time with plotly, importances and slices through optuna.visualization) and the
page itself (page.py: captions, tables, plotly.js inlined once, written atomically). May import
config, errors, files, memory, probe.result and sweep (the study's reading of best and Pareto
front); never torch. plotly is the optional `report` extra, imported only inside functions, so
the rest of autotune runs without it.
"""

from __future__ import annotations

from autotune.report.page import REPORT_NAME, require_plotly, write_report

__all__ = ["REPORT_NAME", "require_plotly", "write_report"]
