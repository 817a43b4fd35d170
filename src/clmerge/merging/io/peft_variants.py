"""Which PEFT LoRA variants clmerge merges, and DoRA's update (the rest of the format: :mod:`.peft`).

Refused, by the config field that selects them: variants whose merged weight is not ``s B A`` (or DoRA's),
initialisations that change the base weights (the adapter then belongs to a residual base), and the parts
clmerge does not read (trainable tokens, LoRA on parameters, replicated layers).
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from .base import MergeInputError

__all__ = ["check_supported", "dora_delta"]

# peft config fields whose adapters are refused, with why (a field is refused when it is set and not false)
_REFUSED_FIELDS = {
    "use_qalora": "QA-LoRA pools the inputs, so its update is not s*B*A",
    "target_parameters": "clmerge does not read LoRA on parameters (MoE experts)",
    "layer_replication": "it changes the layers of the base model",
    "trainable_token_indices": "clmerge does not read trainable tokens",
    **{f: "a LoRA variant whose update is not s*B*A" for f in (
        "alora_invocation_tokens", "velora_config", "monteclora_config", "use_bdlora", "arrow_config",
        "kasa_config")},
}
# initialisations that change the base weights (the adapter belongs to a residual base, not to the base given)
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def check_supported(cfg: dict, where: Path) -> None:
    """Refuse, in one line naming the field and why, an adapter config that clmerge cannot merge exactly."""
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise MergeInputError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported (only LORA)")
    for field, why in _REFUSED_FIELDS.items():
        if cfg.get(field) not in (None, False, [], {}):
            raise MergeInputError(f"{where}: {field}={cfg.get(field)!r} is not supported for LoRA merging: {why}")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise MergeInputError(f"{where}: init_lora_weights={init!r} changes the base weights, so the adapter "
                              "is not an update of the base model; save it converted (peft's save_pretrained("
                              "path_initial_model_for_weight_conversion=...)) and merge that")


def dora_delta(w: Tensor, d: Tensor, magnitude: Tensor, transpose: bool) -> Tensor:
    """DoRA's ``W' - W`` with ``W' = m / ||W + d||_c * (W + d)`` (Liu et al. 2024, Eq. 5), the norm taken per
    output channel as peft's ``get_weight_norm`` does: over every dimension but the first, or over the first
    for weights stored ``(in, out)`` (``fan_in_fan_out``, embeddings: peft's ``DoraEmbeddingLayer`` norms each
    embedding dimension over the vocabulary)."""
    v = w + d
    if transpose:
        norm, m = v.norm(dim=0, keepdim=True), magnitude.reshape(1, -1)
    else:
        norm = v.flatten(1).norm(dim=1).reshape(-1, *[1] * (v.dim() - 1))
        m = magnitude.reshape(-1, *[1] * (v.dim() - 1))
    return v.mul_(m / norm).sub_(w)
