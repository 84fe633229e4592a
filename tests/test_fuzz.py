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

Surface cases (`surface_case`) reach the commands around training: export, export verify,
ladder run (spec and out dir), lab attach, eval and generate, each given damaged or foreign
files, output paths that are files, under files, someone else's, unwritable (simulated:
tests run as root, where mode bits do not stop writes, so `moelab.outputs.writable` is
patched) or oddly named, and arguments out of range. Besides "no traceback, a documented
exit code", each checks that no file outside the command's own output changed. `ladder
run` stops where training would start (run_ladder is replaced): its checks are the case.
"""

import json
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from unittest import mock

import pytest
import yaml
from conftest import FUZZ_STEPS, copy_runs
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from moelab.cli import main
from moelab.errors import EXIT_DIVERGED, EXIT_FAILED, EXIT_OK, EXIT_USER_ERROR
from moelab.schema import MESSAGE_MAX
from moelab.train.metrics import JsonlLog
from moelab.train.rundir import METRICS_FILE

FILE_CASES, ARG_CASES = 24, 60  # default CI run: ~1 minute of CPU on an idle machine
SLOW_FILE_CASES, SLOW_ARG_CASES = 60, 200  # about 3x the default run
SURFACE_CASES, SLOW_SURFACE_CASES = 160, 480  # most are refused before loading a model

# exit codes each command documents (README, errors.py)
ALLOWED = {"train": {EXIT_OK, EXIT_USER_ERROR, EXIT_DIVERGED},
           "checkpoint": {EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR},
           "generate": {EXIT_OK, EXIT_USER_ERROR}, "export": {EXIT_OK, EXIT_USER_ERROR},
           "data": {EXIT_OK, EXIT_USER_ERROR}, "ladder": {EXIT_OK, EXIT_USER_ERROR},
           "lab": {EXIT_OK, EXIT_USER_ERROR}, "eval": {EXIT_OK, EXIT_USER_ERROR},
           "verify": {EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR}}
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


# ------------------------------------------------------------------ surfaces around training

SURFACES = ("export", "verify", "ladder", "attach", "eval", "generate")
OUT_KINDS = ("new", "file", "under_file", "theirs", "ours", "unwritable", "unicode", "long",
             "dot", "devnull", "default")
BAD_NUMBERS = ["-1", "0", "nan", "inf", "-inf", "1e308", str(10**30), "abc", "", "3.5"]


def snapshot(root: Path, allowed: list[Path]) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file and directory under root outside the allowed outputs."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if not any(
            here / d == a or a in (here / d).parents for a in allowed)]
        for name in filenames:
            path = here / name
            if not any(path == a or a in path.parents for a in allowed):
                st = path.lstat()
                out[str(path.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def prepare_surfaces(root: Path, capfd) -> None:
    """An export of `full` (hf) and of `other` (hf-other), a lab with an experiment, a
    valid ladder spec, and the paths the output kinds name."""
    for run, out in (("full", "hf"), ("other", "hf-other")):
        assert main(["export", run, "--out", out]) == 0
    assert main(["lab", "--lab", "lab.sqlite", "new", "x", "--hypothesis", "h", "--config",
                 "config.yaml"]) == 0
    spec = {"base": yaml.safe_load((root / "config.yaml").read_text()), "seeds": [0, 1],
            "rungs": [{"name": f"r{d}", "model": {"d_model": d}} for d in (16, 24, 32)],
            "target": {"name": "big", "model": {"d_model": 32}, "train": {"steps": 400}},
            "fit": {"law": "compute"}}
    (root / "spec.yaml").write_text(yaml.safe_dump(spec))
    (root / "afile").write_text("x")
    (root / "theirs").mkdir()
    (root / "theirs" / "mine.txt").write_text("keep me")
    capfd.readouterr()


def out_path(root: Path, kind: str) -> Path | None:
    """An output path of the given kind (None: the command's default)."""
    return {"new": root / "outs" / "o", "file": root / "afile",
            "under_file": root / "afile" / "o", "theirs": root / "theirs",
            "ours": root / "ours", "unwritable": root / "outs" / "o",
            "unicode": root / "outs" / "ünï cödé ✓", "long": root / "outs" / ("x" * 300),
            "dot": root, "devnull": Path("/dev/null"), "default": None}[kind]


def surface_argv(root: Path, command: str, data) -> tuple[list[str], str, Path]:
    """(argv, the exit-code key, the run it reads) for one drawn case."""
    draw = data.draw
    run = draw(st.sampled_from(["full", "half", "half", "nope", "afile", "data"]), label="run")
    kind = draw(st.sampled_from(OUT_KINDS), label="out")
    out = out_path(root, kind)
    if kind == "ours":
        shutil.copytree(root / "hf", root / "ours")
    outs = ["--out", str(out)] if out is not None else []
    if command == "export":
        return ["export", run, *outs, *(["--force"] if draw(st.booleans()) else [])], \
            "export", root / run
    if command == "verify":
        export = draw(st.sampled_from(["hf", "hf", "hf-other", "nope", "afile", "theirs"]),
                      label="export")
        argv = ["export", "verify", run, "--export", export, *outs]
        if draw(st.booleans()):
            argv += [draw(st.sampled_from(["--bound", "--margin-tol"])),
                     draw(st.sampled_from(BAD_NUMBERS))]
        return argv, "verify", root / run
    if command == "ladder":
        spec = draw(st.sampled_from(["spec.yaml", "spec.yaml", "config.yaml", "afile",
                                     "nope.yaml", "data"]), label="spec")
        experiment = draw(st.sampled_from([None, "exp-1", "exp-9"]), label="experiment")
        return ["ladder", "run", spec, *outs, *(["--experiment", experiment] if experiment
                                                 else [])], "ladder", root / run
    if command == "attach":
        copy = root / "attached"
        copy.mkdir()
        for name in ("config.yaml", "metrics.jsonl", "events.jsonl"):
            if (root / "full" / name).exists():
                shutil.copy(root / "full" / name, copy / name)
        experiment = draw(st.sampled_from(["exp-1", "exp-1", "exp-9", ""]))
        target = draw(st.sampled_from(["attached", "attached", "nope", "afile", "data"]))
        return ["lab", "--lab", "lab.sqlite", "attach", target, "--experiment", experiment], \
            "lab", copy
    if command == "eval":
        action = draw(st.sampled_from(["bpb", "bpb", "tasks", "longctx"]), label="eval")
        argv = ["eval", action, run]
        if action == "longctx":  # a valid longctx is a long evaluation: bad values only
            option = draw(st.sampled_from(["--trials", "--max-multiple", "--original"]))
            return argv + [option, draw(st.sampled_from(BAD_NUMBERS[:8])),
                           *(["--out", str(out)] if out is not None else [])], "eval", \
                root / run
        if action == "tasks":  # the harness is slow to import: refused outputs only
            return argv + ["--out", str(out_path(root, draw(st.sampled_from(
                ["file", "under_file", "theirs", "dot", "devnull"]))))], "eval", root / run
        return argv + outs, "eval", root / run
    prompt = draw(st.sampled_from(["", "def ", b"caf\xe9".decode("utf-8", "surrogateescape"),
                                   "word " * 60_000, "\u2603" * 50]), label="prompt")
    argv = ["generate", run, "--prompt", prompt, "--max-new-tokens",
            draw(st.sampled_from(["1", "2", "0", "-1", "abc", str(10**12), "1e308"]))]
    if draw(st.booleans()):
        argv += [draw(st.sampled_from(["--temperature", "--top-p", "--seed"])),
                 draw(st.sampled_from(BAD_NUMBERS))]
    return argv, "generate", root / run


def surface_targets(root: Path, command: str) -> list[str]:
    """Files a command's case may find damaged: the inputs it reads."""
    if command == "verify":
        return sorted(f"hf/{p.name}" for p in (root / "hf").iterdir())
    if command == "ladder":
        return ["spec.yaml"]
    if command == "attach":
        return ["attached/config.yaml", "attached/metrics.jsonl", "lab.sqlite"]
    return [t for t in targets(root) if t.startswith(("half/", "data/"))]


def surface_case(root: Path, capfd, data, tally: Counter, backup: Path) -> None:
    command = data.draw(st.sampled_from(SURFACES), label="command")
    damaged = None
    try:
        argv, key, run = surface_argv(root, command, data)
        if data.draw(st.booleans(), label="damage"):
            damaged = data.draw(st.sampled_from(surface_targets(root, command)), label="target")
            path = root / damaged
            if path.is_dir():
                shutil.copytree(path, backup / "saved")
            elif path.exists():
                shutil.copy2(path, backup / "saved")
            mutate(root, damaged, data.draw(st.sampled_from(MUTATIONS), label="mutation"), data)
        run_surface(root, capfd, data, tally, command, argv, key, run)
    finally:  # back to the prepared state for the next case
        if damaged is not None:
            path = root / damaged
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            if (backup / "saved").exists():
                shutil.move(backup / "saved", path)
        for made in (root / "outs", root / "ours", root / "attached", root / "runs",
                     *(root / r / o for r in ("full", "half") for o in ("eval", "verify"))):
            if made.is_dir():
                shutil.rmtree(made)
        for run in ("full", "half"):
            (root / run / "longctx.json").unlink(missing_ok=True)


def run_surface(root: Path, capfd, data, tally: Counter, command: str, argv: list[str],
                key: str, run: Path) -> None:
    # what the command may write: its --out, its default outputs, the lab, an attached run
    given = [Path(argv[i + 1]) for i, a in enumerate(argv[:-1]) if a == "--out"]
    allowed = [*(p if p.is_absolute() else root / p for p in given),
               run / "eval", run / "verify", run / "longctx.json", root / "attached",
               root / "lab.sqlite", root / "lab.sqlite-wal", root / "lab.sqlite-shm",
               root / "lab.sqlite-journal", root / "runs"]
    before = snapshot(root, allowed)
    unwritable = str(out_path(root, "unwritable")) in argv and \
        data.draw(st.booleans(), label="unwritable")
    with mock.patch("moelab.ladder.runner.run_ladder", lambda *a, **k: {}):
        if unwritable:
            with mock.patch("moelab.outputs.writable", lambda path: False):
                code, _, err = run_cli(capfd, argv)
        else:
            code, _, err = run_cli(capfd, argv)
    check_exit(key, code, err)
    after = snapshot(root, allowed)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"{argv[:4]}: changed outside its output: {changed[:5]}"
    assert (root / "theirs" / "mine.txt").read_text() == "keep me"
    tally[f"surface {command} -> {code}"] += 1


def fuzz_surfaces(small_runs: Path, tmp_path: Path, monkeypatch, capfd, n: int) -> Counter:
    tally: Counter = Counter()
    root = copy_runs(small_runs, tmp_path / "surfaces", monkeypatch)
    monkeypatch.setenv("MOELAB_LAB", str(root / "lab.sqlite"))  # ladder run --experiment's
    prepare_surfaces(root, capfd)
    lab = (root / "lab.sqlite").read_bytes()
    backup = tmp_path / "backup"
    backup.mkdir()

    # no shrinking: a case costs up to seconds, and the failing draws are printed as drawn
    @settings(derandomize=True, database=None, deadline=None, print_blob=True,
              suppress_health_check=list(HealthCheck), max_examples=n,
              phases=[Phase.explicit, Phase.generate])
    @given(st.data())
    def surfaces(data) -> None:
        os.chdir(root)
        for stale in root.glob("lab.sqlite*"):  # a fresh lab per case: attach writes it
            stale.unlink()
        (root / "lab.sqlite").write_bytes(lab)
        surface_case(root, capfd, data, tally, backup)

    surfaces()
    return tally


def test_fuzz_surfaces(small_runs, tmp_path, monkeypatch, capfd):
    tally = fuzz_surfaces(small_runs, tmp_path, monkeypatch, capfd, SURFACE_CASES)
    report(tally, capfd)
    assert sum(tally.values()) >= 150  # hypothesis ran them (the bar)
    for command in SURFACES:  # every command was reached, and some cases succeeded
        assert any(k.startswith(f"surface {command} ") for k in tally), tally
    assert sum(v for k, v in tally.items() if k.endswith("-> 0")) > 0, tally


@pytest.mark.slow
@pytest.mark.extended
def test_fuzz_surfaces_long(small_runs, tmp_path, monkeypatch, capfd):
    tally = fuzz_surfaces(small_runs, tmp_path, monkeypatch, capfd, SLOW_SURFACE_CASES)
    report(tally, capfd)
    assert sum(tally.values()) >= SLOW_SURFACE_CASES // 2
