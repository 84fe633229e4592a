"""Issue 28: every file moelab reads is validated, nothing restarts silently, divergence is
caught before it is saved. Each example of the issue, run through `moelab.cli.main` in this
process (an exception escaping it is exactly what would print a traceback) on a private
copy of the session's small runs (conftest.small_runs)."""

import json
import math
import os
import shutil
import time

import numpy as np
import pytest
import yaml
from conftest import FUZZ_EVERY, FUZZ_STEPS, copy_runs

from moelab.cli import main
from moelab.data.shards import shard_path
from moelab.schema import MESSAGE_MAX, YAML_MAX_NODES, SchemaError, parse_yaml
from moelab.train.metrics import JsonlLog
from moelab.train.rundir import EVENTS_FILE, METRICS_FILE, WORKER_PID_FILE, RunDirLock
from moelab.train.spikes import plausible_loss_bound


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def steps(run) -> list[int]:
    return [r["step"] for r in JsonlLog(run / METRICS_FILE).read()]


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in JsonlLog(run / METRICS_FILE).read()}


def kinds(run) -> list[str]:
    return [e["kind"] for e in JsonlLog(run / EVENTS_FILE).read() if e["kind"] != "spike"]


@pytest.fixture
def root(small_runs, tmp_path, monkeypatch):
    return copy_runs(small_runs, tmp_path, monkeypatch)


def resume(capsys, run: str = "half", *extra: str) -> tuple[int, str, str]:
    return cli(capsys, "train", "--config", "config.yaml", "--run-dir", run, *extra)


# ------------------------------------------------------------------ malformed structure


@pytest.mark.parametrize("damage", ["renamed key", "list for mapping", "string size"])
def test_malformed_integrity_record_falls_back_to_the_older_checkpoint(root, capsys, damage):
    path = root / "half/checkpoints/8/integrity.json"
    record = json.loads(path.read_text())
    if damage == "renamed key":
        record = {"file": record["files"]}
    elif damage == "list for mapping":
        record["files"] = list(record["files"].items())
    else:
        first = next(iter(record["files"]))
        record["files"][first]["size"] = str(record["files"][first]["size"])
    path.write_text(json.dumps(record))
    code, out, err = cli(capsys, "checkpoint", "verify", "half")
    assert code == 1 and "step 8: BAD: integrity record malformed" in out, out
    code, out, err = resume(capsys)
    assert code == 0, err
    assert "checkpoint 8 is damaged: integrity record malformed" in err
    assert "resumed from checkpoint at step 4" in out
    assert steps(root / "half") == list(range(1, FUZZ_STEPS + 1))
    assert losses(root / "half") == losses(root / "full")  # trained from step 4's state


def test_checkpoint_whose_stored_step_differs_from_its_directory_is_damage(root, capsys):
    """checkpoints/4 renamed to 12: it would resume (and log) as step 12."""
    ckpts = root / "half/checkpoints"
    shutil.rmtree(ckpts / "8")
    os.replace(ckpts / "4", ckpts / "12")
    code, out, err = resume(capsys)
    assert code == 2, err  # the only checkpoint is damaged: nothing to fall back to
    assert "checkpoint 12 is damaged" in err and "stores step 4" in err and "directory is 12" \
        in err


def test_metrics_line_that_is_json_but_not_an_object(root, capsys):
    path = root / "half" / METRICS_FILE
    lines = path.read_text().splitlines(keepends=True)
    lines[2] = "[1, 2, 3]\n"
    path.write_text("".join(lines))
    line = one_line(resume(capsys)[2])
    assert "metrics.jsonl: line 3 should be a mapping" in line


@pytest.mark.parametrize("damage", ["not json", "list", "renamed key", "string vocab",
                                    "eos outside vocab", "source missing"])
def test_damaged_dataset_meta_is_one_line(root, capsys, damage):
    path = root / "data/meta.json"
    meta = json.loads(path.read_text())
    body = {"not json": "{", "list": "[]",
            "renamed key": json.dumps({**{k: v for k, v in meta.items() if k != "sources"},
                                       "source": meta["sources"]}),
            "string vocab": json.dumps({**meta, "vocab_size": "512"}),
            "eos outside vocab": json.dumps({**meta, "eos_id": meta["vocab_size"]}),
            "source missing": json.dumps({**meta, "val_tokens": {}})}[damage]
    path.write_text(body)
    code, _, err = resume(capsys)
    assert code == 2 and "meta.json" in one_line(err), err


def test_token_stream_replaced_by_a_pickle_is_refused_unread(root, capsys):
    """np.load(allow_pickle=True) would run the pickle: its __reduce__ touches a file."""
    canary = root / "pickle-ran"

    class Evil:
        def __reduce__(self):
            return (open, (str(canary), "w"))

    stream = shard_path(root / "data", "code", "train")
    with open(stream, "wb") as f:
        np.save(f, np.array([Evil()], dtype=object), allow_pickle=True)
    line = one_line(resume(capsys)[2])
    assert "not a .npy array" in line or "1-D integer array" in line, line
    assert not canary.exists()


def test_token_stream_of_floats_or_out_of_range_ids_is_refused(root, capsys):
    stream = shard_path(root / "data", "code", "train")
    np.save(stream, np.load(stream).astype(np.float32))
    assert "1-D integer array, not float32" in one_line(resume(capsys)[2])
    np.save(stream, np.full(1000, 10**6, np.int32))
    assert "token ids outside [0, 512)" in one_line(resume(capsys)[2])


def test_ladder_timings_and_lab_marker_of_the_wrong_shape(tmp_path):
    from moelab.ladder.results import TIMINGS_FILE, timings

    (tmp_path / TIMINGS_FILE).write_text(json.dumps({"rung": {"wall_s": "1"}}))
    with pytest.raises(SchemaError, match=r"rung.wall_s should be a finite number"):
        timings(tmp_path)


# ------------------------------------------------------------------ no silent restarts


def test_deleted_checkpoints_refuse_then_restart_from_scratch_archives(root, capsys):
    run = root / "half"
    before = (run / METRICS_FILE).read_bytes()
    shutil.rmtree(run / "checkpoints")
    code, _, err = resume(capsys)
    line = one_line(err)
    assert code == 2 and "metrics/events up to step 8" in line and "--restart-from-scratch" \
        in line
    assert (run / METRICS_FILE).read_bytes() == before  # nothing appended
    code, out, err = resume(capsys, "half", "--restart-from-scratch")
    assert code == 0, err
    archive = next(run.glob("history-*"))
    assert (archive / METRICS_FILE).read_bytes() == before  # archived, never appended to
    assert steps(run) == list(range(1, FUZZ_STEPS + 1))
    assert losses(run) == losses(root / "full")


def test_every_checkpoint_refused_on_the_last_start_refuses_the_next(root, capsys):
    run = root / "half"
    for step in (4, 8):
        (run / "checkpoints" / str(step) / "integrity.json").write_text("[]")
    code, _, err = resume(capsys)
    assert code == 2 and "every checkpoint" in err
    code, _, err = resume(capsys)  # both were moved aside: checkpoints/ is empty now
    assert code == 2 and "2 damaged checkpoint(s) in checkpoints.bad/" in one_line(err)
    assert steps(run) == list(range(1, 9))


def test_killed_before_the_first_checkpoint_starts_over_once(root, capsys):
    """Steps logged before any save are dropped and recomputed, never duplicated."""
    run = root / "early"
    run.mkdir()
    full = JsonlLog(root / "full" / METRICS_FILE).read()
    JsonlLog(run / METRICS_FILE).path.write_text(
        "".join(json.dumps(r) + "\n" for r in full[: FUZZ_EVERY - 1]))
    shutil.copy(root / "full/config.yaml", run / "config.yaml")
    code, _, err = resume(capsys, "early")
    assert code == 0, err
    assert steps(run) == list(range(1, FUZZ_STEPS + 1))
    assert losses(run) == losses(root / "full")
    assert kinds(run)[0] == "fresh_start"


def test_deleted_config_yaml_still_checks_identity_with_the_checkpoints_config(root, capsys):
    (root / "half/config.yaml").unlink()
    code, _, err = resume(capsys, "half", "--set", "optim.lr=0.01")
    line = one_line(err)
    assert code == 2 and "checkpoint 8 (config.yaml is missing)" in line and "optim.lr" in line


def test_a_checkpoint_copied_from_another_run_is_refused(root, capsys):
    shutil.rmtree(root / "half/checkpoints/8")
    shutil.copytree(root / "other/checkpoints/8", root / "half/checkpoints/8")
    code, _, err = resume(capsys)
    line = one_line(err)
    assert code == 2 and "checkpoint 8" in line and "train.seed" in line


# ------------------------------------------------------------------ divergence


def test_a_finite_divergence_is_never_saved(root, capsys):
    """lr 10: the loss leaves the plausible range while staying finite (the issue's 7e19)."""
    code, _, err = cli(capsys, "train", "--config", "config.yaml", "--run-dir", "hot",
                       "--set", "optim.lr=10.0", "--set", "optim.warmup_steps=0")
    assert code == 3, err
    refused = [e for e in JsonlLog(root / "hot" / EVENTS_FILE).read()
               if e["kind"] in ("save_refused", "nan")]
    assert refused, err
    assert "refused to save checkpoint" in err or "non-finite" in err
    from moelab.train.checkpoint import Checkpointer

    ckpt = Checkpointer(root / "hot", keep=100, writer=False)
    bound = plausible_loss_bound(512)
    logged = losses(root / "hot")
    for step in ckpt.steps():  # every kept checkpoint passed: its next logged loss is sane
        assert step + 1 not in logged or logged[step + 1] <= bound


def test_refused_save_names_the_last_checkpoint_that_passed(root, capsys, monkeypatch):
    """A loss above 3 ln(V) at the save of step 12 (forced): exit 3, checkpoint 8 named."""
    from moelab.train import trainer

    real = trainer.Trainer._implausible

    def at_12(self):
        return "forced by the test" if self.step == 12 else real(self)

    monkeypatch.setattr(trainer.Trainer, "_implausible", at_12)
    code, _, err = resume(capsys)
    assert code == 3 and "refused to save checkpoint 12: forced by the test" in err
    assert "checkpoint 8 is the last one that passed" in err
    assert kinds(root / "half")[-1] == "save_refused"
    assert sorted(int(p.name) for p in (root / "half/checkpoints").iterdir()) == [4, 8]


def test_param_bound_is_the_float32_overflow_of_a_sum_of_squares():
    import jax.numpy as jnp

    from moelab.train.checkpoint import param_bound

    n = 1000
    bound = param_bound([jnp.zeros(n)])
    assert math.isfinite(float(jnp.sum(jnp.full(n, bound * 0.99, jnp.float32) ** 2)))
    assert not math.isfinite(float(jnp.sum(jnp.full(n, bound * 1.01, jnp.float32) ** 2)))


# ------------------------------------------------------------------ arguments, messages


BAD_ARGS = [
    ["train", "--restart-backoff", "-1"], ["train", "--restart-backoff", "nan"],
    ["train", "--restart-backoff", "inf"], ["train", "--max-restarts", "-1"],
    ["train", "--max-restarts", "1e3"], ["train", "--max-restarts", str(10**30)],
    ["data", "prepare", "--out", "x", "--max-docs", "0"],
    ["data", "prepare", "--out", "x", "--max-docs", "-1"],
    ["data", "prepare", "--out", "x", "--workers", "0"],
    ["data", "prepare", "--out", "x", "--workers", "-1"],
    ["data", "prepare", "--out", "x", "--shard-docs", "0"],
    ["data", "prepare", "--out", "x", "--quality", "word_count=nan:"],
    ["data", "prepare", "--out", "x", "--quality", "word_count=5:1"],
]


@pytest.mark.parametrize("argv", BAD_ARGS, ids=" ".join)
def test_numeric_arguments_out_of_range_are_refused(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as stop:  # argparse's own refusal: usage line + error line, exit 2
        code = stop.code
    err = capsys.readouterr().err
    # argparse's usage (a few lines) then one error line
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"moelab {argv[0]}"), err
    assert not (tmp_path / "x").exists()


def test_generate_beyond_memory_is_one_line(root, capsys):
    code, _, err = cli(capsys, "generate", "--run-dir", "full", "--max-new-tokens", "1000000000")
    line = one_line(err)
    assert code == 2 and "KV cache" in line and "at most about" in line


def test_yaml_alias_bomb_is_refused_fast_and_briefly(tmp_path, capsys):
    """381 bytes that expand to 9**9 strings; refused before expanding (a bound on the
    nodes an expansion could reach, counted without expanding)."""
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        lines.append(f"{name}: &{name} [{','.join(['*' + prev] * 9)}]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    started = time.perf_counter()
    code, _, err = cli(capsys, "train", "--config", bomb, "--run-dir", tmp_path / "run")
    assert time.perf_counter() - started < 10  # seconds: a JAX import, not an expansion
    assert code == 2 and f"more than {YAML_MAX_NODES}" in one_line(err)
    assert len(err) < MESSAGE_MAX
    code, _, err = cli(capsys, "ladder", "plan", bomb)
    assert code == 2 and len(one_line(err)) < MESSAGE_MAX
    with pytest.raises(SchemaError, match="refers to the node that contains it"):
        parse_yaml("a: &a [*a]", "x.yaml")


def test_binary_ladder_spec_and_report_into_a_file(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe")
    code, _, err = cli(capsys, "ladder", "plan", spec)
    assert code == 2 and "not text" in one_line(err)
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, _, err = cli(capsys, "lab", "--lab", tmp_path / "lab.sqlite", "report", "exp-1",
                       "--out", afile)
    assert code == 2 and "is a file" in one_line(err) and afile.read_text() == "x"


def test_huge_values_are_quoted_briefly(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"model": {"d_model": ["x" * 100] * 1000}}))
    code, _, err = cli(capsys, "train", "--config", config, "--run-dir", tmp_path / "run")
    assert code == 2 and len(one_line(err)) < 400


# ------------------------------------------------------------------ logs and the lock


def test_two_torn_logs_keep_both_repair_events(root, capsys):
    run = root / "half"
    for name in (METRICS_FILE, EVENTS_FILE):
        with open(run / name, "a") as f:
            f.write('{"step": 9, "torn')
    code, _, err = resume(capsys)
    assert code == 0, err
    torn = [e["message"] for e in JsonlLog(run / EVENTS_FILE).read() if e["kind"] == "torn_line"]
    assert [m.split(":")[0] for m in torn] == [METRICS_FILE, EVENTS_FILE]
    assert steps(run) == list(range(1, FUZZ_STEPS + 1))


def test_a_supervisor_refused_by_the_lock_leaves_worker_pid_alone(root, capsys):
    (root / "half" / WORKER_PID_FILE).write_text("12345")
    with RunDirLock(root / "half"):
        code, _, err = resume(capsys, "half", "--max-restarts", "1")
    assert code == 2 and "in use by another trainer" in one_line(err)
    assert (root / "half" / WORKER_PID_FILE).read_text() == "12345"


@pytest.mark.parametrize("stored", ["[1, 2]", "{not json"])
def test_lab_record_of_the_wrong_shape_is_one_line(tmp_path, capsys, stored):
    import sqlite3

    from moelab.lab.store import Store

    lab = tmp_path / "lab.sqlite"
    with Store(lab) as store:
        exp = store.new_experiment("q", "h", {"optim": {"lr": 1e-3}}, None)
    with sqlite3.connect(lab) as db:
        db.execute("UPDATE experiments SET config = ? WHERE id = ?", (stored, exp))
    code, _, err = cli(capsys, "lab", "--lab", lab, "show", exp)
    assert code == 2 and f"experiment {exp}: config" in one_line(err)


def test_damaged_tokenizer_is_one_line(root, capsys):
    (root / "data/tokenizer.json").write_text('{"model": 1}')
    code, _, err = cli(capsys, "generate", "--run-dir", "full", "--max-new-tokens", "1")
    assert code == 2 and "tokenizer.json: not a tokenizer file" in one_line(err)
