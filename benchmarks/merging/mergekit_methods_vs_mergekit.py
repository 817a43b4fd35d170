"""clmerge's nuslerp, multislerp, karcher, sce, breadcrumbs_ties, nearswap, arcee_fusion and task arithmetic's
normalize against mergekit's kernels on the same tensors.

Like ``methods_vs_mergekit.py``: mergekit runs in its own interpreter (``--mergekit-python``), reads the inputs
from a ``torch.save`` file and writes its outputs the same way (both read back with ``weights_only=True``).
Writes its rows into ``methods_vs_mergekit.md`` next to this file, between the markers of its own section.

    PYTHONPATH=src python benchmarks/merging/mergekit_methods_vs_mergekit.py --mergekit-python VENV/bin/python
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from pathlib import Path

import torch

from clmerge import merging

SHAPES = {"a.weight": (64, 48), "a.bias": (64,), "b.weight": (32, 64), "n.scale": (7,)}
DENSITY, GAMMA, TOPK, NEAR_T = 0.3, 0.05, 0.5, 0.02
W2, W3 = (1.0, 3.0), (0.2, 0.5, 0.3)
BEGIN, END = "<!-- mergekit's other methods: begin -->", "<!-- mergekit's other methods: end -->"

MERGEKIT_SIDE = '''
import sys, torch
from mergekit import sparsify
from mergekit.merge_methods.base import PerInputValues, TensorGroup
from mergekit.merge_methods.generalized_task_arithmetic import get_mask
from mergekit.merge_methods.nuslerp import nuslerp_merge_method
from mergekit.merge_methods.multislerp import multislerp
from mergekit.merge_methods.karcher import karcher_merge_method
from mergekit.merge_methods.sce import sce_merge
from mergekit.merge_methods.nearswap import nearswap_merge
from mergekit.merge_methods.arcee_fusion import arcee_fusion_merge_method
DENSITY, GAMMA, TOPK, NEAR_T, W2, W3 = {density}, {gamma}, {topk}, {near_t}, {w2}, {w3}
res = {{}}
def grp(ts, base):
    return TensorGroup.from_tensors(ts, base_index=0 if base else None)
def weights(ws):
    return PerInputValues([(i + 1, w) for i, w in enumerate(ws)])
for case, d in torch.load(sys.argv[1], weights_only=True).items():
    base, ex = d["base"], d["ex"]
    out = res[case] = {{}}
    for k in base:
        b, xs = base[k], [e[k] for e in ex]
        r = {{}}
        r["nuslerp"] = nuslerp_merge_method.implementation(grp([b] + xs[:2], True), weight=weights(W2))
        r["nuslerp rows"] = nuslerp_merge_method.implementation(grp([b] + xs[:2], True), weight=weights(W2),
                                                                 nuslerp_flatten=False)
        r["multislerp"] = multislerp.implementation(grp([b] + xs, True), weight=weights(W3))
        r["karcher"] = karcher_merge_method.implementation(grp(xs, False))
        r["sce"] = sce_merge.implementation(grp([b] + xs, True), select_topk=TOPK)
        r["sce topk 1"] = sce_merge.implementation(grp([b] + xs, True))
        deltas = torch.stack([sparsify.magnitude_outliers(x - b, DENSITY, gamma=GAMMA) for x in xs])
        r["breadcrumbs_ties"] = b + (deltas * get_mask(deltas, method="sum")).sum(0)
        r["task_arithmetic normalize"] = b + torch.stack([x - b for x in xs]).sum(0) / len(xs)
        r["nearswap"] = nearswap_merge.implementation(grp([b, xs[0]], True), t=NEAR_T)
        r["arcee_fusion"] = arcee_fusion_merge_method.implementation(grp([b, xs[0]], True))
        for m, v in r.items():
            out.setdefault(m, {{}})[k] = v.to(b.dtype)
torch.save(res, sys.argv[2])
'''


def make_case(dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    ex = [{k: v + 0.05 * torch.randn(v.shape, generator=g) + 0.02 * torch.randn(1, generator=g)
           for k, v in base.items()} for _ in range(3)]
    return {"base": {k: v.to(dtype) for k, v in base.items()}, "ex": [{k: v.to(dtype) for k, v in e.items()}
                                                                    for e in ex]}


def ours(base: dict, ex: list) -> dict:
    m = merging.merge
    return {
        "nuslerp": m("nuslerp", base=base, experts=ex[:2], weights=list(W2)),
        "nuslerp rows": m("nuslerp", base=base, experts=ex[:2], weights=list(W2), flatten=False),
        "multislerp": m("multislerp", base=base, experts=ex, weights=list(W3)),
        "karcher": m("karcher", experts=ex),
        "sce": m("sce", base=base, experts=ex, select_topk=TOPK),
        "sce topk 1": m("sce", base=base, experts=ex),
        "breadcrumbs_ties": m("breadcrumbs_ties", base=base, experts=ex, density=DENSITY, beta=GAMMA),
        "task_arithmetic normalize": m("task_arithmetic", base=base, experts=ex, normalize=True),
        "nearswap": m("nearswap", base=base, experts=ex[:1], t=NEAR_T),
        "arcee_fusion": m("arcee_fusion", base=base, experts=ex[:1]),
    }


def run_mergekit(python: str, cases: dict) -> tuple[dict, str]:
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp, script = Path(tmp) / "in.pt", Path(tmp) / "out.pt", Path(tmp) / "mk.py"
        torch.save(cases, inp)
        script.write_text(MERGEKIT_SIDE.format(density=DENSITY, gamma=GAMMA, topk=TOPK, near_t=NEAR_T, w2=W2, w3=W3))
        subprocess.run([python, str(script), str(inp), str(outp)], check=True)
        theirs = torch.load(outp, weights_only=True)
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('mergekit'))"],
                             capture_output=True, text=True).stdout.strip()
    return theirs, version


def table(cases: dict, theirs: dict, version: str) -> list[str]:
    lines = [BEGIN, f"## mergekit's other methods vs mergekit {version}", "",
             f"Made by `benchmarks/merging/mergekit_methods_vs_mergekit.py`: the inputs above; nuslerp with a base, "
             f"weights {W2}; multislerp with a base, weights {W3}; karcher of the 3 experts; sce `select_topk` "
             f"{TOPK} and 1; breadcrumbs_ties density {DENSITY}, beta = gamma {GAMMA}, weights 1; nearswap t {NEAR_T}.",
             "", "| inputs | method | key | max abs diff | bit-identical |", "|---|---|---|---|---|"]
    for case, d in cases.items():
        for method, res in ours(d["base"], d["ex"]).items():
            for k in SHAPES:
                a, b = res[k], theirs[case][method][k]
                diff = float((a.double() - b.double()).abs().max())
                lines.append(f"| {case} | {method} | `{k}` | {diff:.3g} | {'yes' if torch.equal(a, b) else 'no'} |")
    return lines + ["", "Why rows differ:",
                    "- float32 differences of a few 1e-7 (`nuslerp`, `multislerp`, `karcher`, `sce`, `nearswap`, "
                    "`task_arithmetic normalize`): the same formulas in float64 here, in float32 there; bf16 rows: "
                    "mergekit computes in bf16 (one or two units in the last place of the output).",
                    "- `sce` on `n.scale` (7 entries, `select_topk` 0.5): `round(3.5) = 4` positions kept here, "
                    "`int(3.5) = 3` there (the exact-density count).",
                    "- `breadcrumbs_ties` on `a.weight`: 922 entries kept here, 921 there (`round` vs `int`, as "
                    "`breadcrumbs`); bf16: mergekit forms the deltas in bf16 and breaks magnitude ties in "
                    "`argsort` order.",
                    "- `arcee_fusion` float32 `a.weight`: one entry whose importance lies within float32 rounding "
                    "of the threshold (1.25529e-4 in float64, 1.25532e-4 in float32) is kept there, not here; "
                    "the kept entries are `x` here and `b + (x - b)` rounded in float32 there. bf16: mergekit's "
                    "softmax, KL and threshold are computed in bf16, which moves many importances across the "
                    "threshold.",
                    "- `della_linear` is not in the table: its masks are random (equal in distribution, never bit "
                    "for bit); at density 1 it is task arithmetic in both (tested here).",
                    END]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mergekit-python", default="/work/venvs/mergekit/bin/python")
    args = ap.parse_args()
    cases = {"float32": make_case(torch.float32, 0), "bfloat16": make_case(torch.bfloat16, 0)}
    theirs, version = run_mergekit(args.mergekit_python, cases)
    lines = table(cases, theirs, version)
    out = Path(__file__).with_name("methods_vs_mergekit.md")
    text = out.read_text() if out.exists() else ""
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + text[text.index(END) + len(END) + 1:]
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(text.rstrip("\n") + "\n\n" + "\n".join(lines) + "\n")
    tmp.replace(out)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
