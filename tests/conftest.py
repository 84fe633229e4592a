"""Shared fixtures: a small real two-source dataset and a tiny training config."""

import random
import sysconfig
from pathlib import Path

import pytest
import yaml

STDLIB = sysconfig.get_paths()["stdlib"]
SMALL_SOURCES = {
    "code": [f"{STDLIB}/json/*.py", f"{STDLIB}/email/*.py", f"{STDLIB}/logging/*.py"],
    "prose": ["/usr/share/common-licenses/*", "/usr/share/doc/*/copyright"],
}


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """A prepared dataset from real files on the machine (stdlib code, license prose)."""
    from moelab.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "small"
    prepare(out, SMALL_SOURCES, vocab_size=512, max_docs_per_source=60, max_chars=20_000)
    return out


def tiny_config(data_path: Path, **sections) -> dict:
    """A model small enough that a training step takes milliseconds on CPU."""
    raw = {
        "model": {"vocab_size": 512, "d_model": 32, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "d_ff": 32},
        "moe": {"n_experts": 4, "top_k": 2, "dispatch": "dropless"},
        "data": {"path": str(data_path), "seq_len": 32, "batch_size": 4},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"steps": 12, "log_every": 4, "eval_every": 6, "eval_batches": 1,
                  "checkpoint_every": 4, "keep_checkpoints": 2},
    }
    for name, fields in sections.items():
        raw.setdefault(name, {}).update(fields)
    return raw


@pytest.fixture
def write_config(tmp_path, small_corpus):
    """write_config(**sections) -> path of a YAML tiny config on the small corpus."""
    def write(**sections) -> Path:
        path = tmp_path / f"config{len(list(tmp_path.glob('config*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(tiny_config(small_corpus, **sections)))
        return path

    return write


def words_text(rng: random.Random, n_words: int) -> str:
    """Text of made-up words: distinct documents share almost no 5-word windows."""
    words = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 7)))
             for _ in range(n_words)]
    return "\n".join(" ".join(words[i : i + 12]) for i in range(0, n_words, 12))


def write_corpus(root: Path, name: str, n_docs: int, n_words: int, seed: int) -> str:
    """n_docs files under root/name; returns their glob."""
    rng = random.Random(seed)
    (root / name).mkdir(parents=True)
    for i in range(n_docs):
        (root / name / f"doc{i:03d}.txt").write_text(words_text(rng, n_words))
    return str(root / name / "*.txt")
