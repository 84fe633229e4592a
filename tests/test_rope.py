"""RoPE scaling for context extension: each type against a float64 reference written here,
the KV cache past the original length, the attention-logit multiplier, bad configs."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import Config, ConfigError, ModelConfig, MoEConfig, RopeConfig, config_from_dict
from moelab.model import Transformer
from moelab.model.layers import rope_angles

HEAD_DIM, THETA, ORIGINAL, FACTOR = 32, 10000.0, 128, 8.0


def reference_inv_freq(rope: RopeConfig, d: int = HEAD_DIM, theta: float = THETA) -> np.ndarray:
    """Each type's frequency per pair, written pair by pair from the published definitions
    (Llama 3.1's reference code, the YaRN paper's ramp over pair index as in its reference
    implementation, bloc97's NTK-aware base), in float64."""
    out = []
    s, orig = rope.factor, rope.original_max_position_embeddings
    for i in range(d // 2):
        f = theta ** (-2 * i / d)
        if rope.type == "linear":
            f = f / s
        elif rope.type == "ntk":
            f = (theta * s ** (d / (d - 2))) ** (-2 * i / d)
        elif rope.type == "llama3":
            wavelength = 2 * math.pi / f
            if wavelength > orig / rope.low_freq_factor:
                f = f / s
            elif wavelength >= orig / rope.high_freq_factor:
                w = (orig / wavelength - rope.low_freq_factor) / (
                    rope.high_freq_factor - rope.low_freq_factor)
                f = w * f + (1 - w) * f / s
        elif rope.type == "yarn":
            # the pair index whose wavelength fits `turns` times into the original length
            pair = lambda turns: d * math.log(orig / (2 * math.pi * turns)) / (2 * math.log(theta))
            lo = max(0, math.floor(pair(rope.beta_fast)))
            hi = min(d - 1, math.ceil(pair(rope.beta_slow)))
            interpolated = min(1.0, max(0.0, (i - lo) / (hi - lo)))  # 0 below lo, 1 above hi
            f = interpolated * f / s + (1 - interpolated) * f
        out.append(f)
    return np.array(out)


TYPES = {
    "default": RopeConfig(),
    "linear": RopeConfig(type="linear", factor=FACTOR),
    "ntk": RopeConfig(type="ntk", factor=FACTOR),
    "llama3": RopeConfig(type="llama3", factor=FACTOR, original_max_position_embeddings=ORIGINAL),
    "yarn": RopeConfig(type="yarn", factor=FACTOR, original_max_position_embeddings=ORIGINAL),
}


@pytest.mark.parametrize("kind", list(TYPES))
def test_every_rope_type_matches_its_float64_reference(kind):
    rope = TYPES[kind]
    positions = jnp.asarray([[0, 1, 127, 128, 500, 1023]])
    cos, sin = rope_angles(positions, HEAD_DIM, THETA, rope)
    angles = np.asarray(positions[0], np.float64)[:, None] * reference_inv_freq(rope)
    angles = np.concatenate([angles, angles], -1)
    mscale = 0.1 * math.log(FACTOR) + 1 if kind == "yarn" else 1.0
    # float32 angle = position * f32(inv_freq), each rounded to 2^-24 relative: at position
    # 1023 (angle <= 1023 rad) that is <= 1023 * 2 * 6e-8 ~ 1.2e-4 rad absolute
    np.testing.assert_allclose(cos[0], mscale * np.cos(angles), atol=2e-4)
    np.testing.assert_allclose(sin[0], mscale * np.sin(angles), atol=2e-4)


def test_scaling_types_shape_the_spectrum_as_published():
    """Independent of the formulas' details: linear slows every pair by the factor; llama3
    and yarn leave the fastest pairs alone and slow the slowest by the full factor; ntk
    slows the slowest pair by ~factor and the fastest not at all."""
    base = reference_inv_freq(TYPES["default"])
    ratio = {k: base / reference_inv_freq(r) for k, r in TYPES.items()}
    np.testing.assert_allclose(ratio["linear"], FACTOR)
    for kind in ("llama3", "yarn"):
        assert ratio[kind][0] == 1.0 and ratio[kind][-1] == pytest.approx(FACTOR)
        assert np.all(np.diff(ratio[kind]) >= 0)  # monotone from extrapolated to interpolated
    assert ratio["ntk"][0] == 1.0 and ratio["ntk"][-1] == pytest.approx(FACTOR)


def test_yarn_temperature_scales_cos_and_sin_so_logits_by_its_square():
    cos, sin = rope_angles(jnp.arange(50)[None], HEAD_DIM, THETA, TYPES["yarn"])
    mscale = 0.1 * math.log(FACTOR) + 1  # 1.2079 at 8x: Marin's qk_mult 1.57 ~ its square
    np.testing.assert_allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2, mscale ** 2, rtol=1e-6)
    custom = dataclasses.replace(TYPES["yarn"], attention_factor=1.5)
    cos, sin = rope_angles(jnp.arange(5)[None], HEAD_DIM, THETA, custom)
    np.testing.assert_allclose(np.asarray(cos) ** 2 + np.asarray(sin) ** 2, 2.25, rtol=1e-6)


SMALL = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=32)
MOE = MoEConfig(n_experts=4, top_k=2, dispatch="dropless")


def small_model(**model) -> Transformer:
    return Transformer.init(dataclasses.replace(SMALL, **model), MOE, jax.random.key(0))


@pytest.mark.parametrize("kind", ["linear", "yarn"])
def test_kv_cache_generation_past_the_original_length_equals_the_full_forward(kind):
    """Original context 16, factor 4: decode token by token from position 20 to 63 (past 16)
    and compare with one full forward over all 64."""
    rope = dataclasses.replace(TYPES[kind], factor=4.0,
                               original_max_position_embeddings=16 if kind == "yarn" else 0)
    model = small_model(rope=rope, attn_logit_scale=1.3)
    tokens = jax.random.randint(jax.random.key(4), (1, 64), 0, 64)
    full = model(tokens)[0]
    caches = model.init_caches(1, 64)
    prefix, _, caches = model(tokens[:, :20], caches, 0)
    step = eqx.filter_jit(lambda m, t, c, i: m(t, c, i))
    outs = [prefix]
    for i in range(20, 64):
        logits, _, caches = step(model, tokens[:, i:i + 1], caches, jnp.int32(i))
        outs.append(logits)
    # the same float32 products in another order: ~1e-6 relative on O(1) logits
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), full, atol=2e-5)


def test_attn_logit_scale_multiplies_the_logits_like_a_scaled_query_norm():
    """Logits scaled by s equal queries scaled by s: the same as multiplying the per-head
    query RMSNorm's weight by s (which is how the HF export expresses it)."""
    scaled = small_model(attn_logit_scale=1.57)
    plain = small_model()
    folded = eqx.tree_at(lambda m: m.moe_layers.attn.q_norm.weight, plain,
                         plain.moe_layers.attn.q_norm.weight * 1.57)
    tokens = jax.random.randint(jax.random.key(5), (2, 40), 0, 64)
    a, b, c = (m(tokens)[0] for m in (scaled, folded, plain))
    np.testing.assert_allclose(a, b, atol=2e-5)  # float32 rounding of the scaled products
    assert float(jnp.max(jnp.abs(a - c))) > 1e-3  # and the scale does change the output


def test_existing_rope_theta_configs_still_load_and_mean_plain_rope():
    cfg = config_from_dict({"model": {"rope_theta": 500000.0}})
    assert cfg.model.rope_theta == 500000.0 and cfg.model.rope == RopeConfig()


def config_with(rope: dict, seq_len: int = 1024, **model) -> dict:
    return {"model": {"rope": rope, **model}, "data": {"seq_len": seq_len}}


@pytest.mark.parametrize("raw,named", [
    (config_with({"type": "linear", "factor": 0}), "model.rope.factor"),
    (config_with({"type": "yarn", "factor": -2, "original_max_position_embeddings": 128}),
     "model.rope.factor"),
    (config_with({"type": "rotary"}), "model.rope.type"),
    (config_with({"type": "yarn", "factor": 8}), "model.rope.original_max_position_embeddings"),
    (config_with({"type": "llama3", "factor": 8}), "model.rope.original_max_position_embeddings"),
    (config_with({"type": "yarn", "factor": 8, "original_max_position_embeddings": 2048}),
     "model.rope.original_max_position_embeddings"),
    (config_with({"type": "default", "factor": 4}), "model.rope.factor"),
    (config_with({"type": "llama3", "factor": 8, "original_max_position_embeddings": 128,
                  "low_freq_factor": 4, "high_freq_factor": 4}), "model.rope.high_freq_factor"),
    (config_with({"type": "yarn", "factor": 8, "original_max_position_embeddings": 128,
                  "beta_fast": 1, "beta_slow": 32}), "model.rope.beta_fast"),
    (config_with({"type": "linear", "factor": 2, "attention_factor": 1.2}),
     "model.rope.attention_factor"),
    (config_with({"type": "linear", "factor": 2, "theta": 1e4}), "model.rope: unknown key"),
    (config_with({}, attn_logit_scale=0), "model.attn_logit_scale"),
])
def test_bad_rope_configs_get_one_line_errors_naming_the_field(raw, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")) as err:
        config_from_dict(raw)
    assert "\n" not in str(err.value)


def test_bad_rope_config_exits_2_with_one_line_from_the_cli(tmp_path, capsys):
    import yaml

    from moelab.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config_with({"type": "yarn", "factor": 0.0,
                                                "original_max_position_embeddings": 128})))
    code = main(["train", "--config", str(path), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "model.rope.factor" in err and err.strip().count("\n") == 0


def test_the_model_config_round_trips_with_a_rope_section():
    raw = config_with({"type": "yarn", "factor": 8, "original_max_position_embeddings": 128},
                      attn_logit_scale=1.21)
    cfg = config_from_dict(raw)
    assert cfg.model.rope.type == "yarn" and cfg.model.rope.factor == 8.0
    again = config_from_dict(dataclasses.asdict(cfg))
    assert again == cfg and isinstance(again, Config)
