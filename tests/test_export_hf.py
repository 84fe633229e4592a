"""The Hugging Face export computes what moelab computes: same logits, same greedy tokens."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_export import TINY, logits_of, random_model, tiny  # noqa: E402  (tests/ on path)

from moelab.config import Config, MoEConfig  # noqa: E402
from moelab.export.generate import generate  # noqa: E402
from moelab.export.hf import export_hf  # noqa: E402

transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()


def load_hf(path):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    return hf.eval()


def logit_error(model, hf) -> tuple[np.ndarray, float]:
    """Our logits on 37 random tokens and the max abs difference to transformers'."""
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (1, 37), 0, TINY.vocab_size))
    ours = np.asarray(logits_of(model, jnp.asarray(tokens)))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    return ours, float(np.max(np.abs(ours - theirs)))


def greedy_both(model, hf) -> tuple[list[int], list[int]]:
    """32 greedy tokens after the same prompt: ours, then transformers'."""
    prompt = [5, 17, 42, 3, 88]
    ours = generate(model, prompt, max_new_tokens=32)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=32,
                          min_new_tokens=32)
    return ours, out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_logits_match_transformers(tmp_path, tie):
    model, cfg = tiny(tie)
    hf = load_hf(export_hf(model, cfg, tmp_path / "hf"))
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert (hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()) == tie
    ours, err = logit_error(model, hf)
    print(f"max |logit error| ({'tied' if tie else 'untied'}): {err:.2e}")
    assert np.std(ours) > 0.5  # logits are far from zero: the bound below means something
    assert err < 1e-4


def test_greedy_generation_matches_transformers(tmp_path):
    model, cfg = tiny()
    hf = load_hf(export_hf(model, cfg, tmp_path / "hf"))
    ours, theirs = greedy_both(model, hf)
    assert len(ours) == 32 and ours == theirs


def test_a_model_with_mtp_modules_exports_without_them(tmp_path):
    """transformers' Qwen3-MoE has no multi-token-prediction heads (DeepseekV3 ignores its
    num_nextn_predict_layers weights): export writes the model alone, every tensor loads
    (no unexpected ones) and the logits still match."""
    from moelab.config import MTPConfig
    from moelab.model.mtp import MTP

    model, cfg = tiny()
    cfg = dataclasses.replace(cfg, mtp=MTPConfig(depth=1))
    model = dataclasses.replace(model, mtp=MTP.init(cfg.model, cfg.moe, 1, jax.random.key(3)))
    hf = load_hf(export_hf(model, cfg, tmp_path / "hf"))
    assert logit_error(model, hf)[1] < 1e-4  # as test_logits_match_transformers


def test_tokenizer_loads_offline_with_autotokenizer(tmp_path):
    from moelab.data.tokenizer import EOS, train_tokenizer

    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over it."] * 20
    tokenizer = train_tokenizer(texts, vocab_size=300)
    model, cfg = tiny()
    out = export_hf(model, cfg, tmp_path / "hf", tokenizer=tokenizer)

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def fox(a):\n    return a + 1  # é\n"
    assert hf_tok(text)["input_ids"] == tokenizer.encode(text).ids
    assert hf_tok.decode(tokenizer.encode(text).ids) == text
    assert hf_tok.eos_token == EOS
    config = json.loads((out / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.token_to_id(EOS) == hf_tok.eos_token_id


def glm_model():
    """Sigmoid router, shared expert 2 x d_ff wide, selection bias, routed scaling, no QK-norm.

    random_model draws every 1-D leaf as 1 + 0.3 N(0, 1): the biases then differ by
    ~0.3 between experts, as much as the sigmoid scores do, so they change the choice.
    """
    moe = MoEConfig(n_experts=4, top_k=2, router="sigmoid", shared_expert=True,
                    d_ff_shared=2 * TINY.d_ff, balance="bias_sign", routed_scaling=2.5)
    cfg = Config(model=dataclasses.replace(TINY, qk_norm=False), moe=moe)
    return random_model(cfg, seed=1), cfg


def test_sigmoid_shared_bias_model_exports_to_glm4moe(tmp_path):
    from moelab.model.router import route

    model, cfg = glm_model()
    hf = load_hf(export_hf(model, cfg, tmp_path / "hf"))
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    ours, err = logit_error(model, hf)
    print(f"max |logit error| (Glm4Moe): {err:.2e}")
    assert np.std(ours) > 0.5 and err < 1e-4
    # the bias matters: without it some token picks other experts
    layer = model.blocks[1].ffn
    x = jax.random.normal(jax.random.key(3), (1, 64, TINY.d_model))
    logits = jnp.einsum("bsd,de->bse", x, layer.router)
    with_bias, _ = route(logits, cfg.moe, layer.bias)
    without, _ = route(logits, cfg.moe)
    assert bool(jnp.any(jnp.sort(with_bias.experts) != jnp.sort(without.experts)))
    ours, theirs = greedy_both(model, hf)
    assert len(ours) == 32 and ours == theirs


def test_group_limited_routing_exports_to_glm4moe_with_its_groups(tmp_path):
    """8 experts in 4 groups, 2 groups eligible (DeepSeek-V3's routing at toy size): the
    config carries n_group / topk_group and the logits match transformers'."""
    from moelab.model.router import route

    moe = MoEConfig(n_experts=8, top_k=2, router="sigmoid", shared_expert=True,
                    balance="bias_sign", routed_scaling=2.5, n_group=4, topk_group=2)
    cfg = Config(model=dataclasses.replace(TINY, qk_norm=False), moe=moe)
    model = random_model(cfg, seed=4)
    out = export_hf(model, cfg, tmp_path / "hf")
    hf_cfg = json.loads((out / "config.json").read_text())
    assert (hf_cfg["n_group"], hf_cfg["topk_group"]) == (4, 2)
    ours, err = logit_error(model, load_hf(out))
    print(f"max |logit error| (Glm4Moe, 4 groups, top 2): {err:.2e}")
    assert np.std(ours) > 0.5 and err < 1e-4  # float32 reordering, as the test above
    # the groups bind: without them some token picks other experts
    layer = model.blocks[1].ffn
    x = jax.random.normal(jax.random.key(3), (1, 64, TINY.d_model))
    logits = jnp.einsum("bsd,de->bse", x, layer.router)
    grouped, _ = route(logits, moe, layer.bias)
    free, _ = route(logits, dataclasses.replace(moe, n_group=1, topk_group=1), layer.bias)
    assert bool(jnp.any(jnp.sort(grouped.experts) != jnp.sort(free.experts)))


# ------------------------------------------------------------ RoPE scaling beyond the context

ORIGINAL = 16  # the "pre-training" context; the logits below run to position 95 (6x past it)
ROPES = {
    "linear": {"type": "linear", "factor": 4.0},
    "ntk": {"type": "ntk", "factor": 4.0},  # exported as default with the NTK-scaled theta
    "llama3": {"type": "llama3", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
}


def long_error(model, hf, length: int = 96) -> tuple[np.ndarray, float]:
    """Our logits and the max abs difference to transformers' at positions ORIGINAL.."""
    tokens = np.asarray(jax.random.randint(jax.random.key(6), (1, length), 0, TINY.vocab_size))
    ours = np.asarray(logits_of(model, jnp.asarray(tokens)))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    return ours, float(np.max(np.abs(ours - theirs)[:, ORIGINAL:]))


@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_scaling_logits_match_transformers_past_the_original_length(tmp_path, kind):
    from moelab.config import RopeConfig

    scale = 1.3 if kind in ("linear", "yarn") else 1.0  # folded into q_norm's weight
    model, cfg = tiny(rope=RopeConfig(**ROPES[kind]), attn_logit_scale=scale)
    hf = load_hf(export_hf(model, cfg, tmp_path / "hf"))
    expected = "default" if kind == "ntk" else kind
    assert hf.config.rope_parameters["rope_type"] == expected
    ours, err = long_error(model, hf)
    print(f"max |logit error| past position {ORIGINAL} ({kind}): {err:.2e}")
    assert np.std(ours) > 0.5 and err < 1e-4


def test_glm4moe_carries_yarn_and_a_logit_scale_folded_into_q_proj(tmp_path):
    from moelab.config import RopeConfig

    _, cfg = glm_model()  # no QK-norm: the scale goes into q_proj
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, rope=RopeConfig(**ROPES["yarn"]), attn_logit_scale=1.46))
    model = random_model(cfg, seed=1)
    hf = load_hf(export_hf(model, cfg, tmp_path / "hf"))
    assert type(hf).__name__ == "Glm4MoeForCausalLM"
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    ours, err = long_error(model, hf)
    print(f"max |logit error| past position {ORIGINAL} (Glm4Moe, yarn, scale 1.46): {err:.2e}")
    assert np.std(ours) > 0.5 and err < 1e-4
