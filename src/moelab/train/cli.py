"""`moelab train`: train (or resume) a run, optionally under a restarting supervisor;
`moelab upcycle`: a new MoE run from a dense run's checkpoint (train/upcycle.py);
`moelab checkpoint verify`: check every checkpoint of a run against its integrity record."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from importlib import resources
from pathlib import Path

from moelab.errors import EXIT_DIVERGED, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UserError
from moelab.schema import add_run_dir, brief, float_in, int_in, parse_yaml
from moelab.train.supervisor import MAX_WAIT_S

PRESETS = ("tiny", "small")
MAX_RESTARTS = 1000  # more than any real run needs; keeps 2**n backoff arithmetic finite


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train an MoE model (resumes if the run exists)")
    p.add_argument("--config", default=None,
                   help=f"a YAML file, or a built-in preset: {', '.join(PRESETS)} (default: "
                   "an existing RUN_DIR's own config.yaml, else tiny)")
    add_run_dir(p, required=False, help="where checkpoints and metrics go (default "
                "runs/<config>, plus the --set overrides when there are any)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set train.steps=100 (YAML value)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="resume a run with a config that differs from its config.yaml, "
                        "recording the change as a config_change event")
    p.add_argument("--max-restarts", type=int_in(0, MAX_RESTARTS), default=0,
                   help="supervise: restart a crashed worker from its checkpoint up to N times")
    p.add_argument("--restart-backoff", type=float_in(0, MAX_WAIT_S), default=1.0,
                   help="seconds before the first restart; doubles each time (up to "
                        f"{MAX_WAIT_S:.0f} s)")
    p.add_argument("--restart-from-scratch", action="store_true",
                   help="move an earlier run's files in RUN_DIR to history-*/ and train "
                        "from step 0 (needed when its checkpoints are gone)")
    p.add_argument("--experiment", help="attach this run to a lab experiment id")
    p.add_argument("--from", dest="parent", metavar="RUN_DIR[@STEP]",
                   help="branch: start this new run from a kept checkpoint of another run "
                        "(default its newest), continuing at that step")
    p.add_argument("--weights-only", action="store_true",
                   help="with --from: take the weights only and start a fresh optimizer state")
    p.set_defaults(func=run)

    up = subparsers.add_parser("upcycle", help="a new MoE run from a dense run's checkpoint: "
                               "every expert a copy of its FFN (plus noise), router fresh")
    up.add_argument("dense_run", type=Path, metavar="DENSE_RUN",
                    help="the run dir of a dense run (model.n_dense_layers = n_layers)")
    up.add_argument("--experts", type=int_in(1, 2**16), required=True, help="moe.n_experts")
    up.add_argument("--top-k", type=int_in(1, 2**16), required=True, help="moe.top_k")
    up.add_argument("--out", type=Path, required=True, metavar="RUN_DIR",
                    help="the new run's directory (must not exist or be empty)")
    up.add_argument("--step", type=int_in(0, 2**31 - 1),
                    help="the dense checkpoint to upcycle (default its newest good one)")
    up.add_argument("--noise", type=float_in(0, 1), default=0.01,
                    help="std of the noise added to each expert copy, relative to the std "
                         "of the dense matrix")
    up.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                    help="seed of the router's init and the noise")
    up.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a field of the new run's config, e.g. --set train.steps=400")
    up.set_defaults(func=run_upcycle)

    ckpt = subparsers.add_parser("checkpoint", help="inspect a run's checkpoints")
    actions = ckpt.add_subparsers(dest="action", required=True)
    verify = actions.add_parser("verify", help="list each checkpoint as good or bad (exit 1 "
                                "if any is bad)")
    verify.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a training run directory")
    verify.set_defaults(func=verify_checkpoints)


def config_path(name: str) -> Path:
    """A preset's YAML (shipped inside the package) or a config file path."""
    from moelab.config import preset_or_file

    presets = {p: Path(str(resources.files("moelab") / "presets" / f"{p}.yaml"))
               for p in PRESETS}
    return preset_or_file(name, presets, "config")


def parse_overrides(items: list[str]) -> dict:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects KEY=VALUE, got {brief(item)}")
        overrides[key] = parse_yaml(value, f"--set {key}", "value")
    return overrides


def default_run_dir(config: str, overrides: list[str]) -> Path:
    """runs/<config>, or runs/<config>-<overrides> so that `--set` never resumes (and
    mixes into) the run of the config without them."""
    name = Path(config).stem
    if overrides:
        name += "-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", "-".join(overrides))[:120]
    return Path("runs") / name


def parse_parent(value: str | None, weights_only: bool):
    """`--from RUN_DIR[@STEP]` as a trainer Parent (None without --from)."""
    from moelab.train.trainer import Parent

    if value is None:
        if weights_only:
            raise UserError("--weights-only applies to a branch: add --from RUN_DIR[@STEP]")
        return None
    path, sep, step = value.rpartition("@")
    if not sep or not path:
        path, step = value, ""
    elif not step.isdigit():
        raise UserError(f"--from {value!r}: expected RUN_DIR or RUN_DIR@STEP (STEP a number)")
    return Parent(Path(path), int(step) if step else None, weights_only)


CONFIG_SUFFIXES = (".yaml", ".yml", ".json")  # RUN_DIR names refused as mistyped configs


def run(args: argparse.Namespace) -> int:
    from moelab import outputs
    from moelab.config import load_config
    from moelab.model import dispatch  # noqa: F401  (checks moe.dispatch by its registry)
    from moelab.train.rundir import current_config_path

    if args.config is None:  # an existing run resumes with its own config, not a preset
        own = current_config_path(Path(args.run_dir)) if args.run_dir else None
        args.config = str(own) if own is not None and own.is_file() else "tiny"
    cfg = load_config(config_path(args.config), parse_overrides(args.set))
    run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(args.config, args.set)
    config_like = bool(args.run_dir) and run_dir.suffix.lower() in CONFIG_SUFFIXES
    if run_dir.exists() and not run_dir.is_dir():
        hint = f" (a config? pass it as --config {run_dir})" if config_like else ""
        raise UserError(f"RUN_DIR {run_dir} is a file, not a directory; pass a directory{hint}")
    if config_like and not run_dir.exists():  # a mistyped config would become a run dir
        raise UserError(f"RUN_DIR {run_dir} does not exist and is named like a config file; "
                        f"a config goes in --config, a new run dir needs another name")
    if run_dir.is_dir() and not outputs.writable(run_dir):
        raise UserError(f"RUN_DIR {run_dir} is not writable; choose another directory")
    if not run_dir.exists():
        outputs.check_dir(run_dir, flag="RUN_DIR")
    parent = parse_parent(args.parent, args.weights_only)
    if args.restart_from_scratch:  # here, not in the workers: a restart must not archive
        from moelab.train.rundir import RunDirLock, archive_history

        with RunDirLock(run_dir):
            if (archive := archive_history(run_dir)):
                print(f"archived the earlier run's files to {archive}; starting over")
    if args.max_restarts > 0:
        from moelab.train.supervisor import supervise

        return supervise(worker_argv(args, run_dir), run_dir, args.max_restarts,
                         args.restart_backoff, args.experiment)
    from moelab.errors import DivergenceError, Interrupted
    from moelab.train.trainer import train

    try:
        summary = train(cfg, run_dir, args.experiment, args.allow_config_change,
                        match_experiment=True, parent=parent)
    except DivergenceError as err:
        print(f"moelab train: diverged: {err}", file=sys.stderr)
        return EXIT_DIVERGED
    except Interrupted as stop:
        print(stop, flush=True)
        return EXIT_INTERRUPTED
    print(f"done: step {summary['step']}, loss {summary.get('loss', float('nan')):.4f}, "
          f"run dir {run_dir}")
    print(next_commands(run_dir, args.experiment))
    return EXIT_OK


def next_commands(run_dir: Path, experiment: str | None) -> str:
    """What a finished run leads to, as commands to copy: a first run should not end in
    silence (the README's "After your first run" says the same). The experiment is planned
    with the run's own config file, so attaching the run to it needs no config change."""
    from moelab.train.rundir import current_config_path

    r, q = shlex.quote(str(run_dir)), shlex.quote  # commands to paste into a shell
    lines = [(f"moelab generate {r} --prompt 'def '", "sample from the model")]
    if experiment:
        lines += [(f"moelab lab show {experiment}", "the experiment, this run included"),
                  (f"moelab lab finish {experiment} --status succeeded --outcome '...'",
                   "say what happened")]
    else:
        lines += [("moelab lab new NAME --hypothesis '...' --config "
                   f"{q(str(current_config_path(run_dir)))}", "plan an experiment (prints its id)"),
                  (f"moelab lab attach {r} --experiment ID", "record this run in it")]
    lines += [("moelab lab publish runs/site", "the lab as a static site (lab extra)"),
              (f"moelab export {r} --out {q('runs/hf/' + run_dir.name)}",
               "a transformers model (export extra)")]
    width = max(len(command) for command, _ in lines)
    return "next:\n" + "\n".join(f"  {command:<{width}}  # {why}" for command, why in lines)


def worker_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """The same training command, without supervision, for the supervisor to run."""
    argv = ["train", str(run_dir), "--config", args.config]
    for item in args.set:
        argv += ["--set", item]
    if args.allow_config_change:
        argv.append("--allow-config-change")
    if args.parent:
        argv += ["--from", args.parent] + (["--weights-only"] if args.weights_only else [])
    return argv + (["--experiment", args.experiment] if args.experiment else [])


def run_upcycle(args: argparse.Namespace) -> int:
    from moelab import outputs
    from moelab.train.upcycle import upcycle_run

    # a file, under a file, unwritable, someone else's or another command's: refused
    outputs.check_dir(args.out, made_by=("upcycle",))
    config = upcycle_run(args.dense_run, args.out, args.experts, args.top_k, args.step,
                         args.noise, args.seed, parse_overrides(args.set))
    print(f"upcycled {args.dense_run} into {args.out} ({args.experts} experts, top-"
          f"{args.top_k}); train it with:\n  moelab train {shlex.quote(str(args.out))} "
          f"--config {shlex.quote(str(config))}")
    return EXIT_OK


def verify_checkpoints(args: argparse.Namespace) -> int:
    from moelab.train.checkpoint import verify_run

    results = verify_run(args.run_dir)
    for step, reason in results:
        print(f"step {step}: " + ("good" if reason is None else f"BAD: {reason}"))
    if not results:
        print(f"no checkpoints in {args.run_dir}")
    return EXIT_FAILED if any(reason for _, reason in results) else EXIT_OK
