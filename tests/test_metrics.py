import math

import pytest

from clmerge import metrics as M

# Hand-made 3-task accuracy matrix (percent); None above the diagonal.
R = [
    [90.0, None, None],
    [70.0, 80.0, None],
    [60.0, 75.0, 95.0],
]
SIZES = [100, 300, 100]


def test_final_accuracy_and_curve():
    assert M.final_accuracy(R) == pytest.approx((60 + 75 + 95) / 3)
    assert M.accuracy_curve(R) == pytest.approx([90.0, 75.0, (60 + 75 + 95) / 3])
    assert M.average_anytime_accuracy(R) == pytest.approx((90 + 75 + 230 / 3) / 3)


def test_sample_weighted():
    assert M.final_accuracy(R, SIZES) == pytest.approx((60 * 100 + 75 * 300 + 95 * 100) / 500)
    assert M.accuracy_curve(R, SIZES)[1] == pytest.approx((70 * 100 + 80 * 300) / 400)


def test_forgetting_bwt_plasticity():
    # task 0: best earlier max(90, 70) = 90 -> 30; task 1: best 80 -> 5
    assert M.forgetting_per_task(R) == pytest.approx([30.0, 5.0])
    assert M.average_forgetting(R) == pytest.approx(17.5)
    assert M.backward_transfer(R) == pytest.approx(((60 - 90) + (75 - 80)) / 2)
    assert M.plasticity(R) == pytest.approx((90 + 80 + 95) / 3)


def test_forgetting_uses_max_not_diagonal():
    R2 = [[50.0, None, None], [80.0, 90.0, None], [40.0, 90.0, 70.0]]
    assert M.forgetting_per_task(R2) == pytest.approx([40.0, 0.0])
    assert M.backward_transfer(R2) == pytest.approx(((40 - 50) + (90 - 90)) / 2)


def test_fwt_defined_only_with_future_entries():
    assert M.forward_transfer(R, [10, 10, 10]) is None
    Rf = [[90.0, 40.0, 30.0], [70.0, 80.0, 50.0], [60.0, 75.0, 95.0]]
    assert M.forward_transfer(Rf, [10.0, 20.0, 30.0]) == pytest.approx(((40 - 20) + (50 - 30)) / 2)


def test_single_task():
    s = M.summarize([[88.0]], sizes=[10])
    assert s["acc"] == 88.0 and s["aaa"] == 88.0
    assert s["forgetting"] is None and s["bwt"] is None


def test_validation_errors():
    with pytest.raises(ValueError, match="row 1"):
        M.final_accuracy([[1.0, None], [1.0]])
    with pytest.raises(ValueError, match=r"\[1\]\[0\]"):
        M.final_accuracy([[1.0, None], [None, 2.0]])


def test_order_robustness_hand_computed():
    orders = [{"a": 90.0, "b": 80.0, "c": 70.0}, {"a": 85.0, "b": 82.0, "c": 60.0}, {"a": 88.0, "b": 81.0, "c": 66.0}]
    r = M.order_robustness(orders)
    assert r["opd"] == pytest.approx({"a": 5.0, "b": 2.0, "c": 10.0})
    assert r["mopd"] == pytest.approx(10.0)
    assert r["aopd"] == pytest.approx(17.0 / 3)
    with pytest.raises(ValueError):
        M.order_robustness([{"a": 1.0}, {"b": 1.0}])
    assert not math.isnan(r["aopd"])
