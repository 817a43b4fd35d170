"""``llm_scale.md`` from ``llm_scale.json`` (by ``llm_scale.py``; running this file rewrites it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

GIB = 2**30
SHARED = ("task_arithmetic", "linear", "ties_per_tensor", "dare_linear", "dare_ties")
ORDER = ("task_arithmetic", "linear", "ties_per_tensor", "ties_global", "dare_linear", "dare_ties", "cart",
         "tsv_m", "iso_cts")
SVD = ("cart", "tsv_m", "iso_cts")


def _model_bytes(res: dict[str, Any]) -> int:
    c = res["spec"]["config"]
    h, i, L, v = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    return 2 * (2 * v * h + L * per_layer + h)  # bf16


def _largest_tensor_bytes(res: dict[str, Any]) -> int:
    c = res["spec"]["config"]
    return 2 * c["vocab_size"] * c["hidden_size"]


def _cell_row(method: str, tool: str, c: dict[str, Any], model: int) -> str:
    if c.get("status") != "ok":
        status = c.get("status", "not run").split(":")[0]
        return f"| {method} | {tool} | {status} |" + " |" * 7
    loads = c.get("loads", {})
    ok = "yes" if loads.get("ok") else f"no ({loads.get('load_error') or loads.get('error') or 'keys'})"[:80]
    lb, la = c["load_before"], c["load_after"]
    peak = c["peak_rss_bytes"]
    return (f"| {method} | {tool} | ok | {c['wall_s']:.0f} | {c['cpu_s']:.0f} | {peak / GIB:.2f} "
            f"({peak / model:.2f}) | {c['polled_peak_anon_bytes'] / GIB:.2f} | "
            f"{c['polled_peak_file_bytes'] / GIB:.2f} | {ok}, {loads.get('shards', '?')} shard(s) | "
            f"{lb[0]:.2f} -> {la[0]:.2f} |")


def cells_table(res: dict[str, Any], condition: str, model: int) -> str:
    head = ("| method | tool | status | wall s | CPU s | peak RSS GiB (models) | anon GiB | file-backed GiB "
            "| output loads | load avg 1 min, before -> after |\n|---|---|---|---|---|---|---|---|---|---|\n")
    methods = sorted(dict.fromkeys(k.split("/")[2] for k in res["cells"] if k.startswith(condition + "/")),
                     key=lambda m: ORDER.index(m) if m in ORDER else len(ORDER))
    rows = [_cell_row(m, t, res["cells"].get(f"{condition}/{t}/{m}", {}), model)
            for m in methods for t in ("clmerge", "mergekit", "fusionbench")
            if t != "fusionbench" or f"{condition}/{t}/{m}" in res["cells"]]
    return head + "\n".join(rows) + "\n"


def goal_table(res: dict[str, Any]) -> str:
    out = ["| condition | method | mergekit peak GiB | clmerge budget GiB (0.5x) | clmerge peak GiB | ratio "
           "(goal <= 0.5) | mergekit wall s | clmerge wall s | ratio (goal <= 1) | met |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for cond in ("idle", "busy"):
        for m in SHARED:
            a, b = (res["cells"].get(f"{cond}/{t}/{m}", {}) for t in ("clmerge", "mergekit"))
            mk = (f"{b['peak_rss_bytes'] / GIB:.2f} | {0.5 * b['peak_rss_bytes'] / GIB:.2f}"
                  if b.get("status") == "ok" else "- | -")
            mk_wall = f"{b['wall_s']:.0f}" if b.get("status") == "ok" else "-"
            if a.get("status") != "ok" or b.get("status") != "ok":
                why = a.get("status", "not run") if a.get("status") != "ok" else b.get("status", "not run")
                out.append(f"| {cond} | {m} | {mk} | - | - | {mk_wall} | - | - | {why.split(':')[0]} |")
                continue
            r, w = a["peak_rss_bytes"] / b["peak_rss_bytes"], a["wall_s"] / b["wall_s"]
            out.append(f"| {cond} | {m} | {mk} | {a['peak_rss_bytes'] / GIB:.2f} | {r:.2f} | {mk_wall} | "
                       f"{a['wall_s']:.0f} | {w:.2f} | {'yes' if r <= 0.5 and w <= 1 else 'no'} |")
    return "\n".join(out) + "\n"


def svd_table(res: dict[str, Any], model: int) -> str:
    """The SVD merges: clmerge's peak against one model's size, FusionBench / clmerge as ratios."""
    imports = res["cells"].get("baseline/clmerge", {}).get("peak_rss_bytes", 0)
    out = ["| condition | method | clmerge peak GiB (models) | clmerge peak above its imports GiB (models) | "
           "clmerge wall s | FusionBench peak GiB (models) | FusionBench wall s | peak ratio FB / clmerge | "
           "wall ratio FB / clmerge | clmerge peak <= 1 model (above imports) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for cond in ("idle", "busy"):
        for m in SVD:
            a, b = (res["cells"].get(f"{cond}/{t}/{m}", {}) for t in ("clmerge", "fusionbench"))
            if a.get("status") != "ok":
                continue
            pa = a["peak_rss_bytes"]
            work = pa - imports
            cl = f"{pa / GIB:.2f} ({pa / model:.2f}) | {work / GIB:.2f} ({work / model:.2f}) | {a['wall_s']:.0f}"
            if b.get("status") == "ok":
                pb = b["peak_rss_bytes"]
                fb = (f"{pb / GIB:.2f} ({pb / model:.2f}) | {b['wall_s']:.0f} | {pb / pa:.2f} | "
                      f"{b['wall_s'] / a['wall_s']:.2f}")
            else:
                fb = f"{b.get('status', 'not run').split(':')[-1].strip()} | - | - | -"
            met = "yes" if pa <= model else "no" + (" (yes)" if work <= model else " (no)")
            out.append(f"| {cond} | {m} | {cl} | {fb} | {met} |")
    return "\n".join(out) + "\n"


def agreement_table(res: dict[str, Any]) -> str:
    out = ["| method | tool | entries changed from the base | norm of the merged delta | distance to the "
           "dense task-arithmetic merge (relative) |", "|---|---|---|---|---|"]
    for m in ORDER:
        for t in ("clmerge", "mergekit"):
            s = res["cells"].get(f"idle/{t}/{m}", {}).get("stats")
            if s and "a_changed_fraction" in s:
                ta = s.get("a_rel_dist_to_dense_ta")
                out.append(f"| {m} | {t} | {100 * s['a_changed_fraction']:.2f}% | {s['a_delta_norm']:.4g} | "
                           f"{'' if ta is None else f'{ta:.4f}'} |")
    out += ["", "| method | bit-identical | max abs diff | entries that differ | ||clmerge - mergekit|| / "
            "||mergekit delta|| | cosine of the deltas |", "|---|---|---|---|---|---|"]
    for m in SHARED:
        s = res["cells"].get(f"agreement/{m}")
        if not s or "max_abs_diff" not in s:
            out.append(f"| {m} | {'pending' if not s else s.get('error', '?')} | | | | |")
            continue
        out.append(f"| {m} | {'yes' if s['bit_identical'] else 'no'} | {s['max_abs_diff']:.3g} | "
                   f"{100 * s['differ_fraction']:.4f}% | {s['rel_diff']:.3g} | {s['delta_cosine']:.6f} |")
    return "\n".join(out) + "\n"


def _parse_size(text: str) -> float:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9}
    return float(text[:-2]) * units[text[-2:]] if text[-2:] in units else float(text)


def memory_model(res: dict[str, Any], model: int) -> str:
    """The 7B extrapolation from the measured idle peaks (the reasoning is in NOTES)."""
    big, big_tensor = 2 * 6.74e9, 2 * 32000 * 4096  # Llama-2-7B: bf16 bytes, embedding bytes
    out_shard, in_shard = _parse_size(res["shard"]), _parse_size(res["spec"]["shard"])
    inputs = 1 + res["spec"]["variants"]
    lines = []
    for tool in ("mergekit", "clmerge"):
        cells = [c for k, c in res["cells"].items()
                 if k.startswith(f"idle/{tool}/") and c.get("status") == "ok"]
        if not cells:
            lines.append(f"- {tool}: no idle cell measured yet.")
            continue
        worst = max(cells, key=lambda c: c["peak_rss_bytes"])
        anon, file_ = worst["polled_peak_anon_bytes"], worst["polled_peak_file_bytes"]
        held = min(model, out_shard) if tool == "mergekit" else 0  # mergekit holds the current output shard
        # the interpreter and its imports: a constant, not scaled
        base = res["cells"].get(f"baseline/{tool}", {}).get("polled_peak_anon_bytes", 0)
        work = max(anon - held - base, 0)
        ratio = big_tensor / _largest_tensor_bytes(res)
        anon_7b = min(big, held and out_shard) + base + work * ratio
        peak = worst["peak_rss_bytes"]
        lines.append(
            f"- {tool}: largest idle peak {peak / GIB:.2f} GiB = {peak / model:.2f} models of "
            f"{model / GIB:.2f} GiB (anonymous {anon / GIB:.2f} GiB, file-backed {file_ / GIB:.2f} GiB = "
            f"{file_ / (inputs * in_shard):.2f} x one {in_shard / 1e6:.0f} MB input shard per input). "
            f"Anonymous = {base / GIB:.2f} GiB of interpreter and imports + "
            + (f"the output shard held whole ({held / GIB:.2f} GiB) + " if held else "")
            + f"{work / GIB:.2f} GiB of per-key working set, which scales with the largest tensor "
            f"(x{ratio:.0f} in a 7B Llama): a 7B merge needs about {anon_7b / GIB:.1f} GiB of private memory"
            + (f" (5 GB output shards), plus up to one mapped input shard per input ({inputs} x 5 GB for "
               "5 GB shards), file-backed and reclaimable." if held else "."))
    return "\n".join(lines) + "\n"


def _runtime(res: dict[str, Any]) -> str:
    if "last_run_s" in res:
        return f"{res['last_run_s'] / 60:.0f} min"
    return "interrupted before the end (the cells it finished are below)"


def write_report(res: dict[str, Any], path: Path) -> None:
    model = _model_bytes(res)
    c = res["spec"]["config"]
    text = HEADER.format(params=model / 2 / 1e9, gib=model / GIB, layers=c["num_hidden_layers"],
                         hidden=c["hidden_size"], heads=c["num_attention_heads"], kv=c["num_key_value_heads"],
                         cpus=res["cpus"], mem=res["mem_total_bytes"] / GIB,
                         threads=res["threads"], shard=res["shard"], runtime=_runtime(res),
                         tokenizer="with" if res["spec"].get("tokenizer") else "without")
    busy = 'Beside a busy CPU process (`python -c "while True: pass"`)'
    for cond, title in (("idle", "Idle machine"), ("busy", busy)):
        text += f"\n## {title}\n\n" + cells_table(res, cond, model)
    loads = [c[w][0] for c in res["cells"].values() if "load_before" in c
             for w in ("load_before", "load_after")]
    if loads:
        text += (f"\nLoad average (1 min) around the cells: {min(loads):.1f} to {max(loads):.1f} on "
                 f"{res['cpus']} CPUs. \"Idle\" means no busy process of ours; other engineers' jobs ran "
                 "throughout, so wall times are noisy; CPU seconds and peak RSS are less affected by the "
                 "load.\n")
    reasons = sorted({c["status"] for c in res["cells"].values() if ":" in c.get("status", "")})
    text += "".join(f"\n- {r}" for r in reasons) + ("\n" if reasons else "")
    text += "\n## Goal: at most half of mergekit's peak memory, no slower\n\n" + goal_table(res)
    if any(k.split("/")[-1] in SVD for k in res["cells"]):
        text += "\n## SVD merges (CART, TSV-M, Iso-CTS) beside FusionBench\n\n" + svd_table(res, model)
    text += "\n## Agreement (idle outputs, key by key)\n\n" + agreement_table(res)
    text += "\n## Memory model and a 7B merge\n\n" + memory_model(res, model) + NOTES
    old = path.read_text() if path.exists() else ""
    path.write_text(text + (old[old.index(SVD_MARK):] if SVD_MARK in old else ""))


# the hand-kept section on another model set (llm_scale.py --layers 2): a rewrite of the report keeps it
SVD_MARK = "\n# SVD merges on the 2-layer set"


def svd_runs_section(runs: list[dict[str, Any]]) -> str:
    """One SVD table per invocation of ``llm_scale.py`` (the same cells measured again, interleaved)."""
    model = _model_bytes(runs[0])
    return "".join(f"\n### Run {i}\n\n" + svd_table(r, model) for i, r in enumerate(runs, 1))


HEADER = """# clmerge vs mergekit on a 1.1B Llama (llm_scale)

Made by `benchmarks/merging/llm_scale.py` (command and method in its docstring); raw numbers in
`llm_scale.json`.

- Models: Llama architecture with TinyLlama-1.1B shapes ({layers} layers, hidden {hidden}, {heads} heads, {kv}
  KV heads), {params:.2f} B parameters, random init, bf16 ({gib:.2f} GiB), saved with `save_pretrained` in ~5
  shards {tokenizer} a tokenizer (a small BPE trained offline on this repo's Markdown); base + 3 variants
  (`llm_models.py`: sparse Gaussian + low-rank deltas of ~1% of each tensor's scale).
- Machine: {cpus} CPUs visible, {mem:.0f} GiB, shared with other engineers (hence the load averages). Both
  tools: {threads} thread(s), output shards of {shard} (both tools' default), arithmetic in fp32 (mergekit:
  `dtype: float32`, `out_dtype: bfloat16`), bf16 output. mergekit 0.1.5 (`mergekit-yaml`) in its own venv.
- Peak RSS is the kernel's high-water mark (`ru_maxrss`) of the merge process; "anon" and "file-backed" are
  the peaks of its two parts polled every 0.1 s. File-backed pages are input files mapped by `safetensors`
  (page cache, reclaimable, but counted in RSS). "models" = peak / the size of one model.
- Last invocation of the script: {runtime}. Run it again to fill "pending" / missing cells (it skips finished
  ones): `python3 -m venv /work/venvs/mergekit && /work/venvs/mergekit/bin/pip install -c constraints.txt
  mergekit==0.1.5` once, then `nice -n 5 env PYTHONPATH=src .venv/bin/python benchmarks/merging/llm_scale.py
  --data /work/llm_models --mergekit /work/venvs/mergekit` (or `MERGEKIT_VENV=...`).
"""

NOTES = """
Reasoning: a streaming merge holds what the writer has not written yet (mergekit: the whole current output
shard, flushed when the next tensor would overflow `--out-shard-size`, 5 GB by default, so for a 1.1B model
the whole output) plus, per key, the inputs of that key and a few fp32 temporaries: about (inputs + 3) x the
largest tensor in fp32. In a 7B Llama the largest tensors are the embedding and the LM head, 32000 x 4096; the
input pages that `safetensors` maps add file-backed RSS that the kernel can drop under pressure. A 7B merge
with 5 GB shards therefore needs about one output shard (5 GB) plus a few GB of working set; a writer that
streams each tensor to disk as it is made (the header of a safetensors shard is known from the plan) needs
only the working set.

Noise: on this shared 2-core machine the same cell's wall time varied by up to 15x between invocations
(mergekit task arithmetic, idle: 485 s in the first run at load ~13, 33 s when re-measured at load ~2; CPU
seconds 38 and 31). The script runs clmerge and mergekit back to back for each method; for the final table
measure both tools in one invocation (`--redo`), and read wall ratios together with the CPU seconds.

## Why the outputs differ

- **task arithmetic:** both compute `base + lambda * sum_t (theta_t - base)` in fp32 from bf16 inputs and
  round once to bf16; identical unless the order of the fp32 additions differs.
- **linear:** both compute the mean of the 3 variants in fp32 (mergekit: `addcmul` by weights, then divide by
  their sum; clmerge: sum / 3); a different rounding order can move a few entries by one bf16 ulp.
- **TIES per tensor:** mergekit keeps `int(density * n)` entries per tensor, chosen by `argsort` of |delta|,
  so entries tied at the threshold are kept in whatever order the sort leaves them; clmerge keeps exactly
  `round(density * n)` with a deterministic tie rule. bf16 deltas tie a lot (a delta of ~1% of an entry's
  scale is a few ulps), so the kept sets differ at the threshold. Elected sign of a zero sum: mergekit +1,
  clmerge the model-wide majority sign. Differences are at the trimmed-threshold magnitude.
- **TIES global:** only clmerge (the TIES paper and FusionBench trim over the whole task vector; mergekit
  trims per tensor).
- **DARE:** random masks (mergekit: `torch.bernoulli` with `--random-seed 0`; clmerge: a generator per key and
  expert), so statistics are compared, not bits. Rescaling: clmerge divides kept entries by `1 - p` (the
  paper); mergekit's `rescale` rescales each masked tensor to the L1 norm of the unmasked one, which is
  `1/(1-p)` only in expectation. The column "distance to the dense task-arithmetic merge" is what DARE equals
  in expectation. dare_ties: mergekit with `normalize: true` (a disjoint mean like clmerge's `merge_fn=mean`),
  density 1 in clmerge's TIES step (sign election only), as mergekit's `dare_ties` does no magnitude trim. """


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    js = Path(sys.argv[1]) if len(sys.argv) > 1 else here / "llm_scale.json"
    md = Path(sys.argv[2]) if len(sys.argv) > 2 else here / "llm_scale.md"
    write_report(json.loads(js.read_text()), md)
