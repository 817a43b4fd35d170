"""run.precision: bf16/fp16 autocast in training and evaluation, fp32 for the end-of-task statistics."""

import json

import numpy as np
import pytest
import torch

from clmerge.config import parse_config
from clmerge.engine import setup as engine_setup
from clmerge.engine.heads import HeadSuite
from clmerge.utils.precision import autocast, check_precision, full_precision, grad_scaler
from clmerge.engine.run import run_experiment
from conftest import tiny_config


def test_autocast_and_scaler_follow_the_precision():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with autocast("fp32", "cpu"):
        assert lin(x).dtype == torch.float32
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        with autocast(name, "cpu"):
            assert lin(x).dtype == dtype
    assert [grad_scaler(p, "cpu").is_enabled() for p in ("fp32", "bf16", "fp16")] == [False, False, True]
    with pytest.raises(ValueError, match="run.precision"):
        check_precision("fp8", "cpu")


def test_full_precision_switches_autocast_off():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    gram = full_precision(lambda u, v: u @ v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert (a @ b).dtype == torch.bfloat16
        out = gram(a, b)
    assert out.dtype == torch.float32 and torch.equal(out, a @ b)


def _pretrained(precision: str, **extra) -> dict:
    return tiny_config(**{"model.pretrained": True, "model.config": {}, "run.precision": precision,
                          "scenario.train_per_class": 60, "scenario.test_per_class": 40, "train.epochs": 1,
                          "train.max_steps_per_epoch": 6, "method.rank": 4, **extra})


@pytest.mark.slow
def test_bf16_and_fp16_runs_stay_close_to_fp32(tmp_path):
    """The shipped pretrained tiny ViT on 2 digit tasks: bf16 and fp16 (with its loss scaler) give accuracies
    within 5 points and per-interval losses within 5% (or 0.005) of fp32 (bf16 has an 8-bit mantissa: its matmuls
    are exact to ~0.4%, which moves a few of these 80 test images per task)."""
    res = {}
    for p in ("fp32", "bf16", "fp16"):
        out = tmp_path / p
        res[p] = run_experiment(parse_config(_pretrained(p)), out)
        res[p]["losses"] = [json.loads(line)["loss"] for line in (out / "events.jsonl").read_text().splitlines()
                            if json.loads(line)["event"] == "step"]
        assert json.loads((out / "manifest.json").read_text())["precision"] == p
    ref = res["fp32"]
    # a meaningful comparison: the model learns (measured: CIL 54.2 / 54.9 / 54.2, chance 25)
    assert ref["acc"] > 45 and ref["til"]["acc"] > 80
    for p in ("bf16", "fp16"):
        assert abs(res[p]["acc"] - ref["acc"]) <= 5.0, p
        assert abs(res[p]["til"]["acc"] - ref["til"]["acc"]) <= 5.0, p
        np.testing.assert_allclose(res[p]["losses"], ref["losses"], rtol=0.05, atol=0.005, err_msg=p)


def _hostile(monkeypatch):
    """Every method's and head suite's end-of-task work called inside a bf16 autocast region."""
    build = engine_setup.build_method

    def build_hostile(*args, **kwargs):
        method = build(*args, **kwargs)
        for hook in ("begin_task", "end_task"):
            inner = getattr(method, hook)

            def wrapped(task, ctx, inner=inner):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    return inner(task, ctx)

            setattr(method, hook, wrapped)
        return method

    monkeypatch.setattr(engine_setup, "build_method", build_hostile)  # prepare() builds the method there
    end = HeadSuite.end_task

    def heads_hostile(self, *args, **kwargs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return end(self, *args, **kwargs)

    monkeypatch.setattr(HeadSuite, "end_task", heads_hostile)


def _state(out):
    from safetensors.torch import load_file

    return load_file(str(sorted((out / "checkpoints").glob("task_*.safetensors"))[-1]))


@pytest.mark.parametrize("method", [
    {"name": "pm", "rank": 2},  # Fisher accumulation, alpha sums (Eq. 8)
    {"name": "inflora", "rank": 2},  # input covariances, DualGPM SVDs
    {"name": "ewc"},  # Fisher
    {"name": "sd_lora", "rank": 2},  # direction Gram / least squares (the RR/KD statistics)
])
def test_end_of_task_statistics_stay_fp32_inside_an_autocast_region(tmp_path, monkeypatch, method):
    """A bf16 run whose end-of-task hooks run inside a caller's bf16 autocast region must give bit-identical
    method and head state to the same run without it: the statistics are computed in fp32 either way (without
    the fp32 guards, the Fisher / covariance / Gram / feature-statistic matmuls drop to bf16 and this fails)."""
    extra = {"method": method, "head.align": True, "head.align_epochs": 2, "scenario.val_fraction": 0.1}
    plain = tmp_path / "plain"
    run_experiment(parse_config(tiny_config(**{"run.precision": "bf16", **extra})), plain)
    _hostile(monkeypatch)
    hostile = tmp_path / "hostile"
    run_experiment(parse_config(tiny_config(**{"run.precision": "bf16", **extra})), hostile)
    a, b = _state(plain), _state(hostile)
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype not in (torch.bfloat16, torch.float16), k
        assert torch.equal(a[k], b[k]), k
