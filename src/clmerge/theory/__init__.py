"""The generalization framework of model merging (Li, Tang et al., arXiv:2601.21690): study specs, the
bound's measured terms, laws.

* :mod:`.spec`: the study spec and its grid points; :mod:`.jobs`: expert fine-tuning and merge jobs;
* :mod:`.quantities`: sigma_i^2, zeta_i^2, task-vector heterogeneity, L2 stability, implicit weights;
* :mod:`.laws`: the one-variable forms of the bound of Theorem 3 (equal experts), fitted with bootstrap intervals; ``predict``;
* :mod:`.advise`: plain-words advice from a study's fits; :mod:`.report`: the study's HTML page.

Running a study (many jobs, local or Ray) is :func:`clmerge.sweep.run_study`.

Layer: above harness and engine (docs/architecture.md).
"""

from .advise import advise
from .analysis import fit_study, predict
from .laws import FORMS, fit_form
from .spec import StudySpec, expand_points, load_study, parse_study

__all__ = ["StudySpec", "expand_points", "load_study", "parse_study", "FORMS", "fit_form", "fit_study", "predict",
           "advise"]
