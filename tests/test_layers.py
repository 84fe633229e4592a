"""Dependencies run one way: the layer order declared once, in pyproject.toml's
[tool.importlinter], holds for src/moelab (every top-level package and module, imports
inside functions included), and an upward import breaks it."""

import shutil
import subprocess
import sys
from pathlib import Path

import moelab

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(moelab.__file__).parent
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports('pyproject.toml', no_cache=True, no_logo=True))")


def lint(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """import-linter in its own process: run in the test process, it leaves pytest's
    captured stdout closed for the tests after it."""
    return subprocess.run([sys.executable, "-c", LINT], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_declared_layers_hold():
    done = lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_an_upward_import_breaks_the_contract(tmp_path):
    """A copy of the package with one lazy import from model up into train must fail, and
    the report must name it: the test above is not vacuous."""
    shutil.copytree(PACKAGE, tmp_path / "src" / "moelab",
                    ignore=shutil.ignore_patterns("__pycache__", "presets", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    layers = tmp_path / "src" / "moelab" / "model" / "layers.py"
    layers.write_text(layers.read_text() + "\n\ndef _upward():\n"
                      "    from moelab.train import optimizer  # noqa: F401\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "src")}
    done = lint(tmp_path, env)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "moelab.model.layers -> moelab.train.optimizer" in done.stdout, done.stdout
