"""One entry point, `moelab`, with a subcommand per part of the pipeline.

Each part owns its arguments in a small `cli` module with a `register(subparsers)`
function; those modules import nothing heavy at the top, so `moelab --help` is instant.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys

from moelab import __version__
from moelab.errors import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USER_ERROR,
    Interrupted,
    UserError,
)
from moelab.schema import bounded, resolve_run_dir

PARTS = [
    "moelab.data.cli",
    "moelab.curate.cli",  # after data: adds its commands under `moelab data`
    "moelab.train.cli",
    "moelab.ladder.cli",
    "moelab.lab.cli",
    "moelab.export.cli",
    "moelab.eval.cli",
    "moelab.serve.cli",
]


# OS errors that mean "this path cannot be written", not a bug: one line, exit 2
PATH_ERRORS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR,
               errno.ENAMETOOLONG, errno.EEXIST)  # EEXIST: a mkdir where a file lies


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (a required option,
    a None/False/[] default) or the help already names it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        nothing = action.default is None or action.default is False or action.default == []
        if action.required or nothing or "default" in (action.help or "").lower():
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; subcommand parsers are of this class
    too (argparse makes them with the parent's type), so every part's options show theirs."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="moelab", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in PARTS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name != name:
                raise
            continue  # a part not built yet
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        note = resolve_run_dir(args)
        code = int(args.func(args) or 0)
        if note and code == EXIT_OK:
            print(note, file=sys.stderr)
        return code
    except (UserError, FileNotFoundError) as err:  # ConfigError is a UserError
        # One bounded line: a message may quote a value read from a file of any size.
        print(bounded(f"moelab {args.command}: error: {err}"), file=sys.stderr)
        return EXIT_USER_ERROR
    except Interrupted as stop:  # a stop that saved its work (the ladder's runs, say)
        print(stop, file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:  # Ctrl-C before training installed its own handler
        print(f"moelab {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as err:
        if err.errno in PATH_ERRORS:  # a path the checks could not foresee (a race, a mount)
            print(bounded(f"moelab {args.command}: error: {err}; choose a path this user "
                          "may write"), file=sys.stderr)
            return EXIT_USER_ERROR
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"moelab {args.command}: error: {err}; free some space and rerun the same "
              "command (what was saved before is intact)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
