"""`moelab lab ...`: plan experiments, end them with an outcome, and read them back.

Reports, the site and the dashboard pull in matplotlib, so they are imported inside their
handlers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

from moelab.config import load_config
from moelab.lab.records import ENDED, current_git_commit
from moelab.lab.store import Store, default_lab_path
from moelab.schema import add_run_dir, float_in, read_yaml
from moelab.train.cli import PRESETS, config_path


def register(subparsers: argparse._SubParsersAction) -> None:
    lab_help = "lab database file (default: $MOELAB_LAB, else runs/lab.sqlite)"
    lab = subparsers.add_parser("lab", help="experiment records, metrics, reports, dashboard")
    lab.add_argument("--lab", type=Path, default=None, help=lab_help)
    # --lab is accepted after the subcommand too (`moelab lab list --lab X`); SUPPRESS keeps
    # a subcommand without it from resetting one given before.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lab", type=Path, default=argparse.SUPPRESS, help=lab_help)
    commands = lab.add_subparsers(dest="lab_command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, description=help, parents=[common])

    new = command("new", "plan an experiment; prints its id")
    new.add_argument("name", help="the question the experiment answers, in a few words")
    new.add_argument("--hypothesis", required=True, help="what you expect, before running")
    new.add_argument("--config", required=True,
                     help=f"the config it will run: a YAML file or a preset ({', '.join(PRESETS)})")
    new.set_defaults(func=_new)

    command("list", "all experiments").set_defaults(func=_list)

    show = command("show", "one experiment as Markdown")
    show.add_argument("id", help="experiment id, e.g. exp-1")
    show.set_defaults(func=_show)

    finish = command("finish", "end an experiment, saying what happened")
    finish.add_argument("id", help="experiment id, e.g. exp-1")
    finish.add_argument("--status", required=True, choices=ENDED, help="how it ended")
    finish.add_argument("--conclusion", "--outcome", dest="outcome", required=True,
                        help="what you conclude from what happened, failures included (the "
                        "measured outcome is the predictions' scores, shown beside it)")
    finish.set_defaults(func=_finish)

    attach = command("attach", "record an existing run dir (trained without --experiment) in "
                     "an experiment, importing its metrics and events")
    add_run_dir(attach)
    attach.add_argument("--experiment", required=True, help="experiment id, e.g. exp-1")
    attach.add_argument("--allow-config-change", action="store_true",
                        help="attach although the run's config differs from the experiment's "
                             "snapshot, recording the difference as a config_change event")
    attach.set_defaults(func=_attach)
    predict = command("predict", "pre-register a prediction of a metric before it is known")
    predict.add_argument("id", help="experiment id, e.g. exp-1")
    predict.add_argument("name", help="what is predicted, e.g. 'final val loss'")
    predict.add_argument("--metric", default="loss", help="the logged metric it predicts")
    predict.add_argument("--value", type=float_in(-1e300), required=True,
                         help="the predicted value")
    predict.add_argument("--low", type=float_in(-1e300), required=True,
                         help="the interval's low end")
    predict.add_argument("--high", type=float_in(-1e300), required=True,
                         help="the interval's high end")
    scored = predict.add_mutually_exclusive_group(required=True)
    scored.add_argument("--run", help="score it on this run (its id or run directory)")
    scored.add_argument("--rule", choices=("best", "mean"),
                        help="score it on the best (lowest) or mean last value of the "
                        "experiment's runs")
    predict.set_defaults(func=_predict)

    report = command("report", "write report.html (interactive), summary.md and PNG plots")
    report.add_argument("id", help="experiment id, e.g. exp-1")
    report.add_argument("--out", type=Path, default=None,
                        help="directory (default: runs/reports/ID)")
    report.set_defaults(func=_report)

    publish = command("publish", "write the whole lab as a static site (works from file://)")
    publish.add_argument("out", type=Path, metavar="OUT_DIR", help="directory to write into")
    publish.set_defaults(func=_publish)

    serve = command("serve", "read-only dashboard on localhost")
    serve.add_argument("--host", default="127.0.0.1", help="bind address")
    serve.add_argument("--port", type=int, default=8765,
                       help="TCP port (0: any free one)")
    serve.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                       help="also answer requests whose Host header is NAME (repeatable; "
                            "localhost and the bind address always are)")
    serve.set_defaults(func=_serve)


def _open(args: argparse.Namespace, mode: Literal["rwc", "rw", "ro"]) -> Store:
    return Store(args.lab or default_lab_path(), mode=mode)


def _new(args: argparse.Namespace) -> None:
    path = config_path(args.config)
    from moelab.model import dispatch  # noqa: F401  (checks moe.dispatch by its registry)

    load_config(path)  # refuse a config that could not run
    snapshot = read_yaml(path, "config") or {}
    with _open(args, "rwc") as store:
        print(store.new_experiment(args.name, args.hypothesis, snapshot, current_git_commit()))


def _list(args: argparse.Namespace) -> None:
    with _open(args, "ro") as store:
        experiments = store.list_experiments()
        if not experiments:
            print(f"no experiments in {store.path}")
        for e in experiments:
            print(f"{e.id:<8} {e.status:<10} {len(store.runs(e.id)):>3} runs  {e.name}")


def _show(args: argparse.Namespace) -> None:
    from moelab.lab.report import load_view, render_markdown

    with _open(args, "ro") as store:
        print(render_markdown(load_view(store, args.id)), end="")  # it ends with a newline


def _finish(args: argparse.Namespace) -> None:
    with _open(args, "rw") as store:
        store.finish_experiment(args.id, args.status, args.outcome)
    print(f"{args.id}: {args.status}")


def _attach(args: argparse.Namespace) -> None:
    """The same record `moelab train --experiment` would have made, for a run that trained
    without it: runs are cheap to start and the experiment is often named afterwards."""
    from moelab import outputs
    from moelab.config import config_to_dict
    from moelab.errors import UserError
    from moelab.train.rundir import LAB_RUN_FILE, RunDirLock, current_config_path
    from moelab.train.runlog import RunLog

    run_dir, config_file = args.run_dir, current_config_path(args.run_dir)
    if not config_file.is_file():
        raise UserError(f"{run_dir} is not a run directory (no {config_file.name}); pass the "
                        "RUN_DIR of a training run")
    if (run_dir / LAB_RUN_FILE).exists():
        raise UserError(f"{run_dir} is already attached ({(run_dir / LAB_RUN_FILE).read_text()})")
    if not outputs.writable(run_dir):  # before the lab is touched
        raise UserError(f"{run_dir} is not writable: attaching records the lab run in it "
                        f"({LAB_RUN_FILE}); make it writable or copy the run")
    from moelab.model import dispatch  # noqa: F401  (checks moe.dispatch by its registry)

    cfg = load_config(config_file)
    _open(args, "rw").close()  # the lab must exist: `moelab lab new` makes the experiment
    with RunDirLock(run_dir):  # not while a trainer is writing it
        log = RunLog(run_dir, args.experiment, config_to_dict(cfg),
                     snapshot_change=args.allow_config_change, lab=args.lab)
        steps = [r["step"] for r in log.metrics.read()]
        finished = bool(steps) and steps[-1] >= cfg.train.steps
        if finished:
            log.finish("succeeded")
    state = (f"finished at step {steps[-1]}" if finished else
             f"at step {steps[-1] if steps else 0} of {cfg.train.steps}; `moelab train "
             f"{run_dir} --experiment {args.experiment}` continues it")
    print(f"attached {run_dir} to {args.experiment} as {log.run_id} ({len(steps)} steps "
          f"imported, {state})")
def _predict(args: argparse.Namespace) -> None:
    details = {"metric": args.metric, **({"run": args.run} if args.run else {"rule": args.rule})}
    with _open(args, "rw") as store:
        store.add_prediction(args.id, args.name, args.value, args.low, args.high, details)
    print(f"{args.id}: predicted {args.name} ({args.metric}) {args.value:g} "
          f"[{args.low:g}, {args.high:g}], scored on "
          + (f"run {args.run}" if args.run else f"the {args.rule} of its runs"))


def _check_out(out: Path, flag: str, pages: tuple[str, ...], command: str) -> None:
    """Refuse, before the lab is read, an output directory holding what moelab did not
    write (outputs.check_dir): a user's own summary.md or index.html is never overwritten.
    One an earlier run of the same `command` wrote is rewritten: it carries its
    outputs.MARKER, or (written before reports were marked) all of its `pages`; another
    command's output (an export, an eval) is refused."""
    from moelab import outputs

    legacy = all((out / name).is_file() for name in pages)
    outputs.check_dir(out, flag=flag, ours=True if legacy else None, made_by=(command,))


def _report(args: argparse.Namespace) -> None:
    from moelab import outputs
    from moelab.lab.site import write_report

    out = args.out or Path("runs/reports") / args.id
    _check_out(out, "--out", ("report.html", "summary.md"), "lab report")
    with _open(args, "ro") as store:
        paths = write_report(store, args.id, out)
    outputs.mark(out, "lab report")
    for path in paths:
        print(path)


def _publish(args: argparse.Namespace) -> None:
    from moelab import outputs
    from moelab.lab.site import publish

    _check_out(args.out, "OUT_DIR", ("index.html", "findings.html"), "lab publish")
    with _open(args, "ro") as store:
        pages = publish(store, args.out)
    outputs.mark(args.out, "lab publish")
    print(f"wrote {len(pages)} pages to {args.out}; open {args.out / 'index.html'}")


def _serve(args: argparse.Namespace) -> None:
    from moelab.lab.dashboard import make_server

    server = make_server(args.lab or default_lab_path(), args.host, args.port,
                         allowed_hosts=args.allow_host)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: {args.host} may expose the dashboard beyond this machine",
              file=sys.stderr)
    print(f"serving {server.lab_path} read-only at {server.url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
