"""ER, DER and DER++: the reservoir buffer is Algorithm R, the losses are their formulas, the buffer is used
in a class-incremental digits run and survives resume bit for bit."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clmerge.config import parse_config
from clmerge.engine.checkpoint import load_checkpoint
from clmerge.engine.run import run_experiment
from clmerge.methods import build_method, method_options_model
from clmerge.methods.rehearsal import replay_generator
from clmerge.methods.reservoir import ReservoirBuffer, reservoir_slots
from _lora_cl_helpers import uncommit_checkpoint


def _algorithm_r(stream: list[int], size: int, u: list[float]) -> list[int]:
    """Vitter's Algorithm R written out: item n replaces slot floor(u_n (n + 1)) if that is < size."""
    kept: list[int] = []
    for n, item in enumerate(stream):
        if n < size:
            kept.append(item)
        elif (j := int(u[n] * (n + 1))) < size:
            kept[j] = item
    return kept


def test_the_reservoir_keeps_algorithm_rs_choices():
    u = torch.rand(10, generator=torch.Generator().manual_seed(3), dtype=torch.float64).tolist()
    # by hand from these draws: items 3..9 draw j = floor(u_n (n + 1)); j < 3 replaces slot j
    hand = [int(u[n] * (n + 1)) for n in range(3, 10)]
    expected = _algorithm_r(list(range(10)), 3, u)
    buf = ReservoirBuffer(3)
    buf.add(torch.Generator().manual_seed(3), x=torch.arange(10))
    assert buf.fields["x"].tolist() == expected and buf.n_seen == 10 and len(buf) == 3
    # u[3:] = .175 .755 .608 .199 .433 .405 .779, so j = 0 3 3 1 3 3 7: item 3 replaces slot 0, item 6 slot 1,
    # items 4, 5, 7, 8, 9 are dropped
    assert hand == [0, 3, 3, 1, 3, 3, 7]
    assert expected == [3, 6, 2]


def test_slots_continue_the_stream_across_batches():
    g = torch.Generator().manual_seed(0)
    assert reservoir_slots(0, 4, 3, g) == [0, 1, 2]  # not full: slot n
    u = torch.rand(5, generator=torch.Generator().manual_seed(1), dtype=torch.float64).tolist()
    slots = reservoir_slots(10, 4, 5, torch.Generator().manual_seed(1))
    assert slots == [j if (j := int(u[i] * (10 + i + 1))) < 4 else -1 for i in range(5)]


def test_every_item_is_kept_with_probability_size_over_n():
    size, n, seeds = 5, 20, 3000
    counts = torch.zeros(n)
    for s in range(seeds):
        buf = ReservoirBuffer(size)
        for start in range(0, n, 4):  # batches of 4, as a training stream offers them
            buf.add(torch.Generator().manual_seed(s * 100 + start), x=torch.arange(start, start + 4))
        counts[buf.fields["x"]] += 1
    freq = counts / seeds
    assert torch.all((freq - size / n).abs() < 0.05), freq  # 0.25 each; the s.e. is about 0.008


def test_a_field_widens_with_zero_padding_and_draws_are_distinct_rows():
    buf = ReservoirBuffer(4)
    g = torch.Generator().manual_seed(0)
    buf.add(g, z=torch.ones(2, 2))
    buf.add(g, z=torch.full((2, 3), 2.0))
    assert buf.fields["z"].tolist() == [[1, 1, 0], [1, 1, 0], [2, 2, 2], [2, 2, 2]]
    rows = buf.sample(10, torch.Generator().manual_seed(0))["z"]
    assert rows.shape == (4, 3) and sorted(rows.sum(1).tolist()) == [2, 2, 6, 6]
    assert buf.nbytes() == 4 * 3 * 4


class _Tiny(nn.Module):
    def __init__(self, d=3, k=4):
        super().__init__()
        torch.manual_seed(0)
        self.backbone, self.head = nn.Linear(d, d), nn.Linear(d, k)

    def forward(self, x):
        return self.head(self.backbone(x))


def _method(name: str, **opts):
    opts.setdefault("head_convention", "grow")  # these formulas are the grown head's (stored width 2 of 4)
    m = build_method(name, method_options_model(name)(buffer_size=6, minibatch_size=3, **opts), seed=7)
    model = _Tiny()
    m.setup(model)
    return m, model


def _ctx(lo=2, hi=4):
    return SimpleNamespace(task=SimpleNamespace(class_range=(lo, hi), index=1), head_loss="seen", batch_size=5,
                           log=lambda ev: None)


def _fill(m, gen=0):
    g = torch.Generator().manual_seed(gen)
    m.buffer.add(g, x=torch.randn(6, 3, generator=g), y=torch.tensor([0, 1, 0, 1, 0, 1]),
                 logits=torch.randn(6, 2, generator=g), width=torch.full((6,), 2))


@pytest.mark.parametrize("name", ["der", "derpp"])
def test_der_loss_is_its_formula(name):
    m, model = _method(name, logit_padding="mask")
    _fill(m)
    m.step = 5
    x, y = torch.randn(5, 3, generator=torch.Generator().manual_seed(9)), torch.tensor([2, 3, 3, 2, 3])
    got = m.loss(model, x, y, _ctx())
    b1 = m.buffer.sample(3, replay_generator(7, 5, 1))
    ce = F.cross_entropy(model(x), y)  # head.loss seen: every class up to the task's end
    mse = (model(b1["x"])[:, :2] - b1["logits"]).pow(2).mean()  # stored width 2: the new classes left out
    want = ce + m.options.alpha * mse
    if name == "derpp":
        b2 = m.buffer.sample(3, replay_generator(7, 5, 2))
        want = want + m.options.beta * F.cross_entropy(model(b2["x"]), b2["y"])
    assert torch.allclose(got, want, atol=1e-6)
    assert (m.options.alpha, getattr(m.options, "beta", None)) == ((0.3, None) if name == "der" else (0.1, 0.5))


def test_der_zero_padding_compares_the_new_classes_with_zero():
    m, model = _method("der")  # logit_padding's default
    _fill(m)
    x, y = torch.randn(5, 3), torch.tensor([2, 3, 3, 2, 3])
    b = m.buffer.sample(3, replay_generator(7, 0, 1))
    want = F.cross_entropy(model(x), y) + 0.3 * F.mse_loss(model(b["x"]), F.pad(b["logits"], (0, 2)))
    assert torch.allclose(m.loss(model, x, y, _ctx()), want, atol=1e-6)


def test_er_loss_is_one_cross_entropy_over_batch_and_buffer_batch():
    m, model = _method("er")
    _fill(m)
    x, y = torch.randn(5, 3), torch.tensor([2, 3, 3, 2, 3])
    b = m.buffer.sample(3, replay_generator(7, 0, 1))
    want = F.cross_entropy(model(torch.cat([x, b["x"]])), torch.cat([y, b["y"]]))
    assert torch.allclose(m.loss(model, x, y, _ctx()), want, atol=1e-6)


def test_der_inserts_the_steps_own_logits_after_the_step():
    m, model = _method("der")
    x, y = torch.randn(5, 3), torch.tensor([2, 3, 3, 2, 3])
    m.loss(model, x, y, _ctx())
    assert len(m.buffer) == 0  # nothing before the optimizer step
    m.after_step(model, _ctx())
    assert m.step == 1 and len(m.buffer) == 5
    assert torch.equal(m.buffer.fields["logits"][:5], model(x)[:, :4].detach())
    assert m.buffer.fields["width"][:5].tolist() == [4] * 5


def _cil_cfg(method: str, **options) -> dict:
    return {
        "scenario": {"dataset": "digits", "n_tasks": 2, "train_per_class": 40, "test_per_class": 10},
        "model": {"name": "mlp", "config": {"image_size": 8, "hidden": [32]}},
        "method": {"name": method, "buffer_size": 30, "minibatch_size": 8, **options},
        "optim": {"lr": 5e-2}, "train": {"epochs": 2, "batch_size": 20},
        "run": {"progress": False, "report": False, "keep_checkpoints": 2},
    }


@pytest.mark.parametrize("method", ["er", "der", "derpp"])
def test_a_two_task_digits_run_uses_the_buffer_and_resumes_bit_for_bit(tmp_path, method):
    data = _cil_cfg(method, head_convention="grow")  # the grown head's numbers (mammoth's: the new test file)
    full = run_experiment(parse_config(data), tmp_path / "full")
    mm = full["method_metrics"]
    # an 8x8 fp32 image and an int64 label; DER: fp32 logits over the 10 classes and their int64 width
    item_bytes = 64 * 4 + 8 + (10 * 4 + 8 if method != "er" else 0)
    assert mm["buffer_items"] == [30, 30] and mm["buffer_bytes"][-1] == 30 * item_bytes
    _, tensors, meta = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_001.safetensors")
    labels = tensors["buffer/y"]
    assert labels.min() < 5 <= labels.max()  # classes of both tasks in the buffer
    assert meta["method"]["replay"]["n_seen"] == 2 * 2 * 200  # two epochs of 200 examples per task
    events = [json.loads(line) for line in (tmp_path / "full" / "events.jsonl").read_text().splitlines()]
    assert [e["bytes"] for e in events if e.get("event") == "replay_buffer"] == mm["buffer_bytes"]
    if method != "der":  # label replay: old classes still recognised after the second task
        assert full["accuracy_matrix"][1][0] > 0

    shutil.copytree(tmp_path / "full", tmp_path / "resumed")
    (tmp_path / "resumed" / "metrics.json").unlink()
    uncommit_checkpoint(tmp_path / "resumed", "task_001.safetensors")  # killed after task 1
    resumed = run_experiment(parse_config(data), tmp_path / "resumed", resume=True)
    assert resumed["accuracy_matrix"] == full["accuracy_matrix"]
    assert resumed["method_metrics"] == full["method_metrics"]
    a = load_checkpoint(tmp_path / "full" / "checkpoints" / "task_001.safetensors")
    b = load_checkpoint(tmp_path / "resumed" / "checkpoints" / "task_001.safetensors")
    for x, z in zip(a[:2], b[:2]):  # model and method tensors (the buffer)
        assert x.keys() == z.keys() and all(torch.equal(x[k], z[k]) for k in x)
