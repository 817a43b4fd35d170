"""Parameter-space tools: Fisher information, task vectors and algebra, safetensors I/O."""

from .fisher import diagonal_fisher, per_sample_grads, per_sample_loop_fisher

__all__ = ["diagonal_fisher", "per_sample_grads", "per_sample_loop_fisher"]
