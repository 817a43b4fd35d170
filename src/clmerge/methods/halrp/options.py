"""Options of ``halrp`` (HALRP, Li et al., TKDE 2024; hyperparameters of App. F.3, Table 8).

Defaults follow the paper; where the paper is wrong or silent the official code (lijiaqi/HALRP) settles it
and the option says so. Each paper-vs-code difference is a named switch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..base import MethodOptions

__all__ = ["HALRPOptions"]


class HALRPOptions(MethodOptions):
    alpha: float = Field(0.9, gt=0, le=1, description="loss approximation rate of the global rank cut (Eq. 11)")
    warmup_epochs: int = Field(1, ge=1, description="n_r: free warm-up epochs of a network copy (Alg. 1 step 3)")
    first_task_extra_epochs: bool = Field(
        True, description="train task 0 for warmup_epochs more epochs, so every task trains n = n_r + train.epochs")
    lambda_l1: float = Field(1e-4, ge=0, description="lambda0: L1 on U', V' (Eq. 12)")
    lambda_l2: float = Field(1e-4, ge=0, description="lambda1: squared L2 on r, s, U', V' (Eq. 12)")
    l2_half: bool = Field(False, description="multiply the L2 term by 1/2 (code); paper (Eq. 12): no 1/2")
    base_l2: bool = Field(False, description="lambda1/2 ||W||^2 on the base weights at task 0 (code); paper: none")
    upper_rank: int = Field(100, ge=1, description="per-layer rank cap (code: 100; 120 for Five-dataset ResNet18)")
    importance: Literal["mean", "sum", "none"] = Field(
        "mean", description="mean = per-entry mean of squared mini-batch gradients (code, the default: the "
        "paper's full gradient vanishes at an optimum); sum = the paper's ||g_l||^2 of mini-batch gradients; "
        "none = sigma^2 only (Table 6 'LRP', reading 2)")
    importance_split: Literal["val", "train"] = Field(
        "val", description="data for the importance: the task's validation split (code; falls back to train if none)")
    importance_batches: int | None = Field(None, ge=1, description="cap on batches for the importance (None: all)")
    column_scale: Literal["paper", "code"] = Field(
        "paper", description="column scalings s: paper = Eq. 20; code = the official code's broadcasting quirk, "
        "s_i = (sum r / sum r^2) * sum_j w^free w^base / sum_j (w^base)^2 (docs/halrp.md)")
    conv_scale: bool = Field(True, description="multiply conv scores by d_h*d_w (code); paper: not stated")
    sigma_source: Literal["residual", "weight"] = Field(
        "residual", description="singular values of B^free (correct) or of W^free (Eq. 9 as printed)")
    rank_method: Literal["global", "flat"] = Field(
        "global", description="global = Hessian-aware cut; flat = upper_rank in every layer "
        "(Table 6 'LRP', reading 1)")
    factor_init: Literal["svd", "random"] = Field(
        "svd", description="svd (Eq. 6) or random U', V' of the same Frobenius norms (Table 6 'Random LRP')")
    warmup_from: Literal["base", "scratch"] = Field(
        "base", description="warm-up starts from the base hidden layers (code) or a fresh random init")
    grad_multiplier: float = Field(1.0, gt=0, description="scale gradients before each step (code: 10)")
    prune: bool = Field(True, description="prune U', V' entries when growth exceeds the budget (Sec. 4.4)")
    prune_q: float = Field(0.4, gt=0, lt=1, description="budget 1 - q of growth (code: 0.8 CIFAR100, else 0.4)")
    prune_abs: float = Field(1e-5, ge=0, description="absolute threshold of the mixed rule")
    prune_budget: Literal["code", "nonzero_count", "total"] = Field(
        "code", description="what the budget 1 - q governs. code (the official l1_pruning): growth counted "
        "densely (every U'/V' entry, zeros included; r, s, BN affine, heads; no BN running stats, no per-task "
        "biases), rate = 1 - (1-q)/growth of the U'/V' entries with the percentile over all entries, which bounds "
        "the U'V' part by 1 - q while the total (r, s, BN, heads are never pruned) may exceed it; nonzero_count: "
        "the same rate from the non-zero (sparse) count with BN running stats, this library's rule before the "
        "audit fix, which under-prunes from the second pruning on (kept to reproduce old tables); total: choose "
        "the rate over the non-zero entries so that the total growth is at most 1 - q (all U'/V' are zeroed if "
        "r, s, BN and heads alone exceed it)")
    prune_scope: Literal["per_task", "global"] = Field(
        "per_task", description="per_task = the code's percentile per task, re-applied to all past tasks; "
        "global = one percentile over all layers of all tasks (paper, Sec. 4.4)")
