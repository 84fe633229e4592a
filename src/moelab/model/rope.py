"""Rotary frequencies for context extension: default, linear, ntk, llama3 and yarn.

Each type maps (head_dim, model.rope_theta, model.rope) to the per-pair inverse frequencies
and a multiplier on cos/sin, the two things Hugging Face `transformers`' rope init functions
return (`modeling_rope_utils.py`), so an exported model rotates exactly as it trained:

- default: theta^(-2i/d).
- linear (position interpolation): default / factor, every pair slowed alike.
- ntk (static NTK-aware scaling): default with theta * factor^(d/(d-2)); high-frequency
  pairs keep their resolution, the lowest one is slowed by ~factor. transformers' "dynamic"
  recomputes this from the current length, which would rotate cached keys differently from
  the full forward, so moelab keeps it static (it exports as `default` with that theta).
- llama3: wavelengths shorter than original/high_freq_factor untouched, longer than
  original/low_freq_factor divided by factor, a linear blend between.
- yarn: per-pair blend of interpolation and extrapolation ramped over the pairs that turn
  beta_slow..beta_fast times within the original length, and cos/sin multiplied by
  0.1 ln(factor) + 1 (the attention temperature; logits scale by its square).

Computed in float64 numpy once per trace (they depend only on static config), then cast.
"""

from __future__ import annotations

import math

import numpy as np

from moelab.config import RopeConfig


def default_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    return 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def yarn_mscale(factor: float) -> float:
    """YaRN's attention temperature: 0.1 ln(factor) + 1 (1 when not extending)."""
    return 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0


def rope_parameters(head_dim: int, theta: float, rope: RopeConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim / 2] float64, the cos/sin multiplier) for `rope`."""
    base = default_inv_freq(head_dim, theta)
    kind, factor = rope.type, rope.factor
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return base / factor, 1.0
    if kind == "ntk":
        return default_inv_freq(head_dim, ntk_theta(head_dim, theta, factor)), 1.0
    original = rope.original_max_position_embeddings
    if kind == "llama3":
        wavelen = 2 * math.pi / base
        smooth = (original / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * base / factor + smooth * base
        return np.where(wavelen < original / rope.high_freq_factor, base,
                        np.where(wavelen > original / rope.low_freq_factor, base / factor,
                                 blended)), 1.0
    if kind == "yarn":
        def pair_turning(rotations: float) -> float:  # the pair that turns `rotations` times
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (
                2 * math.log(theta))

        low = max(math.floor(pair_turning(rope.beta_fast)), 0)
        high = min(math.ceil(pair_turning(rope.beta_slow)), head_dim - 1)
        high = high + 0.001 if low == high else high  # transformers' guard against 0/0
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolate = 1 - ramp  # 1: the pair keeps its frequency, 0: divided by factor
        inv_freq = base / factor * (1 - extrapolate) + base * extrapolate
        return inv_freq, rope.attention_factor or yarn_mscale(factor)
    raise ValueError(f"unknown rope type {kind!r}")  # config validation rules this out


def ntk_theta(head_dim: int, theta: float, factor: float) -> float:
    """The base that NTK-aware scaling rotates with: theta * factor^(d / (d - 2))."""
    return theta * factor ** (head_dim / (head_dim - 2))
