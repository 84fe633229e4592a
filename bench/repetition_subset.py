"""Is the rungs' repetition cost repetition, or a narrower subset? A hindsight diagnostic
of repetition_v4 (issue 47), written after its target's result; it chooses nothing for v4.

    python3 bench/repetition_subset.py     # after `moelab ladder run` of repetition_v4 (~5 min)

A rung repeats `data.unique_tokens`: the first K train tokens of each source. A run at 2
passes over 400K tokens therefore differs from one pass over 800K in two ways: it sees
each token twice, and it sees only the first 400K tokens (fewer files, perhaps fewer
kinds of text). The law charges both to repetition. This trains repetition_v4's
width-32 rung at 195 and 391 steps on wider subsets and on the whole corpus (under one
pass, so nothing repeats), same seed and config, and sets their validation loss (the
ladder's score: the sources' val loss averaged with the mixture's weights) beside v4's
rungs at the same steps: if the one-pass runs agree whatever the subset, the rungs'
extra loss at 2-4 passes is repetition; if the wider subset is lower at the same steps
and passes, part of it is the subset.

Writes bench/results/repetition_subset/repetition_subset.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from machine import run_main  # bench/machine.py

from moelab.config import load_config
from moelab.errors import UserError
from moelab.ladder.results import metrics, source_weights, weighted_loss

LADDER = Path("runs/ladder/repetition_v4")
BASE = LADDER / "w32-u400-p1-s5" / "config.yaml"
OUT = Path("runs/bench/repetition_subset")
RESULTS = Path(__file__).parent / "results" / "repetition_subset" / "repetition_subset.json"
SPLIT = {"code": 0.7802, "prose": 0.2198}  # the corpus's split, as the specs' subsets
# (name, steps, unique tokens or None for the whole corpus); the v4 rungs beside them
NEW = [("w32-u800-195", 195, 800_000), ("w32-all-195", 195, None),
       ("w32-u1600-391", 391, 1_600_000), ("w32-all-391", 391, None)]
V4 = {195: ["w32-u400-p1-s5", "w32-u200-p2-s5"],
      391: ["w32-u800-p1-s5", "w32-u400-p2-s5", "w32-u200-p4-s5"]}


def score(run_dir: Path) -> float:
    """The ladder's score of a finished run: the last evaluation's mixture-weighted loss."""
    config = load_config(run_dir / "config.yaml")
    last = [r for r in metrics(run_dir) if any(k.startswith("val_loss/") for k in r)][-1]
    return weighted_loss(last, source_weights(config))


def unique(total: int | None) -> str:
    if total is None:
        return "{}"
    return json.dumps({s: round(total * w) for s, w in SPLIT.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if not BASE.is_file():
        raise UserError(f"{BASE} is missing: run `moelab ladder run "
                        "configs/ladder/dev/repetition_v4.yaml` first")
    rows = []
    for name, steps, total in NEW:
        run_dir = OUT / name
        if not (run_dir / "metrics.jsonl").is_file() or not any(
                r.get("step") == steps and "val_loss" in r for r in metrics(run_dir)):
            subprocess.run(["moelab", "train", str(run_dir), "--config", str(BASE),
                            "--set", f"train.steps={steps}",
                            "--set", f"data.unique_tokens={unique(total)}"],
                           check=True, stdout=subprocess.DEVNULL)
        rows.append({"run": name, "steps": steps, "unique_tokens": total,
                     "repeats": False, "loss": score(run_dir)})
    for steps, names in V4.items():
        for name in names:
            cfg = load_config(LADDER / name / "config.yaml")
            rows.append({"run": f"repetition_v4/{name}", "steps": steps,
                         "unique_tokens": sum(cfg.data.unique_tokens.values()),
                         "repeats": "-p1-" not in name, "loss": score(LADDER / name)})
    for r in sorted(rows, key=lambda r: (r["steps"], -(r["unique_tokens"] or 1e12))):
        u = "whole corpus" if r["unique_tokens"] is None else f"{r['unique_tokens']:,} tokens"
        print(f"{r['steps']:4d} steps  {u:>16s}  {r['run']:28s} loss {r['loss']:.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kind": "moelab.repetition_subset/1", "seed": 5,
                                    "base": str(BASE), "runs": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    run_main(main)
