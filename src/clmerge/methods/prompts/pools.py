"""The prompt pools of L2P, DualPrompt and CODA-Prompt: learnable prompts and keys, and the query -> prompt rule.

A pool is an ``nn.Module`` (``model.prompts``); ``select(q)`` maps the frozen [CLS] query (B, D) to a
:class:`~clmerge.adapters.prompt.PromptInput` and keeps the matching loss of that pass for ``aux_loss()``.
``usage(q)`` / ``task_hits(q, j, counts)`` are what the methods record about the query mechanism on test data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...adapters.prompt import PromptInput

__all__ = ["PromptPool", "L2PPool", "DualPromptPool", "CodaPool", "cosine_similarity_matrix", "orthonormal_rows",
           "batchwise_majority", "uniform_tensor"]


def cosine_similarity_matrix(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """cos(q_b, k_m) for every query and key (B, M): L2P Eq. 3's gamma(q, k) = 1 - cos(q, k)."""
    return F.normalize(q, dim=-1) @ F.normalize(keys, dim=-1).t()


def batchwise_majority(idx: torch.Tensor, pool_size: int) -> torch.Tensor:
    """The code's ``batchwise_prompt``: the N ids chosen most often in the batch, for every sample (B, N)."""
    counts = torch.bincount(idx.flatten(), minlength=pool_size)
    top = torch.topk(counts, idx.shape[1]).indices  # ties: lowest id first (torch.topk on equal counts)
    return top.unsqueeze(0).expand(idx.shape[0], -1)


@torch.no_grad()
def orthonormal_rows(old: torch.Tensor, n: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` random orthonormal rows orthogonal to the rows of ``old`` (s, d) (CODA-Prompt's Gram-Schmidt init).

    Projects random normal vectors on the orthogonal complement of span(old) (twice, for round-off) and
    orthonormalises them by QR, in float64. Exact for any old rows; the official code's classical Gram-Schmidt
    against the old rows is exact only while they stay mutually orthogonal.
    """
    d = old.shape[1]
    if old.shape[0] + n > d:
        raise ValueError(f"cannot make {old.shape[0] + n} orthogonal rows in {d} dimensions")
    m = torch.randn(d, n, generator=generator, dtype=torch.float64)
    if old.shape[0]:
        basis = torch.linalg.qr(old.detach().double().cpu().t()).Q  # (d, s)
        for _ in range(2):
            m = m - basis @ (basis.t() @ m)
    return torch.linalg.qr(m).Q.t().contiguous()  # (n, d)


def uniform_tensor(shape, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    """A tensor of ``shape`` drawn uniformly from ``[low, high)`` with ``generator`` (prompt and key inits)."""
    return torch.rand(shape, generator=generator) * (high - low) + low


class PromptPool(nn.Module):
    """Shared bookkeeping: the current task (a buffer, so it is checkpointed), training selection counts, the
    matching loss of the last pass."""

    n_choices: int = 0

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("task", torch.tensor(0, dtype=torch.long))
        self._aux: torch.Tensor | None = None
        self._counts = torch.zeros(0)
        self.prefix_layers: list[int] = []
        self.layer_options: dict[str, list[int]] = {}

    def start_task(self, t: int, n_tasks: int, generator: torch.Generator) -> None:
        self.task.fill_(t)
        self._counts = torch.zeros(self.n_choices, dtype=torch.float64)

    def _count(self, per_choice: torch.Tensor) -> None:
        if self.training:  # CODA-Prompt's weights cover only the components in use so far: the first f
            self._counts[: per_choice.shape[0]] += per_choice.detach().double().cpu()

    def train_counts(self) -> list[float]:
        return [round(float(c), 4) for c in self._counts]

    def aux_loss(self) -> torch.Tensor | float:
        aux, self._aux = self._aux, None
        return aux if aux is not None else 0.0

    def after_step(self) -> None:
        """After each optimizer step (CODA-Prompt restores its frozen components)."""


class L2PPool(PromptPool):
    """L2P's pool: M prompts (L_p, D) with keys (D); top-N keys by cosine to the query (Eq. 3-4)."""

    def __init__(self, dim: int, pool_size: int, length: int, top_n: int, *, pull_weight: float, batchwise: bool,
                 task_mask: bool, init: str, generator: torch.Generator) -> None:
        super().__init__()
        self.n_choices, self.top_n, self.length = pool_size, top_n, length
        self.pull_weight, self.batchwise, self.task_mask = pull_weight, batchwise, task_mask
        make = (lambda s: uniform_tensor(s, 0.0, 1.0, generator)) if init == "uniform" else torch.zeros
        self.prompts = nn.Parameter(make((pool_size, length, dim)))  # code: nn.init.uniform_ = U(0, 1)
        self.keys = nn.Parameter(make((pool_size, dim)))

    def _choose(self, sim: torch.Tensor) -> torch.Tensor:
        t, n = int(self.task), self.top_n
        if self.training and self.task_mask and (t + 1) * n <= self.n_choices:
            return torch.arange(t * n, (t + 1) * n, device=sim.device).expand(sim.shape[0], -1)
        idx = torch.topk(sim, n, dim=1).indices  # (B, N)
        return batchwise_majority(idx, self.n_choices) if self.batchwise else idx

    def select(self, q: torch.Tensor) -> PromptInput:
        sim = cosine_similarity_matrix(q.to(self.keys.dtype), self.keys)  # (B, M)
        idx = self._choose(sim)
        b = q.shape[0]
        self._count(F.one_hot(idx, self.n_choices).sum((0, 1)))
        if self.training and self.pull_weight:
            # Eq. 5: + lambda * sum_i gamma(q, k_si) = lambda * sum_i (1 - cos) -> -lambda * sum cos / B (+ const)
            self._aux = -self.pull_weight * sim.gather(1, idx).sum() / b
        tokens = self.prompts[idx].reshape(b, self.top_n * self.length, -1)  # (B, N*L_p, D)
        return PromptInput(tokens=tokens)

    def usage(self, q: torch.Tensor) -> torch.Tensor:
        """Per-sample top-N selection as a 0/1 matrix (B, M)."""
        idx = torch.topk(cosine_similarity_matrix(q.to(self.keys.dtype), self.keys), self.top_n, dim=1).indices
        return F.one_hot(idx, self.n_choices).sum(1).float()

    def task_hits(self, q: torch.Tensor, task: int, train_counts: list[float]) -> torch.Tensor:
        """Proxy of task-id accuracy: the selection includes the prompt used most while training ``task``."""
        top = int(torch.tensor(train_counts).argmax())
        return self.usage(q)[:, top] > 0


class DualPromptPool(PromptPool):
    """DualPrompt: G-prompt prefixes shared by all tasks, E-prompt prefixes chosen by key match (Eq. 3-5)."""

    def __init__(self, dim: int, *, g_layers: list[int], g_length: int, e_layers: list[int], e_length: int,
                 pool_size: int, split: str, pull_weight: float, train_true_task: bool, batchwise: bool,
                 generator: torch.Generator) -> None:
        super().__init__()
        half = (lambda n: n) if split == "each" else (lambda n: n // 2)
        self.g_layers, self.e_layers, self.n_choices = list(g_layers), list(e_layers), pool_size
        self.pull_weight, self.train_true_task, self.batchwise = pull_weight, train_true_task, batchwise
        # [layer, key|value, (pool,) token, D], U(-1, 1) as the code
        self.g_prompts = nn.Parameter(uniform_tensor((len(g_layers), 2, half(g_length), dim), -1.0, 1.0, generator))
        self.e_prompts = nn.Parameter(uniform_tensor((len(e_layers), 2, pool_size, half(e_length), dim), -1.0, 1.0,
                                               generator))
        self.keys = nn.Parameter(uniform_tensor((pool_size, dim), -1.0, 1.0, generator))
        self.prefix_layers = sorted(set(g_layers) | set(e_layers))
        self.layer_options = {"g_layers": self.g_layers, "e_layers": self.e_layers}

    def start_task(self, t: int, n_tasks: int, generator: torch.Generator) -> None:
        if n_tasks > self.n_choices:
            raise ValueError(f"method.e_pool_size: {self.n_choices} E-prompts for {n_tasks} tasks; set "
                             f"e_pool_size >= {n_tasks}")
        super().start_task(t, n_tasks, generator)

    def _match(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sim = cosine_similarity_matrix(q.to(self.keys.dtype), self.keys)  # (B, pool)
        if self.training and self.train_true_task:
            idx = torch.full((q.shape[0],), int(self.task), dtype=torch.long, device=sim.device)
        else:
            idx = sim.argmax(dim=1)
            if self.batchwise:
                idx = batchwise_majority(idx[:, None], self.n_choices)[:, 0]
        return sim, idx

    def select(self, q: torch.Tensor) -> PromptInput:
        sim, idx = self._match(q)
        b = q.shape[0]
        self._count(F.one_hot(idx, self.n_choices).sum(0))
        if self.training and self.pull_weight:  # Eq. 5: lambda * gamma(q, k_t), as -lambda * mean cos (+ const)
            self._aux = -self.pull_weight * sim.gather(1, idx[:, None]).sum() / b
        prefixes: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.e_layers):
            prefixes[layer] = (self.e_prompts[i, 0][idx], self.e_prompts[i, 1][idx])  # (B, L_e, D) each
        for i, layer in enumerate(self.g_layers):
            gk, gv = (self.g_prompts[i, j].expand(b, -1, -1) for j in (0, 1))
            if layer in prefixes:  # a layer with both: E then G tokens (CODA repo's reimplementation)
                ek, ev = prefixes[layer]
                gk, gv = torch.cat([ek, gk], 1), torch.cat([ev, gv], 1)
            prefixes[layer] = (gk, gv)
        return PromptInput(prefixes=prefixes)

    def usage(self, q: torch.Tensor) -> torch.Tensor:
        sim = cosine_similarity_matrix(q.to(self.keys.dtype), self.keys)
        return F.one_hot(sim.argmax(dim=1), self.n_choices).float()

    def task_hits(self, q: torch.Tensor, task: int, train_counts: list[float]) -> torch.Tensor:
        """Exact task-id accuracy of the key match: the best key is the task's own."""
        return self.usage(q).argmax(dim=1) == task


class CodaPool(PromptPool):
    """CODA-Prompt: per layer, components P_m (L_p, D), keys K_m and attention vectors A_m (D).

    alpha_m = cos(q ⊙ A_m, K_m) (Eq. 5-6), prompt p = sum_m alpha_m P_m (Eq. 4), split into key/value halves.
    Task t owns components [t M/T, (t+1) M/T); earlier ones are detached while training and restored after every
    step (exactly unchanged whatever the optimizer does); later ones are unused.
    """

    def __init__(self, dim: int, *, pool_size: int, length: int, layers: list[int], ortho_mu: float, init: str,
                 generator: torch.Generator) -> None:
        super().__init__()
        n = len(layers)
        self.layers, self.length, self.n_choices = list(layers), length, pool_size
        self.ortho_mu, self.init = ortho_mu, init
        self.components = nn.Parameter(torch.zeros(n, pool_size, length, dim))
        self.keys = nn.Parameter(torch.zeros(n, pool_size, dim))
        self.attention = nn.Parameter(torch.zeros(n, pool_size, dim))
        self.register_buffer("span", torch.tensor([0, 0], dtype=torch.long))  # [s, f): the current task's block
        self.register_buffer("per_task", torch.tensor(0, dtype=torch.long))
        self.prefix_layers = sorted(set(layers))
        self.layer_options = {"layers": self.layers}
        self._frozen: list[torch.Tensor] = []
        if init == "orthogonal":
            self._orthonormalise(0, pool_size, generator)

    def _params(self) -> list[nn.Parameter]:
        return [self.components, self.keys, self.attention]

    @torch.no_grad()
    def _orthonormalise(self, s: int, f: int, generator: torch.Generator) -> None:
        for p in self._params():
            for i in range(p.shape[0]):
                rows = p[i].reshape(p.shape[1], -1)  # (M, d)
                new = orthonormal_rows(rows[:s], f - s, generator)
                p[i, s:f] = new.reshape(f - s, *p.shape[2:]).to(p.dtype).to(p.device)

    def start_task(self, t: int, n_tasks: int, generator: torch.Generator) -> None:
        per = self.n_choices // n_tasks
        if per == 0:
            raise ValueError(f"method.pool_size: {self.n_choices} components for {n_tasks} tasks")
        super().start_task(t, n_tasks, generator)
        s, f = t * per, (t + 1) * per
        self.per_task.fill_(per)
        self.span.copy_(torch.tensor([s, f]))
        if self.init == "gram_schmidt":
            self._orthonormalise(s, f, generator)
        self._frozen = [p[:, :s].detach().clone() for p in self._params()]

    def _live(self, p: torch.Tensor, i: int) -> torch.Tensor:
        s, f = (int(v) for v in self.span)
        if self.training:
            return torch.cat([p[i, :s].detach(), p[i, s:f]], dim=0)
        return p[i, :f]

    def weights(self, q: torch.Tensor, i: int) -> torch.Tensor:
        """alpha (B, f) of layer ``i``: cos(q ⊙ A_m, K_m) (Eq. 5-6)."""
        a, k = self._live(self.attention, i), self._live(self.keys, i)
        aq = q.to(a.dtype)[:, None, :] * a[None]  # (B, f, D)
        return (F.normalize(aq, dim=2) * F.normalize(k, dim=1)[None]).sum(-1)

    def select(self, q: torch.Tensor) -> PromptInput:
        prefixes, penalty, half = {}, 0.0, self.length // 2
        for i, layer in enumerate(self.layers):
            w = self.weights(q, i)
            p = torch.einsum("bk,kld->bld", w, self._live(self.components, i))  # (B, L_p, D), Eq. 4
            prefixes[layer] = (p[:, :half], p[:, half:])
            if i == 0:
                self._count(w.abs().sum(0))
            if self.training and self.ortho_mu > 0:
                penalty = penalty + sum(_ortho_penalty(self._live(x, i).flatten(1))
                                        for x in (self.keys, self.attention, self.components))
        if self.training and self.ortho_mu > 0:
            self._aux = self.ortho_mu * penalty
        return PromptInput(prefixes=prefixes)

    @torch.no_grad()
    def after_step(self) -> None:
        s = int(self.span[0])
        for p, old in zip(self._params(), self._frozen):
            if s:
                p[:, :s] = old.to(p.device)

    def train_counts(self) -> list[float]:  # |alpha| mass per component (first prompted layer), training data
        return super().train_counts()

    def usage(self, q: torch.Tensor) -> torch.Tensor:
        """|alpha| mass per task block, mean over layers (B, number of blocks so far)."""
        per = int(self.per_task)
        w = torch.stack([self.weights(q, i).abs() for i in range(len(self.layers))]).mean(0)  # (B, f)
        return w.reshape(w.shape[0], -1, per).sum(-1)

    def task_hits(self, q: torch.Tensor, task: int, train_counts: list[float]) -> torch.Tensor:
        """Proxy of task-id accuracy: the task's own block carries the most |alpha| mass."""
        return self.usage(q).argmax(dim=1) == task


def _ortho_penalty(t: torch.Tensor) -> torch.Tensor:
    """CODA-Prompt's orthogonality penalty, mean((T T^T - I)^2) * 1e-6 as in the official code."""
    eye = torch.eye(t.shape[0], device=t.device, dtype=t.dtype)
    return ((t @ t.t() - eye) ** 2).mean() * 1e-6
