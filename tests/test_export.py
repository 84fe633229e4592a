"""Export refusals and generation (KV cache, sampling), without torch; the CLI end to end."""

import dataclasses
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moelab.config import Config, ConfigError, ModelConfig, MoEConfig
from moelab.errors import UserError
from moelab.export.generate import generate, nucleus_mask, sample_token
from moelab.export.hf import check_exportable, export_hf
from moelab.model import Transformer
from moelab.outputs import MARKER

# GQA (4 query heads on 2 kv heads), head_dim != d_model / n_heads, QK-norm, one dense
# first layer of its own width, then two MoE layers; vocab fits a byte-level tokenizer.
TINY = ModelConfig(vocab_size=320, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2,
                   head_dim=16, d_ff=24, n_dense_layers=1, d_ff_dense=40, init_std=0.3)
MOE = MoEConfig(n_experts=4, top_k=2)


def random_model(cfg: Config, seed: int = 0) -> Transformer:
    """A random model built with numpy, so no initializer is compiled (seconds on 2 cores).

    init_std is large so logits are O(1) and routing far from uniform, and the norm
    weights (the only 1-D parameters) are not all ones, so a misplaced norm would show.
    """
    rng = np.random.default_rng(seed)
    skeleton = eqx.filter_eval_shape(Transformer.init, cfg.model, cfg.moe, jax.random.key(0))
    leaves = [1 + 0.3 * rng.standard_normal(x.shape) if len(x.shape) == 1
              else cfg.model.init_std * rng.standard_normal(x.shape)
              for x in jax.tree.leaves(skeleton)]
    return jax.tree.unflatten(jax.tree.structure(skeleton),
                              [jnp.asarray(x, jnp.float32) for x in leaves])


def tiny(tie: bool = False, **model) -> tuple[Transformer, Config]:
    cfg = Config(model=dataclasses.replace(TINY, tie_embeddings=tie, **model), moe=MOE)
    return random_model(cfg), cfg


@eqx.filter_jit
def logits_of(model: Transformer, tokens):
    return model(tokens)[0]


# ------------------------------------------------------------------------ refused configs


@pytest.mark.parametrize("section,field,value,named", [
    ("moe", "router", "sigmoid", "moe.shared_expert"),  # Glm4Moe always has a shared expert
    ("moe", "shared_expert", True, "moe.shared_expert"),
    ("moe", "balance", "bias_sign", "moe.balance"),
    ("moe", "routed_scaling", 2.0, "moe.routed_scaling"),
    ("model", "qk_norm", False, "model.qk_norm"),
    ("moe", "uniform_routing", True, "moe.uniform_routing"),  # a debug routing
    ("moe", "n_group", 2, "moe.n_group"),  # groups: Glm4Moe's, and it routes with sigmoid
])
def test_inexpressible_configs_are_refused_by_name_and_write_nothing(
        tmp_path, section, field, value, named):
    cfg = Config(model=TINY, moe=MOE)
    cfg = dataclasses.replace(
        cfg, **{section: dataclasses.replace(getattr(cfg, section), **{field: value})})
    model = random_model(cfg)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        check_exportable(cfg)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        export_hf(model, cfg, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_export_refuses_a_mismatched_config_a_small_vocab_and_a_full_directory(tmp_path):
    from moelab.data.tokenizer import train_tokenizer

    model, cfg = tiny()
    other = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, d_ff=48))
    with pytest.raises(UserError, match="different `model` config"):
        export_hf(model, other, tmp_path / "a")
    tokenizer = train_tokenizer(["some text to learn merges from"] * 5, vocab_size=300)
    model, cfg = tiny(vocab_size=tokenizer.get_vocab_size() - 1)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        export_hf(model, cfg, tmp_path / "b", tokenizer=tokenizer)
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        export_hf(model, cfg, tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    assert sorted(p.name for p in export_hf(model, cfg, tmp_path / "ok").iterdir()) == [
        MARKER, "config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full", "ok"]  # no temp left


def test_export_where_the_directory_cannot_be_created_is_one_line(tmp_path, monkeypatch):
    """Mode bits can say yes where creating says no (/proc, a read-only mount): one line
    naming --out, not an OSError about a temporary name."""
    import errno

    from moelab.export import hf

    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(hf.tempfile, "mkdtemp", refuse)
    model, cfg = tiny()
    with pytest.raises(UserError, match=r"--out .*hf: cannot create it in .*Read-only file"):
        export_hf(model, cfg, tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------- generation


def test_kv_cache_generation_equals_greedy_decoding_without_cache():
    model, _ = tiny()
    prompt, n_new = [5, 17, 42, 3, 88], 32
    buffer = np.zeros((1, len(prompt) + n_new), np.int32)  # fixed shape: one compile
    buffer[0, :len(prompt)] = prompt
    for t in range(len(prompt), buffer.shape[1]):  # causal: later zeros do not matter
        buffer[0, t] = int(jnp.argmax(logits_of(model, jnp.asarray(buffer))[0, t - 1]))
    assert generate(model, prompt, n_new) == buffer[0, len(prompt):].tolist()


def test_sampling_is_seeded_and_stays_inside_the_nucleus():
    logits = jnp.log(jnp.array([0.5, 0.3, 0.1, 0.06, 0.04]))
    assert nucleus_mask(jax.nn.softmax(logits), 0.75).tolist() == [True, True, False, False,
                                                                    False]
    assert nucleus_mask(jax.nn.softmax(logits), 0.01).tolist() == [True] + [False] * 4
    draws = jax.vmap(lambda k: sample_token(logits, k, 1.0, 0.75))(
        jax.random.split(jax.random.key(0), 400))
    assert set(np.asarray(draws).tolist()) == {0, 1}

    model, _ = tiny()
    run = lambda seed: generate(model, [1, 2, 3], 12, temperature=1.5, top_p=0.9, seed=seed)
    assert run(7) == run(7)
    assert run(7) != run(8)
    with pytest.raises(ConfigError, match="top_p"):
        generate(model, [1], 4, temperature=1.0, top_p=0.0)


def test_generation_stops_after_eos():
    model, _ = tiny()
    greedy = generate(model, [5, 17], 12)
    eos = greedy[3]
    assert generate(model, [5, 17], 12, eos_id=eos) == greedy[:greedy.index(eos) + 1]


def test_streamed_text_holds_split_characters_and_stops_at_end_of_text(monkeypatch):
    """`moelab generate` prints pieces as they are decoded: a byte-level tokenizer splits
    "€" into three byte tokens, and no piece may show half of it (U+FFFD); the pieces
    join to the decoded tokens, and the end-of-text token ends the text."""
    from moelab.data.tokenizer import EOS, train_tokenizer
    from moelab.export import generate as gen

    tokenizer = train_tokenizer(["plain ascii text, nothing else\n"] * 20, 300)
    ids = tokenizer.encode("price: 5 € and ü").ids
    assert len(ids) > len("price: 5 € and ü") - 8  # bytes of the non-ASCII split apart
    eos = tokenizer.token_to_id(EOS)
    written = [*ids, eos, *tokenizer.encode("after the end").ids]
    monkeypatch.setattr(gen, "iter_generate", lambda *args, **kw: iter(written))
    pieces = list(gen.iter_text(None, tokenizer, "p", 99))
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == tokenizer.decode(ids) == "price: 5 € and ü"
    assert len(pieces) > 1  # streamed, not one piece at the end


# ------------------------------------------------------------------------------------ CLI


def test_cli_module_imports_nothing_heavy():
    code = ("import sys, moelab.export.cli; "
            "print(sorted(m for m in ('jax', 'torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_cli_exports_and_generates_from_a_run_dir(tmp_path, capsys, caplog):
    checkpoint = pytest.importorskip("moelab.train.checkpoint")
    from moelab.cli import main
    from moelab.config import config_to_dict
    from moelab.data.tokenizer import TOKENIZER_FILE, train_tokenizer
    from moelab.train.optimizer import make_optimizer, trainable

    data = tmp_path / "data"
    data.mkdir()
    train_tokenizer(["def f(x):\n    return x * 2\n"] * 10, 300).save(str(data / TOKENIZER_FILE))
    cfg = Config(model=TINY, moe=MOE,
                 data=dataclasses.replace(Config().data, path=str(data)))
    model = random_model(cfg)
    opt_state = make_optimizer(cfg.optim, cfg.train.steps, None).init(trainable(model))
    checkpoint.Checkpointer(tmp_path / "run", keep=1).save(
        3, model, opt_state, {"config": config_to_dict(cfg)})

    assert main(["export", "--run-dir", str(tmp_path / "run"), "--out",
                 str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # not owner-only
    assert main(["generate", "--run-dir", str(tmp_path / "run"), "--prompt", "def",
                 "--max-new-tokens", "5", "--temperature", "0"]) == 0
    exported, generated = capsys.readouterr().out.split("\n", 1)
    # orbax's read-only notices (one claims the checkpoint directory is read only) are noise
    assert not [r for r in caplog.records if r.name == "absl" and r.levelname == "WARNING"]
    assert exported.startswith("exported step 3") and generated.startswith("def")
    seq_len = cfg.data.seq_len  # past the trained context: a note on stderr, text on stdout
    assert main(["generate", str(tmp_path / "run"), "--prompt", "def",
                 "--max-new-tokens", str(seq_len), "--temperature", "0"]) == 0
    streamed = capsys.readouterr()
    assert "context the model trained on" in streamed.err
    assert streamed.out.startswith(generated.rstrip("\n"))  # greedy: the same first tokens
    with pytest.raises(SystemExit) as refused:  # argparse's range check: usage error, exit 2
        main(["generate", "--run-dir", str(tmp_path / "run"), "--top-p", "2"])
    assert refused.value.code == 2
    assert main(["export", "--run-dir", str(tmp_path / "typo"), "--out", "x"]) == 2
    assert not (tmp_path / "typo").exists()
