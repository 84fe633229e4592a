"""Every bad input of issue 13's list ends in one line on stderr and exit 2, never a traceback.

Run through `moelab.cli.main` in this process: an exception escaping it is exactly what
would print a traceback, and none of these inputs gets as far as compiling anything.
"""

import pytest
import yaml

from moelab.cli import main
from moelab.config import load_config


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of `moelab ARGV`; argparse refuses an option's value itself, with
    its one-line usage error and SystemExit(2)."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


def config_file(tmp_path, body: str | bytes) -> str:
    path = tmp_path / "bad.yaml"
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return str(path)


BAD_CONFIGS = {
    "binary file": (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not text"),
    "empty file": ("", "is empty"),
    "d_model 1e12": ("model: {d_model: 1e12}", "model.d_model: expected int"),
    "vocab 2**40": (f"model: {{vocab_size: {2**40}}}", "model.vocab_size"),
    "steps 1e30": ("train: {steps: 1.0e+30}", "train.steps: expected int"),
    "steps 10**30": (f"train: {{steps: {10**30}}}", "train.steps: 1000000"),
    "eval_batches 0": ("train: {eval_batches: 0}", "train.eval_batches: must be > 0"),
    "eps -1": ("optim: {eps: -1}", "optim.eps: must be > 0"),
    "negative warmup": ("optim: {warmup_steps: -5}", "optim.warmup_steps: must be >= 0"),
    "negative weight decay": ("optim: {weight_decay: -0.1}", "optim.weight_decay"),
    "negative spike threshold": ("train: {spike_threshold: -1}", "train.spike_threshold"),
    "lr .inf": ("optim: {lr: .inf}", "optim.lr: must be a finite number"),
    "lr .nan": ("optim: {lr: .nan}", "optim.lr: must be a finite number"),
    "b2 1": ("optim: {b2: 1.0}", "optim.b2: must be in [0, 1)"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_file_is_one_line_and_exit_2(case, tmp_path, capsys):
    body, expected = BAD_CONFIGS[case]
    code, err = run_cli(capsys, "train", "--config", config_file(tmp_path, body),
                        "--run-dir", str(tmp_path / "run"))
    assert code == 2 and expected in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # refused before anything was written


BAD_ARGS = {
    "--set into a value": (["--set", "train.steps.x=3"], "train.steps is a value"),
    "--set unparsable": (["--set", "train.steps=[1,"], "not valid YAML"),
    "--set without =": (["--set", "train.steps"], "expects KEY=VALUE"),
    "--set lr .inf": (["--set", "optim.lr=.inf"], "optim.lr: must be a finite number"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_train_arguments_are_one_line_and_exit_2(case, tmp_path, capsys):
    extra, expected = BAD_ARGS[case]
    code, err = run_cli(capsys, "train", "--run-dir", str(tmp_path / "run"), *extra)
    assert code == 2 and expected in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv", [["train", "--run-dir"], ["data", "prepare", "--out"]])
def test_an_output_dir_naming_a_file_is_refused(argv, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = run_cli(capsys, *argv, str(afile))
    assert code == 2 and "is a file" in err and afile.read_text() == "x"


@pytest.mark.parametrize("argv, expected", [
    (["--temperature", "nan"], "--temperature: must be a finite number"),
    (["--max-new-tokens", "-5"], "--max-new-tokens: must be"),
])
def test_bad_generate_arguments(argv, expected, tmp_path, capsys):
    code, err = run_cli(capsys, "generate", "--run-dir", str(tmp_path), *argv)
    assert code == 2 and expected in err, err


def test_yaml11_exponent_strings_are_numbers(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim: {lr: 3e-4, eps: 1E-8}\n")  # PyYAML reads these as strings
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == "3e-4"
    cfg = load_config(path, {"optim.clip_norm": "2e0"})
    assert (cfg.optim.lr, cfg.optim.eps, cfg.optim.clip_norm) == (3e-4, 1e-8, 2.0)


def test_a_model_too_big_for_memory_is_refused_before_allocation(write_config, tmp_path,
                                                                 capsys):
    # 2**20 x 2**16 embedding alone: 2**36 params x 16 bytes of f32 state = 1 TiB, more
    # than any one device or host this test runs on has.
    config = write_config(model={"d_model": 2**16, "n_heads": 4, "n_kv_heads": 2,
                                 "vocab_size": 2**20})
    code, err = run_cli(capsys, "train", "--config", str(config), "--run-dir",
                        str(tmp_path / "run"))
    assert code == 2 and "GiB per device" in err and "model.d_model (65536)" in err, err


def test_a_path_error_no_check_foresaw_is_one_line(tmp_path, capsys, monkeypatch):
    """An OSError on a path that a command's own checks missed (here FileExistsError, a
    mkdir where a file lies, as a race would leave it) ends in one line and exit 2."""
    import errno

    import moelab.cli

    def mkdir_over_a_file(args):
        raise FileExistsError(errno.EEXIST, "File exists", str(tmp_path / "out"))

    monkeypatch.setattr(moelab.cli, "resolve_run_dir", mkdir_over_a_file)
    code, err = run_cli(capsys, "data", "stats", str(tmp_path))
    assert code == 2 and "File exists" in err and "choose a path" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
