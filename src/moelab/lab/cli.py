"""`moelab lab ...`: plan experiments, end them with an outcome, and read them back.

Reports and the dashboard pull in matplotlib, so they are imported inside their handlers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Literal

import yaml

from moelab.config import load_config
from moelab.lab.records import ENDED, current_git_commit
from moelab.lab.store import Store, default_lab_path


def register(subparsers: argparse._SubParsersAction) -> None:
    lab = subparsers.add_parser("lab", help="experiment records, metrics, reports, dashboard")
    lab.add_argument("--lab", type=Path, default=None,
                     help="lab database file (default: $MOELAB_LAB, else runs/lab.sqlite)")
    commands = lab.add_subparsers(dest="lab_command", required=True)

    new = commands.add_parser("new", help="plan an experiment; prints its id")
    new.add_argument("name")
    new.add_argument("--hypothesis", required=True, help="what you expect, before running")
    new.add_argument("--config", required=True, type=Path, help="the YAML config it will run")
    new.set_defaults(func=_new)

    commands.add_parser("list", help="all experiments").set_defaults(func=_list)

    show = commands.add_parser("show", help="one experiment as Markdown")
    show.add_argument("id")
    show.set_defaults(func=_show)

    finish = commands.add_parser("finish", help="end an experiment, saying what happened")
    finish.add_argument("id")
    finish.add_argument("--status", required=True, choices=ENDED)
    finish.add_argument("--outcome", required=True, help="what happened, failures included")
    finish.set_defaults(func=_finish)

    report = commands.add_parser("report", help="write report.html, summary.md and PNG plots")
    report.add_argument("id")
    report.add_argument("--out", type=Path, default=None, help="default: runs/reports/ID")
    report.set_defaults(func=_report)

    serve = commands.add_parser("serve", help="read-only dashboard on localhost")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8765)
    serve.set_defaults(func=_serve)


def _open(args: argparse.Namespace, mode: Literal["rwc", "rw", "ro"]) -> Store:
    return Store(args.lab or default_lab_path(), mode=mode)


def _new(args: argparse.Namespace) -> None:
    load_config(args.config)  # refuse a config that could not run
    snapshot = yaml.safe_load(args.config.read_text()) or {}
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
        print(render_markdown(load_view(store, args.id)))


def _finish(args: argparse.Namespace) -> None:
    with _open(args, "rw") as store:
        store.finish_experiment(args.id, args.status, args.outcome)
    print(f"{args.id}: {args.status}")


def _report(args: argparse.Namespace) -> None:
    from moelab.lab.report import write_report

    with _open(args, "ro") as store:
        for path in write_report(store, args.id, args.out or Path("runs/reports") / args.id):
            print(path)


def _serve(args: argparse.Namespace) -> None:
    from moelab.lab.dashboard import make_server

    server = make_server(args.lab or default_lab_path(), args.host, args.port)
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
