"""The MoE transformer: `Transformer.init(cfg.model, cfg.moe, key)`, the model a run trains
(`init_model(cfg, key)`: with its multi-token-prediction modules) and its objective."""

from moelab.model.losses import objective
from moelab.model.mtp import init_model
from moelab.model.transformer import Transformer

__all__ = ["Transformer", "init_model", "objective"]
