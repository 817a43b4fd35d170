"""merge-bench's continual-merging protocol: the accuracy matrix and its metrics on planted numbers, P&M's
closed-form step, and the whole protocol on a tiny suite (random-init 1-layer ViT, 3 digit tasks)."""

from __future__ import annotations

import json

import pytest
import torch

from clmerge.harness.merge_bench_continual import CONTINUAL_METHODS, continual_summary, make_merger
from clmerge.harness.merge_bench_run import run_merge_bench

TINY_ARCH = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}


def test_matrix_final_accuracy_and_bwt_on_planted_numbers():
    R = [[90.0, None, None], [80.0, 70.0, None], [60.0, 65.0, 75.0]]
    got = continual_summary(R)
    assert got["final_acc"] == pytest.approx((60 + 65 + 75) / 3)
    assert got["bwt"] == pytest.approx(((60 - 90) + (65 - 70)) / 2)  # mean_(j<T-1) R[T-1][j] - R[j][j]
    assert continual_summary([[50.0]])["bwt"] is None
    with pytest.raises(ValueError, match=r"\[2\]\[1\]"):
        continual_summary([[1.0, None, None], [1.0, 1.0, None], [1.0, None, 1.0]])


def test_pm_alpha_step_is_eq8_with_running_sums():
    """alpha_t = -sum_i (M - u_i)^T F_i Delta / sum_i Delta^T F_i Delta, M the merged task vector before t."""
    base = {"w": torch.zeros(2, 2)}
    u1, u2 = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 2.0], [1.0, 1.0]])
    f1, f2 = torch.tensor([[1.0, 2.0], [0.5, 1.0]]), torch.tensor([[3.0, 1.0], [1.0, 0.1]])
    merger = make_merger("pm_alpha", base)
    first = merger.add({"w": u1}, fisher={"w": f1})
    assert merger.alphas == [1.0] and torch.equal(first["w"], u1)  # the first merge is the first expert
    second = merger.add({"w": u2}, fisher={"w": f2})
    delta = u2 - u1
    num = ((u1 - u1) * f1 * delta).sum() + ((u1 - u2) * f2 * delta).sum()
    den = (f1 * delta * delta).sum() + (f2 * delta * delta).sum()
    alpha = float(-num / den)
    assert 0 < alpha < 1 and merger.alphas[1] == pytest.approx(alpha)
    torch.testing.assert_close(second["w"], u1 + alpha * delta)
    ra = make_merger("running_average", base)
    ra.add({"w": u1})
    torch.testing.assert_close(ra.add({"w": u2})["w"], (u1 + u2) / 2)


@pytest.fixture(scope="module")
def tiny_continual(tmp_path_factory):
    out = tmp_path_factory.mktemp("continual")
    res = run_merge_bench(out, suite="tiny", epochs=1, max_train=48, max_eval=32, random_init=True,
                          arch=TINY_ARCH, continual=True, log=lambda *_: None)
    return out, res


def test_protocol_runs_end_to_end_on_a_tiny_suite(tiny_continual):
    out, res = tiny_continual
    saved = json.loads((out / "continual.json").read_text())
    assert list(saved["rows"]) == list(CONTINUAL_METHODS)
    for name, row in saved["rows"].items():
        R = row["matrix"]
        assert len(R) == 3 and all(len(r) == 3 for r in R)
        assert all((R[i][j] is None) == (j > i) for i in range(3) for j in range(3))
        assert row["final_acc"] == pytest.approx(sum(R[2]) / 3)
        assert row["bwt"] == pytest.approx(((R[2][0] - R[0][0]) + (R[2][1] - R[1][1])) / 2)
        if name != "magmax":  # the first merge is the first expert itself (MagMax scales it by 0.5)
            assert R[0][0] == pytest.approx(saved["individual"][0]), name
    assert len(saved["rows"]["pm_alpha"]["alphas"]) == 3
    md = (out / "continual.md").read_text()
    assert "| method | final avg accuracy | BWT |" in md and "Accuracy matrix of opcm" in md
    assert "**frozen**" in md
    assert any((out / "experts").glob("*.safetensors"))  # the bench's expert cache, shared with merge-bench


def test_protocol_method_subset_and_several_seeds(tmp_path):
    res = run_merge_bench(tmp_path, suite="tiny", epochs=1, max_train=32, max_eval=16, random_init=True,
                          arch=TINY_ARCH, continual=True, methods=["running_average", "opcm"], seeds=[0, 1],
                          log=lambda *_: None)
    assert list(res["rows"]) == ["running_average", "opcm"] and res["seeds"] == [0, 1]
    per = [json.loads((tmp_path / f"seed{s}" / "continual.json").read_text()) for s in (0, 1)]
    accs = [p["rows"]["opcm"]["final_acc"] for p in per]
    assert res["rows"]["opcm"]["final_acc"][0] == pytest.approx(sum(accs) / 2)
    assert "± " in (tmp_path / "continual.md").read_text()
    with pytest.raises(ValueError, match="continual"):
        run_merge_bench(tmp_path / "x", suite="tiny", continual=True, methods=["ties"])


def test_summary_over_seeds_states_whether_opcm_beats_running_averaging(tmp_path):
    from clmerge.harness.merge_bench_continual import summarise_continual

    opcm, avg = [61.0, 63.0, 62.0], [76.0, 75.0, 77.0]
    runs = {s: {"config": {}, "tasks": ["a", "b"],
                "rows": {"opcm": {"final_acc": opcm[s], "bwt": -10.0},
                         "running_average": {"final_acc": avg[s], "bwt": -2.0}}} for s in range(3)}
    got = summarise_continual(tmp_path, runs)["claims"]["opcm_minus_running_average"]
    assert got["per_seed"] == pytest.approx([-15.0, -12.0, -15.0])
    md = (tmp_path / "continual.md").read_text()
    assert "OPCM − running average = -14.0 ± 1.0 points" in md and "does not hold" in md
