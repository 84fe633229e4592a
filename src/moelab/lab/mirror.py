"""Optional copy of runs to Weights & Biases, for people who already read their curves there.

The SQLite store stays the record; W&B is a mirror, switched on only by the environment:
MOELAB_WANDB=offline (writes ./wandb with no network; `wandb sync` uploads later) or
MOELAB_WANDB=online. MOELAB_WANDB_PROJECT names the project (default "moelab").

A mirrored run's W&B id is derived from the lab file and the lab run id (`wandb_id`), so a
branch (`moelab train --from`) can name its parent's W&B run: it starts with W&B's
`fork_from="<parent id>?_step=<step>"`, and W&B shows it as a fork of the parent's curve
at the branch step, as the lab's site does.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from moelab.errors import UserError
from moelab.lab.records import Experiment


def wandb_id(lab: Path | str, run_id: str) -> str:
    """The W&B run id of lab run `run_id` of the lab file `lab`: stable, so a child run can
    refer to it; distinct across lab files (run ids restart at run-1 in each)."""
    digest = hashlib.sha256(f"{Path(lab).resolve()}\0{run_id}".encode()).hexdigest()
    return f"moelab-{digest[:16]}"


def start_mirror(run_id: str, experiment: Experiment, config: dict[str, Any],
                 lab: Path | str, fork: tuple[str, int] | None = None) -> Any | None:
    """A wandb run mirroring `run_id` (the store calls its .log and .finish), or None when
    mirroring is off. `fork`: (parent lab run id, step) of a branch."""
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
    forked = {} if fork is None else {"fork_from": f"{wandb_id(lab, fork[0])}?_step={fork[1]}"}
    return wandb.init(
        project=os.environ.get("MOELAB_WANDB_PROJECT", "moelab"),
        id=wandb_id(lab, run_id),
        **forked,
        name=run_id,
        group=experiment.id,
        notes=experiment.hypothesis,
        config=config,
        mode=mode,
    )
