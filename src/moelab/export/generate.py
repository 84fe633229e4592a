"""Sample from a trained model with a KV cache: greedy, or temperature with top-p.

The prompt is run through the model once (prefill) to fill the cache; then one token per
step, under one jit-compiled step of fixed shapes (the write position, temperature and
top-p are traced scalars). Prompt and cache lengths are rounded up to buckets, so one
compiled prefill and step serve many requests.

Generation routes dropless whatever `moe.dispatch` the model trained with: capacity
dispatch drops assignments depending on what else is in the batch, which a decoder must
not do. That is also the function the Hugging Face export computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from moelab.config import Config, ConfigError
from moelab.model import Transformer
from moelab.model.transformer import with_dropless_dispatch

if TYPE_CHECKING:
    from tokenizers import Tokenizer


def check_sampling(temperature: float, top_p: float) -> None:
    if not temperature >= 0:  # written so that NaN fails too
        raise ConfigError(f"temperature: must be a number >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"top_p: must be in (0, 1], got {top_p}")


def nucleus_mask(probs: Float[Array, " V"], top_p: Array | float) -> Array:
    """True for the smallest set of most likely tokens whose probability reaches top_p."""
    order = jnp.argsort(-probs)
    sorted_probs = probs[order]
    mass_before = jnp.cumsum(sorted_probs) - sorted_probs
    # The most likely token is always kept; top_p = 1 keeps all (whatever rounding says).
    keep_sorted = (mass_before < top_p) | (top_p >= 1)
    return jnp.zeros(probs.shape, bool).at[order].set(keep_sorted)


def sample_token(
    logits: Float[Array, " V"],
    key: PRNGKeyArray,
    temperature: Array | float,
    top_p: Array | float,
) -> Int[Array, ""]:
    """One token from softmax(logits / temperature) restricted to the top-p nucleus."""
    logits = logits.astype(jnp.float32) / temperature
    keep = nucleus_mask(jax.nn.softmax(logits), top_p)
    return jax.random.categorical(key, jnp.where(keep, logits, -jnp.inf))


PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this ...
CACHE_BUCKET = 64  # ... and caches rounded up to one of this, so few shapes get compiled


def generation_bytes(cfg: Config, n_tokens: int, prompt: int = 0) -> int:
    """Device memory of a generation of n_tokens in all, `prompt` of them the prompt: the
    model, its KV cache (n_layers x 2 x length x n_kv_heads x head_dim f32 values) and the
    prompt pass, one layer's at a time: its attention scores and probabilities (n_heads x
    prompt x cache length each) and its expert activations."""
    from moelab.train.memory import BYTES
    from moelab.train.metrics import total_params

    m = cfg.model
    rows = _round_up(prompt, PROMPT_BUCKET) if prompt else 0
    length = _round_up(max(rows, n_tokens), CACHE_BUCKET)
    cache = 2 * m.n_layers * length * m.n_kv_heads * m.resolved_head_dim
    prompt_pass = rows * (2 * m.n_heads * length + 3 * cfg.moe.top_k * m.d_ff + 4 * m.d_model)
    return BYTES * (total_params(cfg) + cache + prompt_pass)


def check_length_fits(cfg: Config, n_tokens: int, prompt: int = 1) -> None:
    """Refuse, before allocating, a generation of n_tokens (`prompt` of them the prompt)
    that cannot fit in one device's memory (`generation_bytes`): otherwise a long prompt or
    a large --max-new-tokens ends in an out-of-memory traceback. Names the most it can take."""
    from moelab.train.memory import available_bytes

    need, have = generation_bytes(cfg, n_tokens, prompt), available_bytes()
    if need <= have:
        return
    new = n_tokens - prompt

    def largest(fits) -> int:  # the largest n with fits(n), fits monotone decreasing
        low, high = 0, 1
        while fits(high) and high < 2**62:
            high *= 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low

    what = (f"generating {new} tokens after a {prompt}-token prompt needs {need / 2**30:.1f} "
            "GiB for the model, its KV cache and the prompt pass's attention")
    if generation_bytes(cfg, prompt + 1, prompt) > have:  # the prompt alone is too long
        hint = ("the largest prompt it can take is about "
                f"{largest(lambda p: generation_bytes(cfg, p + 1, p) <= have)} tokens")
    else:
        hint = ("ask for at most about "
                f"{largest(lambda n: generation_bytes(cfg, prompt + n, prompt) <= have)} new "
                "tokens after this prompt")
    raise ConfigError(f"{what}, the device has {have / 2**30:.1f} GiB; {hint}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@eqx.filter_jit
def _advance(model, caches, tokens, index, n_real, key, temperature, top_p):
    """Feed tokens [S] (the first n_real real, the rest padding) at positions index.. into
    the cache; pick the token after the last real one (greedy where temperature is 0).

    Padding writes keys past the real positions; each is overwritten before any query
    can see it (the causal mask hides positions after the query), and dropless routing
    keeps padded tokens from touching real ones.
    """
    logits, _, caches = model(tokens[None, :], caches, index)
    last = logits[0, n_real - 1]
    sampled = sample_token(last, key, jnp.where(temperature > 0, temperature, 1.0), top_p)
    token = jnp.where(temperature > 0, sampled, jnp.argmax(last))
    return token.astype(jnp.int32), caches


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> list[int]:
    """The new token ids after prompt_ids (greedy when temperature is 0); stops after
    eos_id if given. The same seed gives the same tokens."""
    return list(iter_generate(model, prompt_ids, max_new_tokens, temperature, top_p, seed,
                              eos_id))


def iter_generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos_id: int | None = None,
) -> Iterator[int]:
    """`generate`'s tokens one at a time, each as soon as it is picked: a caller that
    stops iterating (a server whose client went away) stops the decoding."""
    check_sampling(temperature, top_p)
    if not prompt_ids:
        raise ConfigError("prompt: needs at least one token")
    if max_new_tokens <= 0:
        return
    n_prompt = len(prompt_ids)
    padded = np.zeros(_round_up(n_prompt, PROMPT_BUCKET), np.int32)
    padded[:n_prompt] = prompt_ids
    caches = model.init_caches(
        1, _round_up(max(len(padded), n_prompt + max_new_tokens), CACHE_BUCKET))
    key = jax.random.key(seed)
    settings = (jnp.float32(temperature), jnp.float32(top_p))
    token, caches = _advance(with_dropless_dispatch(model), caches, jnp.asarray(padded),
                             jnp.int32(0), jnp.int32(n_prompt), jax.random.fold_in(key, 0),
                             *settings)
    # One token per step: one-row blocks; the training block size would be mostly padding.
    stepper = with_dropless_dispatch(model, block_size=1)
    last = int(token)
    yield last
    for i in range(1, max_new_tokens):
        if last == eos_id:
            return
        token, caches = _advance(stepper, caches, token[None], jnp.int32(n_prompt + i - 1),
                                 jnp.int32(1), jax.random.fold_in(key, i), *settings)
        last = int(token)
        yield last


class TextStream:
    """Token ids in, text out, piece by piece: a piece is released only once no stop string
    can still begin in it and its last character is complete (byte-level tokens can split
    a UTF-8 character, which decodes as U+FFFD until its last byte arrives)."""

    def __init__(self, decode, stops: list[str] | None):
        self._decode, self._stops = decode, [s for s in stops or () if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # everything released so far
        self.stopped = False  # a stop string was met; no more text follows

    def push(self, token: int) -> str:
        """The new text that token releases ('' if none yet)."""
        self.ids.append(token)
        full = self._decode(self.ids)
        cuts = [i for s in self._stops if (i := full.find(s, max(len(self.text) - len(s), 0))) >= 0]
        if cuts:
            self.stopped = True
            return self._release(full[: min(cuts)])
        end = len(full) - self._hold
        while end > len(self.text) and full[end - 1] == "\ufffd":
            end -= 1
        return self._release(full[:end]) if end > len(self.text) else ""

    def finish(self) -> str:
        """What was held back, once decoding has ended without a stop string."""
        return "" if self.stopped else self._release(self._decode(self.ids))

    def _release(self, upto: str) -> str:
        piece, self.text = upto[len(self.text):], upto
        return piece


def iter_text(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Iterator[str]:
    """The text the model writes after `prompt`, piece by piece as it is decoded (a piece
    waits for the last byte of a split UTF-8 character). An empty prompt starts a new
    document (the end-of-text token, which separates documents in training); the
    end-of-text token the model writes ends the text and is not part of it."""
    from moelab.data.tokenizer import EOS

    eos_id = tokenizer.token_to_id(EOS)
    prompt_ids = tokenizer.encode(prompt).ids or ([eos_id] if eos_id is not None else [])
    stream = TextStream(tokenizer.decode, None)
    for token in iter_generate(model, prompt_ids, max_new_tokens, temperature, top_p, seed,
                               eos_id):
        if token == eos_id:
            break
        if piece := stream.push(token):
            yield piece
    if rest := stream.finish():
        yield rest
