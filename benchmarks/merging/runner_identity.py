"""Hash the output of every registered merge (Python API, float32 and bfloat16 inputs) and of ten ``clmerge merge``
runs (flags, recipes with overrides and depth gradients, per-model weights, stages, slices) on tiny Llama folders.

Run it on two commits and compare the JSON files: equal hashes mean bit-identical outputs. Used to check that
restructuring the merge runner changed no result (``runner_identity.md``)::

    python benchmarks/merging/runner_identity.py --out /tmp/after.json --work /tmp/ident
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def _digest(tensors: dict[str, torch.Tensor], h=None) -> str:
    h = h or hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].contiguous()
        h.update(k.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def api_hashes() -> dict[str, str]:
    from clmerge.merging.methods import registry as R

    def inputs(dtype):
        g = torch.Generator().manual_seed(0)
        shapes = {"a.weight": (48, 32), "a.bias": (48,), "b.weight": (32, 48), "emb.weight": (50, 32),
                  "ln.weight": (32,), "c.weight": (16, 16)}
        base = {k: torch.randn(*s, generator=g).to(dtype) for k, s in shapes.items()}
        experts = [{k: (v.float() + 0.1 * torch.randn(*v.shape, generator=g)).to(dtype) for k, v in base.items()}
                   for _ in range(3)]
        return base, experts

    out = {}
    for name in sorted(R.available()):
        for dtype in (torch.float32, torch.bfloat16):
            base, experts = inputs(dtype)
            kw: dict = {}
            if name in ("arcee_fusion", "nearswap", "slerp"):
                experts = experts[:1]
            if name == "nuslerp":
                experts = experts[:2]
            if name == "fisher_merging":
                kw["fishers"] = [{k: v.float() ** 2 + 0.01 for k, v in e.items()} for e in experts]
            if name == "regmean":
                kw["grams"] = [{"a.weight": torch.eye(32) * (i + 1), "b.weight": torch.eye(48) * (i + 2)}
                               for i in range(3)]
            torch.manual_seed(0)
            out[f"{name}/{dtype}"] = _digest(R.merge(name, base=base, experts=experts, **kw))
    return out


def cli_hashes(work: Path) -> dict[str, str]:
    import transformers as tf
    from checkpoint_helpers import llama_config, save_variants
    from safetensors.torch import load_file

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    save_variants(work, llama_config(), ["base", "e1", "e2", "e3"], auto=tf.AutoModelForCausalLM)
    b, e1, e2, e3 = (work / n for n in ["base", "e1", "e2", "e3"])
    recipes = {
        "ties_grad": f"method: ties\nbase: {b}\nmodels: [{e1}, {e2}, {e3}]\nparameters: {{density: 0.3, scaling: "
                     f"[0.6, 1.0]}}\noverrides:\n  - pattern: '*.self_attn.*'\n    parameters: {{density: 0.5}}\n",
        "stages": f"stages:\n  - name: s1\n    method: ties\n    base: {b}\n    models: [{e1}, {e2}]\n    parameters: "
                  f"{{density: 0.3}}\nmethod: slerp\nmodels: [s1, {e3}]\nparameters: {{t: 0.4}}\n",
        "slices": f"method: weight_average\nslices:\n  - sources:\n      - {{model: {e1}, layer_range: [0, 2], "
                  f"parameters: {{weight: 0.7}}}}\n      - {{model: {e2}, layer_range: [0, 2], parameters: {{weight: "
                  f"0.3}}}}\n  - sources:\n      - {{model: {e3}, layer_range: [1, 3]}}\n",
        "della": f"method: della\nbase: {b}\nmodels: [{e1}, {e2}]\nparameters: {{density: 0.4, epsilon: 0.1}}\n",
        "weights": f"method: weight_average\nmodels:\n  - model: {e1}\n    parameters: {{weight: 0.5}}\n"
                   f"  - model: {e2}\n    parameters: {{weight: 0.8}}\n",
    }
    runs = [("ta", ["--method", "task_arithmetic", "--base", b, "--expert", e1, "--expert", e2, "--set", "scaling=0.5"]),
            ("dare_bf16", ["--method", "dare", "--base", b, "--expert", e1, "--expert", e2, "--set", "density=0.5",
                           "--out-dtype", "bfloat16"]),
            ("tsv_m", ["--method", "tsv_m", "--base", b, "--expert", e1, "--expert", e2, "--expert", e3]),
            ("breadcrumbs_ties", ["--method", "breadcrumbs_ties", "--base", b, "--expert", e1, "--expert", e2]),
            ("model_stock", ["--method", "model_stock", "--base", b, "--expert", e1, "--expert", e2])]
    for name, text in recipes.items():
        (work / f"{name}.yaml").write_text(text)
        runs.append((name, [work / f"{name}.yaml"]))
    out = {}
    for name, args in runs:
        o = work / f"out_{name}"
        r = subprocess.run([sys.executable, "-m", "clmerge", "merge", *map(str, args), "--out", str(o),
                            "--no-hash-inputs"], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if r.returncode:
            raise SystemExit(f"{name}: exit {r.returncode}: {r.stderr[-400:]}")
        h = hashlib.sha256()
        for f in sorted(o.glob("*.safetensors")):
            _digest(load_file(str(f)), h)
        h.update((o / "config.json").read_bytes())
        out[name] = h.hexdigest()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file of {merge: sha256}")
    ap.add_argument("--work", type=Path, default=Path("/tmp/clmerge_identity"), help="scratch folder")
    a = ap.parse_args()
    res = {"api": api_hashes(), "cli": cli_hashes(a.work)}
    a.out.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(f"{len(res['api'])} API merges, {len(res['cli'])} CLI merges hashed -> {a.out}")


if __name__ == "__main__":
    main()
