"""Checks on the llm_scale benchmark's merged folders, each run in its own process by ``llm_scale.py``.

``python llm_scale_check.py loads OUT BASE`` -> JSON: the index lists every key of the base with its shape and
dtype, config / tokenizer files are there, and ``AutoModelForCausalLM.from_pretrained(OUT)`` loads it (on the
CPU, in bf16).

``python llm_scale_check.py compare OUT_A OUT_B BASE EXPERT... [--ta-scaling S]`` -> JSON: agreement of two
merged folders (either may be ``-``), key by key, streamed (a few tensors in memory): max |a - b|, entries
that differ, ``||a - b|| / ||b - base||``, cosine of the two merged deltas, and the fraction of entries each
tool changed from the base. With ``--ta-scaling``, also each output's distance to the dense task-arithmetic
merge ``base + S * sum_t (expert_t - base)`` (what DARE equals in expectation), relative to that merge's
delta.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch


class Folder:
    """The tensors of a model folder (sharded with an index, or one ``model.safetensors``), one at a time."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.exists():
            files = {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        else:
            with safe_open(str(path / "model.safetensors"), framework="pt") as f:
                files = {k: path / "model.safetensors" for k in f.keys()}
        self.files = files
        self._open = {f: safe_open(str(f), framework="pt") for f in set(files.values())}

    def keys(self) -> list[str]:
        return list(self.files)

    def get(self, key: str) -> torch.Tensor:
        return self._open[self.files[key]].get_tensor(key)

    def meta(self, key: str) -> tuple[list[int], str]:
        s = self._open[self.files[key]].get_slice(key)
        return list(s.get_shape()), s.get_dtype()


def loads(out: Path, base: Path) -> dict:
    """Does ``out`` hold the base's keys, shapes, dtypes, config, tokenizer, and load with transformers?"""
    res: dict = {"config": (out / "config.json").exists(),
                 "tokenizer": any((out / n).exists() for n in ("tokenizer.json", "tokenizer.model")),
                 "index": (out / "model.safetensors.index.json").exists()}
    try:
        a, b = Folder(out), Folder(base)
        res["shards"] = len(set(a.files.values()))
        bad = [k for k in b.keys() if k not in a.files or a.meta(k) != b.meta(k)]
        res["keys_shapes_dtypes_match"] = not bad and len(a.keys()) == len(b.keys())
        if bad:
            res["first_mismatch"] = bad[0]
    except Exception as exc:  # reported in the table, not raised: a broken output is a result
        res["keys_shapes_dtypes_match"] = False
        res["error"] = f"{type(exc).__name__}: {exc}"[:300]
    try:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
        res["from_pretrained"] = True
        res["params"] = sum(p.numel() for p in model.parameters())
    except Exception as exc:
        res["from_pretrained"] = False
        res["load_error"] = f"{type(exc).__name__}: {exc}"[:300]
    res["ok"] = bool(res["config"] and res["keys_shapes_dtypes_match"] and res["from_pretrained"])
    return res


def _sq(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x, dtype=torch.float64) ** 2)


def compare(a_dir: Path | None, b_dir: Path | None, base_dir: Path, expert_dirs: list[Path],
            ta_scaling: float | None) -> dict:
    """Streamed agreement statistics (see the module docstring)."""
    outs = {n: Folder(p) for n, p in (("a", a_dir), ("b", b_dir)) if p is not None}
    base = Folder(base_dir)
    experts = [Folder(p) for p in expert_dirs] if ta_scaling is not None else []
    acc = {"n": 0, "max_abs_diff": 0.0, "n_differ": 0, "sq_diff": 0.0, "dot": 0.0}
    acc |= {f"{n}_{s}": 0.0 for n in outs for s in ("sq_delta", "n_changed", "sq_to_ta")}
    acc["sq_ta"] = 0.0
    for key in base.keys():
        b = base.get(key).float()
        deltas = {n: f.get(key).float() - b for n, f in outs.items()}
        acc["n"] += b.numel()
        for n, d in deltas.items():
            acc[f"{n}_sq_delta"] += _sq(d)
            acc[f"{n}_n_changed"] += int((d != 0).sum())
        if len(deltas) == 2:
            diff = deltas["a"] - deltas["b"]
            acc["max_abs_diff"] = max(acc["max_abs_diff"], float(diff.abs().max()))
            acc["n_differ"] += int((diff != 0).sum())
            acc["sq_diff"] += _sq(diff)
            acc["dot"] += float(torch.dot(deltas["a"].flatten().double(), deltas["b"].flatten().double()))
        if experts:
            ta = sum(e.get(key).float() - b for e in experts) * ta_scaling
            acc["sq_ta"] += _sq(ta)
            for n, d in deltas.items():
                acc[f"{n}_sq_to_ta"] += _sq(d - ta)
    return summarize(acc, list(outs), bool(experts))


def summarize(acc: dict, names: list[str], with_ta: bool) -> dict:
    res: dict = {"entries": acc["n"]}
    for n in names:
        res[f"{n}_changed_fraction"] = acc[f"{n}_n_changed"] / acc["n"]
        res[f"{n}_delta_norm"] = acc[f"{n}_sq_delta"] ** 0.5
        if with_ta:
            res[f"{n}_rel_dist_to_dense_ta"] = (acc[f"{n}_sq_to_ta"] / acc["sq_ta"]) ** 0.5
    if len(names) == 2:
        res["max_abs_diff"] = acc["max_abs_diff"]
        res["differ_fraction"] = acc["n_differ"] / acc["n"]
        res["bit_identical"] = acc["n_differ"] == 0
        res["rel_diff"] = (acc["sq_diff"] / acc["b_sq_delta"]) ** 0.5 if acc["b_sq_delta"] else 0.0
        den = (acc["a_sq_delta"] * acc["b_sq_delta"]) ** 0.5
        res["delta_cosine"] = acc["dot"] / den if den else 1.0
    return res


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    if argv[0] == "loads":
        print(json.dumps(loads(Path(argv[1]), Path(argv[2]))))
        return
    ta = None
    if "--ta-scaling" in argv:
        i = argv.index("--ta-scaling")
        ta = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2:]
    a, b, base, *experts = argv[1:]
    print(json.dumps(compare(None if a == "-" else Path(a), None if b == "-" else Path(b), Path(base),
                             [Path(e) for e in experts], ta)))


if __name__ == "__main__":
    main(sys.argv[1:])
