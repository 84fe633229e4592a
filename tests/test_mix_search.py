"""Mixture search: the log-linear fit, the capped optimum, and the command end to end."""

import json

import numpy as np
import pytest

from moelab.cli import main
from moelab.curate.mixsearch import choose, fit_loglinear, predict

pytest.importorskip("sklearn", reason="pip install -e '.[curation]'")
TRUE = np.array([[1.5, 1.2, 1.4], [1.3, 1.6, 1.2]])  # [sources, components] of log loss


def test_the_regression_recovers_a_log_linear_law_and_predicts_held_out_mixtures():
    rng = np.random.default_rng(0)
    weights = rng.dirichlet(np.ones(3), size=30)
    losses = np.exp(weights @ TRUE.T)
    models = fit_loglinear(weights[:24], losses[:24])
    # noise-free data: only the ridge term (alpha 1e-4) separates the fit from the law
    np.testing.assert_allclose([m.coef_ for m in models], TRUE, atol=1e-3)
    np.testing.assert_allclose(predict(models, weights[24:]), losses[24:], rtol=1e-3)


def test_the_chosen_weights_are_the_capped_optimum():
    rng = np.random.default_rng(1)
    weights = rng.dirichlet(np.ones(3), size=30)
    models = fit_loglinear(weights, np.exp(weights @ TRUE.T))
    caps = np.array([0.3, 1.0, 1.0])
    chosen = choose(models, np.full(3, 1 / 3), caps, None, kl_weight=0.0)
    assert np.isclose(chosen.sum(), 1) and np.all(chosen <= caps + 1e-6) and np.all(chosen >= 0)
    # brute force over a 0.005 grid of the capped simplex: SLSQP's answer is at least as good
    grid = [(a, b, 1 - a - b) for a in np.arange(0, 0.3001, 0.005)
            for b in np.arange(0, 1 - a + 1e-9, 0.005)]
    best = min(predict(models, np.array(w))[0].mean() for w in grid)
    assert predict(models, chosen)[0].mean() <= best + 1e-6
    target = choose(models, np.full(3, 1 / 3), np.ones(3), 0, kl_weight=0.0)
    assert target.argmax() == TRUE[0].argmin()  # one source's loss: its cheapest component


def test_too_few_proxies_is_a_one_line_error(small_corpus, capsys):
    code = main(["data", "mix-search", "--out", "unused", "--set",
                 f"data.path={small_corpus}", "--set", "model.vocab_size=512",
                 "--proxies", "10"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--proxies must be >= 24" in err


def test_an_out_that_is_a_file_or_someone_elses_is_refused_before_any_run(small_corpus,
                                                                          tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "mine.txt").write_text("keep")
    for out, words in ((tmp_path / "afile", "is a file"), (tmp_path / "theirs", "not empty")):
        code = main(["data", "mix-search", "--out", str(out), "--set",
                     f"data.path={small_corpus}", "--set", "model.vocab_size=512"])
        err = capsys.readouterr().err.strip()  # FileExistsError's traceback for the file
        assert code == 2 and "\n" not in err and words in err, err
    assert (tmp_path / "afile").read_text() == "x"
    assert [p.name for p in (tmp_path / "theirs").iterdir()] == ["mine.txt"]


@pytest.mark.slow  # 24 proxies + 4 validation runs of a few steps (~2 min on 2 busy cores)
def test_mix_search_end_to_end(small_corpus, tmp_path):
    code = main(["data", "mix-search", "--out", str(tmp_path), "--set",
                 f"data.path={small_corpus}", "--set", "model.vocab_size=512", "--set",
                 "model.d_model=32", "--set", "model.d_ff=32", "--set", "data.batch_size=4",
                 "--set", "data.seq_len=32", "--proxy-steps", "4", "--eval-batches", "2"])
    assert code == 0
    result = json.loads((tmp_path / "mix_search.json").read_text())
    assert len(result["runs"]) == 24 and len(result["validation"]["chosen"]) == 2
    assert np.isclose(sum(result["chosen_weights"].values()), 1)
    assert all(w <= result["epoch_caps"][k] + 1e-6 for k, w in result["chosen_weights"].items())
    for key in ("predicted_loss", "measured_loss", "measured_loss_sd", "baseline_loss"):
        assert np.isfinite(result[key])


def test_reused_proxies_and_the_trust_region(small_corpus, tmp_path):
    """--reuse-proxies takes an earlier search's proxy runs (refused in one line when they
    are another search's); --trust proxies keeps each weight within what a proxy gave it,
    though this law's optimum is the all-code corner."""
    from conftest import tiny_config

    from moelab.config import config_from_dict
    from moelab.curate.mixsearch import MIN_PROXIES, mix_search
    from moelab.errors import UserError

    cfg = config_from_dict(tiny_config(small_corpus))
    draws = np.random.default_rng(0).dirichlet(np.ones(2), size=MIN_PROXIES)  # seed 0's
    law = np.array([[1.0, 1.6], [1.2, 1.3]])  # [sources, components]: code helps both
    runs = [{"weights": w.tolist(), "losses": dict(zip(["code", "prose"], np.exp(law @ w).tolist(),
                                                        strict=True))}
            for w in draws]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"components": ["code", "prose"], "runs": runs,
                                   "proxy_steps": 40, "seed": 0}))
    common = dict(proxy_steps=40, validate_steps=2, eval_batches=1, kl_weight=0.0)
    with pytest.raises(UserError, match="not this search's") as err:
        mix_search(cfg, tmp_path / "other", seed=1, reuse=earlier, **common)
    assert "\n" not in str(err.value)
    result = mix_search(cfg, tmp_path / "trusted", reuse=earlier, trust="proxies", **common)
    assert result["runs"] == json.loads(json.dumps(runs))  # taken, not trained
    top = draws[:, 0].max()
    assert result["bounds"]["code"] == pytest.approx(top)
    assert result["chosen_weights"]["code"] == pytest.approx(top, abs=1e-4)  # at the bound
