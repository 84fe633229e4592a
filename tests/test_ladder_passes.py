"""Passes over each source's train tokens, counted per stage as the mixtures draw them, and
the pre-registration's refusal of a target past the rungs' repetition."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import tiny_config

from moelab import cli
from moelab.errors import UserError
from moelab.ladder import repetition
from moelab.ladder.spec import spec_from_dict

# A corpus described by its meta.json alone: the counter reads nothing else.
CODE, PROSE = 10_000, 4_000


def fake_corpus(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "meta.json").write_text(json.dumps({
        "vocab_size": 512, "eos_id": 0, "sources": ["code", "prose"],
        "train_tokens": {"code": CODE, "prose": PROSE}, "val_tokens": {"code": 1, "prose": 1},
        "content_sha256": "abc123"}))
    return path


def two_stage_spec(data, target_steps=400, target_width=64, **fit) -> dict:
    """Rungs of 40 steps and a target, batch 4 x 32 tokens; an equal mixture for the
    first 75% of every run, then prose up-weighted 3:1."""
    base = tiny_config(data, model={"n_layers": 1}, optim={"warmup_steps": 2})
    base["stages"] = [{"mixture": {"code": 1, "prose": 1}},
                      {"start": 0.75, "name": "decay", "mixture": {"code": 1, "prose": 3}}]
    rung = lambda name, d, steps: {"name": name, "model": {"d_model": d, "d_ff": d},
                                   "train": {"steps": steps}}
    return {"base": base, "rungs": [rung("w16", 16, 40), rung("w24", 24, 40),
                                    rung("w32", 32, 40)],
            "target": rung("big", target_width, target_steps), "fit": {"noise_sd": 0.01, **fit}}


def test_passes_per_source_and_stage_match_a_hand_count(tmp_path, capsys):
    """Hand count, 32 tokens a row. A rung (40 steps x 4 rows): stage 0 has 30 steps = 120
    rows, half each: 60 rows = 1920 tokens of each source; stage 1 has 40 rows, a quarter
    code: 10 rows = 320 tokens of code, 30 = 960 of prose. The target (400 steps): 1200
    rows -> 600 each = 19200 tokens; then 400 rows -> 100 code (3200), 300 prose (9600).
    The counts are exact (a staged run's rows are apportioned), so equal to rounding."""
    data = fake_corpus(tmp_path / "data")
    spec = spec_from_dict(two_stage_spec(data), "passes", tmp_path / "ladder")
    rep = repetition.repetition(spec)
    rung, target = rep["runs"]["w16"], rep["runs"]["big"]
    assert [st["name"] for st in target] == ["", "decay"]
    assert rung[0]["tokens"] == {"code": 1920, "prose": 1920}
    assert rung[1]["tokens"] == {"code": 320, "prose": 960}
    assert rung[1]["passes"] == pytest.approx({"code": 320 / CODE, "prose": 960 / PROSE})
    assert rung[1]["cumulative"] == pytest.approx({"code": 2240 / CODE, "prose": 2880 / PROSE})
    assert target[0]["passes"] == pytest.approx({"code": 19200 / CODE, "prose": 19200 / PROSE})
    assert target[1]["passes"] == pytest.approx({"code": 3200 / CODE, "prose": 9600 / PROSE})
    assert rep["target"] == pytest.approx({"code": 22400 / CODE, "prose": 28800 / PROSE})
    # the total would say 51200 / 14000 = 3.7 passes; prose alone is passed 7.2 times
    assert rep["target_max"] == pytest.approx(7.2)
    assert rep["rungs_max"] == pytest.approx({"code": 0.224, "prose": 0.72})
    assert rep["beyond_rungs"] == ["code", "prose"]

    # `moelab ladder plan` prints them, and says the pre-registration would refuse
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(two_stage_spec(data)))
    assert cli.main(["ladder", "plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "content sha256 abc123" in out
    assert "stage 1 (decay), steps 300..400: passes code 0.32 (by its end 2.24), prose 2.4 " \
           "(by its end 7.2)" in out
    assert "stage 1 (decay), steps 30..40: passes code 0.032 (by its end 0.224)" in out
    assert "pre-registration will refuse: the target passes over code 2.24 (rungs at most " \
           "0.22), prose 7.20 (rungs at most 0.72) times" in out


def test_a_target_past_the_rungs_repetition_is_refused_unless_accepted(tmp_path):
    """Past one pass and past the rungs: refused in one line naming the fix; accepted with
    fit.accept_repetition; under one pass over every source: never refused."""
    data = fake_corpus(tmp_path / "data")
    spec = spec_from_dict(two_stage_spec(data), "refused", tmp_path / "ladder")
    with pytest.raises(UserError, match=r"^ladder refused: the target passes over code 2.24 "
                       r".*set fit.accept_repetition: true") as err:
        repetition.check(spec)
    assert "\n" not in str(err.value)
    from moelab.ladder.runner import run_ladder

    with pytest.raises(UserError, match="past what the rungs measured"):
        run_ladder(spec)  # refused before any rung trains
    assert not (tmp_path / "ladder").exists()
    accepted = spec_from_dict(two_stage_spec(data, accept_repetition=True), "ok", tmp_path)
    assert repetition.check(accepted)["accepted"] is True
    # 50 steps (the switch at round(37.5) = 38): prose 76 + 36 rows = 3584 tokens, 0.896
    # passes, past the rungs' 0.72 but under one pass
    short = spec_from_dict(two_stage_spec(data, target_steps=50, target_width=256), "short",
                           tmp_path)
    rep = repetition.check(short)
    assert rep["target"]["prose"] == pytest.approx(0.896) and rep["beyond_rungs"] == []
    with pytest.raises(Exception, match="fit.accept_repetition: must be true or false"):
        spec_from_dict(two_stage_spec(data, accept_repetition="yes"), "bad", tmp_path)


def test_a_one_stage_run_counts_its_capped_mixture(tmp_path):
    """One stage: the loader draws by weight under data.max_epochs's cap, so the count is
    that expectation: 40 steps x 128 tokens = 5120, code:prose 1:3 asks prose for 3840 =
    0.96 passes; a cap of 0.5 holds prose at 2000 tokens and gives code the rest (3120)."""
    from moelab.config import config_from_dict
    from moelab.data.loader import read_meta
    from moelab.data.passes import plan_passes

    data = fake_corpus(tmp_path / "data")
    cfg = config_from_dict(tiny_config(data, data={"mixture": {"code": 1, "prose": 3}},
                                       train={"steps": 40}))
    meta = read_meta(data)
    (only,) = plan_passes(meta, cfg.plan)
    assert only["tokens"] == pytest.approx({"code": 1280, "prose": 3840})
    (capped,) = plan_passes(meta, cfg.plan, max_epochs=0.5)
    assert capped["tokens"] == pytest.approx({"code": 3120, "prose": 2000})
    assert capped["cumulative"]["prose"] == pytest.approx(0.5)


# ---------------------------------------------------------------- the ladder corpus


def test_the_ladder_corpus_preset_resolves_to_fixed_settings(tmp_path, monkeypatch, capsys):
    """`moelab data prepare --preset ladder` (its sources swapped for a few stdlib files,
    the default ones take minutes): written at the preset's data.path under $MOELAB_HOME
    with no per-source cap and long files split; a ladder spec on that path names its
    content sha256; before it exists, training and `ladder plan` say how to prepare it;
    an option the preset fixes, set otherwise, is refused in one line."""
    import sysconfig

    from moelab.data import prepare

    stdlib = sysconfig.get_paths()["stdlib"]
    monkeypatch.setenv("MOELAB_HOME", str(tmp_path / "home"))
    monkeypatch.setitem(prepare.SOURCE_PRESETS, "default",
                        {"code": [f"{stdlib}/json/*.py"],
                         "prose": ["/usr/share/common-licenses/*"]})
    raw = two_stage_spec("runs/data/ladder", accept_repetition=True)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["ladder", "plan", str(path)]) == 0
    assert "run `moelab data prepare --preset ladder` once" in capsys.readouterr().out

    assert cli.main(["data", "prepare", "--preset", "ladder", "--max-docs", "400"]) == 2
    assert "--preset ladder fixes --max-docs to None; drop --max-docs 400" in \
        capsys.readouterr().err
    assert cli.main(["data", "prepare", "--preset", "ladder", "--workers", "1"]) == 0
    meta = json.loads((tmp_path / "home/runs/data/ladder/meta.json").read_text())
    settings = meta["settings"]
    assert settings["max_docs_per_source"] is None and settings["long_files"] == "split"
    assert settings["max_chars"] == 1_000_000 and settings["vocab_size"] == 4096
    assert settings["sources"]["code"] == prepare.SOURCE_PRESETS["default"]["code"]
    capsys.readouterr()
    assert cli.main(["ladder", "plan", str(path)]) == 0
    assert f"content sha256 {meta['content_sha256']}" in capsys.readouterr().out
