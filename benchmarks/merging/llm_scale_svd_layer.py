"""Per-matrix cost and agreement of the SVD merges' two paths (``svd=exact`` / ``svd=randomized``) on one
decoder layer (and optionally the LM head) of the llm_scale models.

``python llm_scale_svd_layer.py --data DIR [--layer 0] [--lm-head] [--methods cart tsv_m iso_cts]
[--paths randomized exact] [--json OUT]`` prints one JSON line per (matrix, method, path): CPU seconds of the
merge of that one key (process user + system time, 1 thread), and, when the exact path ran too,
``||update_randomized - update_exact||_F / ||update_exact||_F`` of the merged update ``(theta - theta_0) /
alpha`` (CART: ``theta - theta_avg``). Inputs are the bf16 tensors cast to float32 (the work dtype of every
path for bf16 inputs), so the output is not rounded to bf16 before the comparison. Settings as in the
llm_scale cells: CART rank ratio 0.08, Iso-CTS common fraction 0.8, scaling 1.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llm_models import model_dirs  # noqa: E402
from llm_svd_error import MATRICES, read  # noqa: E402

ALL = MATRICES + ("self_attn.v_proj", "mlp.up_proj")
SETTINGS = {"cart": {"rank_ratio": 0.08}, "tsv_m": {}, "iso_cts": {"common_space_fraction": 0.8}}


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def update(method: str, key: str, b: torch.Tensor, xs: list[torch.Tensor], svd: str) -> tuple[torch.Tensor, float]:
    from clmerge import merging

    c0 = cpu_s()
    out = merging.merge(method, base={key: b}, experts=[{key: x} for x in xs], svd=svd, **SETTINGS[method])[key]
    sec = cpu_s() - c0
    ref = torch.stack([x.double() for x in xs]).mean(0) if method == "cart" else b.double()
    return out.double() - ref, sec


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--lm-head", action="store_true")
    p.add_argument("--matrices", nargs="*", default=list(ALL))
    p.add_argument("--methods", nargs="*", default=list(SETTINGS))
    p.add_argument("--paths", nargs="*", default=["randomized", "exact"])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    base_dir, experts = model_dirs(args.data)
    keys = [f"model.layers.{args.layer}.{m}.weight" for m in args.matrices] + (["lm_head.weight"] if args.lm_head else [])
    rows = []
    for key in keys:
        b, xs = read(base_dir, key).float(), [read(e, key).float() for e in experts]
        for method in args.methods:
            ups = {}
            row = {"key": key, "shape": list(b.shape), "method": method}
            for svd in args.paths:
                ups[svd], row[f"{svd}_cpu_s"] = update(method, key, b, xs, svd)
            if "exact" in ups and "randomized" in ups:
                e = ups["exact"]
                row["rel_err"] = float((ups["randomized"] - e).norm() / e.norm())
            rows.append(row)
            print(json.dumps(row), flush=True)
            del ups
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
