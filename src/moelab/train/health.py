"""Balance health: which experts have gone dead, per MoE layer, from every step's loads.

An expert is dead when it received no token for `train.dead_expert_window` steps in a row
(Megatron and NeMo log the same count). Each step's metrics carry
`dead_experts/layer_i` beside the router's `router_entropy/layer_i` and
`expert_load_max_over_mean/layer_i`; the step an expert dies (its window fills) the run
gets an `expert_dead` event, and the step it receives tokens again an `expert_revived`
one. The counters are part of the checkpoint, so a resumed run reports the same deaths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DEAD_METRIC = "dead_experts"


@dataclass
class ExpertHealth:
    window: int = 100
    idle: list[list[int]] = field(default_factory=list)  # [layer][expert]: steps without a token

    def update(self, loads: np.ndarray) -> list[tuple[str, str]]:
        """Feed one step's tokens per expert ([layers, experts]); returns the (kind,
        message) events of the experts that died or revived at this step."""
        loads = np.asarray(loads)
        if not self.idle:
            self.idle = np.zeros(loads.shape, int).tolist()
        before = np.asarray(self.idle)
        after = np.where(loads > 0, 0, before + 1)
        self.idle = after.tolist()
        events = []
        for layer, expert in zip(*np.nonzero(after == self.window), strict=True):
            events.append(("expert_dead", f"layer {layer} expert {expert} received no token "
                           f"for {self.window} steps (train.dead_expert_window)"))
        for layer, expert in zip(*np.nonzero((before >= self.window) & (after == 0)),
                                 strict=True):
            events.append(("expert_revived", f"layer {layer} expert {expert} received tokens "
                           f"again after {before[layer, expert]} steps without"))
        return events

    def dead(self) -> list[int]:
        """Dead experts per layer."""
        return [sum(idle >= self.window for idle in layer) for layer in self.idle]

    def state_dict(self) -> dict:
        return {"idle": self.idle}

    def load_state_dict(self, state: dict) -> None:
        self.idle = [list(layer) for layer in state["idle"]]
