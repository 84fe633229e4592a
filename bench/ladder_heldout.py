"""The held-out ladders (configs/ladder/heldout/), one at a time, into one table.

    moelab data prepare --preset ladder                 # once: the fresh-token corpus
    python3 bench/ladder_heldout.py [--only NAME ...] [--ray [ADDRESS]] [--force]

Each spec runs with `moelab ladder run`'s code (runs already finished in its out directory
are only read; its pre-registration is written before its target trains and never again),
one after another. On 2 idle cores (2026-12-06) h2 took ~38 min: every run evaluates the
whole held-out split (1.1M tokens) at each of its 10 evaluations, which costs short rungs
more than their training; specs with cooldown branches (three runs per rung) take about
twice as long. With --ray each spec's runs are Ray tasks (a branch after its parent, the
target after the pre-registration). Writes bench/results/ladder_heldout/ladder_heldout.json
(moelab.ladder.heldout): per spec its stage ends predicted vs actual with their 90%
intervals and the curve's median error; the coverage of the intervals over the rungs'
extrapolating backtests and the targets' stage ends. Entries of specs not run this time
stay in the table. Each spec's pre-registration, report and plots are copied beside it
(ladder_heldout/<spec>/). Timings in the reports are claims about the machine, so a busy
machine is refused as by the other benchmarks.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from machine import add_output_args, quiet_start, run_main, write_result  # bench/machine.py

from moelab.jobs.cli import add_ray_arguments, ray_options
from moelab.ladder import heldout
from moelab.ladder.runner import run_ladder
from moelab.ladder.spec import LADDER_PRESETS, load_spec

RESULTS = Path(__file__).parent / "results" / "ladder_heldout" / "ladder_heldout.json"
SPECS = LADDER_PRESETS / "heldout"
KEPT = ("preregistration.json", "refusal.json", "refusal.md", "report.json", "report.md", "fit.png",
        "curves.png")


def keep(spec, folder: Path) -> None:
    """The ladder's pre-registration, report and plots, into its results folder."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in KEPT:
        if (spec.out / name).is_file():
            shutil.copyfile(spec.out / name, folder / name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", default=None, metavar="NAME",
                        help="run these held-out specs (file stems) only")
    add_output_args(parser, RESULTS)
    add_ray_arguments(parser)
    args = parser.parse_args()
    names = args.only or sorted(p.stem for p in SPECS.glob("*.yaml"))
    specs = [load_spec(SPECS / f"{name}.yaml") for name in names]  # all checked before any runs
    before = quiet_start(args.force)
    entries = []
    for spec in specs:
        report = run_ladder(spec, ray=args.ray, cpus=args.cpus_per_run, **ray_options(args))
        entries.append(heldout.entry(spec.name, report))
        keep(spec, args.out.parent / spec.name)
        for s in entries[-1]["stages"]:
            print(f"{spec.name} {s['name']}: predicted {s['predicted']:.4f} "
                  f"[{s['interval']['low']:.4f}, {s['interval']['high']:.4f}], actual "
                  f"{s['actual']:.4f}: {s['relative_error']:+.2%}", flush=True)
    previous = json.loads(args.out.read_text()) if args.out.exists() else None
    out = write_result(args.out, heldout.table(entries, previous), before)
    cov = out["coverage"]
    print(f"coverage of the 90% intervals: {cov['measured']:.0%} of {cov['n']} "
          f"({cov['n_backtests']} backtests, {cov['n_targets']} stage ends) -> {args.out}")


if __name__ == "__main__":
    run_main(main)
