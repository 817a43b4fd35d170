"""Continual-learning methods, one module or folder each (``halrp/``, ``prompts/``), registered by name with
``@register_method``.

Layer: above merging, models, params and adapters; never imports the engine (docs/architecture.md).
"""

from .base import (
    METHODS,
    ContinualMethod,
    MethodOptions,
    TaskContext,
    available_methods,
    build_method,
    method_class,
    method_options_model,
    register_method,
)
from . import finetune, gpm, halrp, regularized, seq_lora, stl  # noqa: E402,F401  (register the methods)
from . import inflora, pm, sd_lora  # noqa: E402,F401
from . import merge_baselines  # noqa: E402,F401
from . import magmax  # noqa: E402,F401
from . import prompts  # noqa: E402,F401  (L2P, DualPrompt, CODA-Prompt, HiDe-Prompt)
from . import frozen_backbone  # noqa: E402,F401  (SimpleCIL, RanPAC)
from . import aper, ease  # noqa: E402,F401  (APER, EASE: adapters on a frozen backbone)
from . import rehearsal  # noqa: E402,F401  (ER, DER, DER++)
from . import icarl, lwf, rehearsal_plus  # noqa: E402,F401  (iCaRL; LwF; ER-ACE, X-DER)
from . import slca  # noqa: E402,F401
from . import mos  # noqa: E402,F401  (MOS: merged per-task adapters, self-refined retrieval)
from . import fecam, olora  # noqa: E402,F401  (FeCAM: Mahalanobis head; O-LoRA: orthogonal per-task LoRA)
from . import lae  # noqa: E402,F401  (LAE: online PET + EMA offline PET, ensembled)

__all__ = [
    "METHODS",
    "ContinualMethod",
    "MethodOptions",
    "TaskContext",
    "available_methods",
    "build_method",
    "method_class",
    "method_options_model",
    "register_method",
]
from . import cl_lora  # noqa: E402,F401  (CL-LoRA: shared LoRA kept by distillation, task-specific LoRAs)
