"""Self-contained HTML reports of runs and sweeps, with matplotlib plots embedded as PNG ``data:`` URIs."""

from __future__ import annotations

from clmerge.report.html import build_report, build_sweep_report

__all__ = ["build_report", "build_sweep_report"]
