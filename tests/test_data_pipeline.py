"""prepare, the manifest, the loader and the CLI, on small corpora made in tmp_path."""

import gzip
import json
import os
import random
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import words_text, write_corpus

from moelab.cli import main
from moelab.data import prepare as prepare_module
from moelab.data.loader import Loader, read_meta
from moelab.data.prepare import ensure_default_corpus, prepare
from moelab.data.provenance import read_manifest
from moelab.data.shards import shard_path
from moelab.data.tokenizer import EOS, load_tokenizer
from moelab.errors import UserError

SMALL = {"vocab_size": 320, "workers": 1, "min_chars": 50}


def records_by_name(data_dir: Path) -> dict[str, dict]:
    return {Path(r["path"]).name: r for r in read_manifest(data_dir)}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    """Two sources of unequal size, prepared once for the loader tests."""
    root = tmp_path_factory.mktemp("corpus")
    sources = {"code": write_corpus(root, "code", 30, 400, seed=1),
               "prose": write_corpus(root, "prose", 20, 250, seed=2)}
    prepare(root / "data", sources, val_fraction=0.2, **SMALL)
    return root / "data"


# ------------------------------------------------------------------------ prepare


def test_exact_and_near_duplicates_are_dropped_and_name_the_original(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    original = words_text(random.Random(0), 300)
    near = original.split()
    near[100] = "changed"
    (src / "a.txt").write_text(original)
    (src / "b.txt").write_bytes(original.replace("\n", "\r\n").encode())  # same once normalized
    (src / "c.txt").write_text(" ".join(near))  # one word of 300 differs
    (src / "d.txt").write_text(words_text(random.Random(1), 300))
    prepare(tmp_path / "data", {"docs": str(src / "*.txt")}, **SMALL)
    records = records_by_name(tmp_path / "data")
    assert records["a.txt"]["status"] == records["d.txt"]["status"] == "kept"
    assert records["b.txt"]["reason"] == f"exact_dup_of:{src / 'a.txt'}"
    assert records["c.txt"]["reason"] == f"near_dup_of:{src / 'a.txt'}"
    assert records["b.txt"]["sha256"] == records["a.txt"]["sha256"]
    assert {records[n]["status"] for n in ("b.txt", "c.txt")} == {"dropped"}


def test_near_dup_threshold_is_honoured(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    words = words_text(random.Random(0), 300).split()
    (src / "a.txt").write_text(" ".join(words))
    other = words_text(random.Random(1), 100).split()
    # 196 of the 296 word 5-grams shared, 396 in the union: Jaccard about 0.5
    (src / "b.txt").write_text(" ".join(words[:200] + other))
    prepare(tmp_path / "strict", {"docs": str(src / "*.txt")}, near_dup_threshold=0.9, **SMALL)
    assert records_by_name(tmp_path / "strict")["b.txt"]["status"] == "kept"
    prepare(tmp_path / "loose", {"docs": str(src / "*.txt")}, near_dup_threshold=0.4, **SMALL)
    assert records_by_name(tmp_path / "loose")["b.txt"]["reason"].startswith("near_dup_of:")


def test_bad_files_are_dropped_with_their_reason(tmp_path):
    src = tmp_path / "src"
    write_corpus(tmp_path, "src", 3, 200, seed=0)
    (src / "binary.txt").write_bytes(b"\x7fELF\x00\x00" + b"x" * 200)
    (src / "latin1.txt").write_bytes("Ünïcödé façade café ".encode("latin-1") * 20)
    (src / "one_bad_byte.txt").write_bytes(
        b"caf\xe9 " + words_text(random.Random(8), 60).encode())
    (src / "short.txt").write_text("too short")
    (src / "broken.txt").symlink_to(src / "missing")
    (src / "corrupt.txt.gz").write_bytes(b"not gzip at all")
    (src / "zipped.txt.gz").write_bytes(gzip.compress(words_text(random.Random(9), 99).encode()))
    prepare(tmp_path / "data", {"docs": [str(src / "*.txt"), str(src / "*.gz")]}, **SMALL)
    reasons = {name: r["reason"] for name, r in records_by_name(tmp_path / "data").items()}
    assert reasons["binary.txt"] == "binary"
    assert reasons["latin1.txt"] == "not_utf8"
    assert reasons["one_bad_byte.txt"] == "utf8_replaced:1"  # kept, with the repair noted
    assert reasons["short.txt"] == "too_short"
    assert reasons["broken.txt"] == "unreadable:No such file or directory"
    assert reasons["corrupt.txt.gz"].startswith("unreadable:")
    assert reasons["zipped.txt.gz"] == ""
    assert read_meta(tmp_path / "data")["documents"]["docs"]["kept"] == 5


def test_empty_sources_raise_a_clear_user_error(tmp_path):
    with pytest.raises(UserError, match=r"source 'none': no files match"):
        prepare(tmp_path / "a", {"none": str(tmp_path / "*.nothing")}, **SMALL)
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(UserError, match=r"source 'tiny': none of its 1 files.*too_short"):
        prepare(tmp_path / "b", {"tiny": str(tmp_path / "tiny.txt")}, **SMALL)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("bad", [{"vocab_size": 100}, {"near_dup_threshold": 1.0},
                                 {"val_fraction": 1.0}, {"min_chars": 0}])
def test_impossible_settings_raise_before_any_work(tmp_path, bad):
    with pytest.raises(UserError, match="must be"):
        prepare(tmp_path / "data", {"docs": str(tmp_path / "*.nothing")}, **{**SMALL, **bad})


def test_failed_or_interrupted_prepare_never_leaves_a_complete_looking_dataset(
    tmp_path, monkeypatch
):
    sources = {"docs": write_corpus(tmp_path, "src", 6, 200, seed=0)}
    out = tmp_path / "data"
    prepare(out, sources, **SMALL)
    with pytest.raises(UserError):  # bad input fails before anything is written
        prepare(out, {"docs": str(tmp_path / "*.nothing")}, **SMALL)
    assert Loader(out, seq_len=8, batch_size=2).batch(0).shape == (2, 9)

    real_write, written = prepare_module.write_streams, []

    def write_then_crash(paths, totals, pieces, dtype):  # cut off after the first piece
        written.extend(paths.values())
        return real_write(paths, totals, _interrupted(pieces), dtype)

    monkeypatch.setattr(prepare_module, "write_streams", write_then_crash)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, sources, **SMALL)
    assert all(np.load(path).dtype == np.uint16 for path in written)  # the old shards, whole
    assert not (out / "meta.json").exists()
    assert not list(out.glob(".*.tmp"))
    with pytest.raises(UserError, match="not a prepared dataset"):
        Loader(out)
    (out.parent / "a_file").write_text("text")  # a file: named as one, no advice to prepare it
    with pytest.raises(UserError, match="is a file, not a prepared dataset"):
        Loader(out.parent / "a_file")


def test_a_finished_dataset_is_never_rebuilt_with_other_settings(tmp_path):
    sources = {"docs": write_corpus(tmp_path, "src", 6, 200, seed=0)}
    out = tmp_path / "data"
    prepare(out, sources, **SMALL)
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(UserError, match=r"prepared with other settings \(vocab_size\)"):
        prepare(out, sources, **{**SMALL, "vocab_size": 400})
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    prepare(out, sources, **SMALL)  # the same settings: a rerun repeats it
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    # the same settings, a source file edited since: refused once the files are read, the
    # dataset (streams, tokenizer, meta, manifest) left as it was
    manifest = sorted(p.read_bytes() for p in (out / "manifest").iterdir())
    edited = tmp_path / "src" / "doc000.txt"
    edited.write_text(edited.read_text() + " an edit")
    with pytest.raises(UserError, match="prepared from other files than the sources hold"):
        prepare(out, sources, **SMALL)
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.read_bytes() for p in (out / "manifest").iterdir()) == manifest
    assert not (out / ".stages").exists()


def _interrupted(pieces):
    yield next(iter(pieces))
    raise KeyboardInterrupt


def test_tokenizer_round_trips_and_meta_describes_it(dataset):
    tokenizer, meta = load_tokenizer(dataset), read_meta(dataset)
    text = "def f(x):\n    return x ** 2  # ünïcode, emoji \U0001f600 and\ttabs"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text
    assert meta["eos_id"] == tokenizer.token_to_id(EOS)
    assert meta["vocab_size"] == tokenizer.get_vocab_size() <= SMALL["vocab_size"]
    assert meta["sources"] == ["code", "prose"]


def test_shards_pack_documents_with_eos_and_val_is_disjoint_from_train(dataset):
    tokenizer, meta = load_tokenizer(dataset), read_meta(dataset)
    records = list(read_manifest(dataset))
    for source in meta["sources"]:
        texts = {}
        for split in ("train", "val"):
            stream = np.load(shard_path(dataset, source, split))
            assert stream[-1] == meta["eos_id"] and len(stream) == meta[f"{split}_tokens"][source]
            ends = np.flatnonzero(stream == meta["eos_id"])
            docs = np.split(stream, ends + 1)[:-1]
            texts[split] = {tokenizer.decode(d[:-1].tolist()) for d in docs}
            mine = [r for r in records if r["source"] == source and r["split"] == split]
            assert len(ends) == len(mine) and sum(r["tokens"] for r in mine) == len(stream)
        assert texts["train"] and texts["val"] and not texts["train"] & texts["val"]


# ------------------------------------------------------------------------- loader


def test_batches_are_windows_of_the_packed_streams(dataset):
    loader = Loader(dataset, seq_len=16, batch_size=4)
    batch = loader.batch(3)
    assert batch.shape == (4, 17) and batch.dtype == np.int32
    streams = [np.load(shard_path(dataset, s, "train")) for s in loader.sources]
    for row, source, window in zip(batch, *loader.plan(3), strict=True):
        assert np.array_equal(row, streams[source][window * 16 : window * 16 + 17])
    eos = read_meta(dataset)["eos_id"]
    assert any((b == eos).any() for b in (loader.batch(s) for s in range(20)))


@pytest.mark.parametrize("mixture", [{"code": 0.3, "prose": 0.7}, {"code": 1.0}, {}])
def test_mixture_proportions_are_within_2_percent_over_10k_sequences(dataset, mixture):
    loader = Loader(dataset, seq_len=16, batch_size=100, mixture=mixture, seed=7)
    counts = Counter(i for step in range(100) for i in loader.plan(step)[0].tolist())
    if mixture:
        target = {s: mixture.get(s, 0.0) / sum(mixture.values()) for s in loader.sources}
    else:
        tokens = read_meta(dataset)["train_tokens"]
        target = {s: tokens[s] / sum(tokens.values()) for s in loader.sources}
    for i, source in enumerate(loader.sources):
        assert abs(counts[i] / 10_000 - target[source]) < 0.02


def test_loader_is_a_pure_function_of_seed_and_step(dataset):
    a, b = Loader(dataset, seq_len=16, batch_size=4), Loader(dataset, seq_len=16, batch_size=4)
    assert np.array_equal(a.batch(5), b.batch(5))
    assert [next(a).tolist() for _ in range(3)] == [b.batch(s).tolist() for s in range(3)]
    other_seed = Loader(dataset, seq_len=16, batch_size=4, seed=1)
    assert not np.array_equal(other_seed.batch(5), b.batch(5))
    val = [Loader(dataset, "val", seq_len=16, batch_size=4, seed=s).batch(0) for s in (0, 1)]
    assert np.array_equal(*val)  # eval text does not depend on the run's seed


def test_a_restored_loader_yields_the_uninterrupted_batches(dataset):
    settings = {"seq_len": 16, "batch_size": 4, "mixture": {"code": 0.5, "prose": 0.5}}
    uninterrupted = Loader(dataset, **settings)
    for _ in range(7):
        next(uninterrupted)
    state = json.loads(json.dumps(uninterrupted.state_dict()))
    restored = Loader(dataset, **settings)
    restored.load_state_dict(state)
    for _ in range(5):
        assert np.array_equal(next(restored), next(uninterrupted))
    with pytest.raises(UserError, match="seq_len: saved 16, now 32"):
        Loader(dataset, **{**settings, "seq_len": 32}).load_state_dict(state)


def test_mixture_naming_a_missing_source_raises(dataset):
    with pytest.raises(UserError, match=r"\['web'\].*available sources: \['code', 'prose'\]"):
        Loader(dataset, mixture={"code": 1.0, "web": 1.0})
    with pytest.raises(UserError, match="fewer than seq_len"):
        Loader(dataset, "val", seq_len=100_000)


# ---------------------------------------------------------------------------- cli


def test_cli_prepare_and_stats(tmp_path, capsys):
    glob = write_corpus(tmp_path, "src", 5, 100, seed=4)
    (tmp_path / "src" / "dup.txt").write_text((tmp_path / "src" / "doc000.txt").read_text())
    out = str(tmp_path / "data")
    args = ["data", "prepare", "--out", out, "--source", f"notes={glob}",
            "--vocab-size", "300", "--workers", "1", "--max-docs", "5"]
    assert main(args) == 0
    assert main(["data", "stats", out]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, notes = lines[0].split(), lines[1].split()
    assert dict(zip(header, notes, strict=True))["docs"] == "5"
    assert main(["data", "stats", str(tmp_path)]) == 2
    assert main(["data", "prepare", "--out", out, "--source", "no-equals-sign"]) == 2
    assert "NAME=GLOB" in capsys.readouterr().err


@pytest.mark.slow  # about 15 s on two idle cores, twice that on busy ones
def test_default_corpus_is_two_real_sources(tmp_path):
    path = ensure_default_corpus(tmp_path / "default")
    meta = read_meta(path)
    assert meta["sources"] == ["code", "prose"] and meta["vocab_size"] == 4096
    assert all(meta["train_tokens"][s] > 100_000 and meta["val_tokens"][s] > 1000
               for s in meta["sources"])
    assert ensure_default_corpus(path) == path  # complete: not prepared again
    Loader(path, seq_len=128, batch_size=8).batch(0)


def test_named_pipes_and_directories_matched_by_a_glob_are_skipped(tmp_path):
    """A FIFO matched by a source glob would block its reader forever; it is not a document."""
    from moelab.data.ingest import find_files

    (tmp_path / "a.txt").write_text("text")
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "dir.txt").mkdir()
    (tmp_path / "gone.txt").symlink_to(tmp_path / "missing")  # reported later as unreadable
    assert find_files([str(tmp_path / "*.txt")]) == [str(tmp_path / "a.txt"),
                                                     str(tmp_path / "gone.txt")]


@pytest.mark.parametrize("sources,advice", [
    (["only"], "re-prepare with a larger --val-fraction"),  # no other source to weight
    (["short", "long"], "give them weight 0 in data.mixture"),
])
def test_a_too_short_split_gets_advice_that_can_work(tmp_path, sources, advice):
    """Zero mixture weight is a fix only when another source is left to draw from."""
    import json

    import numpy as np

    from moelab.data.loader import Loader

    lengths = {"only": 10, "short": 10, "long": 1000}
    for s in sources:
        for split in ("train", "val"):
            np.save(tmp_path / f"{s}.{split}.npy", np.zeros(lengths[s], np.uint16))
    tokens = {s: lengths[s] for s in sources}
    (tmp_path / "meta.json").write_text(json.dumps(
        {"vocab_size": 512, "eos_id": 0, "sources": sources, "train_tokens": tokens,
         "val_tokens": tokens}))
    with pytest.raises(UserError, match=advice):
        Loader(tmp_path, "val", seq_len=32)
