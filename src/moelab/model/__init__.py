"""The MoE transformer: `Transformer.init(cfg.model, cfg.moe, key)` and its training objective."""

from moelab.model.losses import objective
from moelab.model.transformer import Transformer

__all__ = ["Transformer", "objective"]
