"""Parameter-space tools: Fisher information and per-sample gradients.

Layer: above adapters (docs/architecture.md).
"""

from .fisher import diagonal_fisher, per_sample_grads, per_sample_loop_fisher

__all__ = ["diagonal_fisher", "per_sample_grads", "per_sample_loop_fisher"]
