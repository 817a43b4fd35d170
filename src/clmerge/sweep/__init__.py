"""Many jobs: the local executor (in process or a process pool) by default, Ray when a cluster is there;
sweeps of runs over a grid of config overrides (:mod:`.grid`, :mod:`.runner`) and the study runner.

Layer: above theory and harness (docs/architecture.md).
"""

from .executors import Executor, LocalExecutor, RayExecutor, make_executor
from .finish import finish_study
from .grid import Cell, SweepSpec, expand_cells, load_spec
from .runner import SweepError, plan_sweep, run_sweep
from .study import StudyError, read_results, run_study

__all__ = ["Executor", "LocalExecutor", "RayExecutor", "make_executor", "run_study", "read_results", "StudyError",
           "finish_study", "SweepSpec", "Cell", "load_spec", "expand_cells", "plan_sweep", "run_sweep",
           "SweepError"]
