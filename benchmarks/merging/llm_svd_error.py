"""Relative error of the randomized SVD against the exact one, per SVD merge, on one decoder layer.

``python llm_svd_error.py --data /work/llm2 [--layer 0] [--matrices ...]`` prints a JSON line per matrix: for
CART, TSV-M and Iso-CTS and each weight matrix of layer ``--layer`` of the llm_scale models (base + variants, ``llm_models.py``),
``||update_randomized - update_exact||_F / ||update_exact||_F`` of the method's per-matrix update (CART:
``sum_t SVD_k(theta_t - theta_avg)``, Eq. 4 of Choi et al.; TSV-M: ``U_perp diag(S) V_perp^T``; Iso-CTS:
``sigma_bar U_perp V_perp^T``), at the settings of the llm_scale cells, with the wall seconds of both.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_models import model_dirs  # noqa: E402

MATRICES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")


def read(folder: Path, key: str) -> torch.Tensor:
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            if key in h.keys():
                return h.get_tensor(key)
    raise KeyError(f"{key} not in {folder}")


def updates(base: torch.Tensor, xs: list[torch.Tensor], svd: str) -> dict[str, torch.Tensor]:
    from clmerge.merging.methods.cart import centered_low_rank_sum
    from clmerge.merging.methods.iso import iso_cts_matrix
    from clmerge.merging.methods.lowrank import target_rank, task_matrices
    from clmerge.merging.methods.tsv import tsv_merge_matrix

    taus = task_matrices(base, xs)
    k = target_rank(tuple(base.shape), 0.08, "ceil")
    return {"cart": centered_low_rank_sum(xs, k, svd=svd)[1],
            "tsv_m": tsv_merge_matrix(taus, svd=svd), "iso_cts": iso_cts_matrix(taus, 0.8, svd=svd)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--matrices", nargs="*", default=list(MATRICES), help="which of the layer's matrices")
    args = p.parse_args(argv)
    base_dir, experts = model_dirs(args.data)
    for name in args.matrices:
        key = f"model.layers.{args.layer}.{name}.weight"
        b, xs = read(base_dir, key), [read(e, key) for e in experts]
        t0 = time.perf_counter()
        exact = updates(b, xs, "exact")
        t1 = time.perf_counter()
        rand = updates(b, xs, "randomized")
        t2 = time.perf_counter()
        row = {m: float((rand[m].double() - exact[m].double()).norm() / exact[m].double().norm())
               for m in exact} | {"shape": list(b.shape), "exact_s": t1 - t0, "randomized_s": t2 - t1}
        print(json.dumps({key: row}), flush=True)  # one JSON line per matrix


if __name__ == "__main__":
    main()
