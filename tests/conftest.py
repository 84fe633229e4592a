"""Shared fixtures: a small real two-source dataset and a tiny training config."""

import importlib
import json
import os
import random
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

STDLIB = sysconfig.get_paths()["stdlib"]
# Every test process compiles the same tiny programs: share them through JAX's disk cache.
COMPILE_CACHE = {"JAX_COMPILATION_CACHE_DIR": "/tmp/moelab-test-jax-cache",
                 "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                 "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def pytest_configure(config):
    """One disk cache for every program the suite compiles, in this process and in every
    process it starts: the tests' tiny runs share most of their programs, so a fresh
    machine compiles each once. Set before anything imports jax, whose flags read the
    environment on import; the processes the tests start inherit it."""
    os.environ.update(COMPILE_CACHE)
    if "jax" in sys.modules:  # a plugin imported it first
        import jax

        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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


BENCH = Path(__file__).resolve().parents[1] / "bench"


def import_bench(name: str):
    """A bench/ script as a module; bench/ is on the path only while it imports (the
    scripts import their siblings, bench/machine.py, by bare name)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


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
        if isinstance(fields, list):  # stages=[...]
            raw[name] = fields
        else:
            raw.setdefault(name, {}).update(fields)
    return raw


# A three-stage plan on the small corpus (30 steps): by size, then prose up-weighted at half
# the seq_len (tokens per step kept), then code only with a fresh optimizer and an LR restart.
THREE_STAGES = [
    {"mixture": {}},
    {"start": 0.4, "mixture": {"code": 1, "prose": 3}, "seq_len": 16},
    {"start": 24, "mixture": {"code": 1.0}, "optimizer": "fresh",
     "restart": {"warmup": 2, "peak_fraction": 0.5}},
]


@pytest.fixture
def write_config(tmp_path, small_corpus):
    """write_config(**sections) -> path of a YAML tiny config on the small corpus."""
    def write(**sections) -> Path:
        path = tmp_path / f"config{len(list(tmp_path.glob('config*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(tiny_config(small_corpus, **sections)))
        return path

    return write


# ------------------------------------------------------------------------- training runs


def moelab_train(config, run_dir, *extra, env=None, check=True):
    """Run `moelab train` in a fresh process (compiled programs cached across processes)."""
    cmd = [sys.executable, "-m", "moelab.cli", "train", "--config", str(config),
           "--run-dir", str(run_dir), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def losses(run_dir) -> dict:
    """{step: training loss} of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def events(run_dir) -> list:
    """The run's events.jsonl records (none yet: [])."""
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory, small_corpus) -> dict[str, Path]:
    """Two tiny runs trained 12 steps on the small corpus by the `moelab` CLI: "qwen"
    (softmax router: exports as Qwen3-MoE) and "glm" (sigmoid router, shared expert,
    selection bias, routed scaling: exports as Glm4Moe)."""
    from moelab.cli import main

    root = tmp_path_factory.mktemp("trained")
    glm = {"moe": {"router": "sigmoid", "shared_expert": True, "balance": "bias_sign",
                   "routed_scaling": 2.0}, "loss": {"aux_weight": 0.0}}
    runs = {}
    for name, sections in (("qwen", {}), ("glm", glm)):
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(tiny_config(small_corpus, **sections)))
        assert main(["train", "--config", str(path), "--run-dir", str(root / name)]) == 0
        runs[name] = root / name
    return runs


def fake_devices_env(n: int, **extra: str) -> dict[str, str]:
    """Env for a subprocess with n fake CPU devices (XLA_FLAGS must be set before jax is
    imported); compiles fast and are cached on disk across test processes."""
    flags = f"--xla_force_host_platform_device_count={n} --xla_backend_optimization_level=0"
    return {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu",
            "JAX_COMPILATION_CACHE_DIR": "/tmp/moelab-test-jax-cache",
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5", **extra}


# ------------------------------------------------------------------------------ lab

# A string that would run if any page let it through: as HTML, or by closing a JSON block.
EVIL = "</script><script>window.__pwned = 1</script>"


@pytest.fixture(scope="module")
def sample_lab(tmp_path_factory) -> Path:
    """A lab with two experiments. exp-1: two MoE runs logging every metric the trainer
    logs, a spike, a restart, a prediction, configs that differ in lr, planned for 1000
    steps but stopped at 40 and 30; exp-2: a dense run whose name, hypothesis, run dir
    and event message are EVIL, logging only loss."""
    from moelab.lab.store import Store

    path = tmp_path_factory.mktemp("lab") / "lab.sqlite"
    with Store(path) as store:
        moe = store.new_experiment("moe-baseline", "loss reaches 2.0", {}, "abc+dirty")
        store.add_prediction(moe, "final loss", 2.0, 1.8, 2.2, {"metric": "loss"})
        for lr, steps, scale in ((1e-3, 40, 5.0), (3e-3, 30, 4.5)):
            run = store.start_run(moe, f"runs/moe-{lr}",
                                  {"optim": {"lr": lr}, "train": {"steps": 1000}})
            for step in range(steps):
                store.log_metrics(run, step, {
                    "loss": scale / (1 + step / 8), "grad_norm": 9.0 if step == 20 else 1.0,
                    "val_loss/web": 1.1 * scale / (1 + step / 8), "drop_frac/layer_0": 0.1,
                    "expert_load_max_over_mean/layer_0": 1.5,
                    "expert_load_max_over_mean/layer_1": 1.2, "lr": lr})
        store.log_event("run-1", 20, "spike", "grad norm 9.0")
        store.log_event("run-1", 30, "restart", f"resumed from step 25 {EVIL}")
        store.finish_run("run-1", "failed", "preempted")
        dense = store.new_experiment(EVIL, f"escaping {EVIL}", {}, None)
        dense_run = store.start_run(dense, EVIL, {})
        store.log_metrics(dense_run, 0, {"loss": 4.0})
        store.log_event(dense_run, 0, EVIL, EVIL)
    return path


@pytest.fixture(scope="module")
def chromium(tmp_path_factory):
    """A headless Chromium driven by selenium, offline, collecting the console log (so a
    test can assert that no script error or CSP violation happened)."""
    import shutil

    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install selenium")
    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver):
        pytest.skip("no chromium/chromedriver: apt-get install chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--no-proxy-server",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 "--window-size=1280,1600",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))
    yield browser
    browser.quit()
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


# ------------------------------------------------------------------------- run dirs

FUZZ_STEPS, FUZZ_EVERY = 16, 4  # checkpoints at 4, 8, 12, 16, all kept


@pytest.fixture(scope="session")
def small_runs(tmp_path_factory, small_corpus) -> Path:
    """A root directory holding a copy of the small corpus (`data/`), a config naming it by
    the working-directory path `./data` (`config.yaml`), and three runs of it: `full`, 16 steps;
    `other`, the same with train.seed 1; `half`, `full` as a crash after step 8 leaves it
    (checkpoints 4 and 8, metrics and events to step 8). Tests copy the root and work in
    the copy (chdir'd into it), so each one gets its own dataset and runs."""
    import shutil

    from moelab.config import config_from_dict
    from moelab.train.metrics import JsonlLog
    from moelab.train.trainer import train

    root = tmp_path_factory.mktemp("runs")
    shutil.copytree(small_corpus, root / "data")
    raw = tiny_config("./data", train={"steps": FUZZ_STEPS, "checkpoint_every": FUZZ_EVERY,
                                           "keep_checkpoints": 4, "eval_every": 8})
    (root / "config.yaml").write_text(yaml.safe_dump(raw))
    cwd = Path.cwd()
    os.chdir(root)
    try:
        train(config_from_dict(raw), root / "full")
        raw["train"]["seed"] = 1
        train(config_from_dict(raw), root / "other")
    finally:
        os.chdir(cwd)
    half = root / "half"
    shutil.copytree(root / "full", half)
    for step in (12, 16):
        shutil.rmtree(half / "checkpoints" / str(step))
    for name in ("metrics.jsonl", "events.jsonl"):
        log = JsonlLog(half / name)
        if log.path.exists():
            log.truncate_after(8)
    return root


def copy_runs(small_runs: Path, tmp_path: Path, monkeypatch) -> Path:
    """A private copy of `small_runs`, made the working directory."""
    import shutil

    root = tmp_path / "root"
    shutil.copytree(small_runs, root)
    monkeypatch.chdir(root)
    return root
