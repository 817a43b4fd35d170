"""Plot the image-vs-text verdict figure: the same methods on the image and the text sequence side by side.

Reads ``runs.json`` (written by ``run_evidence.py``) and writes ``figures/regimes.png``: per method, the
test CIL accuracy of the linear head and of RanPAC, and the linear head's TIL accuracy, mean ± standard error
over seeds, for split_mnist5k (the 1M-parameter ViT) and wordnet10 (all-MiniLM-L6-v2).

    python benchmarks/lora_cl/plot_regimes.py
"""

from __future__ import annotations

import json
from pathlib import Path

from clmerge.harness.merge_bench_seeds import mean_se

HERE = Path(__file__).resolve().parent
METHODS = ["frozen", "seq_lora", "pm", "pm_m", "pm_gauss", "lora_avg", "sd_lora", "sd_lora_rr", "inflora"]
PANELS = [("split_mnist5k", "images: split_mnist5k on the 1M ViT"), ("wordnet10", "text: wordnet10 on MiniLM-L6")]
BARS = [("linear CIL", lambda r: r["heads"]["linear"]["acc"]), ("RanPAC CIL", lambda r: r["heads"]["ranpac"]["acc"]),
        ("linear TIL", lambda r: r["til"]["acc"])]


def main(runs_path: Path = HERE / "runs.json", out: Path = HERE / "figures" / "regimes.png") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = json.loads(runs_path.read_text())
    fig, axes = plt.subplots(1, len(PANELS), figsize=(13, 4.2), sharey=True)
    width = 0.8 / len(BARS)
    for ax, (bench, title) in zip(axes, PANELS):
        methods = [m for m in METHODS if m in runs.get(bench, {})]
        for j, (label, get) in enumerate(BARS):
            stats = [mean_se([get(r) for r in runs[bench][m].values()]) for m in methods]
            xs = [i + (j - (len(BARS) - 1) / 2) * width for i in range(len(methods))]
            ax.bar(xs, [s[0] for s in stats], width, yerr=[s[1] for s in stats], label=label, capsize=2)
        ax.set_xticks(range(len(methods)), methods, rotation=35, ha="right")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("test accuracy (%), mean ± s.e. over seeds")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(BARS), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(out)
    return out


if __name__ == "__main__":
    print(f"wrote {main()}")
