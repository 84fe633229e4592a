"""Shared fixtures: a small real two-source dataset and a tiny training config."""

import os
import sysconfig
from pathlib import Path

import pytest
import yaml

STDLIB = sysconfig.get_paths()["stdlib"]
# Every test process compiles the same tiny programs: share them through JAX's disk cache.
COMPILE_CACHE = {"JAX_COMPILATION_CACHE_DIR": "/tmp/moelab-test-jax-cache",
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
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


def fake_devices_env(n: int, **extra: str) -> dict[str, str]:
    """Env for a subprocess with n fake CPU devices (XLA_FLAGS must be set before jax is
    imported); compiles fast and are cached on disk across test processes."""
    flags = f"--xla_force_host_platform_device_count={n} --xla_backend_optimization_level=0"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": "/tmp/moelab-test-jax-cache",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", **extra}
