"""L2P, DualPrompt and CODA-Prompt on a frozen backbone; prompts enter through :mod:`clmerge.adapters.prompt`.

Each method keeps its learnable prompts, keys (and CODA's attention vectors) in a pool module attached to the
model as ``model.prompts`` (so they are in the model's state dict, move with ``.to()`` and are restored by
``--resume`` with the model). The backbone is frozen; the pool and the head train. Before every backbone pass the
mechanism computes the query q(x) = frozen [CLS] feature without prompts and the pool turns it into prompt tokens
(L2P) or key/value prefixes (DualPrompt, CODA-Prompt).

Sources: L2P (Wang et al., CVPR 2022; google-research/l2p, JH-LEE-KR/l2p-pytorch), DualPrompt (Wang et al.,
ECCV 2022; JH-LEE-KR/dualprompt-pytorch), CODA-Prompt (Smith et al., CVPR 2023; GT-RIPL/CODA-Prompt). Every
place where the paper and the code differ is an option (docs/prompts.md lists them).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ...adapters.prompt import attach_prompts
from ...models.losses import classification_loss
from ..base import ContinualMethod, MethodOptions, grid_rate, register_method
from .pools import CodaPool, DualPromptPool, L2PPool

__all__ = ["PromptMethod", "PromptMethodOptions", "L2P", "DualPrompt", "CodaPrompt", "L2POptions", "DualPromptOptions",
           "CodaPromptOptions"]


class PromptMethodOptions(MethodOptions):
    record_task_id: bool = Field(True, description="at each task end, match the queries of every seen task's "
                                 "test data and record the selection histogram and the task-id accuracy")


class PromptMethod(ContinualMethod):
    """Shared hooks: frozen backbone, a pool on ``model.prompts``, the mechanism, the loss, the records."""

    feature = "cls"

    def build_pool(self, dim: int, generator: torch.Generator):
        raise NotImplementedError

    def setup(self, model) -> None:
        super().setup(model)
        model.backbone.requires_grad_(False)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + 4099)
        pool = self.build_pool(model.backbone.feature_dim, gen)
        depth = model.backbone.inner.config.num_hidden_layers
        for key, layers in pool.layer_options.items():
            if bad := [i for i in layers if not 0 <= i < depth]:
                raise ValueError(f"method.{key}: layer(s) {bad} do not exist (the backbone has {depth} layers)")
        model.add_module("prompts", pool)
        self.mechanism = attach_prompts(model.backbone, prefix_layers=pool.prefix_layers, feature=self.feature)
        self.mechanism.selector = pool.select
        self._queries: dict[int, torch.Tensor] = {}

    @property
    def pool(self):
        return self.model.prompts

    def begin_task(self, task, ctx) -> None:
        super().begin_task(task, ctx)
        self.pool.start_task(task.index, ctx.n_tasks or task.index + 1, ctx.generator)

    def loss(self, model, x, y, ctx) -> torch.Tensor:
        logits = model(x)  # the pre-hook selects the prompts from the query; the pool keeps its matching terms
        return classification_loss(logits, y, ctx.task, ctx.head_loss) + self.pool.aux_loss()

    def after_step(self, model, ctx) -> None:
        self.pool.after_step()

    def end_task(self, task, ctx) -> None:
        entry = {"task": task.index, "train_counts": self.pool.train_counts()}
        if self.options.record_task_id:
            entry.update(self._task_id_record(ctx))
        self.record("prompt_selection", entry)
        ctx.log({"event": "prompt_selection", **entry})

    # -- the query mechanism on test data --------------------------------------------------------------
    def _task_queries(self, task, ctx) -> torch.Tensor:
        """Queries of ``task``'s test data; cached (the backbone is frozen, so they never change)."""
        if task.index not in self._queries:
            qs = [self.mechanism.query(x.to(ctx.device)).float().cpu() for x, _ in task.test.batches(ctx.eval_batch_size)]
            self._queries[task.index] = torch.cat(qs)
        return self._queries[task.index]

    @torch.no_grad()
    def _task_id_record(self, ctx) -> dict:
        counts, accs = [], []
        history = self._metrics.get("prompt_selection", [])
        train_counts = [e["train_counts"] for e in history] + [self.pool.train_counts()]
        for seen in ctx.seen_tasks:
            q = self._task_queries(seen, ctx).to(next(self.pool.parameters()).device)
            counts.append([round(float(c), 4) for c in self.pool.usage(q).sum(0)])
            hits = self.pool.task_hits(q, seen.index, train_counts[seen.index])
            accs.append(round(100.0 * float(hits.float().mean()), 3))
        return {"test_counts": counts, "task_id_acc": accs, "task_id_acc_mean": round(sum(accs) / len(accs), 3)}


# ------------------------------------------------------------------------------------------------------------
class L2POptions(PromptMethodOptions):
    pool_size: int = Field(10, ge=1, description="M, prompts in the pool (paper and code: 10)")
    length: int = Field(5, ge=1, description="L_p, tokens per prompt (paper and code: 5)")
    top_n: int = Field(5, ge=1, description="N, prompts selected per input (paper and code: 5)")
    pull_weight: float = Field(0.1, ge=0, description="lambda of the surrogate loss pulling the selected keys to "
                               "the query (Eq. 5; code pull_constraint_coeff 0.1)")
    feature: Literal["prompt_mean", "cls"] = Field("prompt_mean", description="classifier input: mean of the "
                                                   "prompt tokens' outputs (paper and code head_type='prompt') "
                                                   "or the [CLS] output")
    batchwise_selection: bool = Field(False, description="replace each sample's top-N by the N prompts chosen most "
                                      "often in the batch. Paper: per-sample (False); code: batchwise_prompt=True "
                                      "(at test too, so a test sample's prompts depend on its batch)")
    task_prompt_mask: bool = Field(False, description="training on task t uses prompts [tN, (t+1)N) instead of the "
                                   "matched ones (code option use_prompt_mask, default off in paper and code)")
    init: Literal["uniform", "zero"] = Field("uniform", description="prompt and key init: U(0, 1) (code "
                                             "'uniform') or zeros")


@register_method
class L2P(PromptMethod):
    name = "l2p"
    description = "L2P: a pool of prompts with learnable keys, top-N matched to the frozen [CLS] query, prompt-tuning"
    Options = L2POptions
    optim_defaults, optim_source = grid_rate(1e-3)

    @property
    def feature(self) -> str:  # type: ignore[override]
        return self.options.feature

    def build_pool(self, dim, generator) -> L2PPool:
        o = self.options
        if o.top_n > o.pool_size:
            raise ValueError(f"method.top_n: {o.top_n} > pool_size {o.pool_size}")
        return L2PPool(dim, o.pool_size, o.length, o.top_n, pull_weight=o.pull_weight,
                       batchwise=o.batchwise_selection, task_mask=o.task_prompt_mask, init=o.init, generator=generator)


class DualPromptOptions(PromptMethodOptions):
    g_layers: list[int] = Field(default_factory=lambda: [0, 1], description="G-prompt layers (paper and code: 0-1)")
    g_length: int = Field(5, ge=1, description="G-prompt length L_g (paper and code: 5)")
    e_layers: list[int] = Field(default_factory=lambda: [2, 3, 4], description="E-prompt layers (paper and code: 2-4)")
    e_length: int = Field(5, ge=1, description="E-prompt length L_e (code default 5)")
    e_pool_size: int = Field(10, ge=1, description="number of E-prompts and keys; must be >= the number of tasks "
                             "(code: size 10 for 10 tasks)")
    prefix_split: Literal["each", "halves"] = Field(
        "each", description="Pre-T: 'each' = a key prefix and a value prefix of L tokens each (dualprompt-pytorch, "
        "shape (2, L, D)); 'halves' = one L-token prompt split into L/2 key and L/2 value tokens (paper text, CODA "
        "repo's reimplementation; needs even lengths)")
    pull_weight: float = Field(1.0, ge=0, description="lambda of the matching loss pulling the task's key to the "
                               "query (Eq. 5; code pull_constraint_coeff 1.0)")
    train_true_task: bool = Field(True, description="training uses the true task's E-prompt and key (paper; code "
                                  "use_prompt_mask=True); False: the matched one, as at test")
    batchwise_selection: bool = Field(False, description="test-time E-prompt = the one matched most often in the "
                                      "batch. Paper: per-sample (False); code: batchwise_prompt=True")


@register_method
class DualPrompt(PromptMethod):
    name = "dualprompt"
    description = "DualPrompt: shared G-prompt (layers 0-1) and task E-prompts (layers 2-4) by key match, prefix-tuning"
    Options = DualPromptOptions
    optim_defaults, optim_source = grid_rate(1e-2)

    def build_pool(self, dim, generator) -> DualPromptPool:
        o = self.options
        if o.prefix_split == "halves" and (o.g_length % 2 or o.e_length % 2):
            raise ValueError(f"method.prefix_split: 'halves' needs even g_length and e_length, got {o.g_length}, "
                             f"{o.e_length}")
        return DualPromptPool(dim, g_layers=o.g_layers, g_length=o.g_length, e_layers=o.e_layers,
                              e_length=o.e_length, pool_size=o.e_pool_size, split=o.prefix_split,
                              pull_weight=o.pull_weight, train_true_task=o.train_true_task,
                              batchwise=o.batchwise_selection, generator=generator)


class CodaPromptOptions(PromptMethodOptions):
    pool_size: int = Field(100, ge=1, description="M, prompt components over all tasks, M / n_tasks added per task "
                           "(paper and code: 100)")
    length: int = Field(8, ge=2, description="L_p, prompt length, split into L_p/2 key and L_p/2 value tokens "
                        "(paper and code: 8)")
    layers: list[int] = Field(default_factory=lambda: [0, 1, 2, 3, 4], description="prefix layers (code: 0-4)")
    ortho_mu: float = Field(0.0, ge=0, description="weight of the orthogonality penalty ||K K^T - I||^2 on keys, "
                            "attention vectors and components (code: ortho_mu, 0.0 in its ImageNet-R configs; the "
                            "code scales the mean squared penalty by 1e-6, kept here)")
    init: Literal["gram_schmidt", "orthogonal"] = Field(
        "gram_schmidt", description="gram_schmidt: each task's new components, keys and attention vectors start "
        "orthonormal to the earlier ones (current official code); orthogonal: the whole pool orthogonal once at the "
        "start (paper / first code release)")


@register_method
class CodaPrompt(PromptMethod):
    name = "coda_prompt"
    description = "CODA-Prompt: prompts as query-attention-weighted sums of components, earlier components frozen"
    Options = CodaPromptOptions
    optim_defaults, optim_source = grid_rate(3e-3)

    def build_pool(self, dim, generator) -> CodaPool:
        o = self.options
        if o.length % 2:
            raise ValueError(f"method.length: CODA-Prompt splits the prompt into key/value halves; got odd {o.length}")
        if o.pool_size > dim:
            raise ValueError(f"method.pool_size: {o.pool_size} components cannot be orthogonal in the backbone's "
                             f"{dim} dimensions")
        return CodaPool(dim, pool_size=o.pool_size, length=o.length, layers=o.layers, ortho_mu=o.ortho_mu,
                        init=o.init, generator=generator)

