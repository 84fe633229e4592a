"""A recipe comparison as a committed result: `moelab ladder compare` plus its cost and machine.

    python bench/ladder_compare.py NAME BASE.yaml VARIANT.yaml [MORE.yaml ...]

trains the specs' missing rungs (finished ones are read, never retrained), compares them,
and writes bench/results/NAME/NAME.json (the comparison, the specs, every run's wall and CPU
seconds, the code commit and the CPU model), NAME.md and NAME.png. The realized
(wall-clock) multiplier comes from the rungs' logged throughput, so train them on a quiet
machine; the load before and after is recorded beside it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from machine import cpu_model, load_per_core, run_main  # noqa: E402

from moelab.lab.store import Store, default_lab_path  # noqa: E402
from moelab.ladder.compare import compare_ladders  # noqa: E402
from moelab.ladder.results import timings  # noqa: E402
from moelab.ladder.spec import load_spec  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def outcome(result: dict) -> str:
    """The measured multipliers, one sentence per variant."""
    parts = []
    for name, v in result["variants"].items():
        said = []
        for kind in ("theoretical", "realized"):
            e = v[kind]
            low, high = e["interval"]
            said.append(f"{kind} {e['value']:.3f}x [{low:.3f}, {high:.3f}] "
                        f"({'' if e['distinguishable'] else 'not '}distinguishable from noise)")
        parts.append(f"{name} vs {result['base']} at C={v['theoretical']['at'][0]['compute']:.3g}"
                     f": {'; '.join(said)}")
    return ". ".join(parts) + "."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="result name: writes bench/results/NAME/NAME.{json,md,png}")
    parser.add_argument("specs", nargs="+", help="BASE.yaml VARIANT.yaml [MORE.yaml ...]")
    parser.add_argument("--at", type=float, action="append", help="compute (FLOPs) to report at")
    parser.add_argument("--question", help="with --hypothesis: record the comparison in the lab "
                        "($MOELAB_LAB, else runs/lab.sqlite) as an experiment, ended with its "
                        "measured multipliers as the outcome (the findings page lists it)")
    parser.add_argument("--hypothesis", help="what was expected before the ladders ran")
    args = parser.parse_args(argv)
    if bool(args.question) != bool(args.hypothesis):
        parser.error("--question and --hypothesis go together")
    specs = [load_spec(p) for p in args.specs]
    out = Path("runs/ladder") / args.name
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    experiment = None
    if args.question:
        with Store(default_lab_path()) as store:
            experiment = store.new_experiment(args.question, args.hypothesis,
                                              {"compare": args.specs}, commit or None)
    load_before, started = load_per_core(), time.time()
    result = compare_ladders(specs, out, args.at, experiment=experiment, train=True)
    wall = time.time() - started
    if experiment:
        with Store(default_lab_path()) as store:
            store.finish_experiment(experiment, "succeeded", outcome(result))
        print(f"recorded as lab experiment {experiment} in {default_lab_path()}")
    spent = {}
    for spec in specs:
        runs = {r.name: timings(spec.out).get(r.name) for r in spec.rungs}
        spent[spec.name] = {"runs": runs,
                            "wall_total_s": sum(t["wall_s"] for t in runs.values() if t),
                            "cpu_total_s": sum(t["cpu_s"] for t in runs.values() if t)}
    record = {
        "command": "python bench/ladder_compare.py " + " ".join(sys.argv[1:]),
        "specs": args.specs, "code_commit": commit, "cpu": cpu_model(),
        "load_per_core": {"before": load_before, "after": load_per_core(),
                          "when": "around this invocation: when every rung already existed "
                                  "it only refitted, and the rungs' throughput was measured "
                                  "when they trained (their tokens/s, in compare.recipes)"},
        "this_invocation_wall_s": wall, "timings": spent,
        # two specs: the headline (value, interval) at the top, as the bar reads it
        **{k: result[k] for k in ("theoretical", "realized") if k in result},
        "compare": result,
    }
    folder = RESULTS / args.name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{args.name}.json").write_text(json.dumps(record, indent=1) + "\n")
    (folder / f"{args.name}.md").write_text(
        (out / "report.md").read_text().replace("(compare.png)", f"({args.name}.png)"))
    shutil.copy(out / "compare.png", folder / f"{args.name}.png")
    print((out / "report.md").read_text())
    print(f"wrote {folder / args.name}.json, .md, .png")
    return 0


if __name__ == "__main__":
    run_main(main)
