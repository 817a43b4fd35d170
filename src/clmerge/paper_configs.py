"""The papers' configs shipped inside the package (``clmerge/configs/paper/*.yaml``), found by name.

``clmerge run sd_lora_imagenet_r_10`` runs the shipped file of that name; an argument that names an existing
file runs that file. ``clmerge configs`` lists the names with the method, dataset and paper of each.
"""

from __future__ import annotations

import re
from difflib import get_close_matches
from pathlib import Path

import yaml

from .config import ConfigError, ConfigFileError

__all__ = ["PAPER_DIR", "available_configs", "describe_config", "resolve_config_arg"]

PAPER_DIR = Path(__file__).resolve().parent / "configs" / "paper"
_SUFFIXES = (".yaml", ".yml")
# the first comment line opens with "<Method> (<Authors> et al., <Venue Year>)"
_CITATION = re.compile(r"^#\s*(?P<cite>[^(]+\([^()]*et al\.[^()]*\))")


def available_configs() -> dict[str, Path]:
    """Shipped config names (file stems), sorted, with their files."""
    return {p.stem: p for p in sorted(PAPER_DIR.glob("*.yaml"))}


def resolve_config_arg(arg: str | Path) -> Path:
    """The file a ``clmerge run CONFIG`` argument means: an existing path as given, else a shipped name.

    A bare word (no folder, no ``.yaml``) that is not a shipped name is a usage error with the nearest name;
    a missing path is an input error, which names the shipped config when the path's stem is one."""
    p = Path(arg)
    if p.exists():
        return p
    names = available_configs()
    bare = len(p.parts) == 1 and p.suffix not in _SUFFIXES
    if bare and str(arg) in names:
        return names[str(arg)]
    if bare:
        near = get_close_matches(str(arg), list(names), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]!r}?" if near else "list them with `clmerge configs`"
        raise ConfigError(f"config {str(arg)!r}: no such file and no shipped config of that name ({hint})")
    also = f" (a shipped config has that name: `clmerge run {p.stem}`)" if p.stem in names else ""
    raise ConfigFileError(f"config file not found: {p}{also}")


def describe_config(path: Path) -> str:
    """One line: method, dataset, tasks, backbone, and the paper cited on the file's first comment line."""
    text = path.read_text()
    data = yaml.safe_load(text) or {}
    sc, method, model = data.get("scenario", {}), data.get("method", {}), data.get("model", {})
    first = text.splitlines()[0] if text else ""
    m = _CITATION.match(first)
    paper = m.group("cite").strip() if m else "(no paper named)"
    return (f"{method.get('name', '?')} on {sc.get('dataset', '?')}, {sc.get('n_tasks', '?')} tasks, "
            f"{model.get('name', '?')}: {paper}")
