"""bench/width_transfer.py's fitted rule: the optim settings whose matrix LR follows the
optima a sweep measured (issue 42, item 2)."""

from __future__ import annotations

import pytest
from conftest import import_bench

from moelab.config import OptimConfig
from moelab.train.optimizer import width_factor


@pytest.fixture(scope="module")
def sweep_module():
    return import_bench("width_transfer")


@pytest.mark.parametrize("true_power", [0.8, 0.65, 1.0])
def test_fitted_rule_puts_the_matrix_lr_at_every_measured_optimum(sweep_module, true_power):
    # optima measured as factors of muP's rule (lr_base_width 32): the optimum matrix LR is
    # 0.02 (16/d)^p, so its factor over the rule's lr (32/d) is that over 0.006 * 32/d
    lr, base = 0.006, 32
    widths = [{"d_model": d,
               "optimum_factor_interpolated": 0.02 * (16 / d) ** true_power / (lr * base / d)}
              for d in (16, 32, 56, 192)]
    fit = sweep_module.power(widths)
    assert fit[0] == pytest.approx(1.0 - true_power, abs=1e-9)  # exact data, exact line
    rule = sweep_module.fitted_rule(fit, base)
    assert rule["lr_width_power"] == pytest.approx(true_power, abs=0.005)  # rounded to 0.01
    optim = OptimConfig(lr=lr, **rule)
    for w in widths:
        wanted = 0.02 * (16 / w["d_model"]) ** true_power
        # lr_base_width is an integer (rounding it moves the LR by < 0.5/base ~ 2% at p 1)
        # and the power is rounded to 0.01 (ln(192/16) x 0.005 ~ 1.3%): 4% covers both
        assert lr * width_factor(optim, w["d_model"]) == pytest.approx(wanted, rel=0.04)


def test_no_rule_without_two_optima_inside_the_grid(sweep_module):
    assert sweep_module.power([{"d_model": 16, "optimum_factor_interpolated": 1.0},
                               {"d_model": 192, "optimum_factor_interpolated": None}]) is None
    assert sweep_module.fitted_rule(None, 32) is None
    # two optima: the line through them (factor 2 over 4x the width: slope ln 2 / ln 4)
    slope, _ = sweep_module.power([{"d_model": 16, "optimum_factor_interpolated": 1.0},
                                   {"d_model": 64, "optimum_factor_interpolated": 2.0}])
    assert slope == pytest.approx(0.5, abs=1e-12)
    assert sweep_module.fitted_rule((1.2, 0.0), 32) is None  # optimum LR rising with width


def test_horizon_power_is_the_optimum_lrs_slope_in_tokens():
    """bench/horizon_transfer.py: optima at two or three horizons, the power of the optimum
    LR in tokens read back exactly from exact data; a horizon whose optimum sat at the
    grid's edge (None) is left out, and one optimum alone gives no power."""
    horizon = import_bench("horizon_transfer")
    for power in (-0.28, 0.0, 0.1):
        rows = [{"tokens": t, "optimum_factor_interpolated": 1.3 * (t / 1e6) ** power}
                for t in (1.2e6, 2.4e6, 4.9e6)]
        assert horizon.tokens_power(rows) == pytest.approx(power, abs=1e-12)
    rows[1]["optimum_factor_interpolated"] = None
    assert horizon.tokens_power(rows) == pytest.approx(0.1, abs=1e-12)
    assert horizon.tokens_power(rows[:2]) is None
