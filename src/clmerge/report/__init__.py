"""Self-contained HTML reports of runs and sweeps, with matplotlib plots embedded as PNG ``data:`` URIs.

Layer: above data; reads run directories, never the engine that wrote them (docs/architecture.md).
"""

from __future__ import annotations

from clmerge.report.html import build_report, build_sweep_report
from clmerge.report.sweep_page import build_sweep_page

__all__ = ["build_report", "build_sweep_page", "build_sweep_report"]
