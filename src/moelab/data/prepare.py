"""prepare: files -> documents -> deduplicated splits -> tokenizer -> token shards.

The work runs as stages over Parquet shards in DIR/.stages (see `stages`), on a local
process pool or on Ray, each task skipped when its outputs exist: memory does not grow
with the corpus, and an interrupted prepare resumes where it stopped. Input errors
(globs, settings) are raised before anything is written; a source left empty by the
filters is found before the output files are touched. The final files (token streams,
tokenizer, manifest) are then written, meta.json last, and .stages is removed: a
directory without meta.json is never a dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer

from moelab.config import data_dir
from moelab.data import quality, stages
from moelab.data.chat import CHAT_TEMPLATE, CHAT_TEMPLATE_FILE
from moelab.data.dedup import MAX_THRESHOLD, NUM_PERM, SHINGLE_WORDS, lsh_bands
from moelab.data.executor import Executor, RayExecutor, peak_rss_mb, reset_peak_rss
from moelab.data.ingest import list_documents, source_globs
from moelab.data.loader import META_FILE, SPLITS
from moelab.data.provenance import (
    MANIFEST_DIR,
    content_sha256,
    count_documents,
    read_manifest,
    reason_kind,
)
from moelab.data.shards import (
    read_table,
    shard_path,
    token_dtype,
    write_json,
    write_streams,
    write_text,
)
from moelab.data.tokenizer import EOS, MIN_VOCAB, TOKENIZER_FILE
from moelab.errors import UserError

WORK_DIR = ".stages"  # stage outputs, inside the dataset directory: every worker sees it
PLAN_FILE = "plan.json"
SHARD_DOCS = 32  # documents per shard of a large corpus: a task's memory is one shard's
# A small corpus (the default one `moelab train` waits for: ~800 files) gets bigger
# shards instead, TASKS_PER_WORKER per worker: at 32 documents it made ~150 tasks whose
# fixed costs (a Parquet round trip, pool dispatch) cost more than the tasks' work.
SMALL_CORPUS_DOCS = 1024
TASKS_PER_WORKER = 2
SHARDS_PER_PARTITION = 8  # default partitions: one per 8 shards (files: shards x partitions)
MAX_PARTITIONS = 64
TOKENIZER_SAMPLE_CHARS = 64_000_000  # ~64 MB of text: more than the default corpus holds
_STDLIB = sysconfig.get_paths()["stdlib"]
# Real text nobody here wrote, on every Debian machine with Python: the standard
# library's sources (code) and the packages' docs and man pages (English prose).
DEFAULT_SOURCES: dict[str, list[str]] = {
    "code": [f"{_STDLIB}/**/*.py", "!*/site-packages/*", "!*/dist-packages/*",
             "!*/test/*", "!*/tests/*", "!*/idle_test/*"],
    "prose": ["/usr/share/doc/*/README*", "/usr/share/doc/*/NEWS*",
              "/usr/share/doc/*/changelog*", "/usr/share/doc/*/copyright",
              "/usr/share/man/man[1-8]/*", "!*.html"],
}
_SITE = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
# A bigger real corpus to measure scale: every installed Python package's sources, and
# all system docs, man and info pages plus the packages' own docs (~0.7 GB of files here).
INSTALLED_SOURCES: dict[str, list[str]] = {
    "code": [f"{_STDLIB}/**/*.py", *(f"{site}/**/*.py" for site in _SITE)],
    "prose": ["/usr/share/doc/**/*", "/usr/share/man/**/*", "/usr/share/info/*",
              *(f"{site}/**/{name}" for site in _SITE
                for name in ("*.md", "*.rst", "*.txt", "METADATA")), "!*.html"],
}
SOURCE_PRESETS = {"default": DEFAULT_SOURCES, "installed": INSTALLED_SOURCES}
# Named corpora (`moelab data prepare --preset NAME`): every setting that shapes the bytes
# fixed, so one machine's files always give the same dataset (its content_sha256 names it),
# and a data.path where specs find it (under $MOELAB_HOME, see config.data_dir).
# "ladder": the default sources without the per-source cap of `moelab train`'s corpus, long
# files split: ~35M train tokens on the developers' machine (2026-12-05) against the default
# corpus's 1.8M, so the held-out ladder targets (configs/ladder/heldout/) stay under one pass
# over each source. Its settings are the command's defaults with --sources default.
CORPUS_PRESETS: dict[str, dict] = {
    "ladder": {"path": "runs/data/ladder", "sources": "default",
               "settings": {"vocab_size": 4096, "near_dup_threshold": 0.8, "val_fraction": 0.05,
                            "min_chars": 200, "max_docs_per_source": None,
                            "max_chars": 1_000_000, "long_files": "split"}},
}


def check_preset_prepared(path: str) -> None:
    """A data.path naming a corpus preset that is not prepared: a UserError saying the
    command that prepares it (nothing for any other path)."""
    name = next((n for n, p in CORPUS_PRESETS.items() if p["path"] == path), None)
    if name and not (data_dir(path) / META_FILE).is_file():
        raise UserError(f"data.path: {path} is the {name} corpus, not prepared yet at "
                        f"{data_dir(path)}; run `moelab data prepare --preset {name}` once")


# Caps that keep ensure_default_corpus near 15 s on two cores (`moelab train` with no
# arguments calls it): about 2.5M tokens, plenty for the small models of the lab.
DEFAULT_MAX_DOCS = 400
DEFAULT_MAX_CHARS = 100_000  # a few multi-megabyte changelogs would dominate the prose
LONG_FILES = ("split", "drop")  # what prepare does with a file of more than max_chars



def prepare(
    out_dir: str | Path,
    sources: dict[str, str | list[str]] | None = None,
    vocab_size: int = 4096,
    near_dup_threshold: float = 0.8,
    val_fraction: float = 0.05,
    min_chars: int = 200,
    max_docs_per_source: int | None = None,
    workers: int | None = None,
    use_ray: bool = False,
    max_chars: int | None = None,
    quality_thresholds: Mapping | None = None,
    shard_docs: int | None = None,
    partitions: int | None = None,
    tokenizer_sample_chars: int = TOKENIZER_SAMPLE_CHARS,
    seed: int = 0,
    long_files: str = "split",
    chat_tokens: bool = False,
) -> dict:
    """Build a dataset in out_dir; return meta.json's contents plus "seconds" and
    "peak_rss_mb" (driver per phase, largest task per stage) to locate time and memory.

    sources: {name: glob or globs, '!glob' excluding}; None = the default corpus.
    A file of more than max_chars bytes of content is split into documents of at most
    max_chars bytes at blank lines or line ends (long_files "split"; the pieces are read
    one at a time, never the whole file) or dropped as too_long ("drop": what prepare did
    before, kept for `moelab train`'s default corpus, whose streams the lab's measurements
    used). Documents outside [min_chars, max_chars] after normalization are dropped, as are
    those failing a quality threshold ({score: [min, max]} over quality's defaults) and
    those in a near-duplicate cluster (MinHash Jaccard >= near_dup_threshold) behind its
    first document; about val_fraction of each source's documents are held out. workers /
    use_ray choose the executor (None = one process per CPU); shard_docs (None =
    default_shard_docs) and partitions (None = one per 8 shards, at most 64) size the
    tasks; the tokenizer trains on at most tokenizer_sample_chars of train text, sampled
    with seed. The output bytes depend on neither the executor nor the number of workers.
    chat_tokens: the tokenizer also holds the chat template's special tokens (its last two
    ids; see `train_tokenizer`) and the template is written beside it (a corpus to pre-train
    a model that is then fine-tuned on conversations).
    """
    _check_settings(vocab_size, near_dup_threshold, val_fraction, min_chars)
    thresholds = quality.check_thresholds(quality_thresholds or {})
    if shard_docs is not None and shard_docs < 1 or (partitions is not None and partitions < 1):
        raise UserError("shard_docs and partitions must be >= 1")
    if long_files not in LONG_FILES:
        raise UserError(f"long_files {long_files!r} must be one of {LONG_FILES}")
    if max_chars is not None and max_chars < 1:
        raise UserError(f"max chars {max_chars} must be >= 1 (None: no limit)")
    globs = source_globs(DEFAULT_SOURCES if sources is None else sources)
    phases = _Phases()
    with phases("list"):
        docs = list_documents(globs, max_docs_per_source,
                              piece_bytes=max_chars if long_files == "split" else None)
    bands, rows = lsh_bands(near_dup_threshold)
    if shard_docs is None:
        shard_docs = default_shard_docs(len(docs), workers)
    n_shards = -(-len(docs) // shard_docs)
    plan = stages.Plan(
        work=str(Path(out_dir) / WORK_DIR), n_docs=len(docs), shard_docs=shard_docs,
        partitions=partitions or min(-(-n_shards // SHARDS_PER_PARTITION), MAX_PARTITIONS),
        min_chars=min_chars,
        max_chars=max_chars, thresholds=thresholds, near_dup_threshold=near_dup_threshold,
        bands=bands, rows=rows, vocab_size=vocab_size,
        tokenizer_sample_chars=tokenizer_sample_chars, seed=seed, chat_tokens=chat_tokens)
    settings = dict(sources=globs, vocab_size=vocab_size, near_dup_threshold=near_dup_threshold,
                    val_fraction=val_fraction, min_chars=min_chars, max_chars=max_chars,
                    max_docs_per_source=max_docs_per_source, quality_thresholds=thresholds,
                    minhash=dict(num_perm=NUM_PERM, shingle_words=SHINGLE_WORDS, bands=bands,
                                 rows=rows),
                    tokenizer_sample_chars=tokenizer_sample_chars, seed=seed,
                    long_files=long_files)
    if chat_tokens:  # only then: meta.json of a corpus without chat stays byte-identical
        settings["chat_tokens"] = True
    _check_finished(Path(out_dir), settings)
    listing = hashlib.sha256("\n".join(f"{d.source}\t{d.path}\t{d.span}"
                                       for d in docs).encode())
    created = not Path(out_dir).exists()
    _start_work(plan, stages.plan_fingerprint(plan, settings, listing.hexdigest()))
    stages.write_list(plan, docs)
    del docs  # from here on the documents live in the list shards
    try:
        with RayExecutor() if use_ray else Executor(workers) as executor:
            _run_stages(plan, executor, val_fraction, phases)
    except UserError:  # bad input, not an interruption: leave nothing behind
        shutil.rmtree(out_dir if created else plan.work, ignore_errors=True)
        raise
    with phases("write"):
        meta = write_dataset(Path(out_dir), plan, settings)
    # tasks: the largest peak of one task per stage (in the driver when workers == 1)
    return {**meta, "seconds": phases.seconds,
            "peak_rss_mb": {"driver": phases.driver_rss_mb, "tasks": executor.peak_rss_mb}}


def default_shard_docs(n_docs: int, workers: int | None) -> int:
    """SHARD_DOCS, or for a corpus of at most SMALL_CORPUS_DOCS documents enough to make
    TASKS_PER_WORKER tasks per worker (None = one per CPU): the output bytes do not depend
    on the shard size, and a small corpus's shards stay small in memory."""
    if n_docs > SMALL_CORPUS_DOCS:
        return SHARD_DOCS
    tasks = TASKS_PER_WORKER * (workers or os.cpu_count() or 1)
    return max(SHARD_DOCS, -(-n_docs // tasks))


def _check_finished(out: Path, settings: dict) -> None:
    """A finished dataset is prepared again only with its own settings (a rerun repeats
    it): other settings would replace its streams and tokenizer under every run trained on
    it, which then could not load. An unreadable meta.json is no dataset to keep."""
    try:
        old = json.loads((out / META_FILE).read_text()).get("settings")
    except (OSError, ValueError, AttributeError):
        return
    new = json.loads(json.dumps(settings))  # as meta.json holds them: tuples as lists
    if isinstance(old, dict) and old != new:
        differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
        raise UserError(f"{out} holds a dataset prepared with other settings ({', '.join(differ)}"
                        f"), which runs trained on it need as it is; choose another --out, or "
                        f"delete {out} to rebuild it")


def _start_work(plan: stages.Plan, fingerprint: str) -> None:
    """Keep the stage outputs of an interrupted run with the same inputs, else start over."""
    work = Path(plan.work)
    for stale in [*work.parent.glob(".*.tmp"), *work.rglob(".*.tmp")]:
        stale.unlink()  # half-written by a killed run (a clean failure removes its own)
    plan_file = work / PLAN_FILE
    if plan_file.is_file() and json.loads(plan_file.read_text()).get("fingerprint") != fingerprint:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    write_json(plan_file, {"fingerprint": fingerprint})


def _run_stages(plan: stages.Plan, executor: Executor, val_fraction: float,
                phases: _Phases) -> None:
    """Each stage a phase (seconds and peak RSS); tasks on the executor, one-off steps
    (merge, clusters, split counts, tokenizer) in the driver."""
    for name in ("ingest", "exact", "band", "pair"):
        with phases(name):
            executor.map(stages.tasks(plan, name), name)
        if name == "exact":
            with phases("merge_exact"):
                stages.merge_exact(plan)
    with phases("cluster"):
        stages.cluster(plan)
    with phases("decide"):
        executor.map(stages.tasks(plan, "decide"), "decide")
    with phases("split_counts"):
        counts = stages.split_counts(plan, val_fraction)
        _require_kept(plan, counts)
    with phases("train_tokenizer"):
        stages.train_on_sample(plan, counts, val_fraction)
    with phases("tokenize"):
        executor.map(stages.tasks(plan, "tokenize", counts=counts, val_fraction=val_fraction),
                     "tokenize")


def write_dataset(out: Path, plan: stages.Plan, settings: dict) -> dict:
    """Token streams, tokenizer and manifest into out, meta.json last; then drop .stages."""
    work = Path(plan.work)
    content = _check_same_documents(out, work)
    tokenizer = Tokenizer.from_file(str(work / TOKENIZER_FILE))
    (out / META_FILE).unlink(missing_ok=True)  # incomplete until the new meta lands
    sources = list(settings["sources"])
    totals: Counter = Counter()
    for shard in range(plan.shards):
        table = read_table(plan.shard_file("manifest", shard), ["source", "split", "tokens"])
        for source, split, tokens in zip(*(table[c].to_pylist() for c in table.column_names),
                                         strict=True):
            totals[source, split] += tokens
    dtype = token_dtype(tokenizer.get_vocab_size())
    streams = [(source, split) for source in sources for split in SPLITS]
    write_streams({key: shard_path(out, *key) for key in streams},
                  {key: totals[key] for key in streams}, stages.stream_pieces(plan, dtype), dtype)
    os.replace(work / TOKENIZER_FILE, out / TOKENIZER_FILE)
    (out / CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
    if settings.get("chat_tokens"):
        write_text(out / CHAT_TEMPLATE_FILE, CHAT_TEMPLATE)
    shutil.rmtree(out / MANIFEST_DIR, ignore_errors=True)
    os.replace(work / MANIFEST_DIR, out / MANIFEST_DIR)
    counts = count_documents(read_manifest(out))
    meta = {
        "format": 2,
        "vocab_size": tokenizer.get_vocab_size(),
        "eos_id": tokenizer.token_to_id(EOS),
        "eos_token": EOS,
        "dtype": str(dtype),
        "sources": sources,
        **{f"{split}_tokens": {s: totals[s, split] for s in sources} for split in SPLITS},
        "documents": {s: dict(counts[s]) for s in sources},
        "held_out": held_out(sources),
        "content_sha256": content,
        "settings": settings,
    }
    write_json(out / META_FILE, meta)
    shutil.rmtree(work)
    return meta


def _check_same_documents(out: Path, work: Path) -> str:
    """This build's content sha256 (of its input files, from the manifest in `work`). A
    finished dataset prepared again with its own settings is rewritten only from the same
    input files (then byte for byte the same). Files edited, added or removed since would
    replace its streams under every run trained on it: refused, the dataset left as it
    was and this build's stage outputs dropped. (The settings are checked before any
    work; the files' content is known once they are read.)"""
    new = content_sha256(read_manifest(work))
    try:
        old = json.loads((out / META_FILE).read_text()).get("content_sha256")
    except (OSError, ValueError, AttributeError):
        return new
    if old is not None and old != new:
        shutil.rmtree(work)
        raise UserError(f"{out} holds a dataset prepared from other files than the sources "
                        f"hold now (content sha256 {old[:12]} then, {new[:12]} now), which "
                        f"runs trained on it need as it is; choose another --out, or delete "
                        f"{out} to rebuild it")
    return new


def held_out(sources: list[str]) -> dict:
    """meta.json's statement of the held-out split: which domains have one and why
    training never sees it (the evals' bits per byte and tasks are drawn from it)."""
    return {"split": "val", "domains": list(sources),
            "rule": "about val_fraction of each source's kept documents, chosen by the sha256 "
                    "of the normalized text after exact and near-duplicate removal (so no "
                    "copy of a val document stays in train); the tokenizer is trained on "
                    "train text only and the trainer's loader reads only the train split"}


def ensure_default_corpus(path: str | Path) -> Path:
    """Prepare the built-in two-source corpus at path unless a complete one is there."""
    path = Path(path)
    if not (path / META_FILE).is_file():
        prepare(path, DEFAULT_SOURCES, max_docs_per_source=DEFAULT_MAX_DOCS,
                max_chars=DEFAULT_MAX_CHARS, long_files="drop")
    return path


def _check_settings(vocab_size: int, threshold: float, val_fraction: float,
                    min_chars: int) -> None:
    if vocab_size < MIN_VOCAB:
        raise UserError(f"vocab size {vocab_size} must be >= {MIN_VOCAB} (256 bytes + EOS)")
    if not 0 < threshold <= MAX_THRESHOLD:
        raise UserError(f"near-dup threshold {threshold} must be in (0, {MAX_THRESHOLD}]")
    if not 0 <= val_fraction < 1:
        raise UserError(f"val fraction {val_fraction} must be in [0, 1)")
    if min_chars < 1:
        raise UserError(f"min chars {min_chars} must be >= 1")


def _require_kept(plan: stages.Plan, counts: dict[str, dict]) -> None:
    """A source whose every document was filtered out cannot be trained on: say why."""
    for source, count in counts.items():
        if count["kept"]:
            continue
        reasons: Counter = Counter()
        for shard in range(plan.shards):
            table = read_table(plan.shard_file("decided", shard), ["source", "reason"])
            reasons.update(reason_kind(r) for s, r in zip(
                table["source"].to_pylist(), table["reason"].to_pylist(), strict=True)
                if s == source)
        raise UserError(
            f"source {source!r}: none of its {reasons.total()} files survived filtering "
            f"({dict(reasons)}); add files, or lower --min-chars / raise "
            "--near-dup-threshold"
        )


class _Phases:
    """Seconds and the driver's peak RSS per phase of a prepare: the peak is reset when a
    phase starts, so growth shows in the phase that causes it."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.driver_rss_mb: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        reset_peak_rss()
        start = time.perf_counter()
        yield
        self.seconds[phase] = round(time.perf_counter() - start, 3)
        self.driver_rss_mb[phase] = peak_rss_mb()
