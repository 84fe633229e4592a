"""`moelab ladder compare` on synthetic ladders: rung results fabricated on disk from known
laws (no training), read back through the ladder's own result code."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import yaml
from conftest import tiny_config

from moelab import cli
from moelab.config import config_from_dict, config_to_dict
from moelab.errors import UserError
from moelab.lab.report import MULTIPLIER
from moelab.lab.store import Store
from moelab.ladder.compare import compare_recipes, recipe_from_spec
from moelab.ladder.results import result, run_dir
from moelab.ladder.spec import Rung, load_spec
from moelab.train.rundir import CONFIG_FILE, METRICS_FILE

L_INF, A, ALPHA = 2.0, 1.5, 0.3  # the base's true law: L = L_INF + A (C / C_REF)^-ALPHA
SEED_SD = 0.01  # each point's two replicates sit at mean +- SEED_SD / sqrt(2): sd exactly this
SAMPLES = 200  # bootstrap draws: enough for a 90% percentile interval, ~1 s per comparison


def write_spec(tmp_path, name: str, data, rungs=((32, 20), (32, 40), (48, 60), (64, 80)),
               **base_sections) -> object:
    """A spec of 4 rungs (4 compute levels), 2 seeds each, written as YAML; its LadderSpec."""
    base = tiny_config(data, **base_sections)
    raw = {"out": str(tmp_path / "runs" / name), "seeds": [0, 1], "evals": 2,
           "base": base, "fit": {"bootstrap": SAMPLES},
           "rungs": [{"name": f"w{d}s{s}", "model": {"d_model": d, "d_ff": d},
                      "train": {"steps": s}} for d, s in rungs],
           "target": {"name": "big", "model": {"d_model": 64, "d_ff": 64},
                      "train": {"steps": 2000}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def data(tmp_path):
    """A 'dataset' that holds only the meta the results reader needs (one source)."""
    path = tmp_path / "data"
    path.mkdir()
    (path / "meta.json").write_text(json.dumps(
        {"vocab_size": 512, "eos_id": 0, "sources": ["text"], "train_tokens": {"text": 1000},
         "val_tokens": {"text": 100}}))
    return path


def fabricate(spec_path, law, flops_per_s: float = 1e9) -> None:
    """Every rung of the spec 'trained': config.yaml and metrics.jsonl whose final
    whole-val loss is law(C) -+ SEED_SD/sqrt(2) for the two seeds, logged at the tokens/s
    that make every rung run at `flops_per_s` model FLOPs/s (so seconds = C / flops_per_s)."""
    spec = load_spec(spec_path)
    for rung in spec.rungs:
        tokens_per_s = flops_per_s * rung.tokens / rung.compute
        path = run_dir(spec, rung)
        path.mkdir(parents=True)
        (path / CONFIG_FILE).write_text(yaml.safe_dump(config_to_dict(rung.config)))
        sign = 1 if rung.seed == 0 else -1
        final = law(rung.compute) + sign * SEED_SD / np.sqrt(2)
        steps = rung.config.train.steps
        records = [{"step": s, "tokens_per_s": tokens_per_s, "loss": final + 1}
                   for s in range(1, steps)]
        records.append({"step": steps, "tokens_per_s": tokens_per_s, "val_loss/text": final})
        (path / METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in records))


def base_law(c, alpha: float = ALPHA, c_ref: float = 1e9):
    return L_INF + A * (np.asarray(c) / c_ref) ** -alpha


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["ladder", "compare", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_known_multiplier_of_two_is_recovered_within_its_interval(tmp_path, data, capsys):
    base, variant = write_spec(tmp_path, "dense", data), write_spec(tmp_path, "moe", data)
    fabricate(base, base_law, flops_per_s=1e9)
    # the variant at C is as good as the base at 2C, at half the base's FLOPs/s: its
    # wall-clock per FLOP is 2x the base's, so realized = 2 x 1/2 = 1
    fabricate(variant, lambda c: base_law(2 * c), flops_per_s=5e8)
    out = tmp_path / "cmp"
    code, stdout, err = run_cli(capsys, base, variant, "--out", out)
    assert code == 0, err
    result = json.loads((out / "compare.json").read_text())
    th, re = result["theoretical"], result["realized"]
    # exact losses (the replicates' mean is the law): the fit returns the truth up to the
    # solver's tolerance, the interval must hold it, and with sd 0.01 it must exclude 1
    assert th["value"] == pytest.approx(2.0, rel=1e-3)
    assert th["interval"][0] <= 2.0 <= th["interval"][1] and th["interval"][0] > 1.0
    assert re["value"] == pytest.approx(1.0, rel=1e-3)
    assert re["interval"][0] <= 1.0 <= re["interval"][1]
    # steady FLOPs/s: wall-clock grows exactly as C, and the report raises no doubt
    assert result["recipes"]["moe"]["seconds_vs_compute_slope"] == pytest.approx(1.0)
    assert "not a compute statement" not in (out / "report.md").read_text()
    v = result["variants"]["moe"]
    assert not v["varies_with_compute"] and v["theoretical"]["distinguishable"]
    assert result["l_inf"]["value"] == pytest.approx(L_INF, abs=1e-3)
    assert "fitted jointly" in result["l_inf"]["mode"]
    assert (out / "report.md").exists() and (out / "compare.png").stat().st_size > 0
    assert "theoretical 2x" in stdout and "distinguishable from seed noise" in stdout


def test_equal_recipes_give_an_interval_containing_one(tmp_path, data, capsys):
    base, variant = write_spec(tmp_path, "a", data), write_spec(tmp_path, "b", data)
    fabricate(base, base_law)
    fabricate(variant, base_law)
    code, stdout, err = run_cli(capsys, base, variant, "--out", tmp_path / "cmp")
    assert code == 0, err
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    th = result["theoretical"]
    assert th["value"] == pytest.approx(1.0, rel=1e-3)
    assert th["interval"][0] < 1.0 < th["interval"][1]
    assert not result["variants"]["b"]["theoretical"]["distinguishable"]
    assert "not distinguishable" in stdout


def test_differing_alphas_are_reported_as_a_curve(tmp_path, data, capsys):
    """Variant alpha 0.45 vs 0.3: C_needed/C = (C/C_ref)^(0.45/0.3 - 1) grows with C."""
    base, variant = write_spec(tmp_path, "a", data), write_spec(tmp_path, "b", data)
    fabricate(base, base_law)
    fabricate(variant, lambda c: base_law(c, alpha=0.45))
    spec = load_spec(variant)
    top = max(r.compute for r in spec.rungs)
    code, _, err = run_cli(capsys, base, variant, "--out", tmp_path / "cmp", "--at", top,
                           "--at", 10 * top)
    assert code == 0, err
    v = json.loads((tmp_path / "cmp" / "compare.json").read_text())["variants"]["b"]
    assert v["alpha_difference"]["differ"] and v["varies_with_compute"]
    assert v["alpha_difference"]["value"] == pytest.approx(0.15, abs=1e-3)
    at = v["theoretical"]["at"]
    for row in at:  # the true multiplier at C, from the laws above
        truth = (row["compute"] / 1e9) ** (0.45 / 0.3 - 1)
        assert row["value"] == pytest.approx(truth, rel=1e-2)
        assert row["low"] <= truth <= row["high"]
    assert at[1]["low"] > at[0]["high"]  # 10x more compute: a different number, not noise
    curve = [p["value"] for p in v["theoretical"]["curve"]]
    assert curve == sorted(curve) and len(curve) > 10


def test_more_than_two_specs_give_a_table_against_the_base(tmp_path, data, capsys,
                                                           monkeypatch):
    paths = [write_spec(tmp_path, n, data) for n in ("base", "x2", "x4")]
    for path, m in zip(paths, (1, 2, 4), strict=True):
        fabricate(path, lambda c, m=m: base_law(m * c))
    monkeypatch.setenv("MOELAB_LAB", str(tmp_path / "lab.sqlite"))
    with Store(tmp_path / "lab.sqlite") as store:
        exp = store.new_experiment("recipes", "x4 > x2 > base", {}, None)
    code, _, err = run_cli(capsys, *paths, "--out", tmp_path / "cmp", "--experiment", exp)
    assert code == 0, err
    with Store(tmp_path / "lab.sqlite") as store:  # recorded as a finding, with its interval
        (run,) = store.runs(exp)
        latest = store.latest(run.id)
    assert latest[f"{MULTIPLIER}/theoretical/x4 vs base"][1] == pytest.approx(4, rel=1e-3)
    assert latest[f"{MULTIPLIER}_low/realized/x2 vs base"][1] < 2
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert "theoretical" not in result  # no single headline with two variants
    for name, m in (("x2", 2), ("x4", 4)):
        assert result["variants"][name]["theoretical"]["value"] == pytest.approx(m, rel=1e-3)
    report = (tmp_path / "cmp" / "report.md").read_text()
    assert "| x2 |" in report and "| x4 |" in report


# ---------------------------------------------------------------------- bad input


def test_a_missing_rung_is_named_in_one_line(tmp_path, data, capsys):
    base, variant = write_spec(tmp_path, "a", data), write_spec(tmp_path, "b", data)
    fabricate(base, base_law)
    fabricate(variant, base_law)
    spec = load_spec(variant)
    missing = spec.rungs[3]
    (run_dir(spec, missing) / METRICS_FILE).unlink()
    code, _, err = run_cli(capsys, base, variant, "--out", tmp_path / "cmp")
    assert code == 2 and err.count("\n") == 1
    assert missing.name in err and "not trained" in err and "Traceback" not in err


def test_different_data_and_metrics_are_refused(tmp_path, data, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "meta.json").write_text((data / "meta.json").read_text())
    base, variant = write_spec(tmp_path, "a", data), write_spec(tmp_path, "b", other)
    fabricate(base, base_law)
    fabricate(variant, base_law)
    code, _, err = run_cli(capsys, base, variant, "--out", tmp_path / "cmp")
    assert code == 2 and err.count("\n") == 1 and "same data" in err
    # a metric key arrives with issue 24's specs; the check is on the recipes themselves
    a = recipe_from_spec(load_spec(base))
    b = dataclasses.replace(a, name="b", metric="bits per byte")
    with pytest.raises(UserError, match="one metric for both"):
        compare_recipes([a, b], samples=SAMPLES)


def test_a_ladder_with_two_compute_levels_is_refused(tmp_path, data, capsys):
    base = write_spec(tmp_path, "a", data)
    # three points, two compute levels: w32 at 40 steps twice (the second at another lr)
    flat = write_spec(tmp_path, "b", data, rungs=((32, 20), (32, 40)))
    raw = yaml.safe_load(flat.read_text())
    raw["rungs"].append({"name": "w32lr", "model": {"d_model": 32, "d_ff": 32},
                         "train": {"steps": 40}, "optim": {"lr": 1e-3}})
    flat.write_text(yaml.safe_dump(raw))
    fabricate(base, base_law)
    fabricate(flat, base_law)
    code, _, err = run_cli(capsys, base, flat, "--out", tmp_path / "cmp")
    assert code == 2 and err.count("\n") == 1 and "2 compute level(s)" in err
    code, _, err = run_cli(capsys, base)
    assert code == 2 and "at least one variant" in err


# ------------------------------------------------------------ the dense recipe


def test_the_dense_ladder_matches_the_moe_ladder_in_active_params_and_flops():
    """configs/ladder/dev/dense.yaml: the same runs as default.yaml, each with a dense FFN of the
    MoE's active width. FLOPs per token by the README's formula (PaLM: 6 N_active + 12 L H
    d_head S), counted here by hand from the config: the two differ only by the router's
    d_model x n_experts weights per layer."""
    dense = load_spec("configs/ladder/dev/dense.yaml")
    moe = load_spec("configs/ladder/dev/default.yaml")
    pairs = list(zip(dense.runs(), moe.runs(), strict=True))
    assert len(pairs) == len(moe.runs()) > 10
    for d, m in pairs:
        assert (d.name, d.tokens, d.config.model.d_model) == (m.name, m.tokens,
                                                               m.config.model.d_model)
        assert dataclasses.replace(d.config, model=m.config.model) == m.config  # same recipe
        cm, cd = m.config.model, d.config.model
        assert cd.n_dense_layers == cd.n_layers and cm.n_dense_layers == 0
        assert not m.config.moe.shared_expert
        assert cd.d_ff_dense == m.config.moe.top_k * cm.d_ff  # the MoE's active FFN width
        hd = cm.resolved_head_dim
        attention = cm.d_model * hd * (2 * cm.n_heads + 2 * cm.n_kv_heads)
        ffn = 3 * cm.d_model * m.config.moe.top_k * cm.d_ff
        router = cm.d_model * m.config.moe.n_experts
        head = cm.d_model * cm.vocab_size
        dense_active = cm.n_layers * (attention + ffn) + head
        assert d.active_params == dense_active
        assert m.active_params == dense_active + cm.n_layers * router
        attn_flops = 12 * cm.n_layers * cm.n_heads * hd * m.config.data.seq_len
        assert d.compute == (6 * dense_active + attn_flops) * d.tokens
        assert m.compute == (6 * (dense_active + cm.n_layers * router) + attn_flops) * m.tokens
        assert m.compute / d.compute - 1 < 0.005  # the router: under 0.5% of the FLOPs


def test_a_rung_on_a_cell_mixture_weighs_each_source_by_the_tokens_it_draws(tmp_path):
    """A ladder run on `cell:` names (`moelab data curate`): the val splits are per source,
    so the final loss weighs them by each source's share of what the cells draw. Here
    d00/q0 is all code and d01/q0 is 1/5 code, 4/5 prose; at 3:1 the run draws code
    0.75 + 0.25 x 0.2 = 0.8 and prose 0.2, so code 3.0 and prose 5.0 give 3.4."""
    cells = {"d00/q0": {"train_tokens": 500, "val_tokens": 50,
                        "source_train_tokens": {"code": 500}},
             "d01/q0": {"train_tokens": 500, "val_tokens": 50,
                        "source_train_tokens": {"code": 100, "prose": 400}}}
    meta = {"vocab_size": 512, "eos_id": 0, "sources": ["code", "prose"],
            "train_tokens": {"code": 600, "prose": 400}, "val_tokens": {"code": 60, "prose": 40},
            "cells": {"cells": cells}}
    data = tmp_path / "data"
    data.mkdir()
    (data / "meta.json").write_text(json.dumps(meta))
    mixture = {"cell:d00/q0": 3.0, "cell:d01/q0": 1.0}
    rung = Rung("r", config_from_dict(tiny_config(data, data={"mixture": mixture})))
    run = tmp_path / "r"
    run.mkdir()
    steps = rung.config.train.steps
    (run / METRICS_FILE).write_text(json.dumps(
        {"step": steps, "val_loss/code": 3.0, "val_loss/prose": 5.0}) + "\n")
    done = result(rung, run)
    assert done.final_val_loss == pytest.approx(3.4, rel=1e-12)  # float rounding only
    assert done.val_loss == {"code": 3.0, "prose": 5.0}

    del cells["d01/q0"]["source_train_tokens"]  # a dataset curated by an older moelab
    (data / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="re-run `moelab data curate`"):
        result(rung, run)


def test_throughput_noise_widens_the_realized_interval(tmp_path, data):
    """Two equal recipes at the same true FLOPs/s, one's per-point wall-clock off by up to
    +-10% (a shared machine): the lines' slopes then differ, and a realized interval that
    ignored the timing noise would exclude the true 1.0. Drawn with the seconds lines'
    residual sd, it holds 1.0 and is wider than the noise-free one."""
    base = write_spec(tmp_path, "a", data)
    fabricate(base, base_law)
    a = recipe_from_spec(load_spec(base))
    noise = np.exp([0.10, -0.10, 0.06, -0.04])  # one value per compute level, not a trend
    assert len(a.seconds) == len(noise)
    b = dataclasses.replace(a, name="b", seconds=a.seconds * noise)
    quiet = compare_recipes([a, dataclasses.replace(a, name="b")], samples=SAMPLES)
    noisy = compare_recipes([a, b], samples=SAMPLES)
    assert b.seconds_sd > 0.05 and a.seconds_sd == pytest.approx(0, abs=1e-9)
    low, high = noisy["realized"]["interval"]
    assert low <= 1.0 <= high
    q_low, q_high = quiet["realized"]["interval"]
    assert high - low > 2 * (q_high - q_low)
    # the theoretical multiplier does not see wall-clock at all
    assert noisy["theoretical"] == quiet["theoretical"]
