"""clmerge's ``add_merged_adapter`` against peft's ``add_weighted_adapter``: the merged Delta W of both, per
peft combination type, on the small model of ``tests/merging/test_inmemory.py`` (its helpers are imported), at
full rank (8), with peft drawing clmerge's DARE masks; then the cases where the two differ by design.

In the repository root (CPU, one thread, a few seconds), with ``HF_HUB_OFFLINE=1``:
``.venv/bin/python benchmarks/merging/peft_agreement.py > benchmarks/merging/peft_agreement.md``
"""

from __future__ import annotations

import sys
from pathlib import Path

import peft
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "merging"))
from test_inmemory import FULL, NAMES, PEFT_CASES, deltas, shared_dare_masks, tiny_peft  # noqa: E402

from clmerge.merging import add_merged_adapter  # noqa: E402
from clmerge.merging.inmemory import PEFT_COMBINATIONS  # noqa: E402


class Patch:
    """The one ``setattr`` of pytest's monkeypatch that ``shared_dare_masks`` uses, undone by ``undo``."""

    def __init__(self) -> None:
        self.saved: list = []

    def setattr(self, obj, name, value) -> None:
        self.saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def undo(self) -> None:
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)


def both(combination: str, weights: list[float], density: float | None, same_masks: bool = True):
    model, patch = tiny_peft(), Patch()
    if combination.startswith("dare") and same_masks:
        shared_dare_masks(model, patch)
    kw = {} if density is None else {"density": density}
    model.add_weighted_adapter(list(NAMES), weights, "peft", combination_type=combination, svd_rank=FULL,
                               **kw)
    add_merged_adapter(model, list(NAMES), method=combination, weights=weights, new_name="ours", rank=FULL,
                       **kw)
    patch.undo()
    return model, deltas(model, "ours"), deltas(model, "peft")


def max_abs(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def main() -> None:
    torch.set_num_threads(1)
    print(f"# add_merged_adapter vs peft {peft.__version__} add_weighted_adapter\n")
    print("Small model: an embedding 16 x 8 and linear layers 8 -> 12 -> 8, two LoRA adapters (rank 2, "
          "alpha 4 and 3) on all three; Delta W compared at full rank 8 (`get_delta_weight` of both new "
          "adapters).\n")
    print("| peft combination_type | clmerge method | weights | density | max abs diff | max abs Delta W "
          "| ratio |")
    print("|---|---|---|---|---|---|---|")
    for comb, (w, d) in sorted(PEFT_CASES.items()):
        _, ours, theirs = both(comb, w, d)
        diff, big = max_abs(ours, theirs), max(float(v.abs().max()) for v in theirs.values())
        method = PEFT_COMBINATIONS[comb][0]
        print(f"| {comb} | {method} | {w} | {d} | {diff:.2e} | {big:.3f} | {diff / big:.1e} |")
    print("\nWhere they differ by design:\n")
    model = tiny_peft()
    truth = {k: a + b for (k, a), b in zip(deltas(model, "math").items(), deltas(model, "code").values())}
    model.add_weighted_adapter(list(NAMES), [1.0, 1.0], "lin", combination_type="linear")
    add_merged_adapter(model, list(NAMES), method="svd", weights=[1.0, 1.0], new_name="ours", rank=FULL)
    rel = {n: max(float((deltas(model, n)[k] - t).norm() / t.norm()) for k, t in truth.items())
           for n in ("lin", "ours")}
    print(f"- peft `linear` (A and B combined separately), weights [1, 1]: largest relative Frobenius error "
          f"against the sum of the updates {rel['lin']:.3f}; clmerge `svd`: {rel['ours']:.1e}.")
    _, ours, theirs = both("ties_svd", [1.0, 0.2], 0.5)
    n_diff = sum(int(((ours[k] - theirs[k]).abs() > 1e-5).sum()) for k in ours)
    total = sum(v.numel() for v in ours.values())
    print(f"- `ties_svd`, weights [1.0, 0.2], density 0.5 (sign elected on unweighted vs weighted updates): "
          f"max abs diff {max_abs(ours, theirs):.3f}, {n_diff} of {total} entries differ by more than 1e-5.")
    _, ours, theirs = both("ties_svd", [1.0, 1.0], 0.3)
    print(f"- `ties_svd`, density 0.3 (0.3 x 96 = 28.8 entries: peft keeps 28, clmerge 29): max abs diff "
          f"{max_abs(ours, theirs):.3f}.")
    _, ours, theirs = both("dare_linear_svd", [1.0, 1.0], 0.5, same_masks=False)
    print(f"- `dare_linear_svd` with each drawing its own masks: max abs diff {max_abs(ours, theirs):.3f}.")
    print(f"\nCommand: `HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/merging/peft_agreement.py` (torch "
          f"{torch.__version__}, CPU, one thread; deterministic: the same numbers on every run).")


if __name__ == "__main__":
    main()
