"""FusionBench's TSV-M or Iso-CTS on model folders in one process: ``llm_scale.py``'s ``fusionbench`` tool.

``python fusionbench_llm.py --fusion-bench CHECKOUT --method tsv_m|iso_cts --base DIR --expert DIR ...
--out DIR``

It does what FusionBench's ``TaskSingularVectorMerging.run`` / ``IsotropicMergingInCommonAndTaskSubspace.run``
do, minus ``nn.Module`` loading: every state dict is loaded whole, task vectors by ``state_dict_sub``, then
``TSVM_utils.compute_and_sum_svd_mem_reduction`` or ``iso_utils.iso_cts`` (on the CPU), ``state_dict_mul`` by
the scaling and ``state_dict_add`` to the base. The merge functions are FusionBench's, loaded from the
checkout by :func:`fusionbench_rows.load_fusion_bench` (nothing of FusionBench is copied here). Two choices of this
runner: ``--exclude`` names the 2-D keys averaged instead of decomposed (``llm_scale.py`` passes the keys
clmerge's default rule excludes, so both tools compute the same merge), and Iso-CTS's task vectors are cast to
float32 first (``torch.linalg.svd`` has no bfloat16 kernel; FusionBench's TSV-M casts per matrix itself). The
output is one ``model.safetensors`` in the base's dtype beside the base's config and tokenizer files.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fusionbench_rows import SVD_FILES, load_fusion_bench  # noqa: E402


def load_folder(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a model folder (all its ``*.safetensors`` shards), in memory."""
    sd: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    return sd


def merge(fb, method: str, base: dict, experts: list[dict], exclude: list[str], scaling: float,
          fraction: float) -> dict[str, torch.Tensor]:
    sda = fb.state_dict_arithmetic
    tvs = [sda.state_dict_sub(e, base) for e in experts]
    del experts[:]
    if method == "tsv_m":
        tv = fb.TSVM_utils.compute_and_sum_svd_mem_reduction(tvs, exclude_keys=exclude, accelerator="cpu")
    else:
        tvs = [{k: v.float() for k, v in tv.items()} for tv in tvs]
        tv = fb.iso_utils.iso_cts(tvs, fraction, accelerator="cpu", exclude_keys=exclude)
    del tvs
    start = {k: v.to(tv[k].dtype) for k, v in base.items()}  # float32 for Iso-CTS, the base itself for TSV-M
    merged = sda.state_dict_add(start, sda.state_dict_mul(tv, scaling))
    return {k: v.to(base[k].dtype).contiguous() for k, v in merged.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fusion-bench", type=Path, required=True, help="a FusionBench checkout")
    p.add_argument("--method", choices=("tsv_m", "iso_cts"), required=True)
    p.add_argument("--base", type=Path, required=True)
    p.add_argument("--expert", type=Path, action="append", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--exclude-regex", default="embed", help="2-D keys (re.search) averaged, not decomposed")
    p.add_argument("--scaling", type=float, default=1.0)
    p.add_argument("--common-space-fraction", type=float, default=0.8)
    args = p.parse_args(argv)
    fb = load_fusion_bench(args.fusion_bench, SVD_FILES)
    base = load_folder(args.base)
    experts = [load_folder(e) for e in args.expert]
    exclude = [k for k in base if re.search(args.exclude_regex, k)]
    merged = merge(fb, args.method, base, experts, exclude, args.scaling, args.common_space_fraction)
    tmp = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(merged, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for f in args.base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and not f.name.endswith(".index.json"):
            shutil.copy2(f, tmp / f.name)
    tmp.rename(args.out)


if __name__ == "__main__":
    main()
