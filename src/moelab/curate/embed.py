"""Document embedders for curation: lexical (hashed TF-IDF + SVD) or neural (a moelab model).

Both are offline and deterministic for a seed, and both return unit vectors, so the
spherical k-means of `cluster` compares documents by cosine similarity.

    lexical  HashingVectorizer (stateless: no vocabulary to hold) -> TfidfTransformer and
             TruncatedSVD fitted on a seeded sample of documents, then applied per shard.
             This is DataKit's first embedder (192-d); it makes catch-all clusters on
             mixed-language corpora (reference.md), which is why a neural one exists.
    neural   the mean of a trained moelab checkpoint's final hidden states (after the
             final norm) over the first NEURAL_WINDOWS windows of data.seq_len tokens, in
             JAX. The checkpoint must share the dataset's tokenizer: its token ids mean
             nothing under another.

A public embedder (with network) plugs in as a third branch of `curate.embed_shard`
returning unit vectors for a shard's texts (curate/pipeline.py): see README "Curation".
"""

from __future__ import annotations

import hashlib
import pickle
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from moelab.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Iterable

EMBEDDERS = ("lexical", "neural")
LEXICAL_DIM = 192  # DataKit's first (lexical) embedder was 192-d
HASH_FEATURES = 2**18  # hashed vocabulary: collisions are rare at 262k buckets
NEURAL_WINDOWS = 4  # windows of data.seq_len tokens per document: the cost is bounded
LEXICAL_FILE = "lexical.pkl"


def unit_rows(x: np.ndarray) -> np.ndarray:
    """Rows scaled to length 1 (a zero row stays zero): cosine = dot product."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return (x / np.where(norms > 0, norms, 1.0)).astype(np.float32)


# --------------------------------------------------------------------------- lexical


def _hasher():
    from sklearn.feature_extraction.text import HashingVectorizer

    # Word unigrams and bigrams; raw counts (TF-IDF weights them next).
    return HashingVectorizer(n_features=HASH_FEATURES, ngram_range=(1, 2),
                             alternate_sign=False, norm=None, lowercase=True)


def fit_lexical(texts: Iterable[str], dim: int, seed: int, out: Path) -> int:
    """Fit TF-IDF weights and a TruncatedSVD of `dim` components on the sample `texts`;
    pickle both to `out`. Returns the dimension used: at most the sample size - 1 (an
    SVD has no more informative components than that)."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfTransformer

    from moelab.data.shards import atomic_write

    counts = _hasher().transform(texts)
    tfidf = TfidfTransformer(sublinear_tf=True).fit(counts)
    dim = max(1, min(dim, counts.shape[0] - 1))
    svd = TruncatedSVD(n_components=dim, random_state=seed).fit(tfidf.transform(counts))
    atomic_write(out, lambda file: pickle.dump((tfidf, svd), file))
    return dim


@lru_cache(maxsize=1)
def _lexical_model(path: str):
    with open(path, "rb") as file:
        return pickle.load(file)  # written by fit_lexical in this run's work directory


def embed_lexical(texts: list[str], model_path: Path) -> np.ndarray:
    """float32 [n, dim] unit vectors of texts under the fitted lexical model."""
    tfidf, svd = _lexical_model(str(model_path))
    return unit_rows(svd.transform(tfidf.transform(_hasher().transform(texts))))


# ---------------------------------------------------------------------------- neural


def tokenizer_digest(path: Path) -> str:
    """sha256 of a tokenizer.json: two datasets tokenize alike iff these match."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_checkpoint(run_dir: Path, data_dir: Path) -> None:
    """One-line error unless the run at run_dir trained on data_dir's tokenizer."""
    from moelab.data.tokenizer import TOKENIZER_FILE
    from moelab.train.checkpoint import Checkpointer
    from moelab.train.rundir import CHECKPOINT_DIR

    if not (Path(run_dir) / CHECKPOINT_DIR).is_dir():
        raise UserError(f"--checkpoint {run_dir} has no checkpoint; train a run first")
    ckpt = Checkpointer(Path(run_dir), keep=1_000_000, writer=False)
    steps = ckpt.steps()
    if not steps:
        raise UserError(f"--checkpoint {run_dir} has no checkpoint; train a run first")
    run_data = Path(ckpt.read_meta(steps[-1])["config"]["data"]["path"])
    theirs, ours = run_data / TOKENIZER_FILE, Path(data_dir) / TOKENIZER_FILE
    if not theirs.is_file():
        raise UserError(f"--checkpoint {run_dir}: its dataset {run_data} has no "
                        f"{TOKENIZER_FILE}, so its tokenizer cannot be checked; re-prepare it")
    if tokenizer_digest(theirs) != tokenizer_digest(ours):
        raise UserError(f"--checkpoint {run_dir} was trained with the tokenizer of {run_data}, "
                        f"not that of {data_dir}: its embeddings would be meaningless; pass a "
                        f"run trained on {data_dir}")


@lru_cache(maxsize=1)
def _neural_model(run_dir: str):
    """(embed function, seq_len, eos id) of the run's newest good checkpoint, loaded once
    per process (a pool worker embeds many shards)."""
    import equinox as eqx
    import jax.numpy as jnp

    from moelab.model.layers import rope_angles
    from moelab.model.transformer import with_dropless_dispatch
    from moelab.train.checkpoint import load_latest

    model, cfg, _ = load_latest(run_dir)
    model = with_dropless_dispatch(model)  # no token's route depends on its batch

    @eqx.filter_jit
    def pooled(model, tokens, mask):
        """[B, D] masked mean of the final hidden states (after final_norm): the same
        layers as Transformer.__call__, stopping before the output head."""
        b, s = tokens.shape
        cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(s), (b, s)),
                               model.cfg.resolved_head_dim, model.cfg.rope_theta)
        x = model.embed[tokens]
        cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
        x = model._run(model.dense_layers, x, cos, sin, None, 0)[0]
        x = model.final_norm(model._run(model.moe_layers, x, cos, sin, None, 0)[0])
        weights = mask[..., None].astype(jnp.float32)
        return (x.astype(jnp.float32) * weights).sum(1) / jnp.maximum(weights.sum(1), 1.0)

    return (lambda tokens, mask: np.asarray(pooled(model, tokens, mask))), cfg.data.seq_len


def embed_neural(docs: list[np.ndarray], run_dir: Path, eos_id: int) -> np.ndarray:
    """float32 [n, d_model] unit vectors: per document, the token-weighted mean of its
    windows' mean hidden states (windows of seq_len tokens, the first NEURAL_WINDOWS).
    Windows are padded to seq_len with EOS after the text; causal attention means the
    padding changes no earlier position, and the mask leaves it out of the mean."""
    pooled, seq_len = _neural_model(str(run_dir))
    rows, owners, lengths = [], [], []
    for i, ids in enumerate(docs):
        ids = np.asarray(ids[: seq_len * NEURAL_WINDOWS], np.int32)
        for start in range(0, max(len(ids), 1), seq_len):
            window = ids[start : start + seq_len]
            rows.append(np.pad(window, (0, seq_len - len(window)), constant_values=eos_id))
            owners.append(i)
            lengths.append(len(window))
    batch = 16  # fixed batch shape: one compile for every shard
    means = []
    for start in range(0, len(rows), batch):
        tokens = np.stack(rows[start : start + batch])
        n = len(tokens)
        tokens = np.pad(tokens, ((0, batch - n), (0, 0)), constant_values=eos_id)
        mask = np.arange(seq_len)[None, :] < np.pad(lengths[start : start + n],
                                                    (0, batch - n))[:, None]
        means.append(pooled(tokens, mask)[:n])
    means = np.concatenate(means)
    weights = np.asarray(lengths, np.float64)[:, None]
    sums = np.zeros((len(docs), means.shape[1]))
    np.add.at(sums, np.asarray(owners), means * weights)
    return unit_rows(sums)
