"""Optional copy of runs to Weights & Biases, for people who already read their curves there.

The SQLite store stays the record; W&B is a mirror, switched on only by the environment:
MOELAB_WANDB=offline (writes ./wandb with no network; `wandb sync` uploads later) or
MOELAB_WANDB=online. MOELAB_WANDB_PROJECT names the project (default "moelab").
"""

from __future__ import annotations

import os
from typing import Any

from moelab.errors import UserError
from moelab.lab.records import Experiment


def start_mirror(run_id: str, experiment: Experiment, config: dict[str, Any]) -> Any | None:
    """A wandb run mirroring `run_id` (the store calls its .log and .finish), or None when
    mirroring is off."""
    mode = os.environ.get("MOELAB_WANDB", "")
    if not mode:
        return None
    if mode not in ("online", "offline"):
        raise UserError(f"MOELAB_WANDB={mode!r}: use online or offline, or unset it")
    try:
        import wandb
    except ImportError as err:
        raise UserError("MOELAB_WANDB is set but wandb is not installed; "
                        "pip install wandb, or unset MOELAB_WANDB") from err
    return wandb.init(
        project=os.environ.get("MOELAB_WANDB_PROJECT", "moelab"),
        name=run_id,
        group=experiment.id,
        notes=experiment.hypothesis,
        config=config,
        mode=mode,
    )
