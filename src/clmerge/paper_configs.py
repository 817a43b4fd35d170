"""The papers' configs shipped inside the package (``clmerge/configs/paper/*.yaml``), found by name.

Finding a config by name is the config layer's (:func:`clmerge.config.resolve_config_arg`, re-exported here);
this module describes the shipped files for ``clmerge configs``.

``clmerge run sd_lora_imagenet_r_10`` runs the shipped file of that name, even when the current folder holds a
file of that name (``clmerge run ./sd_lora_imagenet_r_10`` runs that one); an argument with a ``/`` or a
``.yaml`` / ``.yml`` suffix is a path (the rule: :func:`clmerge.config.resolve_config_arg`). ``clmerge configs`` lists the names with the method, dataset and paper of each.
"""

from __future__ import annotations

import re
from pathlib import Path

from .config import PAPER_DIR, available_configs, resolve_config_arg
from .utils.inpaths import read_text as read_input_text
from .utils.yaml_io import load_yaml

__all__ = ["PAPER_DIR", "available_configs", "describe_config", "resolve_config_arg"]

# the first comment line opens with "<Method> (<Authors> et al., <Venue Year>)"
_CITATION = re.compile(r"^#\s*(?P<cite>[^(]+\([^()]*et al\.[^()]*\))")


def describe_config(path: Path) -> str:
    """One line: method, dataset, tasks, backbone, and the paper cited on the file's first comment line."""
    text = read_input_text(path, kind="yaml")
    data = load_yaml(text, source=str(path)) or {}
    sc, method, model = data.get("scenario", {}), data.get("method", {}), data.get("model", {})
    first = text.splitlines()[0] if text else ""
    m = _CITATION.match(first)
    paper = m.group("cite").strip() if m else "(no paper named)"
    return (f"{method.get('name', '?')} on {sc.get('dataset', '?')}, {sc.get('n_tasks', '?')} tasks, "
            f"{model.get('name', '?')}: {paper}")
