"""``clmerge merge-bench``: the merging benchmark (:func:`clmerge.harness.merge_bench_run.run_merge_bench`)."""

from __future__ import annotations

from pathlib import Path

import typer

from .base import app, fail
from ..utils.inpaths import read_text as read_input_text

__all__ = ["merge_bench_command"]


@app.command("merge-bench")
def merge_bench_command(
    out: Path | None = typer.Option(None, "--out", help="results directory (default: ./merge-bench-runs/suite<S>; "
                                    "a folder holding an earlier merge-bench result is reused)"),
    suite: str = typer.Option("8", "--suite", help="task suite: 8, 14 or split8 (these two need Fashion-MNIST), "
                              "tiny, text6 / text-tiny (WordNet supersenses on minilm-l6; docs/text.md), or "
                              "clip-ta8 / clip-tall14 / clip-tall20 (given CLIP experts; docs/clip_merging.md)"),
    backbone: str | None = typer.Option(None, "--backbone", help="the backbone to fine-tune (default: the suite's: "
                                        "minilm-l6 for text suites, else vit-tiny-fmnist)"),
    heads: str = typer.Option("frozen", "--heads", help="head protocol: frozen (heads fitted on the pretrained "
                              "backbone before fine-tuning, then fixed) or cotrained (trained with each expert)"),
    head_init: str = typer.Option("probe", "--head-init", help="frozen heads: probe (linear probe) or prototypes "
                                  "(class means); probe was chosen on validation: benchmarks/merging/README.md"),
    seeds: str = typer.Option("0", "--seeds", "--seed", help="fine-tuning seed(s), e.g. 0 or 0,1,2 (several: "
                              "one run per seed in OUT/seed<s> and mean ± standard error in OUT)"),
    epochs: int = typer.Option(5, "--epochs", help="fine-tuning epochs per expert (chosen on validation: "
                               "benchmarks/merging/lr_probe.md)"),
    lr: float = typer.Option(1e-4, "--lr", help="AdamW learning rate of the experts' fine-tuning (chosen on "
                             "validation: benchmarks/merging/lr_probe.md)"),
    max_train: int | None = typer.Option(None, "--max-train", help="cap on training samples per task (default: "
                                         "none; text6: 768)"),
    max_eval: int | None = typer.Option(None, "--max-eval", help="cap on validation/test samples per task (default: "
                                        "none; text6: 400)"),
    random_init: bool = typer.Option(False, "--random-init", help="start from a random-init backbone (dry runs)"),
    method: list[str] = typer.Option([], "--method", help="only these methods (repeatable; default: all in the grid)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="write into an existing non-empty --out that holds "
                                   "no merge-bench result"),
    continual: bool = typer.Option(False, "--continual", help="the continual-merging protocol: experts arrive one "
                                   "at a time, every merge so far is evaluated; accuracy matrix, final accuracy and "
                                   "BWT of opcm, dop, running_average, magmax and pm_alpha in OUT/continual.md"),
    clip: str | None = typer.Option(None, "--clip", help="clip-* suites: the CLIP model, a folder or hub id (e.g. "
                                    "openai/clip-vit-base-patch32); docs/clip_merging.md"),
    experts_pattern: str = typer.Option("tanganke/clip-vit-base-patch32_{dataset}", "--experts",
                                        help="clip-* suites: each expert's folder or hub id, {dataset} filled in"),
    data_root: Path | None = typer.Option(None, "--data-root", help="clip-* suites: ROOT/<dataset>/test/<label>/* "
                                          "(default: $CLMERGE_DATA, else ./data)"),
    datasets: str | None = typer.Option(None, "--datasets", help="clip-* suites: only these datasets (comma list)"),
    hp: list[str] = typer.Option([], "--hp", help="clip-* suites: METHOD.KEY=VALUE overriding a method's fixed "
                                 "hyperparameter (repeatable)"),
    device: str = typer.Option("cpu", "--device", help="clip-* suites: torch device (cpu, cuda)"),
) -> None:
    """Fine-tune one expert per task, merge with every method, select on validation, report test accuracy."""
    from ..utils.outpaths import check_output_dir
    from ..harness.merge_bench_run import parse_seeds, run_merge_bench

    _check_suite_options(suite, continual=continual, seeds=seeds, clip=clip, data_root=data_root,
                         datasets=datasets, hp=hp, device=device)
    if suite.startswith("clip-"):
        return _clip(out, suite, clip, experts_pattern, data_root, datasets, method, hp, max_eval, device, overwrite)
    if out is None:  # never into the source tree's benchmarks/ unless asked
        out = Path("merge-bench-runs") / f"suite{suite}"
        typer.echo(f"writing to {out.absolute()} (give --out to choose)", err=True)
    check_output_dir(out, overwrite=overwrite, ours=("results.json", "continual.json", "experts", "seed0"))
    try:
        res = run_merge_bench(out, suite=suite, epochs=epochs, lr=lr, max_train=max_train, max_eval=max_eval,
                              random_init=random_init, methods=method or None, heads=heads, head_init=head_init,
                              seeds=parse_seeds(seeds), backbone=backbone, continual=continual)
    except (ValueError, FileNotFoundError, KeyError) as exc:
        fail(exc)
    name = "continual" if continual else "results"
    typer.echo(read_input_text(out / f"{name}.md", within=out))
    typer.echo(f"wrote {out / f'{name}.json'} ({len(res['tasks'])} tasks)")


def _parse_hp(items: list[str]) -> dict[str, dict]:
    from ..utils.yaml_io import YamlError, load_yaml

    out: dict[str, dict] = {}
    for item in items:
        key, eq, value = item.partition("=")
        m, dot, k = key.partition(".")
        if not (eq and dot and m and k):
            fail(ValueError(f"--hp {item!r}: expected METHOD.KEY=VALUE, e.g. task_arithmetic.scaling=0.3"))
        try:
            out.setdefault(m, {})[k] = load_yaml(value, source=f"--hp {key}")
        except YamlError as exc:
            fail(ValueError(f"--hp {item!r}: not a YAML value ({exc})"))
    return out


def _clip(out, suite, clip, experts, data_root, datasets, methods, hp, max_eval, device, overwrite) -> None:
    """``merge-bench --suite clip-*``: the given CLIP experts merged by every method (harness.merge_bench_clip)."""
    from ..data.folders import resolve_data_root
    from ..errors import UsageError
    from ..harness.merge_bench_clip import run_clip_bench
    from ..utils.outpaths import check_output_dir

    if clip is None:
        fail(UsageError(f"--suite {suite}: needs --clip (a CLIP folder or hub id, e.g. openai/clip-vit-base-patch32)"))
    if out is None:
        out = Path("merge-bench-runs") / "clip"
        typer.echo(f"writing to {out.absolute()} (give --out to choose)", err=True)
    check_output_dir(out, overwrite=overwrite, ours=("table1.md", "heads"))
    try:
        run_clip_bench(out, suite=suite, clip=clip, data_root=resolve_data_root(data_root), experts=experts,
                       datasets=[d.strip() for d in datasets.split(",")] if datasets else None,
                       methods=methods or None, hparams=_parse_hp(hp), max_eval=max_eval, device=device)
    except (ValueError, FileNotFoundError, KeyError, OSError) as exc:
        fail(exc)
    typer.echo(read_input_text(out / suite / "results.md", within=out))
    typer.echo(read_input_text(out / "table1.md", within=out))
    typer.echo(f"wrote {out / suite / 'results.json'} and {out / 'table1.md'}")


def _check_suite_options(suite: str, **given) -> None:
    """Refuse an option the chosen suite would silently ignore: the fine-tuned suites' protocol options with a
    clip-* suite (given experts, no fine-tuning, one evaluation) and the clip-only options with the others."""
    from ..errors import UsageError

    if suite.startswith("clip-"):
        ignored = [f for f, on in (("--continual", given["continual"]), ("--seeds", given["seeds"] != "0")) if on]
    else:
        ignored = [f for f, on in (("--clip", given["clip"] is not None), ("--data-root", given["data_root"] is not None),
                                   ("--datasets", given["datasets"] is not None), ("--hp", bool(given["hp"])),
                                   ("--device", given["device"] != "cpu")) if on]
    if ignored:
        scope = ("a clip-* suite evaluates the given experts once (no fine-tuning, no continual protocol)"
                 if suite.startswith("clip-") else "it applies to clip-* suites only")
        raise UsageError(f"{ignored[0]} with --suite {suite}: {scope}; leave it out")
