"""`moelab export verify`: golden forward files from moelab against the export in
transformers, for trained Qwen3-MoE and Glm4Moe runs; the parity rule on made-up outputs."""

import json

import numpy as np
import pytest

from moelab.cli import main
from moelab.eval.golden import compare, golden_record, input_lengths, log_softmax64


def _golden(logprobs: np.ndarray, margin: float) -> dict:
    """A one-input golden file: tokens 0..S-1, one MoE layer routing to experts (0, 1)."""
    s = logprobs.shape[0]
    layer = {"experts": np.tile([0, 1], (s, 1)), "weights": np.tile([0.6, 0.4], (s, 1)),
             "margin": np.full(s, margin)}
    return {"inputs": [golden_record(np.arange(s), logprobs, [layer], top_k=3)]}


def _outputs(logprobs: np.ndarray, experts) -> list[dict]:
    s = logprobs.shape[0]
    return [{"logprobs": logprobs,
             "layers": [{"experts": np.tile(experts, (s, 1)),
                         "weights": np.tile([0.6, 0.4], (s, 1))}]}]


def test_parity_rule_allows_near_ties_and_margin_flips_only():
    probs = np.array([[0.5, 0.3, 0.1, 0.1], [0.40001, 0.39999, 0.1, 0.1]])
    gold = log_softmax64(np.log(probs))
    same = compare(_golden(gold, margin=0.5), _outputs(gold, [0, 1]), "x", 1e-4, 1e-4)
    assert same.passed and same.max_prob_error < 1e-12
    # position 1: a near tie (gap 2e-5 < bound) flips its argmax: allowed, and counted
    tie = np.log(np.array([[0.5, 0.3, 0.1, 0.1], [0.39999, 0.40001, 0.1, 0.1]]))
    v = compare(_golden(gold, margin=0.5), _outputs(tie, [0, 1]), "x", 1e-4, 1e-4)
    assert v.argmax_differ == 1 and not v.argmax_bad and v.passed
    # a clear winner flipped: the probabilities are off and the argmax rule fails
    wrong = np.log(np.array([[0.3, 0.5, 0.1, 0.1], [0.40001, 0.39999, 0.1, 0.1]]))
    v = compare(_golden(gold, margin=0.5), _outputs(wrong, [0, 1]), "x", 1e-4, 1e-4)
    assert not v.passed and v.argmax_bad and v.max_prob_error == pytest.approx(0.2)
    # a route flip is explained only by a gold k vs k+1 margin within the tolerance
    assert compare(_golden(gold, margin=5e-5), _outputs(gold, [0, 2]), "x", 1e-4, 1e-4).passed
    v = compare(_golden(gold, margin=0.5), _outputs(gold, [0, 2]), "x", 1e-4, 1e-4)
    assert not v.passed and v.route_flips == 2 and "route flip" in v.problems()[0]


def test_inputs_straddle_the_training_length():
    assert input_lengths(32) == [1, 7, 31, 32, 33]
    assert input_lengths(128)[-3:] == [127, 128, 129]


@pytest.mark.parametrize("name,arch", [("qwen", "Qwen3MoeForCausalLM"),
                                       ("glm", "Glm4MoeForCausalLM")])
def test_verify_passes_on_the_export_of_a_trained_run(trained_runs, name, arch, capsys):
    pytest.importorskip("transformers")
    assert main(["export", "verify", str(trained_runs[name])]) == 0
    out = capsys.readouterr().out
    assert "[transformers] PASS" in out and "vLLM is not installed" in out
    report = json.loads((trained_runs[name] / "verify" / "verify.json").read_text())
    config = json.loads((trained_runs[name] / "verify" / "hf" / "config.json").read_text())
    assert config["architectures"] == [arch]
    (v,) = report["backends"]
    golden = json.loads((trained_runs[name] / "verify" / "golden.json").read_text())
    assert [len(r["tokens"]) for r in golden["inputs"]] == [1, 7, 31, 32, 33]
    assert len(golden["inputs"][0]["layers"]) == 2  # both layers are MoE layers
    # float32 on both sides, same weights: only summation order differs
    assert report["passed"] and v["max_prob_error"] <= 1e-4
    assert v["routes"] == 2 * sum(len(r["tokens"]) for r in golden["inputs"])
    assert v["route_flips"] == v["route_flips_explained"]


def test_verify_fails_on_a_perturbed_export(trained_runs, tmp_path, capsys):
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file

    run = trained_runs["qwen"]
    assert main(["export", "--run-dir", str(run), "--out", str(tmp_path / "hf")]) == 0
    weights = load_file(tmp_path / "hf" / "model.safetensors")
    name = "model.layers.1.mlp.gate.weight"
    # a router perturbed like a wrong conversion would: routes flip with a large margin
    weights[name] = weights[name] + np.random.default_rng(0).normal(
        0, 5 * weights[name].std(), weights[name].shape).astype(np.float32)
    save_file(weights, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    code = main(["export", "verify", str(run), "--export", str(tmp_path / "hf"),
                 "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err
    assert code == 1 and "moelab export verify: FAILED" in err and "route flip" in err
    assert not json.loads((tmp_path / "v" / "verify.json").read_text())["passed"]


def test_verify_bad_input_is_one_line(tmp_path, capsys):
    assert main(["export", "verify", str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert main(["export", "verify", str(tmp_path), "--backend", "vllm"]) == 2
    assert "GPU" in capsys.readouterr().err
