"""Fuzz: damaged files and wild arguments never end in a traceback, a duplicated or lost
metrics record, or a run trained from a state other than the one it reports.

File cases: a private copy of conftest.small_runs (a 16-step run `full`, its crash after
step 8 `half`, a run `other` of another seed, their dataset and config), one random
mutation of one file moelab reads (truncate, flip bytes, rename a key, change a value's
type, swap in the same file of the other run or a file of another kind, delete), then one
command on `half`: resume training, verify, generate, or dataset stats. Argument cases:
random values (wrong types, out of range, NaN/inf, huge, binary and missing files) for
every numeric or path argument of the commands. Everything runs through
`moelab.cli.main` in this process: an exception escaping it is what would have printed a
traceback. Hypothesis draws the cases from a fixed seed (derandomize), so a run is
reproducible; the default run is bounded in cases (see FILE_CASES, ARG_CASES and the
printed count) and the slow variant tries many more.
"""

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path

import pytest
import yaml
from conftest import FUZZ_STEPS, copy_runs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moelab.cli import main
from moelab.errors import EXIT_DIVERGED, EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR
from moelab.schema import MESSAGE_MAX
from moelab.train.metrics import JsonlLog
from moelab.train.rundir import METRICS_FILE

FILE_CASES, ARG_CASES = 24, 60  # default CI run: ~1 minute of CPU on an idle machine
SLOW_FILE_CASES, SLOW_ARG_CASES = 60, 200  # about 3x the default run

# exit codes each command documents (README, errors.py)
ALLOWED = {"train": {EXIT_OK, EXIT_USER_ERROR, EXIT_DIVERGED},
           "checkpoint": {EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR},
           "generate": {EXIT_OK, EXIT_USER_ERROR}, "export": {EXIT_OK, EXIT_USER_ERROR},
           "data": {EXIT_OK, EXIT_USER_ERROR}, "ladder": {EXIT_OK, EXIT_USER_ERROR},
           "lab": {EXIT_OK, EXIT_USER_ERROR}}
MUTATIONS = ("truncate", "flip", "rename_key", "change_type", "swap", "delete")
COMMANDS = ("train", "train", "verify", "generate", "stats")  # resuming matters most


def targets(root: Path) -> list[str]:
    """Every file (and checkpoint directory) a command on `half` reads, sorted."""
    run = root / "half"
    files = [p for p in run.rglob("*") if p.is_file() and "history-" not in str(p)]
    files += [run / "checkpoints" / "8", root / "config.yaml"]
    files += [p for p in (root / "data").rglob("*") if p.suffix in (".json", ".npy", ".parquet")]
    return sorted(str(p.relative_to(root)) for p in files)


def _mutate_tree(value, data, depth: int = 0):
    """A copy of a JSON/YAML value with one key renamed or one value's type changed."""
    if isinstance(value, dict) and value:
        key = data.draw(st.sampled_from(sorted(value, key=str)))
        if depth < 3 and isinstance(value[key], dict | list) and data.draw(st.booleans()):
            return {**value, key: _mutate_tree(value[key], data, depth + 1)}
        if data.draw(st.booleans()):
            rest = {k: v for k, v in value.items() if k != key}
            return {**rest, f"{key}_x": value[key]}  # a renamed key
        return {**value, key: _other_type(value[key], data)}
    if isinstance(value, list) and value:
        i = data.draw(st.integers(0, len(value) - 1))
        return value[:i] + [_mutate_tree(value[i], data, depth + 1)] + value[i + 1:]
    return _other_type(value, data)


def _other_type(value, data):
    options = [v for v in ("text", 7, -1, 2.5, None, [1, 2], {"a": 1}, True, 1e300)
               if type(v) is not type(value)]
    return data.draw(st.sampled_from(options))


def mutate(root: Path, target: str, how: str, data) -> None:
    path = root / target
    if how == "delete":
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        return
    if path.is_dir():  # a checkpoint directory: swap in the other run's, else delete
        shutil.rmtree(path)
        if how == "swap":
            shutil.copytree(root / target.replace("half/", "other/", 1), path)
        return
    raw = path.read_bytes()
    if how == "truncate":
        path.write_bytes(raw[: data.draw(st.integers(0, max(len(raw) - 1, 0)))])
    elif how == "flip":
        flipped = bytearray(raw)
        for _ in range(data.draw(st.integers(1, 4))):
            if flipped:
                i = data.draw(st.integers(0, len(flipped) - 1))
                flipped[i] ^= data.draw(st.integers(1, 255))
        path.write_bytes(bytes(flipped))
    elif how == "swap":
        twin = root / target.replace("half/", "other/", 1)
        if target.startswith("half/") and twin.is_file() and data.draw(st.booleans()):
            shutil.copy(twin, path)  # the same file of another run
        else:  # a file of another kind
            donors = [t for t in targets(root) if (root / t).is_file() and t != target]
            shutil.copy(root / data.draw(st.sampled_from(donors)), path)
    else:  # rename_key / change_type on structured text; bytes otherwise
        text = raw.decode(errors="replace")
        if path.suffix == ".jsonl":
            lines = text.splitlines()
            if not lines:
                return
            i = data.draw(st.integers(0, len(lines) - 1))
            lines[i] = json.dumps(_mutate_tree(json.loads(lines[i]), data))
            path.write_text("\n".join(lines) + "\n")
        elif path.suffix in (".json", ".yaml") or path.name in ("_METADATA", "metadata"):
            try:
                tree = yaml.safe_load(text) if path.suffix == ".yaml" else json.loads(text)
            except (ValueError, yaml.YAMLError):
                return
            changed = _mutate_tree(tree, data)
            path.write_text(yaml.safe_dump(changed) if path.suffix == ".yaml"
                            else json.dumps(changed))
        else:
            mutate(root, target, "flip", data)


def run_cli(capfd, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr); argparse's refusals (SystemExit 2) count as exits.
    Captured at the file descriptors: a supervised run's worker is a subprocess."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    out, err = capfd.readouterr()
    return code, out, err


def check_exit(command: str, code: int, err: str) -> None:
    assert "Traceback" not in err, err
    assert code in ALLOWED[command] or (code == 0 and command in ("checkpoint",)), (code, err)
    if code == EXIT_USER_ERROR:
        last = err.strip().splitlines()[-1]
        assert last.startswith("moelab ") and "error" in last, err
        assert len(last) <= MESSAGE_MAX + 100, len(last)  # "moelab <cmd>: error: " + message


def metrics_or_none(run: Path) -> list[dict] | None:
    try:
        return JsonlLog(run / METRICS_FILE).read()
    except Exception:  # noqa: BLE001 - a damaged file is what the case made; judged elsewhere
        return None


def check_file_case(root: Path, target: str, command: str, code: int, out: str,
                    before: list[dict] | None) -> None:
    """No record duplicated or lost, and a resumed run's new steps are those of the
    uninterrupted run from the state it reports (determinism makes it bitwise)."""
    after = metrics_or_none(root / "half")
    if command != "train" or after is None:
        return
    seen = [r["step"] for r in after]
    assert len(seen) == len(set(seen)), f"duplicated steps: {sorted(seen)}"
    if code != EXIT_OK:
        return
    resumed = re.search(r"resumed from checkpoint at step (\d+)", out)
    start = int(resumed.group(1)) if resumed else 0
    mine = {r["step"]: r for r in after}
    for r in before or []:  # what was logged up to the resumed state is kept as it was
        if r["step"] <= start and isinstance(r.get("step"), int):
            assert mine.get(r["step"]) == r, f"step {r['step']} lost or changed"
    assert set(range(start + 1, FUZZ_STEPS + 1)) <= set(mine)
    if target.startswith("data/") or target == "config.yaml":
        return  # the data or config itself changed: another run's losses, rightly
    reference = {r["step"]: r["loss"] for r in JsonlLog(root / "full" / METRICS_FILE).read()}
    for step in range(start + 1, FUZZ_STEPS + 1):
        assert mine[step]["loss"] == reference[step], \
            f"step {step} after resuming from {start}: not the state it reports"


def file_case(root: Path, capfd, data, tally: Counter) -> None:
    target = data.draw(st.sampled_from(targets(root)), label="target")
    how = data.draw(st.sampled_from(MUTATIONS), label="mutation")
    command = data.draw(st.sampled_from(COMMANDS), label="command")
    mutate(root, target, how, data)
    before = metrics_or_none(root / "half")
    argv = {"train": ["train", "--config", "config.yaml", "--run-dir", "half"],
            "verify": ["checkpoint", "verify", "half"],
            "generate": ["generate", "--run-dir", "half", "--max-new-tokens", "3"],
            "stats": ["data", "stats", "data"]}[command]
    code, out, err = run_cli(capfd, argv)
    check_exit(argv[0], code, err)
    check_file_case(root, target, command, code, out, before)
    tally[f"file {command} -> {code}"] += 1


# ------------------------------------------------------------------ arguments

NUMBERS = ["-1", "0", "1", "nan", "inf", "-inf", "1e308", str(10**30), "-0.0", "3.5",
           "abc", "", "0x10", "\x00\xff"]


def arg_case(root: Path, capfd, data, tally: Counter) -> None:
    files = {"binary": root / "binary.bin", "dir": root / "data", "missing": root / "nope",
             "good": root / "config.yaml", "bomb": root / "bomb.yaml",
             "long": root / ("x" * 200)}
    pick_file = st.sampled_from(sorted(files))
    value = st.one_of(st.sampled_from(NUMBERS), st.integers(-10**20, 10**20).map(str),
                      st.floats(allow_nan=True, allow_infinity=True).map(repr))
    kind = data.draw(st.sampled_from(["train", "prepare", "generate", "ladder", "report",
                                      "verify"]), label="command")
    if kind == "train":  # on the finished run: valid arguments resume it and stop at once
        argv = ["train", "--config", str(files[data.draw(pick_file)]), "--run-dir", "full"]
        for option in data.draw(st.lists(st.sampled_from(
                ["--max-restarts", "--restart-backoff", "--set"]), max_size=2, unique=True)):
            v = data.draw(value)
            argv += [option, f"{data.draw(st.sampled_from(['train.steps', 'optim.lr']))}={v}"
                     if option == "--set" else v]
    elif kind == "prepare":  # a glob matching nothing: never a real (slow) prepare
        option = data.draw(st.sampled_from(["--max-docs", "--workers", "--shard-docs",
                                            "--vocab-size", "--val-fraction", "--min-chars",
                                            "--near-dup-threshold"]))
        argv = ["data", "prepare", "--out", str(root / "new"), "--source",
                f"a={root}/nothing/*", option, data.draw(value)]
    elif kind == "generate":
        option = data.draw(st.sampled_from(["--max-new-tokens", "--temperature", "--top-p",
                                            "--seed"]))
        # a length that is valid and fits would really generate it: only wrong or huge ones
        length = st.sampled_from(["-1", "0", "1", "nan", "abc", "", "1e308", str(10**12),
                                  str(10**30), "\x00\xff"])
        argv = ["generate", "--run-dir", "full", option,
                data.draw(length if option == "--max-new-tokens" else value)]
        if option != "--max-new-tokens":
            argv += ["--max-new-tokens", "1"]
    elif kind == "ladder":
        argv = ["ladder", "plan", str(files[data.draw(pick_file)])]
    elif kind == "report":
        argv = ["lab", "--lab", str(root / "lab.sqlite"), "report", "exp-1", "--out",
                str(files[data.draw(pick_file)])]
    else:
        argv = ["checkpoint", "verify", str(files[data.draw(pick_file)])]
    code, _, err = run_cli(capfd, argv)
    check_exit(argv[0], code, err)
    tally[f"args {kind} -> {code}"] += 1


def prepare_arg_files(root: Path) -> None:
    (root / "binary.bin").write_bytes(bytes(range(256)) * 4)
    bomb = ['a: &a ["l","l","l","l","l","l","l","l","l"]']
    bomb += [f"{n}: &{n} [{','.join(['*' + p] * 9)}]" for p, n in zip("abcdefgh", "bcdefghi",
                                                                       strict=True)]
    (root / "bomb.yaml").write_text("\n".join(bomb) + "\n")


def fuzz(small_runs: Path, tmp_path: Path, monkeypatch, capfd, n_files: int,
         n_args: int) -> Counter:
    tally: Counter = Counter()
    fixed = settings(derandomize=True, database=None, deadline=None, print_blob=True,
                     suppress_health_check=list(HealthCheck))

    @settings(fixed, max_examples=n_files)
    @given(st.data())
    def files(data) -> None:
        root = copy_runs(small_runs, tmp_path / f"f{sum(tally.values())}", monkeypatch)
        try:
            file_case(root, capfd, data, tally)
        finally:
            os.chdir(tmp_path)
            shutil.rmtree(root, ignore_errors=True)

    # argument cases only read (or are refused before writing): one copy serves them all
    root = copy_runs(small_runs, tmp_path / "args", monkeypatch)
    prepare_arg_files(root)

    @settings(fixed, max_examples=n_args)
    @given(st.data())
    def arguments(data) -> None:
        os.chdir(root)
        arg_case(root, capfd, data, tally)

    files()
    arguments()
    return tally


def report(tally: Counter, capfd) -> None:
    with capfd.disabled():
        print(f"\nfuzz: {sum(tally.values())} cases: " +
              ", ".join(f"{k} x{v}" for k, v in sorted(tally.items())))


def test_fuzz_files_and_arguments(small_runs, tmp_path, monkeypatch, capfd):
    tally = fuzz(small_runs, tmp_path, monkeypatch, capfd, FILE_CASES, ARG_CASES)
    report(tally, capfd)
    assert sum(tally.values()) >= (FILE_CASES + ARG_CASES) // 2  # hypothesis ran them
    assert tally["file train -> 0"] > 0  # some resumes really trained, and were checked


@pytest.mark.slow
def test_fuzz_files_and_arguments_long(small_runs, tmp_path, monkeypatch, capfd):
    tally = fuzz(small_runs, tmp_path, monkeypatch, capfd, SLOW_FILE_CASES, SLOW_ARG_CASES)
    report(tally, capfd)
    assert sum(tally.values()) >= (SLOW_FILE_CASES + SLOW_ARG_CASES) // 2
