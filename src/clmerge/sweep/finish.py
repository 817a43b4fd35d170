"""The step after a study's jobs: fit the laws, write ``fits.json``, ``advice.txt`` and ``report.html``.

Run at the end of ``clmerge study``, alone by ``clmerge study --fit-only``, and by ``clmerge advise`` on a
study directory without ``fits.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .study import read_results

__all__ = ["finish_study"]


def finish_study(out: Path, rows: list[dict] | None = None, *, n_boot: int = 200) -> dict[str, Any]:
    """Fit the laws of the study in ``out`` and write ``fits.json``, ``advice.txt`` and ``report.html``."""
    from ..config import ConfigError, ConfigFileError
    from ..theory.advise import advise
    from ..theory.analysis import fit_study
    from ..theory.report import build_study_report
    from ..theory.spec import parse_study
    from ..utils.inpaths import InputMissing
    from ..utils.io import atomic_write_text, write_json
    from ..utils.outpaths import child
    from ..utils.yaml_io import read_yaml

    out = Path(out)
    saved = out / "study.yaml"
    try:
        data = read_yaml(saved, within=out) or {}  # the study directory's own copy: read inside it
    except InputMissing:
        raise ConfigFileError(f"study spec not found: {saved}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{saved}: expected a mapping of study keys, got {type(data).__name__}")
    spec = parse_study(data)
    rows = read_results(out) if rows is None else rows
    fits = fit_study(rows, spec, n_boot=n_boot)
    write_json(child(out, "fits.json"), fits)
    text = advise(rows, fits)
    atomic_write_text(child(out, "advice.txt"), text + "\n")
    build_study_report(out, rows, fits, text)
    return fits
