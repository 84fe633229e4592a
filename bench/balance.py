"""Aux-loss vs. bias balancing on the tiny preset: expert load and val loss at the end.

    python3 bench/balance.py [--runs runs/bench/balance] [--steps 300]

Trains the tiny preset seven ways (a run directory that already holds a finished run is
reused): `aux_loss` (the preset as it ships: softmax router, aux weight 0.01),
`bias_sign` (rate 0.01: 300 steps is short), `bias_quantile` (quantile_rate 0.1) and
`bias_quantile_hard` (rate 1, Marin's rule): sigmoid router, no aux loss, selection bias
moved after every step; and the sign rule plus DeepSeek-V3's sequence-wise aux loss at
weight 0.01, 0.03 and 0.1 (`loss.seq_aux_weight`). `--methods` runs a subset and keeps the
other methods' entries of the JSON. Then, on 20 training batches the runs never saw
(indices past the last step), the final model's expert loads per layer: max/mean per batch
(what a capacity dispatch feels) and of the 20 batches summed (what the bias can fix; the
rest is sequences of one batch sharing experts). Writes bench/results/balance_tiny.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np

from moelab.config import load_config
from moelab.data.loader import Loader
from moelab.train.checkpoint import load_latest
from moelab.train.cli import config_path
from moelab.train.trainer import train

RESULTS = Path(__file__).parent / "results" / "balance_tiny.json"
BIAS = {"moe.router": "sigmoid", "loss.aux_weight": 0.0}
METHODS = {
    "aux_loss": {},
    "bias_sign": {**BIAS, "moe.balance": "bias_sign", "moe.bias_rate": 0.01},
    "bias_quantile": {**BIAS, "moe.balance": "bias_quantile"},
    "bias_quantile_hard": {**BIAS, "moe.balance": "bias_quantile", "moe.quantile_rate": 1.0},
    # the sign rule plus DeepSeek-V3's sequence-wise loss against per-sequence concentration
    "bias_sign_seq_aux": {**BIAS, "moe.balance": "bias_sign", "moe.bias_rate": 0.01,
                          "loss.seq_aux_weight": 0.01},
    "bias_sign_seq_aux_0.03": {**BIAS, "moe.balance": "bias_sign", "moe.bias_rate": 0.01,
                               "loss.seq_aux_weight": 0.03},
    "bias_sign_seq_aux_0.1": {**BIAS, "moe.balance": "bias_sign", "moe.bias_rate": 0.01,
                              "loss.seq_aux_weight": 0.1},
}
HELD_OUT = 20


def finished(run: Path, steps: int) -> bool:
    log = run / "metrics.jsonl"
    return log.exists() and json.loads(log.read_text().splitlines()[-1])["step"] == steps


@eqx.filter_jit
def loads(model, batch):
    return model(batch[:, :-1])[1].tokens_per_expert  # [L_moe, E]


def measure(run: Path, steps: int) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    model, cfg, _ = load_latest(run)
    d = cfg.data
    loader = Loader(Path(d.path), "train", d.seq_len, d.batch_size, d.mixture, d.seed)
    held = np.stack([np.asarray(loads(model, jnp.asarray(loader.batch(steps + i))))
                     for i in range(HELD_OUT)])
    ratio = lambda a: a.max(-1) / a.mean(-1)
    layers = held.shape[1]
    val = {k: v for k, v in rows[-1].items() if k.startswith("val_loss/")}
    return {
        "val_loss": val, "val_loss_mean": float(np.mean(list(val.values()))),
        "last_step_max_over_mean": [rows[-1][f"expert_load_max_over_mean/layer_{i}"]
                                    for i in range(layers)],
        "last20_steps_max_over_mean": [float(np.mean(
            [r[f"expert_load_max_over_mean/layer_{i}"] for r in rows[-20:]]))
            for i in range(layers)],
        "held_out_per_batch_max_over_mean": ratio(held).mean(0).round(4).tolist(),
        "held_out_summed_max_over_mean": ratio(held.sum(0)).round(4).tolist(),
        "bias_range": [rows[-1].get(f"bias_range/layer_{i}") for i in range(layers)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default="runs/bench/balance")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS),
                        help="train/measure only these; the others keep their JSON entries")
    args = parser.parse_args()
    kept = json.loads(RESULTS.read_text())["methods"] if RESULTS.exists() else {}
    out = {name: kept[name] for name in METHODS if name in kept and name not in args.methods}
    for name in args.methods:
        overrides = METHODS[name]
        run = Path(args.runs) / name
        if not finished(run, args.steps):
            cfg = load_config(config_path("tiny"), {**overrides, "train.steps": args.steps})
            train(cfg, run)
        out[name] = {"overrides": overrides, **measure(run, args.steps)}
        print(name, json.dumps(out[name]))
    out = {name: out[name] for name in METHODS if name in out}
    base = out["aux_loss"]["val_loss_mean"]
    for name in out:
        out[name]["val_loss_vs_aux_pct"] = round(100 * (out[name]["val_loss_mean"] / base - 1), 3)
    RESULTS.write_text(json.dumps({"preset": "tiny", "steps": args.steps, "methods": out},
                                  indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
