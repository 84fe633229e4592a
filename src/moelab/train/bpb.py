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

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

LN2 = math.log(2.0)
LOSS_PREFIX, BPB_PREFIX = "val_loss/", "val_bpb/"
BPB_MACRO = "val_bpb_macro"


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
