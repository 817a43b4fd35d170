"""mergekit configs run unchanged through ``clmerge merge`` and through mergekit 0.1.5, on tiny models.

The configs: mergekit's own examples (``tests/data/mergekit_examples/``, vendored unchanged; their model names
are mapped to tiny local models here) and one config per remaining mergekit method, written in mergekit's
format below. The models: a 40-layer Llama (and a Mistral for ``bio-merge.yml``) of hidden size 16, built with
``transformers``' config classes and ``save_pretrained`` (float32; ``bf16`` configs use bfloat16 copies), a base
and three variants (base plus Gaussian noise of standard deviation 0.02). Each config runs through clmerge in
this process (:func:`clmerge_merge`) and through ``mergekit-yaml`` in mergekit's own interpreter; every tensor of
the two outputs is compared. Writes ``mergekit_configs_vs_mergekit.md`` next to this file.

    PYTHONPATH=src python benchmarks/merging/mergekit_configs_vs_mergekit.py \\
        --mergekit-python /work/venvs/mergekit/bin/python --work /tmp/mk
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time
from pathlib import Path

import torch
import yaml

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parents[1] / "tests" / "data" / "mergekit_examples"
LAYERS = 40
SOURCE = "arcee-ai/mergekit examples/ at a6e402884ba9bc30da7f23e8304a35f19485de95 (LGPL-3.0-only)"

#: the example configs' model names -> the tiny model standing in for each (roles of :func:`build_models`)
NAMES = {
    "model_a": "base", "model_b": "a",
    "mistralai/Mistral-7B-v0.1": "m_base", "mistralai/Mistral-7B-Instruct-v0.2": "m_a", "BioMistral/BioMistral-7B": "m_b",
    "TheBloke/Llama-2-13B-fp16": "base", "psmathur/orca_mini_v3_13b": "a", "garage-bAInd/Platypus2-13B": "b",
    "WizardLM/WizardLM-13B-V1.2": "c", "WizardLM/WizardMath-13B-V1.0": "c",
}

_M3 = "models:\n  - model: a\n  - model: b\n  - model: c\n"
_W3 = "models:\n" + "".join(f"  - model: {m}\n    parameters: {{weight: 0.6, density: 0.5}}\n" for m in "abc")

#: one config per mergekit method the examples do not cover, in mergekit's format (roles as model names)
EXTRA = {
    "task_arithmetic": "merge_method: task_arithmetic\nbase_model: base\n" + _M3.replace(
        "model: a\n", "model: a\n    parameters: {weight: 0.7}\n").replace(
        "model: b\n", "model: b\n    parameters: {weight: 0.7}\n").replace(
        "model: c\n", "model: c\n    parameters: {weight: 0.7}\n") + "parameters: {lambda: 0.9}\ndtype: float32\n",
    "ties_gradient_filter": "merge_method: ties\nbase_model: base\nmodels:\n" + "".join(
        f"  - model: {m}\n    parameters: {{weight: [0.2, 1.0]}}\n" for m in "abc") + (
        "parameters:\n  density:\n    - filter: self_attn\n      value: 0.25\n    - value: 0.5\n"
        "  normalize: false\ndtype: float32\n"),
    "dare_ties": "merge_method: dare_ties\nbase_model: base\n" + _W3 + "dtype: float32\n",
    "dare_linear": "merge_method: dare_linear\nbase_model: base\n" + _W3 + "dtype: float32\n",
    "breadcrumbs": "merge_method: breadcrumbs\nbase_model: base\n" + _W3 + "parameters: {gamma: 0.0625}\ndtype: float32\n",
    "breadcrumbs_ties": "merge_method: breadcrumbs_ties\nbase_model: base\n" + _W3
                        + "parameters: {gamma: 0.0625}\ndtype: float32\n",
    "della": "merge_method: della\nbase_model: base\n" + _W3 + "parameters: {epsilon: 0.1}\ndtype: float32\n",
    "della_linear": "merge_method: della_linear\nbase_model: base\n" + _W3 + "parameters: {epsilon: 0.1}\n"
                    "dtype: float32\n",
    "dare_linear_one": "merge_method: dare_linear\nbase_model: base\nmodels:\n  - model: a\n"
                       "    parameters: {weight: 1.0, density: 0.5}\ndtype: float32\n",
    "della_linear_one": "merge_method: della_linear\nbase_model: base\nmodels:\n  - model: a\n"
                        "    parameters: {weight: 1.0, density: 0.5}\nparameters: {epsilon: 0.15}\ndtype: float32\n",
    "slerp_models": "merge_method: slerp\nbase_model: a\nmodels:\n  - model: a\n  - model: b\n"
                    "parameters: {t: [0.2, 0.8]}\ndtype: float32\n",
    "nuslerp": "merge_method: nuslerp\nbase_model: base\nmodels:\n  - model: a\n    parameters: {weight: 1.0}\n"
               "  - model: b\n    parameters: {weight: 3.0}\ndtype: float32\n",
    "multislerp": "merge_method: multislerp\nmodels:\n  - model: a\n    parameters: {weight: 0.2}\n"
                  "  - model: b\n    parameters: {weight: 0.5}\n  - model: c\n    parameters: {weight: 0.3}\n"
                  "dtype: float32\n",
    "karcher_base": "merge_method: karcher\nbase_model: base\n" + _M3 + "dtype: float32\n",
    "karcher": "merge_method: karcher\n" + _M3 + "dtype: float32\n",
    "model_stock": "merge_method: model_stock\nbase_model: base\n" + _M3 + "dtype: float32\n",
    "sce": "merge_method: sce\nbase_model: base\n" + _M3 + "parameters: {select_topk: 0.5}\ndtype: float32\n",
    "nearswap": "merge_method: nearswap\nbase_model: base\nmodels:\n  - model: a\nparameters: {t: 0.02}\n"
                "dtype: float32\n",
    "passthrough_models": "merge_method: passthrough\nmodels:\n  - model: a\ndtype: float32\n",
    "linear_bf16": "merge_method: linear\nmodels:\n  - model: a16\n    parameters: {weight: 0.3}\n"
                   "  - model: b16\n    parameters: {weight: 0.7}\ndtype: bfloat16\n",
    "task_arithmetic_bf16": "merge_method: task_arithmetic\nbase_model: base16\nmodels:\n"
                            "  - model: a16\n    parameters: {weight: 0.5}\n  - model: b16\n"
                            "    parameters: {weight: 0.5}\ndtype: bfloat16\n",
    "ties_bf16": "merge_method: ties\nbase_model: base16\nmodels:\n"
                 "  - model: a16\n    parameters: {weight: 1.0, density: 0.5}\n  - model: b16\n"
                 "    parameters: {weight: 1.0, density: 0.5}\ndtype: bfloat16\n",
}

#: clmerge's own choice where a mergekit config follows mergekit, and mergekit's arithmetic where a config
#: keeps clmerge's (``compute_dtype``): ``{row: (config, changes to the translated recipe)}``, run against the
#: same mergekit output to show what the named option changes
CLMERGE_DEFAULTS = {
    "linear_bf16, compute_dtype: bfloat16": ("linear_bf16", {"compute_dtype": "bfloat16"}),
    "task_arithmetic_bf16, compute_dtype: bfloat16": ("task_arithmetic_bf16", {"compute_dtype": "bfloat16"}),
    "ties_bf16, compute_dtype: bfloat16": ("ties_bf16", {"compute_dtype": "bfloat16"}),
    "karcher_base, include_base: false": ("karcher_base", {"parameters": {"include_base": False}}),
    "gradient-slerp.yml @float32, outer_tensors: base": ("gradient-slerp.yml @float32", {"outer_tensors": "base"}),
    "della, window/rescale: paper": ("della", {"parameters": {"window": "paper", "rescale": "paper"}}),
    "dare_linear_one, rescale_rule: paper": ("dare_linear_one", {"parameters": {"rescale_rule": "paper"}}),
    "della_linear_one, window/rescale: paper": ("della_linear_one",
                                                {"parameters": {"window": "paper", "rescale": "paper"}}),
}

#: per-tensor TIES merges whose differing entries are checked against each expert's cut (:func:`at_cut`):
#: ``{row: (density, [expert roles], base role)}``
AT_CUT = {"ties_bf16, compute_dtype: bfloat16": (0.5, ["a16", "b16"], "base16")}

#: merges with per-model densities whose differing tensors are checked against the kept counts (:func:`counts`)
COUNTED = {"ties.yml", "ties.yml @float32"}

#: random merges of one expert whose expected output per magnitude decile is measured (:func:`profile`)
PROFILED = {"della_linear_one", "della_linear_one, window/rescale: paper", "dare_linear_one",
            "dare_linear_one, rescale_rule: paper"}

#: why a config's outputs differ (or are identical), by config
REASONS = {
    "arcee_fusion.yml": "bf16: mergekit computes the importance, softmax, KL and threshold in bf16, clmerge in "
                        "float32 (rounding once), so entries near the threshold are kept in one tool only",
    "bio-merge.yml": "float16: mergekit casts the float32 inputs to float16 and forms the task vectors in float16, "
                     "which moves magnitudes across TIES's cut (other entries kept); identical in float32 (below)",
    "gradient-slerp.yml": "float16: mergekit slerps the inputs cast to float16, clmerge the float32 inputs in "
                          "float64, rounding once (one float16 unit)",
    "linear.yml": "float16: mergekit casts the inputs to float16 on loading (then sums in float32), clmerge sums "
                  "the float32 inputs (one float16 unit); identical in float32 (below)",
    "orcamini-platy-44layer.yml": "layers copied in both",
    "arcee_fusion.yml @float32": "float32: importances within float32 rounding of the threshold (float64 here) "
                                 "keep or drop whole entries",
    "bio-merge.yml @float32": "float32, density 0.5 of even-sized tensors (int and round counts agree)",
    "gradient-slerp.yml @float32": "float32 inputs: clmerge slerps in float64",
    "linear.yml @float32": "float32",
    "orcamini-platy-44layer.yml @float32": "layers copied in both",
    "ties.yml @float32": "float32: each model's own density and weight (a density gradient, a weight gradient, "
                         "a weight filter) in both; mergekit keeps max(1, int(d n)) entries of a tensor, clmerge "
                         "round(d n), which differ for most of these densities",
    "ties.yml": "float16: mergekit casts the inputs to float16 and forms the task vectors, the sign sum and the "
                "weighted mean in float16; and the kept counts, as ties.yml @float32",
    "task_arithmetic": "float32: weight x lambda applied once here, in two steps there",
    "ties_gradient_filter": "float32 (a weight gradient, a density filter; densities whose counts are whole "
                            "numbers, where int and round agree)",
    "dare_ties": "random masks (mergekit: torch.bernoulli; clmerge: seeded per key); the same L1 rescale "
                 "(rescale_rule: l1)",
    "dare_linear": "random masks, as dare_ties",
    "dare_linear_one": "one expert, random masks, L1 rescale in both (rescale_rule: l1)",
    "dare_linear_one, rescale_rule: paper": "clmerge's default: each kept entry divided by 1 - p",
    "breadcrumbs": "float32 (gamma 0.0625 and density 0.5: whole-number counts, where int and round agree)",
    "breadcrumbs_ties": "float32, as breadcrumbs",
    "della": "random masks: the same drop probabilities and L1 rescale (window: mergekit, rescale: l1), other "
             "draws",
    "della_linear": "random masks, as della",
    "slerp_models": "float32 inputs: clmerge slerps in float64",
    "nuslerp": "float64 vs float32",
    "multislerp": "float64 vs float32",
    "karcher_base": "base as a fourth point of the mean in both (include_base: true); float64 vs float32",
    "karcher": "float64 vs float32",
    "model_stock": "float64 vs float32",
    "sce": "float32 (select_topk 0.5 of even-sized tensors: int and round counts agree)",
    "nearswap": "float32, another order of operations",
    "passthrough_models": "copied in both",
    "linear_bf16": "bf16 inputs: mergekit 0.1.5's linear computes in float32 and rounds once, as clmerge",
    "linear_bf16, compute_dtype: bfloat16": "clmerge's weight_average stays in float32 under compute_dtype "
                                            "bfloat16 (the inputs are cast to bf16 on reading, a no-op here), "
                                            "as mergekit's linear",
    "task_arithmetic_bf16": "bf16 inputs: mergekit forms x - base, the products and the sum in bf16 (its "
                            "generalized task arithmetic computes in the base's dtype), clmerge in float32 "
                            "and rounds once (one bf16 unit)",
    "task_arithmetic_bf16, compute_dtype: bfloat16": "clmerge computes in bf16 too: the same numbers",
    "ties_bf16": "bf16 inputs: mergekit forms the task vectors, the sign sum and the disjoint mean in bf16, "
                 "clmerge in float32, so TIES's per-tensor cut falls between other magnitudes and whole "
                 "entries differ",
    "ties_bf16, compute_dtype: bfloat16": "clmerge computes in bf16 too; the rest are entries whose magnitude "
                                          "equals an expert's cut (bf16 magnitudes tie there): clmerge keeps "
                                          "such ties in flat order, mergekit in the order its argsort leaves "
                                          "them",
    "karcher_base, include_base: false": "clmerge's default leaves the base out of the mean; mergekit takes it",
    "gradient-slerp.yml @float32, outer_tensors: base": "clmerge's default copies the embeddings, final norm and "
                                                        "head from the base; mergekit slerps them at t's first value",
    "della_linear_one": "one expert, random masks: mergekit's drop probabilities and L1 rescale in both (window: "
                        "mergekit, rescale: l1), other draws",
    "della_linear_one, window/rescale: paper": "clmerge's defaults: the paper's probabilities and 1/(1-p) "
                                               "rescale",
    "della, window/rescale: paper": "the paper's drop probabilities and 1/(1-p) rescale against mergekit's "
                                    "window and L1 rescale (and other draws)",
}


def _config(arch: str, layers: int):
    import transformers as tf

    cls = tf.MistralConfig if arch == "mistral" else tf.LlamaConfig
    return cls(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
               num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)


def build_models(folder: Path, layers: int = LAYERS) -> dict[str, Path]:
    """A base and three variants (base + N(0, 0.02^2) noise) of a tiny Llama, a Mistral base and two variants,
    and bfloat16 copies of the Llama base and two variants; ``{role: folder}``."""
    import transformers as tf

    out: dict[str, Path] = {}
    for arch, prefix, roles in (("llama", "", ("base", "a", "b", "c")), ("mistral", "m_", ("base", "a", "b"))):
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(_config(arch, layers))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        for i, role in enumerate(roles):
            g = torch.Generator().manual_seed(100 + i)
            model.to(torch.float32).load_state_dict(
                {k: v + 0.02 * torch.randn(v.shape, generator=g) if i else v for k, v in state.items()})
            model.save_pretrained(folder / f"{prefix}{role}")
            out[f"{prefix}{role}"] = folder / f"{prefix}{role}"
            if arch == "llama" and role in ("base", "a", "b"):  # bfloat16 copies for the bf16 configs
                model.to(torch.bfloat16).save_pretrained(folder / f"{role}16")
                out[f"{role}16"] = folder / f"{role}16"
    return out


def configs() -> dict[str, str]:
    """Every config: the vendored examples (their text unchanged) and :data:`EXTRA`."""
    out = {p.name: p.read_text() for p in sorted(EXAMPLES.glob("*.yml"))}
    for p in sorted(EXAMPLES.glob("*.yml")):  # the same with dtype: float32 (mergekit then computes in float32)
        data = yaml.safe_load(p.read_text())
        if data.get("dtype") != "float32":
            out[f"{p.name} @float32"] = yaml.safe_dump({**data, "dtype": "float32"}, sort_keys=False)
    out.update(EXTRA)
    return out


def localize(text: str, models: dict[str, Path]) -> dict:
    """The config with each model name replaced by the tiny model standing in for it."""
    data = yaml.safe_load(text)

    def sub(v):
        if isinstance(v, dict):
            return {k: (str(models[NAMES.get(x, x)]) if k in ("model", "base_model") and isinstance(x, str)
                        else sub(x)) for k, x in v.items()}
        if isinstance(v, list):
            return [sub(x) for x in v]
        return v

    return sub(data)


def clmerge_merge(data: dict, out: Path, changes: dict | None = None) -> str | None:
    """Run a (localized) mergekit config through clmerge's recipe runner (``changes``: keys of the translated
    recipe set otherwise, ``parameters`` merged); the refusal's text, or None."""
    from clmerge.merging.mergekit_config import translate
    from clmerge.merging.recipes import recipe_of
    from clmerge.merging.run import run_merge

    try:
        recipe = recipe_of(data, "config.yml")
    except ValueError as exc:
        return str(exc)
    if changes:
        spec = translate(data)
        spec.update({k: v for k, v in changes.items() if k != "parameters"})
        spec["parameters"] = {**spec.get("parameters", {}), **changes.get("parameters", {})}
        recipe = recipe_of(spec)
    run_merge(recipe, out, hash_inputs=False)
    return None


def mergekit_merge(python: str, cfg: Path, out: Path) -> str | None:
    """Run ``mergekit-yaml`` of the venv whose interpreter is ``python``; its error's last line, or None."""
    exe = Path(python).parent / "mergekit-yaml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    res = subprocess.run([str(exe), str(cfg), str(out), "--random-seed", "0", "--quiet"], capture_output=True,
                         text=True, env=env)
    if res.returncode:
        lines = [ln for ln in (res.stderr or res.stdout).strip().splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit {res.returncode}"
    return None


def profile(out: Path, base: Path, expert: Path) -> list[float]:
    """The mean of ``(merged - base) / (expert - base)`` per decile of ``|expert - base|`` within each row of
    every 2-D tensor (one draw per entry, pooled over the tensors): the expected output of a one-expert random
    merge relative to its task vector, smallest-magnitude decile first."""
    from clmerge.merging.io.readers import open_checkpoint

    o, b, e = (open_checkpoint(p) for p in (out, base, expert))
    sums, counts = torch.zeros(10, dtype=torch.float64), torch.zeros(10, dtype=torch.float64)
    for k in o.keys():
        tb = b.get(k).double()
        if tb.dim() != 2:
            continue
        tv, got = e.get(k).double() - tb, o.get(k).double() - tb
        ranks = tv.abs().argsort(dim=1).argsort(dim=1)
        dec = (ranks * 10 // tv.shape[1]).reshape(-1)
        ok = (tv != 0).reshape(-1)
        ratio = (got / torch.where(tv == 0, 1.0, tv)).reshape(-1)
        sums.index_add_(0, dec[ok], ratio[ok])
        counts.index_add_(0, dec[ok], torch.ones(int(ok.sum()), dtype=torch.float64))
    return (sums / counts.clamp(min=1)).tolist()


def at_cut(a: Path, b: Path, base: Path, experts: list[Path], density: float) -> tuple[int, int]:
    """``(entries that differ, of those whose task-vector magnitude in some expert equals that expert's
    per-tensor cut)``: mergekit keeps ``max(1, int(density * n))`` entries by ``argsort``, so which of the
    entries tied at the cut it keeps is the sort's order."""
    from clmerge.merging.io.readers import open_checkpoint

    x, y, tb = open_checkpoint(a), open_checkpoint(b), open_checkpoint(base)
    xs = [open_checkpoint(e) for e in experts]
    differ = tied = 0
    for k in x.keys():
        d = (x.get(k) != y.get(k)).reshape(-1)
        if not d.any():
            continue
        on_cut = torch.zeros_like(d)
        for e in xs:
            mag = (e.get(k) - tb.get(k)).abs().reshape(-1).float()
            cut = mag.sort(descending=True).values[max(1, int(density * mag.numel())) - 1]
            on_cut |= mag == cut
        differ += int(d.sum())
        tied += int((d & on_cut).sum())
    return differ, tied


def counts(data: dict, a: Path, b: Path) -> tuple[int, int, int, float]:
    """For a TIES merge with per-model densities: ``(tensors that differ, of which some expert of nonzero weight
    keeps another count -- round(d n) here, max(1, int(d n)) in mergekit 0.1.5's ``magnitude`` sparsification --,
    tensors whose counts all agree that differ, their max abs diff)``; each tensor's densities and weights as
    the clmerge runner reads them from the translated config."""
    import math

    from clmerge.merging.io.readers import open_checkpoint
    from clmerge.merging.methods.hparams import method_hparams, per_model_params
    from clmerge.merging.methods.registry import get_method
    from clmerge.merging.recipes import key_groups, recipe_of

    recipe = recipe_of(data)
    method = get_method(recipe.method)
    fed = per_model_params(method, method_hparams(method), recipe.models)
    x, y = open_checkpoint(a), open_checkpoint(b)
    differ = by_count = equal_differ = 0
    worst = 0.0
    for hp, keys in key_groups(sorted(x.keys()), {**recipe.parameters, **fed}, recipe.overrides,
                               {"densities", "weights"}):
        for k in keys:
            u, v = x.get(k).double(), y.get(k).double()
            d = float((u - v).abs().max()) if u.numel() else 0.0
            n = u.numel()
            moved = any(math.floor(de * n + 0.5) != max(1, int(de * n))
                        for de, w in zip(hp["densities"], hp["weights"]) if w != 0)
            differ += d > 0
            by_count += d > 0 and moved
            if not moved and d > 0:
                equal_differ += 1
                worst = max(worst, d)
    return differ, by_count, equal_differ, worst


def compare(a: Path, b: Path) -> tuple[float, int, int, str]:
    """``(max abs diff, tensors, tensors that differ, dtype)`` over every tensor of two model folders."""
    from clmerge.merging.io.readers import open_checkpoint

    x, y = open_checkpoint(a), open_checkpoint(b)
    keys = sorted(x.keys())
    if sorted(y.keys()) != keys:
        missing = sorted(set(keys) ^ set(y.keys()))
        raise ValueError(f"the outputs hold different keys: {missing[:3]}")
    worst, differ, dtypes = 0.0, 0, set()
    for k in keys:
        u, v = x.get(k), y.get(k)
        dtypes.add(str(u.dtype).replace("torch.", ""))
        d = float((u.double() - v.double()).abs().max()) if u.numel() else 0.0
        differ += d > 0
        worst = max(worst, d)
    return worst, len(keys), differ, "/".join(sorted(dtypes))


def run(python: str, work: Path, names: list[str] | None = None) -> list[dict]:
    """Every config (or those in ``names``) through both tools; one row per config."""
    work.mkdir(parents=True, exist_ok=True)
    models = build_models(work / "models")
    rows = []
    for name, text in configs().items():
        if names and name not in names:
            continue
        data = localize(text, models)
        stem = name.replace(" @", "_").replace(".yml", "")
        cfg = work / "configs" / f"{stem}.yml"
        cfg.parent.mkdir(exist_ok=True)
        cfg.write_text(yaml.safe_dump(data, sort_keys=False))
        ours, theirs = work / "clmerge" / stem, work / "mergekit" / stem
        t0 = time.perf_counter()
        refused = clmerge_merge(data, ours)
        failed = mergekit_merge(python, cfg, theirs)
        row = {"config": name, "clmerge": "refused" if refused else "ran",
               "mergekit": "failed" if failed else "ran", "note": refused or failed or "",
               "seconds": round(time.perf_counter() - t0, 1)}
        if not refused and not failed:
            row["max_abs_diff"], row["tensors"], row["differ"], row["dtype"] = compare(ours, theirs)
            if name in PROFILED:
                row["profile"] = [profile(p, models["base"], models["a"]) for p in (ours, theirs)]
            if name in COUNTED:
                row["counts"] = counts(data, ours, theirs)
        rows.append(row)
        print(row, flush=True)
    for label, (name, changes) in CLMERGE_DEFAULTS.items():
        if names and name not in names:
            continue
        stem = name.replace(" @", "_").replace(".yml", "")
        ours, theirs = work / "clmerge" / f"{stem}_default", work / "mergekit" / stem
        refused = clmerge_merge(localize(configs()[name], models), ours, changes)
        row = {"config": label, "clmerge": "refused" if refused else "ran", "mergekit": "ran", "note": refused or ""}
        if not refused and theirs.exists():
            row["max_abs_diff"], row["tensors"], row["differ"], row["dtype"] = compare(ours, theirs)
            if label in PROFILED:
                row["profile"] = [profile(p, models["base"], models["a"]) for p in (ours, theirs)]
            if label in AT_CUT:
                density, roles, base_role = AT_CUT[label]
                row["at_cut"] = at_cut(ours, theirs, models[base_role], [models[r] for r in roles], density)
        rows.append(row)
        print(row, flush=True)
    return rows


def table(rows: list[dict], command: str) -> str:
    lines = ["# mergekit configs through clmerge and mergekit 0.1.5", "",
             f"Made by `{command}` on {platform.machine()} ({os.cpu_count()} cores, CPU only), "
             f"torch {torch.__version__}. Configs: mergekit's examples ({SOURCE}), vendored unchanged under "
             "`tests/data/mergekit_examples/` with their model names mapped to tiny local models "
             f"({LAYERS}-layer Llama / Mistral, hidden size 16, base + 3 variants), and one config per other "
             "method (`EXTRA` in the script). Every tensor of the two outputs compared.", "",
             "| config | clmerge | mergekit | output dtype | tensors that differ | max abs diff | why |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        why = REASONS.get(r["config"], "")
        if r["clmerge"] == "refused" or r["mergekit"] == "failed":
            why = f"{why}; {r['note']}" if why else r["note"]
            lines.append(f"| `{r['config']}` | {r['clmerge']} | {r['mergekit']} | | | | {why} |")
            continue
        diff = "0 (identical)" if r["max_abs_diff"] == 0 else f"{r['max_abs_diff']:.3g}"
        if "profile" in r:
            (c, m) = r["profile"]
            why += (f"; expected output / task vector by magnitude decile (smallest, median, largest): clmerge "
                    f"{c[0]:.2f}, {c[4]:.2f}, {c[9]:.2f}; mergekit {m[0]:.2f}, {m[4]:.2f}, {m[9]:.2f}")
        if "counts" in r:
            c = r["counts"]
            why += (f"; of the {c[0]} tensors that differ, {c[1]} have an expert whose count differs; where every "
                    f"count agrees, {c[2]} differ" + (f" (max {c[3]:.3g})" if c[2] else " (identical)"))
        if "at_cut" in r:
            why += (f"; entries that differ: {r['at_cut'][0]}, of which {r['at_cut'][1]} have a magnitude equal to "
                    "their expert's cut")
        lines.append(f"| `{r['config']}` | ran | ran | {r['dtype']} | {r['differ']} of {r['tensors']} | {diff} | "
                     f"{why} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mergekit-python", default="/work/venvs/mergekit/bin/python")
    ap.add_argument("--work", type=Path, required=True, help="a folder for the models and outputs")
    ap.add_argument("--only", nargs="*", help="config names (default: all); their rows (and their option "
                    "rows) replace or extend those of the table already written")
    ap.add_argument("--write", type=Path, default=HERE / "mergekit_configs_vs_mergekit.md")
    ap.add_argument("--rows", type=Path, help="re-render the table from the row lines of an earlier run's log")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.rows:
        import ast

        rows = [ast.literal_eval(ln) for ln in args.rows.read_text().splitlines() if ln.startswith("{'config'")]
    else:
        rows = run(args.mergekit_python, args.work, args.only)
    cmd = ("PYTHONPATH=src python benchmarks/merging/mergekit_configs_vs_mergekit.py --mergekit-python "
           "/work/venvs/mergekit/bin/python --work DIR")
    text = table(rows, cmd)
    if args.only and args.write.exists():
        text = splice(args.write.read_text(), text)
    args.write.write_text(text)
    print(f"wrote {args.write}")


def splice(old: str, new: str) -> str:
    """The table ``old`` with the rows of ``new`` in place of the rows of the same config (a row of a config
    ``old`` lacks goes after the last row of its base config, or at the end)."""
    def rows(text: str) -> list[str]:
        return [ln for ln in text.splitlines() if ln.startswith("| `")]

    def name(line: str) -> str:
        return line.split("`")[1]

    lines = old.rstrip("\n").splitlines()
    for row in rows(new):
        names = [name(ln) if ln.startswith("| `") else None for ln in lines]
        if name(row) in names:
            lines[names.index(name(row))] = row
            continue
        related = [i for i, n in enumerate(names) if n is not None and n.split(",")[0] == name(row).split(",")[0]]
        lines.insert(related[-1] + 1 if related else len(lines), row)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
