"""Refuse, before allocating anything, a config whose training state cannot fit in memory.

Without this a too-large `model.d_model` or `model.vocab_size` ends in an XLA
out-of-memory traceback minutes later (or the host swapping to a halt). The estimate is
a floor, not a forecast: f32 params, their gradient and AdamW's two moments
(4 copies x 4 bytes per parameter) plus the activations of one micro-batch that the
backward pass keeps (a few residual-width tensors per layer and token, the routed
experts' hidden units, the attention scores, and the logits with their gradient).
A config above it certainly fails; one below it may still be tight.
"""

from __future__ import annotations

import ctypes
import os

import jax

from moelab.config import Config
from moelab.errors import ConfigError
from moelab.train.metrics import total_params

BYTES = 4  # f32
STATE_COPIES = 4  # params, gradient, Adam m, Adam v
RESIDUAL_TENSORS = 12  # per layer and token: norms, q/k/v/o, residuals, router, ...


def estimate_bytes(cfg: Config) -> tuple[int, int]:
    """(training state, activations of one micro-batch) in bytes: a lower bound."""
    m, moe, d = cfg.model, cfg.moe, cfg.data
    state = STATE_COPIES * BYTES * total_params(cfg)
    tokens = d.batch_size // cfg.optim.grad_accum * d.seq_len
    # attention_impl chunked keeps no scores for the backward (it recomputes each block)
    scores = 0 if m.attention_impl == "chunked" else m.n_heads * d.seq_len
    per_layer = RESIDUAL_TENSORS * m.d_model + 3 * moe.top_k * m.d_ff + scores
    logits = 2 * m.vocab_size  # logits and their gradient
    # each MTP module: one more layer and its own logits (its weights are not counted)
    depth = cfg.mtp.depth
    return state, BYTES * tokens * ((m.n_layers + depth) * per_layer + (1 + depth) * logits)


def available_bytes() -> int:
    """Memory of one device: its allocator's limit on GPU/TPU, physical RAM on CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(cfg: Config) -> None:
    state, activations = estimate_bytes(cfg)
    shards = cfg.mesh.data * cfg.mesh.expert  # params replicated (data), experts split
    need = state / cfg.mesh.expert + activations / shards
    have = available_bytes()
    if need > have:
        m = cfg.model
        raise ConfigError(
            f"this config needs at least {need / 2**30:.1f} GiB per device ("
            f"{state / 2**30:.1f} GiB of params, gradients and AdamW state, "
            f"{activations / 2**30:.1f} GiB of activations) but the device has "
            f"{have / 2**30:.1f} GiB; shrink model.d_model ({m.d_model}), model.d_ff "
            f"({m.d_ff}), model.n_layers ({m.n_layers}), model.vocab_size ({m.vocab_size}), "
            f"moe.n_experts ({cfg.moe.n_experts}) or data.batch_size x data.seq_len, "
            "or raise optim.grad_accum")


# glibc's mallopt parameters (malloc.h) and the size below which freed memory is kept
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
KEEP_FREED_BELOW = 1 << 30


def keep_freed_memory() -> bool:
    """Make this process's malloc keep the memory a train step frees, for the next step.

    XLA:CPU allocates each step's intermediates afresh and frees them at its end, mostly
    from its thread pool's threads. glibc gives such threads arenas of their own, whose
    heaps are unmapped once empty, and serves blocks above its mmap threshold (at most
    32 MiB by default) with mappings unmapped on free: every step faults its buffers in
    page by page again (measured: ~34,000 minor faults per step of the tiny preset). With
    one arena for all threads, blocks below 1 GiB served from the heap and the heap not
    trimmed, the pages stay mapped (~1,600 faults per step) and the tiny preset trains
    1.12x faster (`bench/train_step.py`, default vs kept side by side). The process's
    resident memory stays at its peak, which a training process reaches every step
    anyway. Call it before the process's first JAX computation: a thread keeps the arena
    it first allocated from. Returns whether it applied (glibc only; elsewhere a no-op).
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError, TypeError):
        return False
    arena_ok = mallopt(_M_ARENA_MAX, 1)
    mmap_ok = mallopt(_M_MMAP_THRESHOLD, KEEP_FREED_BELOW)
    trim_ok = mallopt(_M_TRIM_THRESHOLD, KEEP_FREED_BELOW)
    return bool(arena_ok and mmap_ok and trim_ok)
