"""``clmerge run CONFIG --dry-run``: every paper config passes on a random-init backbone and look-alike data.

The tests shorten ViT-B/16 to one block (``model.config.num_hidden_layers=1``); nothing else of the config
changes. One full-depth ViT-B/16 dry run and the slowest configs are marked slow (``make test-all``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from clmerge.cli import app
from clmerge.config import load_config
from clmerge.engine.dry_run import dry_run, lookalike_classes
from clmerge.methods import method_class
from clmerge.paper_configs import PAPER_DIR

PAPER = sorted(PAPER_DIR.glob("*.yaml"))
# Slow tier (`make test-all`): HALRP with AlexNet on Tiny-ImageNet (the method's own rank selection at the
# second task, SVDs of the large layers, takes ~100 s on this CPU) and the dry runs that took 8-30 s each on
# a loaded 2-core machine (DomainNet's 345 classes, Omniglot's 1200, 200-class ImageNet-R/A and CUB sets).
# Every method keeps dry runs in the default tier (pm_cifar100_10, sd_lora_imagenet_r_10, sd_lora_cifar100_10,
# halrp_cifar100_split_lenet, halrp_tiny20/five_dataset_resnet18_reduced...); DomainNet's and
# AlexNet's dry runs (9.5 and 6.7 s on a loaded machine) are in the slow tier only.
SLOW = {"halrp_tiny20_alexnet", "halrp_tiny40_alexnet", "halrp_omniglot_rotation_lenet", "pm_domainnet_5",
        "pm_imagenet_r_5", "pm_imagenet_r_10", "pm_imagenet_a_10", "pm_cub200_10", "sd_lora_domainnet_5",
        "sd_lora_imagenet_r_5", "pm_imagenet_r_20", "halrp_five_dataset_alexnet",
        # 5 ViT-B blocks (their prefixes live in blocks 0-4): 25-43 s each on a loaded machine; the prompt
        # methods' end-to-end, mechanism and resume tests stay in the default tier (test_prompt_methods.py)
        "dualprompt_imagenet_r_10", "dualprompt_imagenet_r_20", "coda_prompt_imagenet_r_10",
        "coda_prompt_imagenet_r_20", "l2p_imagenet_r_20", "magmax_imagenet_r_20",
        "l2p_imagenet_r_10", "magmax_imagenet_r_10",
        # HiDe-Prompt adds TII and TAP alignments over 768-d class covariances at each task end
        "hide_prompt_imagenet_r_10", "hide_prompt_imagenet_r_20",
        # the PILOT-protocol SimpleCIL on 200 ImageNet-R classes (15 s); its CIFAR-100 twin stays in the default tier
        "simplecil_imagenet_r_10",
        # MOS: ViT-B forwards under every task adapter at evaluation, class covariances and alignment (84-220 s)
        "mos_imagenet_r_10", "mos_cifar100_10",
        # twins of a dry run that stays in the default tier (same method and model, another look-alike class
        # count or task count), each 2-3 CPU s, none reaching a line of src/clmerge the default tier does not:
        # sd_lora_imagenet_r_10 stays, halrp_cifar100_split_lenet and halrp_tiny20_resnet18_reduced stay
        "sd_lora_imagenet_r_20", "sd_lora_imagenet_a_10", "sd_lora_cub200_10", "halrp_tiny40_resnet18_reduced",
        "halrp_cifar100_superclass_lenet", "halrp_pmnist_lenet"}
PARAMS = [pytest.param(p, id=p.stem, marks=pytest.mark.slow if p.stem in SLOW else ()) for p in PAPER]


def _overrides(path: Path) -> list[str]:
    """ViT-B/16 shortened to the fewest blocks the method's prompts need (1 without prompts; DualPrompt and
    CODA-Prompt prefix blocks 0-4, so 5)."""
    cfg = load_config(path)
    if "vit" not in cfg.model.name:
        return []
    opts = cfg.method.options()
    used = [i for key in ("layers", "g_layers", "e_layers") for i in opts.get(key) or []]
    return [f"model.config.num_hidden_layers={max(used, default=0) + 1}"]


def test_there_are_paper_configs() -> None:
    assert len(PAPER) >= 21


@pytest.mark.parametrize("path", PARAMS)
def test_paper_config_dry_run(path: Path, tmp_path) -> None:
    cfg = load_config(path, _overrides(path))
    lines: list[str] = []
    out = dry_run(cfg, echo=lines.append, workdir=tmp_path, train_per_class=1)
    assert out["tasks_run"] == 2 and out["n_tasks"] == cfg.scenario.n_tasks
    trains = method_class(cfg.method.name).trains_linear_head  # simplecil trains nothing: no loss to log
    assert len(out["accuracy_row"]) == 2 and set(out["losses"]) == ({0, 1} if trains else set())
    assert lines[-1].startswith("dry run ok")


def test_lookalike_class_counts() -> None:
    by_name = {p.stem: load_config(p) for p in PAPER}
    assert lookalike_classes(by_name["pm_domainnet_5"]) == 345
    assert lookalike_classes(by_name["sd_lora_imagenet_r_10"]) == 200
    assert lookalike_classes(by_name["halrp_tiny20_alexnet"]) == 200
    assert lookalike_classes(by_name["halrp_cifar100_superclass_lenet"]) == 100


def test_cli_dry_run_flag(tmp_path) -> None:
    path = next(p for p in PAPER if p.stem == "sd_lora_cifar100_10")
    res = CliRunner().invoke(app, ["run", str(path), "--dry-run", "--set", "model.config.num_hidden_layers=1"])
    assert res.exit_code == 0, res.output
    assert "dry run ok" in res.output and "look-alike data" in res.output
    assert not Path("runs").exists() or not any(Path("runs").glob("sd_lora-cifar100-*"))


def test_cli_dry_run_reports_failure(tmp_path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("scenario: {dataset: imagenet_r, n_tasks: 7}\nmodel: {name: vit-b16, config: {num_hidden_layers: 1}}\n"
                   "method: {name: seq_lora}\n")
    res = CliRunner().invoke(app, ["run", str(cfg), "--dry-run"])
    # a config error the real run would refuse too (200 classes in 7 tasks): the usage code, naming the key
    assert res.exit_code == 2 and "dry run failed" in res.output and "scenario.n_tasks=7" in res.output


@pytest.mark.slow  # full-depth ViT-B/16 on CPU
def test_full_depth_vit_b16_dry_run(tmp_path) -> None:
    path = next(p for p in PAPER if p.stem == "sd_lora_imagenet_r_10")
    out = dry_run(load_config(path), echo=lambda s: None, workdir=tmp_path)
    assert out["backbone_params"] > 85e6 and out["tasks_run"] == 2
