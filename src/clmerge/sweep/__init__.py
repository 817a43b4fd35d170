"""Many jobs: the local executor (in process or a process pool) by default, Ray when a cluster is there.

Layer: above theory and harness (docs/architecture.md).
"""

from .executors import Executor, LocalExecutor, RayExecutor, make_executor
from .finish import finish_study
from .study import StudyError, read_results, run_study

__all__ = ["Executor", "LocalExecutor", "RayExecutor", "make_executor", "run_study", "read_results", "StudyError",
           "finish_study"]
