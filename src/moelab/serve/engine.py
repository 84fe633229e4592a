"""The model behind the server: one run's checkpoint, its tokenizer and chat template,
token-by-token decoding through `export.generate`'s KV cache, and prompt scoring through
the same forward the in-process lm-eval adapter uses.

Nothing here knows about HTTP: the app (`serve.app`) validates requests and calls these.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moelab.errors import UserError


@dataclass(frozen=True)
class Scores:
    """Log-probabilities of a token sequence under the model (temperature 1, no top-p).

    token_logprobs[i]: log p(ids[i] | ids[:i]) for i >= 1 (None for the first token);
    top[i]: the k most likely (token id, log-prob) at position i (None for the first)."""

    token_logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]


class Engine:
    """One run's model, served. `context` is the longest sequence a request may use
    (prompt + max_tokens): the sequence length the checkpoint's stage trained at."""

    def __init__(self, model, cfg, tokenizer, step: int, name: str,
                 chat_template: str | None = None):
        from moelab.data.tokenizer import EOS
        from moelab.eval.harness import model_logits_fn

        self.model, self.cfg, self.tokenizer, self.step, self.name = \
            model, cfg, tokenizer, step, name
        self.chat_template = chat_template
        self.context = cfg.data.seq_len
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_id = tokenizer.token_to_id(EOS)
        # the adapter's forward (dropless, the training dtype): prompt scores match its own
        self._logits = model_logits_fn(model, cfg.train.dtype)

    @classmethod
    def load(cls, run_dir: Path, step: int | None = None, name: str | None = None) -> Engine:
        """The engine of a run's newest good checkpoint (or `step`); a missing run, a run
        without checkpoints or its tokenizer, a broken chat template or one whose tokens
        the tokenizer lacks is a UserError."""
        from moelab.config import data_dir
        from moelab.data.chat import CHAT_TEMPLATE_FILE, chat_template_of, require_chat_tokens
        from moelab.data.tokenizer import load_tokenizer
        from moelab.train.checkpoint import load_latest

        if not run_dir.is_dir():  # checked here: the loader would create it
            raise UserError(f"{run_dir} is not a run directory; pass the directory of a "
                            "training run")
        model, cfg, step = load_latest(run_dir, step)
        data = data_dir(cfg.data.path)
        tokenizer = load_tokenizer(data)
        template = None  # a corpus prepared without --chat-tokens: completions only
        if (data / CHAT_TEMPLATE_FILE).is_file():  # a broken one fails here, at startup
            template = chat_template_of(data)
            require_chat_tokens(tokenizer, data)
        return cls(model, cfg, tokenizer, step, name or run_dir.resolve().name, template)

    # -------------------------------------------------------------- text and tokens
    def encode(self, text: str) -> list[int]:
        """A prompt's ids; an empty one starts a new document (EOS, as in training)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ids or ([self.eos_id] if self.eos_id is not None else [])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        from moelab.data.chat import encode_chat

        return encode_chat(self.tokenizer, messages, add_generation_prompt=True,
                           template=self.chat_template)[0]

    def chat_stop_ids(self) -> set[int]:
        from moelab.data.chat import END_OF_TURN

        return {i for i in (self.tokenizer.token_to_id(END_OF_TURN), self.eos_id)
                if i is not None}

    # -------------------------------------------------------------- the model
    def tokens(self, prompt_ids: list[int], max_tokens: int, temperature: float, top_p: float,
               seed: int, stop_ids: set[int]) -> Iterator[int]:
        """New token ids, one per step, through generate's KV cache; the first of
        stop_ids met is the last yielded."""
        from moelab.export.generate import iter_generate

        for token in iter_generate(self.model, prompt_ids, max_tokens, temperature, top_p,
                                   seed):
            yield token
            if token in stop_ids:
                return

    def score(self, ids: list[int], k: int) -> Scores:
        """Scores of ids (at most `context` tokens) from one forward pass, padded to the
        context so one shape compiles; log-softmax in float64 as the adapter does."""
        tokens = np.zeros((1, self.context), np.int32)
        tokens[0, : len(ids)] = ids
        logits = np.asarray(self._logits(tokens), np.float64)[0, : len(ids) - 1]
        peak = logits.max(-1, keepdims=True)
        logp = logits - (np.log(np.exp(logits - peak).sum(-1, keepdims=True)) + peak)
        picked = logp[np.arange(len(ids) - 1), ids[1:]]
        k = min(k, logp.shape[-1])
        best = np.argpartition(-logp, k - 1, axis=-1)[:, :k] if k else \
            np.zeros((len(logp), 0), int)
        top: list[list[tuple[int, float]] | None] = [None]
        for row, ids_k in zip(logp, best, strict=True):
            ranked = sorted(ids_k.tolist(), key=lambda t: -row[t])[:k]
            top.append([(t, float(row[t])) for t in ranked])
        return Scores([None, *map(float, picked)], top)
