"""Bad configs fail at load time with an error that names the field."""

import pytest

from moelab.config import ConfigError, config_from_dict, load_config
from moelab.model import dispatch  # noqa: F401  (its registry checks moe.dispatch)


@pytest.mark.parametrize(
    "raw, field",
    [
        ({"model": {"d_modle": 64}}, "d_modle"),
        ({"modle": {}}, "modle"),
        ({"model": {"d_model": "wide"}}, "model.d_model"),
        ({"model": {"n_layers": 2.5}}, "model.n_layers"),
        ({"moe": {"shared_expert": 1}}, "moe.shared_expert"),
        ({"model": {"d_model": 100, "n_heads": 3}}, "model.d_model"),
        ({"model": {"n_heads": 4, "n_kv_heads": 3}}, "model.n_kv_heads"),
        ({"moe": {"n_experts": 4, "top_k": 5}}, "moe.top_k"),
        ({"moe": {"dispatch": "magic"}}, "moe.dispatch"),
        ({"data": {"batch_size": 4, "short_rows": 5, "short_len": 32}}, "data.short_rows"),
        ({"data": {"seq_len": 128, "short_rows": 1, "short_len": 48}}, "data.short_len"),
        ({"data": {"seq_len": 128, "short_rows": 1}}, "data.short_len"),
        ({"moe": {"n_experts": 6}, "mesh": {"expert": 4}}, "mesh.expert"),
        ({"data": {"batch_size": 6}, "optim": {"grad_accum": 4}}, "optim.grad_accum"),
        ({"data": {"batch_size": 6}, "moe": {"dispatch": "pooled", "pool_size": 4}},
         "moe.pool_size"),
        ({"train": {"steps": 0}}, "train.steps"),
        ({"loss": {"seq_aux_weight": -0.1}}, "loss.seq_aux_weight"),
        ({"moe": {"uniform_routing": "yes"}}, "moe.uniform_routing"),
        ({"moe": {"balance": "bias_sign", "bias_rate_schedule": "cosine"}},
         "moe.bias_rate_schedule"),
        ({"moe": {"bias_rate_schedule": "lr_decay"}}, "moe.bias_rate_schedule"),  # no bias
        ({"data": {"mixture": {"code": -1.0}}}, "data.mixture.code"),
        ({"optim": {"lr_base_width": -32}}, "optim.lr_base_width"),
        ({"optim": {"lr_base_width": 32, "lr_width_power": 0}}, "optim.lr_width_power"),
        ({"optim": {"lr_width_power": 0.8}}, "optim.lr_width_power"),
        ({"mtp": {"depth": 1}, "data": {"conversations": "sft/train.jsonl"}}, "mtp.depth"),
    ],
)
def test_bad_config_names_the_field(raw, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        config_from_dict(raw)


def test_yaml_round_trip_and_int_widens_to_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1\nmoe:\n  dispatch: pooled\n  pool_size: 2\n")
    cfg = load_config(path, {"train.steps": 7})
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.moe.dispatch == "pooled" and cfg.train.steps == 7


def test_missing_and_invalid_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
