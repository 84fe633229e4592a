"""Repeated data in the ladder's laws: tokens past one pass over the corpus count at their
published worth (Muennighoff et al. 2023), in L(N, D)'s D and in the curve law's S1."""

from __future__ import annotations

import math

import numpy as np
import pytest
from conftest import tiny_config
from test_ladder_stages import law, staged_spec, synthetic_results

from moelab.config import config_from_dict
from moelab.ladder import predict
from moelab.ladder.curve import REPEAT_DECAY, effective_tokens, schedule_areas
from moelab.ladder.predict import forecast
from moelab.ladder.spec import spec_from_dict


def test_effective_tokens_is_the_published_form():
    """D' = D up to one pass; past it U + U R* (1 - exp(-(D/U - 1) / R*)), which grows
    ever slower and never past U (1 + R*). Closed forms, so equal to rounding."""
    u = 1000.0
    d = np.array([0.0, 500.0, 1000.0, 3000.0, 1e9])
    expected = [0.0, 500.0, 1000.0, u + u * REPEAT_DECAY * (1 - math.exp(-2 / REPEAT_DECAY)),
                u * (1 + REPEAT_DECAY)]
    assert effective_tokens(d, u) == pytest.approx(expected, rel=1e-12)
    assert np.array_equal(effective_tokens(d, None), d)


def test_schedule_areas_count_repeated_steps_at_their_worth(tmp_path):
    """With the corpus's size given, S1 is unchanged up to one pass and after it grows by
    each step's worth: S1 at the end of a constant-LR stretch after the warmup equals the
    plain S1 minus exactly what effective_tokens takes off (the same sums)."""
    cfg = config_from_dict(tiny_config(tmp_path / "data", optim={"schedule": "constant",
                                                                  "warmup_steps": 0},
                                       train={"steps": 40}))
    per_step = cfg.data.batch_size * cfg.data.seq_len
    unique = 10 * per_step  # one pass = 10 steps
    plain, _ = schedule_areas(cfg)
    counted, _ = schedule_areas(cfg, unique)
    assert np.array_equal(plain[:11], counted[:11])
    assert counted[40] == pytest.approx(float(effective_tokens(40 * per_step, unique)),
                                        rel=1e-12)
    assert counted[40] < plain[40] and np.all(np.diff(counted) > 0)


@pytest.mark.parametrize("repetition", ["muennighoff", "none"])
def test_a_target_past_one_pass_is_predicted_at_its_effective_tokens(tmp_path, monkeypatch,
                                                                    repetition):
    """Rungs within one pass whose stage-end losses follow L(N, D) exactly; the target
    makes ~5 passes. With repetition counted, every stage's prediction is the law at the
    target's *effective* tokens (the data term larger: a higher loss); with `none`, at its
    plain tokens. Exact points, so 1e-3 relative is the solver's tolerance."""
    raw = staged_spec(tmp_path / "data")
    raw["fit"]["repetition"] = repetition
    spec = spec_from_dict(raw, "synthetic", tmp_path / "ladder")
    unique = max(r.tokens for r in spec.rungs) * 1.01
    monkeypatch.setattr(predict, "_epochs", lambda s: {"train_tokens": unique})
    record = forecast(spec, synthetic_results(spec), [])
    first, last = record["stages"]
    counted = unique if repetition == "muennighoff" else None
    n = spec.target.active_params
    assert spec.target.tokens / unique > 4
    assert first["value"] == pytest.approx(
        law(0, n, float(effective_tokens(first["tokens"], counted))), rel=1e-3)
    assert last["value"] == pytest.approx(
        law(1, n, float(effective_tokens(spec.target.tokens, counted))), rel=1e-3)
    assert record["repetition"]["law"] == repetition
    if counted:
        plain = law(1, n, spec.target.tokens)
        assert last["value"] > plain * (1 + 1e-2)  # well apart from the uncounted law
        assert record["repetition"]["target_effective_tokens"] < spec.target.tokens
