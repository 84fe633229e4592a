"""Bits per byte: a loss that does not depend on the tokenizer.

Cross-entropy per token rewards a tokenizer with long tokens as much as a better model, so
two runs with different vocabularies cannot be compared by it. Bits per byte divides the
same total information by the length of the text instead of its token count:

    bpb = (sum over scored tokens of -ln p(token) / ln 2) / (UTF-8 bytes those tokens decode to)

(Paloma, Marin's ladder metric). The bytes of a token are those of its byte-level BPE
symbols mapped back to raw bytes, so the bytes of consecutive tokens add up to the bytes
of their decoded text exactly (a window that cuts a multi-byte character still counts
each of its bytes once, where decoding the window alone would print U+FFFD). Special
tokens (EOS between documents) decode to no text: their loss counts, their bytes are 0.

Per held-out domain: a domain is a source of the dataset (code, prose); its val split is
documents held out at prepare time that training never reads (`data.prepare` records
this in meta.json under "held_out"). The macro average weighs every domain equally, as
Paloma does, so a small domain is not drowned by a large one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from moelab.data.loader import read_meta
from moelab.data.shards import shard_path

LN2 = math.log(2.0)
LOSS_PREFIX, BPB_PREFIX = "val_loss/", "val_bpb/"
BPB_MACRO = "val_bpb_macro"
ROWS = 16  # windows per forward pass of the whole-split evaluator


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: printable stand-in character -> raw byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Tokenizer) -> np.ndarray:
    """int64 [vocab]: how many UTF-8 bytes each token id decodes to (0 for special tokens).

    Byte-level tokens are mapped symbol by symbol; any other token falls back to the
    length of its decoded text."""
    decoder = _byte_decoder()
    special = set(tokenizer.get_added_tokens_decoder())
    out = np.zeros(tokenizer.get_vocab_size(), np.int64)
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if all(ch in decoder for ch in token):
            out[i] = len(token)
        else:
            out[i] = len(tokenizer.decode([i]).encode("utf-8"))
    return out


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    """Total negative log-likelihood (nats) over the bytes it predicted, in bits per byte."""
    return nll_nats / LN2 / n_bytes if n_bytes > 0 else float("nan")


def add_macro(metrics: dict[str, float]) -> dict[str, float]:
    """metrics plus val_bpb_macro: the unweighted mean of every val_bpb/<domain>."""
    per_domain = [v for k, v in metrics.items() if k.startswith(BPB_PREFIX)]
    if per_domain:
        metrics[BPB_MACRO] = float(np.mean(per_domain))
    return metrics


def val_windows(data_dir: str | Path, source: str, seq_len: int) -> np.ndarray:
    """int32 [n, seq_len + 1]: window k is tokens[k*S : k*S + S + 1] of the val stream;
    the windows' targets tile the stream, so each token after the first is scored once."""
    stream = np.load(shard_path(data_dir, source, "val"), mmap_mode="r")
    n = (len(stream) - 1) // seq_len
    rows = [stream[k * seq_len : k * seq_len + seq_len + 1] for k in range(n)]
    return np.stack(rows).astype(np.int32) if rows else np.zeros((0, seq_len + 1), np.int32)


@functools.cache
def token_nll_fn(dtype_name: str) -> Callable[[Any, np.ndarray], Any]:
    """A jitted (model, batch [B, S+1]) -> f32 [B, S] next-token NLL in nats.

    One per compute dtype, cached, so runs of the same shapes reuse the compiled code."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from moelab.train.step import cast_floats

    dtype = jnp.dtype(dtype_name)

    @eqx.filter_jit
    def token_nll(model, batch):
        logits, _, _ = cast_floats(model, dtype)(batch[:, :-1])
        logits = logits.astype(jnp.float32)  # the NLL in f32 whatever the compute dtype
        lse = jax.nn.logsumexp(logits, axis=-1)
        return lse - jnp.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]

    return token_nll


def tokenizer_bytes(data_dir: str | Path) -> np.ndarray | None:
    """token_bytes of the dataset's tokenizer, or None when the dataset has none (then
    only the loss is reported)."""
    from moelab.data.tokenizer import TOKENIZER_FILE, load_tokenizer

    path = Path(data_dir) / TOKENIZER_FILE  # a damaged one: one line naming it
    return token_bytes(load_tokenizer(data_dir)) if path.is_file() else None


def domain_metrics(nll: Mapping[str, float], tokens: Mapping[str, int],
                   n_bytes: Mapping[str, int] | None) -> dict[str, float]:
    """{val_loss/<d>, val_bpb/<d>, val_bpb_macro} from each domain's summed NLL, token
    count and byte count (no bpb when n_bytes is None)."""
    out = {f"{LOSS_PREFIX}{d}": nll[d] / tokens[d] for d in nll}
    if n_bytes is not None:
        out.update({f"{BPB_PREFIX}{d}": bits_per_byte(nll[d], n_bytes[d]) for d in nll})
    return add_macro(out)


def whole_split_evaluator(data_dir: str | Path, seq_len: int,
                          dtype: str = "float32") -> Callable[[Any], dict[str, float]]:
    """model -> {val_loss/<d>, val_bpb/<d>, val_bpb_macro} over *every* window of each
    domain's val split, in order: the same text for every run, no sampling noise.

    Always ROWS windows per forward (one compiled shape; the last batch wraps to the start
    and the wrapped rows are discarded). With dropless dispatch a token's loss does not
    depend on the other rows of its batch."""
    sources = read_meta(data_dir)["sources"]
    rows = {s: val_windows(data_dir, s, seq_len) for s in sources}
    rows = {s: r for s, r in rows.items() if len(r)}
    table = tokenizer_bytes(data_dir)
    n_bytes = None if table is None else {s: int(table[r[:, 1:]].sum()) for s, r in rows.items()}
    token_nll = token_nll_fn(dtype)

    def evaluate(model) -> dict[str, float]:
        nll, tokens = {}, {}
        for source, source_rows in rows.items():
            n, total = len(source_rows), 0.0
            for start in range(0, n, ROWS):
                batch = source_rows[np.arange(start, start + ROWS) % n]
                kept = np.asarray(token_nll(model, batch))[: n - start]
                total += float(kept.sum(dtype=np.float64))
            nll[source], tokens[source] = total, source_rows[:, 1:].size
        return domain_metrics(nll, tokens, n_bytes)

    return evaluate
