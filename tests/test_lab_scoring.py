"""Which run a prediction is scored on, `moelab lab predict`, the measured outcome beside
the conclusion, and compute multipliers on the findings page."""

from __future__ import annotations

import pytest

from moelab import cli
from moelab.errors import UserError
from moelab.lab.report import MULTIPLIER, load_view, render_markdown
from moelab.lab.site import publish, render_experiment
from moelab.lab.store import Store


@pytest.fixture
def lab(monkeypatch, capsys, tmp_path):
    """(store path, run `moelab lab --lab <it> ARGS...` -> (code, stdout, stderr))."""
    monkeypatch.setattr(cli, "PARTS", ["moelab.lab.cli"])
    path = tmp_path / "lab.sqlite"

    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["lab", "--lab", str(path), *argv])
        out, err = capsys.readouterr()
        return code, out, err

    return path, run


def two_runs(store: Store, exp: str, first: float = 2.0, second: float = 3.0) -> None:
    """runs/a (run-1) ends at loss `first`, runs/b (run-2, started later) at `second`."""
    for run_dir, final in (("runs/a", first), ("runs/b", second)):
        run = store.start_run(exp, run_dir, {})
        store.log_metrics(run, 1, {"loss": final + 1})
        store.log_metrics(run, 2, {"loss": final})
        store.finish_run(run, "succeeded")


def test_a_prediction_is_scored_on_its_named_run_or_rule_not_on_run_order(lab):
    path, moelab = lab
    with Store(path) as store:
        exp = store.new_experiment("q", "h", {}, None)
    assert moelab("predict", exp, "named", "--value", "2", "--low", "1.9", "--high", "2.1",
                  "--run", "runs/a")[0] == 0
    for rule in ("best", "mean"):
        assert moelab("predict", exp, rule, "--value", "2", "--low", "1.9", "--high", "2.1",
                      "--rule", rule)[0] == 0
    with Store(path) as store:
        store.add_prediction(exp, "legacy", 2.0, 1.9, 2.1, {})  # names neither (old records)
        two_runs(store, exp)
        view = load_view(store, exp)
        scored = {p.name: view.scored(p) for p in view.predictions}
        assert scored["named"] == (2.0, "run run-1 (named)")  # not run-2, the last one
        assert scored["best"] == (2.0, "best of 2 runs (run-1)")
        assert scored["mean"][0] == pytest.approx(2.5)
        assert scored["legacy"][0] == 3.0 and "no run or rule named" in scored["legacy"][1]
        store.finish_experiment(exp, "succeeded", "the recipe works")
        publish(store, path.parent / "site")
        page = render_experiment(store, exp)
        markdown = render_markdown(load_view(store, exp))
    findings = (path.parent / "site" / "findings.html").read_text()
    assert "<td>run run-1 (named)</td>" in findings and "best of 2 runs (run-1)" in findings
    assert "Inside their interval: 2 of 4" in findings  # named, best 2.0; mean 2.5, legacy 3
    # the measured outcome and the conclusion are two separate facts
    assert "<dt>Outcome (measured)</dt><dd>named: predicted 2 [1.9, 2.1], observed 2 " in page
    assert "<dt>Conclusion</dt><dd>the recipe works</dd>" in page
    assert "- **Conclusion:** the recipe works" in markdown


def test_lab_predict_needs_a_run_or_a_rule_and_refuses_bad_input(lab, capsys):
    path, moelab = lab
    with Store(path) as store:
        exp = store.new_experiment("q", "h", {}, None)
    with pytest.raises(SystemExit) as exit_:  # argparse: neither --run nor --rule
        moelab("predict", exp, "p", "--value", "2", "--low", "1", "--high", "3")
    assert exit_.value.code == 2 and "one of the arguments --run --rule" in capsys.readouterr().err
    code, _, err = moelab("predict", exp, "p", "--value", "5", "--low", "1", "--high", "3",
                          "--rule", "best")
    assert code == 2 and err.count("\n") == 1 and "low <= value <= high" in err
    with Store(path) as store, pytest.raises(UserError, match="not both"):
        store.add_prediction(exp, "p", 2, 1, 3, {"run": "run-1", "rule": "best"})
    with Store(path) as store, pytest.raises(UserError, match="one of best, mean, last"):
        store.add_prediction(exp, "p", 2, 1, 3, {"rule": "median"})
    code, _, err = moelab("predict", exp, "p", "--value", "2", "--low", "1", "--high", "3",
                          "--rule", "best", "--metric", " ")  # never scorable, never changeable
    assert code == 2 and err.count("\n") == 1 and "prediction metric" in err
    with Store(path) as store:
        assert store.predictions(exp) == []


def test_multipliers_are_findings_with_intervals(lab):
    path, _ = lab
    with Store(path) as store:
        exp = store.new_experiment("moe vs dense", "MoE is worth > 1x dense compute", {}, None)
        run = store.start_run(exp, "runs/ladder/compare", {})
        pair = "theoretical/moe vs dense"
        store.log_metrics(run, 0, {f"{MULTIPLIER}/{pair}": 2.5, f"{MULTIPLIER}_low/{pair}": 1.8,
                                   f"{MULTIPLIER}_high/{pair}": 3.1})
        store.finish_run(run, "succeeded")
        publish(store, path.parent / "site")
    findings = (path.parent / "site" / "findings.html").read_text()
    assert "Compute multipliers (measured, with intervals)" in findings
    assert ("<td>MoE is worth &gt; 1x dense compute</td><td>run-1</td><td>moe vs dense</td>"
            "<td>theoretical</td><td>2.5x</td><td>[1.8, 3.1]</td><td>yes</td>") in findings
