"""Byte-level BPE tokenizer, trained on the train split with Hugging Face `tokenizers`.

Byte-level means every input, whatever its script or stray bytes, encodes losslessly
with no unknown token; the Rust trainer and batch encoder keep both steps to seconds.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moelab.data.chat import SPECIAL_TOKENS
from moelab.errors import UserError
from moelab.schema import SchemaError, bounded

EOS = "<|endoftext|>"  # ends every document in the packed token streams
TOKENIZER_FILE = "tokenizer.json"
MIN_VOCAB = 257  # the 256 byte symbols and EOS


def train_tokenizer(texts: Iterable[str], vocab_size: int, chat_tokens: bool = False
                    ) -> Tokenizer:
    """A new byte-level BPE tokenizer with at most vocab_size (>= MIN_VOCAB) tokens,
    EOS included; fewer when the texts hold fewer merges.

    chat_tokens: the chat template's SPECIAL_TOKENS appended as the last two ids, the BPE
    trained to vocab_size - 2. BPE adds merges greedily, so the merges are those of a
    vocab_size run less its last two, and EOS and every other id keep their number; without
    the flag the tokenizer is exactly what it was before chat existed."""
    reserved = len(SPECIAL_TOKENS) if chat_tokens else 0
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - reserved,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its bars print blank lines when stdout is not a terminal
    )
    tokenizer.train_from_iterator(texts, trainer)
    if chat_tokens:
        tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def load_tokenizer(data_dir: str | Path) -> Tokenizer:
    """The tokenizer a prepared dataset was tokenized with."""
    path = Path(data_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing; run `moelab data prepare --out {data_dir}`")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises bare Exception
        raise SchemaError(path, f"not a tokenizer file ({bounded(str(err), 160)}); re-prepare "
                                "the dataset") from None
