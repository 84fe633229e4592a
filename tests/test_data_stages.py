"""The staged pipeline: output independent of sharding and executor, resume after a kill,
duplicate clusters, quality scores, and the real Ray executor."""

import gzip
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import words_text, write_corpus

from moelab.cli import main
from moelab.data import executor, ingest, quality, stages
from moelab.data.dedup import BUCKET_WINDOW, bucket_pairs, cluster_roots
from moelab.data.loader import read_meta
from moelab.data.prepare import SHARD_DOCS, SMALL_CORPUS_DOCS, WORK_DIR, default_shard_docs, prepare
from moelab.data.provenance import content_sha256, manifest_shards, read_manifest
from moelab.errors import UserError

SMALL = {"vocab_size": 300, "min_chars": 50}


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under root by relative path: what "byte-identical dataset" compares."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def corpus_with_duplicates(root: Path) -> dict[str, str]:
    """Two sources; an exact copy across sources and a near copy inside one."""
    sources = {"a": write_corpus(root, "a", 14, 120, seed=5),
               "b": write_corpus(root, "b", 9, 90, seed=6)}
    original = (root / "a" / "doc003.txt").read_text()
    (root / "b" / "copy.txt").write_text(original)
    words = original.split(" ")
    words[40] = "changed"
    (root / "a" / "near.txt").write_text(" ".join(words))
    return sources


def test_output_does_not_depend_on_shards_partitions_or_workers(tmp_path):
    sources = corpus_with_duplicates(tmp_path)
    prepare(tmp_path / "one", sources, workers=1, shard_docs=1000, **SMALL)
    result = prepare(tmp_path / "many", sources, workers=2, shard_docs=3, partitions=4, **SMALL)
    assert set(result["peak_rss_mb"]["tasks"]) == {"ingest", "exact", "band", "pair", "decide",
                                                   "tokenize"}  # every stage's tasks probed
    assert set(result["peak_rss_mb"]["driver"]) == set(result["seconds"])
    one, many = tree_bytes(tmp_path / "one"), tree_bytes(tmp_path / "many")
    assert len([n for n in many if n.startswith("manifest/")]) == 9  # 25 documents / 3
    for name in ("tokenizer.json", "meta.json", "a.train.npy", "a.val.npy", "b.train.npy"):
        assert one[name] == many[name], name
    records = list(read_manifest(tmp_path / "many"))
    assert records == list(read_manifest(tmp_path / "one"))
    listed = sorted(str(p) for d in ("a", "b") for p in (tmp_path / d).iterdir())
    assert sorted(r["path"] for r in records) == listed  # every input exactly once
    by_name = {Path(r["path"]).name: r for r in records}
    assert by_name["copy.txt"]["reason"] == f"exact_dup_of:{tmp_path / 'a' / 'doc003.txt'}"
    assert by_name["near.txt"]["reason"] == f"near_dup_of:{tmp_path / 'a' / 'doc003.txt'}"
    assert not (tmp_path / "many" / WORK_DIR).exists()


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK),
                    reason="needs Linux's resettable RSS high-water mark")
def test_the_rss_probe_sees_a_task_allocation_and_forgets_it_after_a_reset():
    def allocate() -> int:
        block = b"x" * (64 << 20)  # 64 MiB, every page written, so resident
        return len(block)

    size, peak = executor.measured(allocate)
    executor.reset_peak_rss()  # the block is freed (unmapped): the mark restarts below it
    assert size == 64 << 20
    assert peak - executor.peak_rss_mb() >= 60  # 64 MiB seen (probe MB are MiB), then forgotten


def arrow_then_pandas_loaded() -> bool:
    """Whether pandas is imported in this process after pyarrow built an array (a task)."""
    import pyarrow as pa

    assert pa.array([1, 2], pa.int64()).to_pylist() == [1, 2]
    return "pandas" in sys.modules


def test_pool_workers_use_arrow_without_importing_pandas():
    with executor.Executor(workers=2) as pool:
        loaded = pool.map([arrow_then_pandas_loaded] * 2, "probe")
    assert loaded == [False, False]


def test_a_small_corpus_gets_two_tasks_per_worker_and_a_large_one_fixed_shards():
    assert default_shard_docs(800, 2) == 200  # the default corpus: 4 tasks on 2 workers
    assert default_shard_docs(800, 1) == 400
    assert default_shard_docs(10, 2) == SHARD_DOCS  # never below the large-corpus size
    assert default_shard_docs(SMALL_CORPUS_DOCS + 1, 2) == SHARD_DOCS  # memory stays bounded


def test_clusters_are_merged_and_name_the_first_document():
    roots = cluster_roots([(5, 6), (2, 3), (1, 2), (6, 9)])
    assert roots == {1: 1, 2: 1, 3: 1, 5: 5, 6: 5, 9: 5}
    assert cluster_roots([]) == {}


def test_band_buckets_pair_every_document_with_its_window():
    assert sorted(bucket_pairs([1, 4, 9])) == [(1, 4), (1, 9), (4, 9)]
    big = list(bucket_pairs(list(range(1000))))
    assert len(big) == sum(min(BUCKET_WINDOW, 999 - i) for i in range(1000))  # not 1000^2/2
    assert cluster_roots(big) == {i: 0 for i in range(1000)}


def test_a_chain_of_near_copies_and_their_exact_copies_all_name_the_kept_one(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    words = words_text(random.Random(0), 400).split()
    for name, position in [("a", None), ("b", 100), ("c", 200), ("d", 300)]:
        if position is not None:  # each a one-word edit of the one before
            words[position] = f"edit{position}"
        (src / f"{name}.txt").write_text(" ".join(words))
    (src / "e.txt").write_text((src / "c.txt").read_text())  # exact copy of a near copy
    prepare(tmp_path / "data", {"docs": str(src / "*.txt")}, workers=1, shard_docs=2, **SMALL)
    reasons = {Path(r["path"]).stem: r["reason"] for r in read_manifest(tmp_path / "data")}
    assert reasons == {"a": "", **{n: f"near_dup_of:{src / 'a.txt'}" for n in "bcde"}}


def test_an_interrupted_prepare_resumes_from_its_complete_tasks(tmp_path, monkeypatch):
    sources = corpus_with_duplicates(tmp_path)
    settings = {**SMALL, "workers": 1, "shard_docs": 4}
    prepare(tmp_path / "reference", sources, **settings)
    real_train, real_process, calls = stages.train_on_sample, stages.process_document, []

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    def counted(*args, **kwargs):
        calls.append(1)
        return real_process(*args, **kwargs)

    monkeypatch.setattr(stages, "process_document", counted)
    monkeypatch.setattr(stages, "train_on_sample", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "out", sources, **settings)
    assert (tmp_path / "out" / WORK_DIR).is_dir() and not (tmp_path / "out/meta.json").exists()
    assert len(calls) == 25

    monkeypatch.setattr(stages, "train_on_sample", real_train)
    prepare(tmp_path / "out", sources, **settings)
    assert len(calls) == 25  # every ingest task was complete: none ran again
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "reference")

    monkeypatch.setattr(stages, "train_on_sample", interrupted)
    with pytest.raises(KeyboardInterrupt):  # a new dir: a finished one keeps its settings
        prepare(tmp_path / "out2", sources, **settings)
    monkeypatch.setattr(stages, "train_on_sample", real_train)
    prepare(tmp_path / "out2", sources, **{**settings, "min_chars": 60})
    assert len(calls) == 75  # other settings: the stale stage outputs were not reused


def test_every_source_gets_one_val_document_even_when_none_hashes_into_val(tmp_path):
    glob = write_corpus(tmp_path, "src", 6, 100, seed=4)
    (tmp_path / "src" / "a_first_and_too_short.txt").write_text("short")
    prepare(tmp_path / "data", {"docs": glob}, val_fraction=0.0, workers=1, shard_docs=2,
            **SMALL)
    splits = [r["split"] for r in read_manifest(tmp_path / "data")]
    assert sorted(splits) == ["", "train", "train", "train", "train", "train", "val"]


def test_a_huge_file_is_too_long_without_being_read_whole(tmp_path):
    glob = write_corpus(tmp_path, "src", 3, 100, seed=7)
    huge = words_text(random.Random(8), 2000).encode()  # > 4 bytes per allowed character
    (tmp_path / "src" / "huge.txt").write_bytes(huge)
    prepare(tmp_path / "data", {"docs": glob}, max_chars=len(huge) // 5, workers=1,
            long_files="drop", **SMALL)
    record = {Path(r["path"]).name: r for r in read_manifest(tmp_path / "data")}["huge.txt"]
    assert record["reason"] == "too_long"
    assert record["sha256"] == hashlib.sha256(huge).hexdigest()  # of the bytes, streamed


def paragraphs(rng: random.Random, n_bytes: int) -> str:
    """~n_bytes of paragraphs (3-30 lines of 12 words over a 3,000-word vocabulary, one
    blank line between them, a multi-byte word here and there): 20 MB in about a second,
    where drawing every letter (words_text) takes twenty."""
    vocab = words_text(rng, 3000).split() + ["naïve", "Straße", "\u6f22\u5b57", "\U0001f600"]
    out, size = [], 0
    while size < n_bytes:
        words = rng.choices(vocab, k=12 * rng.randint(3, 30))
        out.append("\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12)))
        size += len(out[-1].encode()) + 2
    return "\n\n".join(out) + "\n"


class CountingReads:
    """Wraps a binary file: records the size of every read, refuses a whole-file read."""

    largest = 0

    def __init__(self, file) -> None:
        self.file = file

    def read(self, n: int = -1) -> bytes:
        assert n is not None and n >= 0, "a whole-file read"
        data = self.file.read(n)
        CountingReads.largest = max(CountingReads.largest, len(data))
        return data

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()


@pytest.mark.parametrize("gz", [False, True])
def test_a_20_mb_file_is_streamed_into_pieces_that_hold_each_byte_once(tmp_path, monkeypatch,
                                                                       gz):
    """20 MB (gzip: the size comes from its trailer, a piece is reached by seeking through
    the decompressed stream) in pieces of at most 1 MB, each cut after a blank line; the
    pieces, each read as ingest reads it, put the file back together byte for byte, and
    no read ever returned more than a piece plus the one byte that tells the end."""
    data = paragraphs(random.Random(0), 20_000_000).encode()
    path = tmp_path / ("big.txt.gz" if gz else "big.txt")
    path.write_bytes(gzip.compress(data, 1) if gz else data)
    opener = ingest.open_bytes
    monkeypatch.setattr(ingest, "open_bytes", lambda p: CountingReads(opener(p)))
    CountingReads.largest = 0
    limit = 1_000_000
    docs = ingest.list_documents({"big": [str(path)]}, piece_bytes=limit)
    spans = [d.span for d in docs]
    assert spans[0][0] == 0 and spans[-1][1] == len(data) and len(spans) >= 20
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # tiles
    for start, end in spans:
        assert end - start <= limit
        if end < len(data):  # every cut after a blank line, none in the window's first half
            assert data[end - 2 : end] == b"\n\n" and end - start > limit // 2
    assert b"".join(ingest.read_bytes(str(path), span=s) for s in spans) == data
    assert CountingReads.largest <= limit + 1


def test_pieces_become_documents_that_keep_every_character(tmp_path):
    """Text-level: each piece decodes whole (a cut inside a 200 kB line of multi-byte
    characters moves back to a character boundary), fits max_chars and is kept; joined in
    order they are the file's text, but for the line ends that a cut or normalization
    (stripping a piece's leading and trailing ones) takes away."""
    rng = random.Random(1)
    text = paragraphs(rng, 300_000) + "\u00e9\u6f22" * 40_000 + "\n" + paragraphs(rng, 50_000)
    path = tmp_path / "long.txt"
    path.write_text(text)
    docs = ingest.list_documents({"long": [str(path)]}, piece_bytes=20_000)
    off = {name: (None, None) for name in quality.SCORES}
    done = [ingest.process_document(d, min_chars=1, max_chars=20_000, thresholds=off)
            for d in docs]
    assert len(done) > 350_000 // 20_000
    assert all(d.kept and "\ufffd" not in d.text and len(d.text) <= 20_000 for d in done)
    assert "".join(d.text for d in done).replace("\n", "") == text.replace("\n", "")


def test_prepare_splits_a_long_file_into_documents_that_name_their_range(tmp_path):
    """`moelab data prepare` end to end: the long file's manifest records tile its bytes,
    all kept and tokenized; a copy of one piece is a duplicate naming that piece; with
    --long-files drop the file is one too_long record, as before."""
    glob = write_corpus(tmp_path, "src", 4, 100, seed=9)
    data = paragraphs(random.Random(2), 60_000).encode()
    (tmp_path / "src" / "long.txt").write_bytes(data)
    common = ["--source", f"docs={glob}", "--max-chars", "8000", "--min-chars", "50",
              "--vocab-size", "300", "--workers", "1"]
    assert main(["data", "prepare", "--out", str(tmp_path / "split"), *common]) == 0
    pieces = [r for r in read_manifest(tmp_path / "split") if r["path"].endswith("long.txt")]
    spans = [(r["byte_start"], r["byte_end"]) for r in pieces]
    assert spans[0][0] == 0 and spans[-1][1] == len(data) and len(spans) >= 60_000 // 8000
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert all(r["status"] == "kept" and r["tokens"] > 0 for r in pieces)

    start, end = spans[2]
    (tmp_path / "src" / "zcopy.txt").write_bytes(data[start:end])  # listed after long.txt
    assert main(["data", "prepare", "--out", str(tmp_path / "copy"), *common]) == 0
    copy = {Path(r["path"]).name: r for r in read_manifest(tmp_path / "copy")}["zcopy.txt"]
    assert copy["reason"] == f"exact_dup_of:{tmp_path / 'src' / 'long.txt'}[{start}:{end}]"
    assert copy["byte_start"] is None  # a whole file

    assert main(["data", "prepare", "--out", str(tmp_path / "drop"), *common,
                 "--long-files", "drop"]) == 0
    dropped = [r for r in read_manifest(tmp_path / "drop") if r["path"].endswith("long.txt")]
    assert [(r["reason"], r["byte_start"]) for r in dropped] == [("too_long", None)]


def test_a_manifest_written_before_pieces_reads_as_whole_files(tmp_path):
    """Older datasets' manifests lack byte_start/byte_end: they still read (every
    document a whole file) and hash to the same content_sha256."""
    glob = write_corpus(tmp_path, "src", 4, 100, seed=10)
    prepare(tmp_path / "data", {"docs": glob}, workers=1, **SMALL)
    before = list(read_manifest(tmp_path / "data"))
    for shard in manifest_shards(tmp_path / "data"):
        pq.write_table(pq.read_table(shard).drop_columns(["byte_start", "byte_end"]), shard)
    after = list(read_manifest(tmp_path / "data"))
    assert after == before and all(r["byte_start"] is None for r in after)
    assert content_sha256(after) == read_meta(tmp_path / "data")["content_sha256"]


# ------------------------------------------------------------------------ quality


def test_prose_scores_follow_their_definitions():
    text = "The cat sat.\n- item one\n- item two\nThe cat sat."
    scores = quality.scores(text, code=False)
    assert scores["word_count"] == 12
    assert scores["bullet_line_fraction"] == 0.5
    assert scores["dup_line_fraction"] == 0.25  # 4 lines, 3 distinct
    assert scores["punct_line_fraction"] == 0.5
    assert scores["alpha_word_fraction"] == round(10 / 12, 6)  # the two "-" have no letter
    # "The cat" is one of the most frequent 2-grams: 2 x 6 letters of the 36
    assert scores["top_2gram_fraction"] == round(12 / 36, 6)
    assert set(scores) == set(quality.PROSE_SCORES)


def test_code_scores_catch_long_lines_and_generated_files():
    long_line = quality.scores("x = 1\n" + "y" * 1200, code=True)
    assert long_line["max_line_length"] == 1200
    assert quality.failed(long_line, quality.DEFAULT_THRESHOLDS) == "max_line_length"
    generated = quality.scores("# Generated by protoc. DO NOT EDIT.\nx = 1\n", code=True)
    assert generated["autogenerated"] == 1.0
    assert quality.failed(generated, quality.DEFAULT_THRESHOLDS) == "autogenerated"
    assert quality.is_code("a/b.py") and not quality.is_code("a/README")
    # str.isalnum's letters and digits in any script; "_" and punctuation are not
    assert quality.scores("a_b 1\u00e9!\u0663", code=True)["alnum_fraction"] == round(5 / 8, 6)


def test_quality_drops_are_counted_by_rule_and_thresholds_are_configurable(tmp_path, capsys):
    glob = write_corpus(tmp_path, "src", 4, 150, seed=2)
    lines = words_text(random.Random(3), 120).split("\n")
    (tmp_path / "src" / "repeats.txt").write_text("\n".join(lines * 4))
    prepare(tmp_path / "strict", {"docs": glob}, workers=1, **SMALL)
    record = {Path(r["path"]).name: r for r in read_manifest(tmp_path / "strict")}["repeats.txt"]
    assert record["reason"] == "quality_dup_line_fraction"
    assert record["quality"]["dup_line_fraction"] == 0.75  # 40 lines, 10 distinct
    assert read_meta(tmp_path / "strict")["documents"]["docs"]["quality_dup_line_fraction"] == 1
    off = {"dup_line_fraction": [None, None], "dup_5gram_fraction": [None, None]}
    prepare(tmp_path / "loose", {"docs": glob}, workers=1, quality_thresholds=off, **SMALL)
    assert read_meta(tmp_path / "loose")["documents"]["docs"]["kept"] == 5
    args = ["data", "prepare", "--out", str(tmp_path / "cli"), "--source", f"docs={glob}",
            "--vocab-size", "300", "--min-chars", "50", "--workers", "1",
            "--quality", "dup_line_fraction=:", "--quality", "dup_5gram_fraction=:"]
    assert main(args) == 0
    assert main(args[:-1] + ["dup_5gram_fraction"]) == 2
    assert "SCORE=MIN:MAX" in capsys.readouterr().err
    with pytest.raises(UserError, match="unknown score"):
        quality.check_thresholds({"words": [1, 2]})
    with pytest.raises(UserError, match=r"must be \[min, max\]"):
        quality.check_thresholds({"word_count": [1]})
    with pytest.raises(UserError, match="min 5 > max 1 would drop every document"):
        quality.check_thresholds({"word_count": [5, 1]})
    assert quality.check_thresholds({"word_count": [5, 5]})["word_count"] == (5, 5)


# ---------------------------------------------------------------------------- ray


def test_real_ray_executor_writes_the_local_executors_bytes(tmp_path):
    pytest.importorskip("ray.data", reason="ray is not installed: pip install -e '.[ray]'")
    import ray
    sources = corpus_with_duplicates(tmp_path)
    prepare(tmp_path / "local", sources, workers=1, shard_docs=8, **SMALL)
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False, configure_logging=False)
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        prepare(tmp_path / "ray", sources, use_ray=True, shard_docs=8, **SMALL)
    finally:
        ray.shutdown()
    assert tree_bytes(tmp_path / "ray") == tree_bytes(tmp_path / "local")


# --------------------------------------------------------------------- kill -9


KILL_SCRIPT = """
import sys
from moelab.data.prepare import prepare
prepare(sys.argv[1], {"a": sys.argv[2], "b": sys.argv[3]}, vocab_size=300, min_chars=50,
        workers=2, shard_docs=4)
"""


@pytest.mark.slow  # ten killed runs and their resumes: minutes (10 on two loaded cores)
def test_sigkill_at_random_points_then_rerun_gives_the_same_bytes(tmp_path):
    sources = [write_corpus(tmp_path, "a", 60, 300, seed=11),
               write_corpus(tmp_path, "b", 40, 200, seed=12)]

    def run(out: Path, kill_after: float | None) -> float | None:
        """Seconds the run took, or None when it was killed (with its workers)."""
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(out), *sources],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=kill_after)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None
        assert proc.returncode == 0
        return time.perf_counter() - start

    duration = run(tmp_path / "reference", None)
    reference = tree_bytes(tmp_path / "reference")
    rng = random.Random(0)
    for attempt in range(10):
        out = tmp_path / f"out{attempt}"
        while (elapsed := run(out, rng.uniform(0.5, duration))) is not None:
            duration = elapsed  # finished before the kill (the machine got faster): again
            shutil.rmtree(out)
        for _ in range(2):  # resume; killed again at most twice, so a slower machine ends
            if run(out, rng.uniform(0.5, duration)) is not None:
                break
        else:
            assert run(out, None) is not None
        assert tree_bytes(out) == reference, attempt
        shutil.rmtree(out)
