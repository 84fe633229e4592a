"""Structure checks for every file moelab reads back: its own and its users'.

A file can be whole (its bytes verify, its JSON parses) and still not be what the reader
expects: a renamed key, a list where a mapping was written, a string where a number was.
Reading such a file without checking its shape ends in a `KeyError` or `TypeError` far
from the file, or worse, in a wrong number. Every reader therefore states the shape it
needs as a small spec and calls `check`, which names the file, the place in it and what
is wrong in one bounded line (`SchemaError`, a `UserError`: exit 2; checkpoint loaders
catch it and fall back to an older good checkpoint).

A spec is one of:
    a type or a tuple of types      isinstance (bool is not accepted as int or float)
    {"key": spec, ...}              a mapping with at least these keys (more are fine)
    MapOf(spec)                     a mapping of str keys to values of one spec
    [spec]                          a list whose items all match spec
    Number                          a finite int or float (not bool)
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moelab.errors import UserError

if TYPE_CHECKING:
    import numpy as np

MESSAGE_LIMIT = 80  # characters of a value quoted in a message: enough to recognise it
MESSAGE_MAX = 2000  # an error line longer than this is cut: a message is read by a person
YAML_MAX_NODES = 100_000  # a config or spec is hundreds of nodes; an alias bomb is billions


class SchemaError(UserError):
    """A file that parses but does not have the structure its reader needs."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(bounded(f"{path}: {problem}"))
        self.path, self.problem = Path(path), problem


class MapOf:
    """Spec of a mapping from str keys to values of one spec."""

    def __init__(self, value: Any):
        self.value = value


class _Number:
    """Spec of a finite int or float."""


Number = _Number()


def brief(value: Any, limit: int = MESSAGE_LIMIT) -> str:
    """`repr(value)` cut to `limit` characters without building more than a little of it
    (reprlib caps nesting and items): a value from a file can be huge, or through YAML
    aliases exponentially large."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother, r.maxdict, r.maxlist = 2, 60, 60, 4, 4
    text = r.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def bounded(message: str, limit: int = MESSAGE_MAX) -> str:
    """One line of at most `limit` characters."""
    line = " ".join(message.split())
    return line if len(line) <= limit else line[: limit - 20] + f"... ({len(line)} chars)"


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    return f"{type(value).__name__} {brief(value, 40)}"


def _describe(spec: Any) -> str:
    if spec is Number:
        return "a finite number"
    if isinstance(spec, dict | MapOf):
        return "a mapping"
    if isinstance(spec, list):
        return "a list"
    types = spec if isinstance(spec, tuple) else (spec,)
    return " or ".join(t.__name__ for t in types)


def _problem(value: Any, spec: Any, where: str) -> str | None:
    """What is wrong with `value` at `where`, or None when it matches `spec`."""
    if spec is Number:
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value))
    elif isinstance(spec, dict | MapOf):
        ok = isinstance(value, dict)
    elif isinstance(spec, list):
        ok = isinstance(value, list)
    else:
        types = spec if isinstance(spec, tuple) else (spec,)
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        return f"{where or 'the top level'} should be {_describe(spec)}, not {_kind(value)}"
    if isinstance(spec, dict):
        for key, sub in spec.items():
            if key not in value:
                return f"{where + '.' if where else ''}{key} is missing"
            if (problem := _problem(value[key], sub, f"{where}.{key}" if where else key)):
                return problem
    elif isinstance(spec, MapOf):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where or 'the top level'} has a key {brief(key, 40)} that is not text"
            if (problem := _problem(item, spec.value, f"{where}.{key}" if where else key)):
                return problem
    elif isinstance(spec, list):
        for i, item in enumerate(value):
            if (problem := _problem(item, spec[0], f"{where}[{i}]")):
                return problem
    return None


def check(value: Any, spec: Any, path: str | Path, where: str = "") -> Any:
    """`value` if it matches `spec`, else a SchemaError naming `path` and the place."""
    problem = _problem(value, spec, where)
    if problem:
        raise SchemaError(path, problem)
    return value


def read_json(path: str | Path, spec: Any) -> Any:
    """The JSON in `path`, checked against `spec`; any fault is a SchemaError."""
    path = Path(path)
    try:
        value = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as err:
        raise SchemaError(path, f"not valid JSON ({type(err).__name__}: "
                                f"{bounded(str(err), 160)})") from None
    except IsADirectoryError:
        raise SchemaError(path, "is a directory, not a file") from None
    return check(value, spec, path)


def read_yaml(path: str | Path, what: str = "file") -> Any:
    """The YAML in `path` (safe types only), refusing alias bombs before they expand."""
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise SchemaError(path, f"the {what} is not text (a binary file?)") from None
    except IsADirectoryError:
        raise SchemaError(path, "is a directory, not a file") from None
    return parse_yaml(text, path, what)


def parse_yaml(text: str, path: str | Path, what: str = "file") -> Any:
    """`yaml.safe_load(text)` after checking that its aliases expand to at most
    YAML_MAX_NODES nodes (a few hundred bytes of nested aliases make billions)."""
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _expanded_size(node)
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SchemaError(path, f"the {what} is not valid YAML ({bounded(str(err), 300)})"
                          ) from None
    except RecursionError:
        raise SchemaError(path, f"the {what} nests too deeply") from None


def _expanded_size(root: Any) -> int:
    """Nodes of the YAML graph with every alias expanded, counted without expanding it
    (memoised per node); raises yaml.YAMLError when too large or self-referencing."""
    import yaml

    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise yaml.YAMLError("an alias refers to the node that contains it")
        active.add(key)
        if isinstance(node, yaml.MappingNode):
            n = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            n = 1 + sum(size(v) for v in node.value)
        else:
            n = 1
        active.discard(key)
        if n > YAML_MAX_NODES:
            raise yaml.YAMLError(f"its aliases expand to more than {YAML_MAX_NODES} values "
                                 "(nested aliases: a 'billion laughs' file?)")
        sizes[key] = n
        return n

    return 0 if root is None else size(root)


def load_tokens(path: str | Path, what: str = "token stream") -> np.ndarray:
    """A memory-mapped 1-D integer .npy array; never unpickles (allow_pickle=False)."""
    import numpy as np

    path = Path(path)
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise
    except (ValueError, OSError, EOFError) as err:
        raise SchemaError(path, f"the {what} is not a .npy array ({bounded(str(err), 160)}); "
                                "re-prepare the dataset") from None
    if not isinstance(tokens, np.ndarray) or tokens.ndim != 1 or \
            not np.issubdtype(tokens.dtype, np.integer):
        shape = getattr(tokens, "shape", "?")
        dtype = getattr(tokens, "dtype", type(tokens).__name__)
        raise SchemaError(path, f"the {what} should be a 1-D integer array, not {dtype} "
                                f"of shape {shape}; re-prepare the dataset")
    return tokens


# ------------------------------------------------------------------ command-line numbers


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse `type` accepting integers in [low, high]: argparse then refuses anything
    else with a one-line usage error (exit 2) instead of a crash later on."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {brief(text)}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_range(low, high)}, got {value}")
        return value

    return parse


def float_in(low: float, high: float | None = None) -> Callable[[str], float]:
    """An argparse `type` accepting finite numbers in [low, high] (no NaN, no inf)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {brief(text)}") from None
        if not math.isfinite(value) or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be a finite number {_range(low, high)}, "
                                             f"got {brief(text)}")
        return value

    return parse


def _range(low: float, high: float | None) -> str:
    return f">= {low}" if high is None else f"between {low} and {high}"


# ------------------------------------------------------------------ naming a run

RUN_DIR_HELP = "a training run directory"


def add_run_dir(p: argparse.ArgumentParser, required: bool = True, positional: bool = True,
                help: str = RUN_DIR_HELP) -> None:
    """The one way every command names a run: a positional RUN_DIR. `--run-dir` stays, for
    a release, as a deprecated alias (`resolve_run_dir` prints a one-line note)."""
    if positional:
        p.add_argument("run_dir", nargs="?", type=Path, metavar="RUN_DIR", help=help)
    p.add_argument("--run-dir", dest="run_dir_flag", type=Path, metavar="RUN_DIR",
                   help="deprecated alias of the positional RUN_DIR")
    p.set_defaults(run_dir=None, run_dir_required=required, run_dir_usage=p.prog)


def resolve_run_dir(args: argparse.Namespace) -> str | None:
    """Set args.run_dir from whichever form named it, refusing a missing or doubly-named
    run; returns the deprecation note for `--run-dir` (the CLI prints it after a command
    that succeeded, so an error stays one line), else None."""
    if not hasattr(args, "run_dir_flag"):
        return None
    flag, usage = args.run_dir_flag, args.run_dir_usage
    note = None
    if flag is not None:
        if args.run_dir is not None and Path(args.run_dir) != flag:
            raise UserError(f"two run directories given ({args.run_dir} and --run-dir "
                            f"{flag}); pass one: {usage} RUN_DIR")
        note = f"note: --run-dir is deprecated; name the run first: {usage} {flag} ..."
        args.run_dir = flag
    if args.run_dir is None and args.run_dir_required:
        raise UserError(f"no run directory given; usage: {usage} RUN_DIR [options]")
    return note
