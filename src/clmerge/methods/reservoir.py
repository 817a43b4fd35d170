"""A fixed-size replay buffer filled by reservoir sampling (Vitter 1985, Algorithm R).

Item ``n`` of the stream (0-based; ``n`` items came before it) goes to slot ``n`` while the buffer is not full;
after that it draws ``j`` uniformly from ``{0, ..., n}`` and replaces slot ``j`` if ``j < size``, else it is
dropped. Every item seen so far is then in the buffer with probability ``size / (n + 1)``.

The buffer holds named fields (inputs, labels, logits...), each a tensor of ``size`` rows allocated at the
first insertion. A field may widen (DER's logits when the head grows): older rows are padded with zeros.
All randomness comes from the generator the caller passes, so a run and its resumed copy draw the same.
"""

from __future__ import annotations

import torch

__all__ = ["ReservoirBuffer", "reservoir_slots"]


def reservoir_slots(n_seen: int, size: int, n_new: int, generator: torch.Generator) -> list[int]:
    """Algorithm R's slot for each of the next ``n_new`` stream items (-1: not kept). One uniform draw per item,
    used once the buffer is full: item ``n`` keeps ``j = floor(u * (n + 1))`` if ``j < size``."""
    u = torch.rand(n_new, generator=generator, dtype=torch.float64).tolist()
    out = []
    for i, ui in enumerate(u):
        n = n_seen + i
        j = n if n < size else min(int(ui * (n + 1)), n)
        out.append(j if j < size else -1)
    return out


class ReservoirBuffer:
    """``size`` rows of named tensors; ``n_seen`` counts the stream items offered so far."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.n_seen = 0
        self.fields: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        return min(self.n_seen, self.size)

    def add(self, generator: torch.Generator, **fields: torch.Tensor) -> list[int]:
        """Offer a batch (rows of every field, in stream order); returns the slot each row went to (-1: none)."""
        n_new = len(next(iter(fields.values())))
        slots = reservoir_slots(self.n_seen, self.size, n_new, generator)
        self.n_seen += n_new
        last = {j: i for i, j in enumerate(slots) if j >= 0}  # a slot hit twice in one batch keeps the later row
        if not last:
            return slots
        dst = torch.tensor(list(last), dtype=torch.long)
        src = torch.tensor(list(last.values()), dtype=torch.long)
        for name, value in fields.items():
            store = self._field(name, value)
            store[dst.to(store.device)] = _pad_to(value.detach(), store.shape[1:])[src.to(value.device)]
        return slots

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """``min(n, len(self))`` distinct rows drawn uniformly (without replacement, as Mammoth's buffer)."""
        idx = torch.randperm(len(self), generator=generator)[:n]
        return {name: t[idx.to(t.device)] for name, t in self.fields.items()}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.fields.values())

    def to(self, device: torch.device) -> None:
        self.fields = {k: v.to(device) for k, v in self.fields.items()}

    def _field(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """The stored tensor of ``name``, allocated (or widened along dim 1) to hold rows like ``value``."""
        store = self.fields.get(name)
        if store is None:
            store = torch.zeros((self.size, *value.shape[1:]), dtype=value.dtype, device=value.device)
        elif value.dim() == 2 and value.shape[1] > store.shape[1]:
            store = _pad_to(store, value.shape[1:])
        self.fields[name] = store
        return store


def _pad_to(t: torch.Tensor, shape: torch.Size | tuple) -> torch.Tensor:
    """``t`` with its dim 1 zero-padded to ``shape[0]`` (2-d tensors only; others are returned as they are)."""
    if t.dim() != 2 or t.shape[1] >= shape[0]:
        return t
    return torch.nn.functional.pad(t, (0, shape[0] - t.shape[1]))
