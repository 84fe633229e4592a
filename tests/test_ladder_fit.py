"""The ladder's fits, spec validation and pre-registration record (no training here)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import tiny_config

from moelab.config import ConfigError
from moelab.errors import UserError
from moelab.ladder import prereg
from moelab.ladder.fit import FitError, bootstrap_interval, fit_chinchilla, fit_power_law
from moelab.ladder.spec import spec_from_dict

E, A_RAW, ALPHA = 1.8, 3.0e3, 0.28  # a made-up "true" law, L = E + A_RAW * C^-ALPHA
COMPUTE = np.geomspace(1e11, 3e12, 6)
TARGET = 3e13  # 10x beyond the largest rung


def law(compute):
    return E + A_RAW * np.asarray(compute) ** -ALPHA


def test_fit_recovers_exact_parameters():
    fit = fit_power_law(COMPUTE, law(COMPUTE))
    assert fit.E == pytest.approx(E, rel=1e-4)
    assert fit.alpha == pytest.approx(ALPHA, rel=1e-4)
    assert fit.A_raw == pytest.approx(A_RAW, rel=1e-3)
    assert fit.rmse < 1e-8


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_parameters_from_noisy_data(seed):
    rng = np.random.default_rng(seed)
    noisy = law(COMPUTE) * (1 + 0.001 * rng.standard_normal(len(COMPUTE)))  # 0.1% noise
    fit = fit_power_law(COMPUTE, noisy)
    assert fit.E == pytest.approx(E, abs=0.15)
    assert fit.alpha == pytest.approx(ALPHA, rel=0.15)
    truth = law(TARGET)
    assert float(fit.predict(TARGET)) == pytest.approx(truth, rel=0.01)
    interval = bootstrap_interval(fit, COMPUTE, noisy, TARGET, samples=100, seed=seed)
    assert interval.low < float(fit.predict(TARGET)) < interval.high
    assert interval.high - interval.low < 0.05 * truth
    assert interval.samples > 90


def test_bootstrap_covers_the_truth_most_of_the_time():
    """A 90% interval should contain the true loss in most noisy replicates."""
    covered = 0
    for seed in range(10):
        rng = np.random.default_rng(100 + seed)
        noisy = law(COMPUTE) * (1 + 0.002 * rng.standard_normal(len(COMPUTE)))
        fit = fit_power_law(COMPUTE, noisy)
        interval = bootstrap_interval(fit, COMPUTE, noisy, TARGET, samples=60, seed=seed)
        covered += interval.low <= law(TARGET) <= interval.high
    assert covered >= 6


def test_three_rungs_fit_exactly_with_a_zero_width_interval():
    compute = COMPUTE[::2]
    fit = fit_power_law(compute, law(compute))
    interval = bootstrap_interval(fit, compute, law(compute), TARGET, samples=50)
    assert interval.low == interval.high == pytest.approx(law(TARGET), rel=1e-4)
    assert "zero width" in interval.method


def test_degenerate_and_bad_fits_raise_clear_errors():
    with pytest.raises(FitError, match="degenerate.*stopped falling|degenerate.*alpha"):
        fit_power_law(COMPUTE, [5.0, 4.0, 3.9, 3.9, 3.9, 3.9])
    with pytest.raises(FitError, match="do not fall with compute"):
        fit_power_law(COMPUTE, [4.0, 4.0, 4.0, 4.0, 4.0, 4.0])
    with pytest.raises(FitError, match="at least 3 rungs"):
        fit_power_law(COMPUTE[:2], law(COMPUTE[:2]))
    with pytest.raises(FitError, match="diverged"):
        fit_power_law(COMPUTE, [5.0, 4.0, float("nan"), 3.5, 3.4, 3.3])


def test_chinchilla_fit_recovers_parameters_and_ties_exponents_with_five_rungs():
    n = np.array([1e5, 2e5, 4e5, 1e5, 4e5, 2e5, 8e5])
    d = np.array([1e6, 4e6, 2e6, 8e6, 8e6, 1.6e7, 4e6])
    loss = 1.5 + 40 * n**-0.33 + 400 * d**-0.3
    fit = fit_chinchilla(n, d, loss)
    assert (fit.E, fit.a, fit.b) == pytest.approx((1.5, 0.33, 0.3), rel=1e-3)
    assert not fit.tied
    assert float(fit.predict(2e6, 5e7)) == pytest.approx(1.5 + 40 * 2e6**-0.33 + 400 * 5e7**-0.3)
    tied = fit_chinchilla(n[:5], d[:5], loss[:5])
    assert tied.tied and tied.a == tied.b
    with pytest.raises(FitError, match="at least 5 rungs"):
        fit_chinchilla(n[:4], d[:4], loss[:4])


# ------------------------------------------------------------------------ specs


def spec_raw(tmp_path, steps=(20, 40, 80), target_steps=1000) -> dict:
    base = tiny_config(tmp_path / "data")
    return {"base": base,
            "rungs": [{"name": f"r{i}", "train": {"steps": s}} for i, s in enumerate(steps)],
            "target": {"name": "big", "model": {"d_model": 64}, "train": {"steps": target_steps}}}


def test_spec_builds_rungs_with_rising_compute(tmp_path):
    spec = spec_from_dict(spec_raw(tmp_path), "demo")
    assert [r.name for r in spec.runs()] == ["r0", "r1", "r2", "big"]
    assert spec.out.as_posix() == "runs/ladder/demo"
    assert spec.target.config.model.d_model == 64 and spec.rungs[0].config.model.d_model == 32
    assert spec.rungs[0].config.train.eval_every == 6  # base fields survive a rung's override
    computes = [r.compute for r in spec.runs()]
    assert computes == sorted(computes)


def test_spec_rejects_rungs_not_rising_in_compute(tmp_path):
    with pytest.raises(ConfigError, match=r"rungs\[2\] \(r2\).*not above rungs\[1\] \(r1\)"):
        spec_from_dict(spec_raw(tmp_path, steps=(20, 40, 40)), "demo")


def test_spec_rejects_a_target_inside_the_range_or_too_close(tmp_path):
    raw = spec_raw(tmp_path)
    raw["target"] = {"name": "big", "train": {"steps": 30}}
    with pytest.raises(ConfigError, match=r"target \(big\).*inside the rung range"):
        spec_from_dict(raw, "demo")
    raw["target"] = {"name": "big", "train": {"steps": 160}}
    with pytest.raises(ConfigError, match=r"target \(big\).*only 2.00x.*at least 8x"):
        spec_from_dict(raw, "demo")


def test_spec_errors_name_the_rung_and_field(tmp_path):
    raw = spec_raw(tmp_path)
    raw["rungs"][1]["model"] = {"d_modle": 64}
    with pytest.raises(ConfigError, match=r"rungs\[1\] \(r1\): model: unknown key.*d_modle"):
        spec_from_dict(raw, "demo")
    with pytest.raises(ConfigError, match="at least 3 rungs"):
        spec_from_dict(spec_raw(tmp_path, steps=(20, 40)), "demo")
    raw = spec_raw(tmp_path)
    raw["rungs"][2]["name"] = "r0"
    with pytest.raises(ConfigError, match=r"names \['r0'\] are used twice"):
        spec_from_dict(raw, "demo")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['rung'\]"):
        spec_from_dict({**spec_raw(tmp_path), "rung": []}, "demo")


# -------------------------------------------------------------- pre-registration


def test_preregistration_is_written_once_and_edits_are_detected(tmp_path):
    path = tmp_path / prereg.PREREG_FILE
    record = {"kind": prereg.KIND, "prediction": {"value": 3.0}, "rungs": [],
              "target": {"name": "big", "config_sha256": "abc"}}
    assert prereg.write_once(path, record)
    assert not prereg.write_once(path, {**record, "prediction": {"value": 2.0}})
    assert prereg.read(path)["prediction"]["value"] == 3.0
    prereg.check_matches(prereg.read(path), path, {"big": "abc"})
    with pytest.raises(UserError, match=r"other configs.*big"):
        prereg.check_matches(prereg.read(path), path, {"big": "abd"})
    path.chmod(0o644)
    edited = json.loads(path.read_text())
    edited["prediction"]["value"] = 2.5
    path.write_text(json.dumps(edited))
    with pytest.raises(UserError, match="edited after it was written"):
        prereg.read(path)
