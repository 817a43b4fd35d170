"""The scaling-law fits (one-variable forms of Theorem 3 of Li, Tang et al.): recovery from synthetic data,
R^2, trends, predict."""

from __future__ import annotations

import numpy as np
import pytest

from clmerge.theory.analysis import predict
from clmerge.theory.laws import FORMS, evaluate_form, fit_form, observed_trend, power_slope

# (law, grid of the variable, true coefficients): every form with all terms active
CASES = [
    ("steps", [10, 20, 40, 80, 160, 320], [0.5, 2.0, 0.004]),
    ("lr", [0.001, 0.005, 0.01, 0.02, 0.04], [0.7, 300.0]),
    ("batch_size", [8, 16, 32, 64, 128, 256], [0.4, 6.0, 0.003]),
    ("data_ratio", [0.1, 0.25, 0.5, 0.8, 1.0], [0.3, 0.05]),
    ("n_experts", [2, 3, 4, 6, 8, 12], [0.2, 0.9, 0.05]),
]


def _synthetic(law: str, xs: list[float], coef: list[float], noise: float, reps: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = np.repeat(np.asarray(xs, dtype=float), reps)
    y = evaluate_form(FORMS[law], coef, x) + noise * rng.standard_normal(len(x))
    return x, y


@pytest.mark.parametrize("law,xs,coef", CASES)
def test_fit_recovers_known_coefficients(law, xs, coef):
    x, y = _synthetic(law, xs, coef, noise=1e-4)
    fit = fit_form(FORMS[law], x, y, n_boot=50)
    np.testing.assert_allclose(fit["coef"], coef, rtol=0.05, atol=2e-3)
    assert fit["r2"] > 0.999
    for c, lo, hi in zip(fit["coef"], fit["ci_low"], fit["ci_high"]):
        assert lo - 1e-12 <= c <= hi + 1e-12


@pytest.mark.parametrize("law,xs,coef", CASES)
def test_exact_data_is_fitted_exactly(law, xs, coef):
    x, y = _synthetic(law, xs, coef, noise=0.0, reps=1)
    fit = fit_form(FORMS[law], x, y, n_boot=10)
    np.testing.assert_allclose(fit["coef"], coef, rtol=1e-6, atol=1e-9)


def test_the_optimum_of_the_steps_law():
    c = [0.5, 2.0, 0.004]
    x, y = _synthetic("steps", [10, 20, 40, 80, 160, 320], c, noise=0.0, reps=1)
    fit = fit_form(FORMS["steps"], x, y, n_boot=10)
    assert fit["optimum"] == pytest.approx((c[1] / (2 * c[2])) ** (2 / 3), rel=1e-4)
    assert fit["observed_trend"] == "tradeoff" and fit["agrees"]


@pytest.mark.parametrize("true_law,fit_law", [("data_ratio", "lr"), ("n_experts", "data_ratio"), ("lr", "data_ratio")])
def test_data_from_another_form_gets_a_low_r2(true_law, fit_law):
    xs = [0.1, 0.2, 0.4, 0.6, 0.8, 1.0] if true_law != "n_experts" else [2, 3, 4, 6, 8, 12]
    coef = {"data_ratio": [0.3, 0.05], "n_experts": [0.2, 0.9, 0.05], "lr": [0.1, 2.0]}[true_law]
    x, y = _synthetic(true_law, xs, coef, noise=1e-3)
    fit = fit_form(FORMS[fit_law], x, y, n_boot=20)
    assert fit["r2"] < 0.2  # the opposite monotone direction: NNLS keeps only the constant
    same = fit_form(FORMS[true_law], x, y, n_boot=20)
    assert same["r2"] > 0.9


def test_trends_are_compared_with_the_paper():
    x, y = _synthetic("lr", [0.001, 0.01, 0.02, 0.04], [0.7, 300.0], noise=0.0)
    assert fit_form(FORMS["lr"], x, y, n_boot=10)["agrees"]
    assert observed_trend(x, -y)[0] == "decreasing"
    assert not fit_form(FORMS["lr"], x, 2 - y, n_boot=10)["agrees"]


def test_power_slope_recovers_an_exponent():
    x = np.repeat([0.01, 0.02, 0.04, 0.08], 2)
    y = 3.0 * x ** 2 * np.exp(0.01 * np.random.default_rng(0).standard_normal(len(x)))
    s = power_slope(x, y, n_boot=50)
    assert s["slope"] == pytest.approx(2.0, abs=0.05) and s["ci"][0] <= 2.0 <= s["ci"][1]
    assert power_slope(np.ones(3), np.ones(3)) is None


def test_predict_with_an_interval_from_the_fitted_laws():
    fits = {"laws": {}}
    for law, xs, coef in CASES[:2]:
        x, y = _synthetic(law, xs, coef, noise=1e-3)
        f = fit_form(FORMS[law], x, y, n_boot=100)
        f["default_x"] = xs[1]
        fits["laws"][law] = {"averaging": f}
    base = predict(fits, "averaging")
    moved = predict(fits, "averaging", lr=0.03)
    truth = float(evaluate_form(FORMS["lr"], CASES[1][2], 0.03)[0] - evaluate_form(FORMS["lr"], CASES[1][2], 0.005)[0])
    assert moved["loss"] - base["loss"] == pytest.approx(truth, rel=0.05)
    assert moved["low"] <= moved["loss"] <= moved["high"] and not moved["extrapolated"]
    assert predict(fits, "averaging", lr=1.0)["extrapolated"] == ["lr"]
    with pytest.raises(KeyError, match="batch_size"):
        predict(fits, "averaging", batch_size=64)
    with pytest.raises(KeyError, match="ties"):
        predict(fits, "ties")


def test_batch_lr_interaction_recovers_b_star_proportional_to_one_over_lr():
    from clmerge.theory.analysis import _interaction

    defaults = {"steps": 10, "lr": 0.01, "batch_size": 16, "data_ratio": 1.0, "optimizer": "sgd", "n_experts": 3}
    rows = []
    for lr in (0.005, 0.01, 0.02, 0.04):
        for b in (2, 4, 8, 16, 32, 64, 128, 256):
            loss = 1.0 + 2.0 / b + 40.0 * lr ** 2 * b  # b* = sqrt(2 / (40 lr^2)) = 0.2236 / lr
            rows.append({**defaults, "kind": "grid", "method": "averaging", "lr": lr, "batch_size": b,
                         "merged_loss": loss})
    out = _interaction(rows, defaults, ["averaging"], n_boot=20)["averaging"]
    assert out["by_lr"]["0.01"]["optimum"] == pytest.approx(np.sqrt(2 / 40) / 0.01, rel=1e-3)
    assert out["b_star_slope"]["slope"] == pytest.approx(-1.0, abs=1e-3)
