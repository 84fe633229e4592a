"""Curation: embed + cluster + quality buckets -> cells; mixtures over cells; the epoch cap."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import tiny_config

from moelab.cli import main
from moelab.curate.pipeline import curate
from moelab.data import cells, cluster
from moelab.data.loader import Loader, capped, read_meta, resolve_mixture
from moelab.data.provenance import read_manifest
from moelab.errors import UserError

pytest.importorskip("faiss", reason="pip install -e '.[curation]'")
SETTINGS = {"clusters": 8, "domains": 3, "buckets": 2, "workers": 1}


def copy_of(dataset: Path, to: Path) -> Path:
    shutil.copytree(dataset, to)
    return to


@pytest.fixture(scope="module")
def curated(small_corpus, tmp_path_factory) -> Path:
    """The small two-source corpus, curated with the lexical embedder."""
    out = copy_of(small_corpus, tmp_path_factory.mktemp("curated") / "data")
    curate(out, **SETTINGS)
    return out


def test_clustering_is_deterministic_for_a_seed(curated, small_corpus, tmp_path):
    again = copy_of(small_corpus, tmp_path / "again")
    curate(again, **SETTINGS)
    for name in (cells.ASSIGNMENTS_FILE, cells.REPORT_FILE):
        assert (again / cells.CELLS_DIR / name).read_bytes() == \
            (curated / cells.CELLS_DIR / name).read_bytes()
    assert read_meta(again)["cells"] == read_meta(curated)["cells"]


def test_every_document_lands_in_exactly_one_cell(curated):
    meta = read_meta(curated)
    kept = sorted(r["doc_id"] for r in read_manifest(curated) if r["split"])
    assigned = pq.read_table(curated / cells.CELLS_DIR / cells.ASSIGNMENTS_FILE)
    assert sorted(assigned["doc_id"].to_pylist()) == kept  # each kept document, once
    table = meta["cells"]["cells"]
    assert sum(c["documents"] for c in table.values()) == len(kept)
    for split in ("train", "val"):
        # the cells' streams hold exactly the sources' tokens, each token once
        lengths = {name: len(np.load(curated / cells.CELLS_DIR /
                                     f"{cells.cell_file_stem(name)}.{split}.npy"))
                   for name in table}
        assert lengths == {name: c[f"{split}_tokens"] for name, c in table.items()}
        assert sum(lengths.values()) == sum(meta[f"{split}_tokens"].values())
        joined = np.sort(np.concatenate([np.load(curated / cells.CELLS_DIR /
                                                 f"{cells.cell_file_stem(n)}.{split}.npy")
                                         for n in table]))
        sources = np.sort(np.concatenate([np.load(curated / f"{s}.{split}.npy")
                                          for s in meta["sources"]]))
        np.testing.assert_array_equal(joined, sources)
    for source in meta["sources"]:  # each source's train tokens, spread over the cells
        assert sum(c["source_train_tokens"].get(source, 0) for c in table.values()) == \
            meta["train_tokens"][source]
    assert all(sum(c["source_train_tokens"].values()) == c["train_tokens"]
               for c in table.values())
    report = json.loads((curated / cells.CELLS_DIR / cells.REPORT_FILE).read_text())
    assert report["documents"] == len(kept)
    assert 0 < report["purity"] <= 1 and 0 <= report["nmi"] <= 1
    assert all(len(d["snippets"]) <= 3 and d["top_terms"] for d in report["per_domain"])


def test_tiny_cells_merge_into_the_tail():
    final = cells.merge_tiny({"d00/q0": 900, "d00/q1": 95, "d01/q0": 5}, 0.01)
    assert final == {"d00/q0": "d00/q0", "d00/q1": "d00/q1", "d01/q0": cells.TAIL}
    assert cells.merge_tiny({"a": 1, "b": 1}, 0.9) == {"a": "a", "b": "b"}  # all tiny: kept


def test_quality_cuts_split_the_sample_into_equal_buckets():
    rng = np.random.default_rng(0)
    sample = [{"symbol_word_ratio": float(x)} for x in rng.random(1000)]
    ref = cells.reference(sample)
    quality = np.array([cells.composite(s, ref) for s in sample])
    cut_points = cells.cuts(quality, 5)
    counts = np.bincount([cells.bucket(q, cut_points) for q in quality], minlength=5)
    assert counts.tolist() == [200] * 5  # quantile cuts of distinct values: exact fifths
    ref = cells.reference([{"symbol_word_ratio": x, "alpha_word_fraction": x} for x in
                           (0.2, 0.5, 0.9)])
    best = cells.composite({"symbol_word_ratio": 0.0, "alpha_word_fraction": 1.0}, ref)
    worst = cells.composite({"symbol_word_ratio": 1.0, "alpha_word_fraction": 0.0}, ref)
    assert (best, worst) == (1.0, 0.0)  # a lower symbol ratio and more alpha words are better


def test_k_larger_than_the_sample_is_a_one_line_error(small_corpus, tmp_path, capsys):
    data = copy_of(small_corpus, tmp_path / "data")
    code = main(["data", "curate", str(data), "--clusters", "50", "--sample-docs", "20",
                 "--workers", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--clusters 50 is larger than the sample" in err
    with pytest.raises(UserError, match="larger than the sample"):
        cluster.fit_centroids(np.eye(4, dtype=np.float32), 5, 0)


def test_a_mixture_over_cells_draws_each_cells_share(curated):
    names = list(read_meta(curated)["cells"]["cells"])
    weights = {f"cell:{n}": float(i + 1) for i, n in enumerate(names)}
    loader = Loader(curated, "train", seq_len=16, batch_size=50, mixture=weights, seed=3)
    counts = np.zeros(len(names))
    steps = 400
    for step in range(steps):
        counts += np.bincount(loader.plan(step)[0], minlength=len(names))
    n = steps * loader.batch_size
    expected = np.arange(1, len(names) + 1) / sum(range(1, len(names) + 1))
    # Each row picks cell c with probability p_c independently, so its count is
    # Binomial(n, p_c): 4.5 standard deviations leave a 7e-6 chance per cell of a false
    # failure (and the draws are a fixed function of the seed, so it cannot flake).
    bound = 4.5 * np.sqrt(expected * (1 - expected) / n)
    assert np.all(np.abs(counts / n - expected) <= bound)
    rows = loader.batch(0)
    assert rows.shape == (50, 17)


def test_an_unknown_cell_or_a_mixed_mixture_is_a_one_line_error(curated, small_corpus):
    with pytest.raises(UserError, match=r"cell\(s\) \['cell:d99/q9'\].*available cells"):
        Loader(curated, mixture={"cell:d99/q9": 1.0})
    with pytest.raises(UserError, match="both sources and cells"):
        Loader(curated, mixture={"code": 1.0, "cell:d00/q0": 1.0})
    with pytest.raises(UserError, match="run `moelab data curate"):
        Loader(small_corpus, mixture={"cell:d00/q0": 1.0})


def test_the_epoch_cap_holds(curated):
    meta = read_meta(curated)
    table = meta["cells"]["cells"]
    names = [f"cell:{n}" for n in table]
    train = np.array([table[n]["train_tokens"] for n in table], float)
    smallest = int(train.argmin())
    mixture = {n: (10.0 if i == smallest else 1.0) for i, n in enumerate(names)}
    seq_len, batch, steps = 16, 32, 300
    run_tokens = seq_len * batch * steps
    cap = 1.5 * run_tokens / train.sum()  # binding for the over-weighted smallest cell
    free = resolve_mixture(meta, "train", mixture)
    assert free.weights[smallest] * run_tokens / train[smallest] > cap  # the cap must bind
    loader = Loader(curated, "train", seq_len, batch, mixture, seed=0, max_epochs=cap,
                    run_tokens=run_tokens)
    epochs = np.array(loader.mixture.epochs)
    assert np.all(epochs <= cap * (1 + 1e-9)) and math.isclose(loader.weights.sum(), 1.0)
    assert math.isclose(epochs[smallest], cap)
    drawn = np.zeros(len(names))
    for step in range(steps):
        drawn += np.bincount(loader.plan(step)[0], minlength=len(names))
    # The realized tokens of a component are seq_len x Binomial(rows, w): at most 4.5 sd
    # above the capped expectation (see the mixture test for why 4.5).
    rows = batch * steps
    sd = np.sqrt(rows * loader.weights * (1 - loader.weights))
    assert np.all(drawn * seq_len <= cap * train + 4.5 * sd * seq_len)
    with pytest.raises(UserError, match="data.max_epochs"):
        Loader(curated, "train", seq_len, batch, mixture, max_epochs=1e-6, run_tokens=run_tokens)


def test_capped_weights_fill_the_simplex_and_keep_proportions():
    weights, caps = np.array([0.7, 0.2, 0.1]), np.array([0.3, 1.0, 0.1])
    out = capped(weights, caps, {})
    assert math.isclose(out.sum(), 1.0) and np.all(out <= caps + 1e-12)
    np.testing.assert_allclose(out, [0.3, 0.6, 0.1])  # the excess went to the only free one


@pytest.mark.slow  # two training processes (~2 min on a busy 2-core machine)
def test_neural_embedder_uses_a_checkpoint_of_the_same_tokenizer(curated, small_corpus, tmp_path):
    """A tiny run trained on the corpus embeds it; a dataset with another tokenizer is
    refused in one line; and a run trains on a capped mixture of the resulting cells."""
    run = tmp_path / "run"
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(tiny_config(small_corpus, train={"steps": 4})))
    train = [sys.executable, "-m", "moelab.cli", "train", "--config", str(config)]
    subprocess.run([*train, "--run-dir", str(run)], check=True, capture_output=True,
                   timeout=600)
    neural = copy_of(small_corpus, tmp_path / "neural")
    entry = curate(neural, "neural", run, **SETTINGS)
    assert entry["report"]["dim"] == tiny_config(small_corpus)["model"]["d_model"]
    kept = sum(1 for r in read_manifest(small_corpus) if r["split"])
    assert entry["report"]["documents"] == kept
    other = copy_of(small_corpus, tmp_path / "other")
    (other / "tokenizer.json").write_text((other / "tokenizer.json").read_text() + " ")
    code = main(["data", "curate", str(other), "--embedder", "neural", "--checkpoint", str(run),
                 "--clusters", "4", "--workers", "1"])
    assert code == 2
    names = {f"cell:{n}": 1.0 for n in read_meta(curated)["cells"]["cells"]}
    config.write_text(yaml.safe_dump(tiny_config(curated, train={"steps": 4}, data={
        "mixture": names, "max_epochs": 4.0})))
    done = subprocess.run([*train, "--run-dir", str(tmp_path / "cells_run")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "mixture: cell:" in done.stdout and "epochs)" in done.stdout


def _stops() -> None:
    raise StopIteration  # what scikit-learn's HashingVectorizer raised on an empty shard


def test_a_task_raising_stop_iteration_fails_its_stage_instead_of_ending_it():
    from moelab.data.executor import Executor

    with Executor(workers=1) as executor, pytest.raises(RuntimeError, match="StopIteration"):
        executor.map([lambda: 1, _stops, lambda: 3], "stage")
