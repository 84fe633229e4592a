"""Peak host memory of one forward+backward of the tiny preset at 1K/2K/4K tokens on CPU.

    PYTHONPATH=src python bench/attention_memory.py [--lengths 1024 2048 4096]

Each length runs in a fresh subprocess, which reports from /proc/self/status: VmHWM after
importing JAX and building the model (the floor) and after compiling and running one
jitted value_and_grad of the training loss on one sequence (compiler included); then the
RSS sampled every 0.5 ms during three more runs of the compiled step, whose rise over the
RSS before them is the step's own working memory (activations, gradients, buffers).
The causal attention runs in query chunks (model/attention.py: at most 8, each against
only the keys it can see), so the probabilities kept for the backward pass are the lower
triangle, ~S^2/2 per head: the table states that term beside the measurement, so what
grows quadratically is visible.

Writes bench/results/attention_memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, threading, time
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024  # MiB
import equinox as eqx, jax, jax.numpy as jnp
from moelab.config import load_config
from moelab.model import Transformer, objective
from moelab.model.attention import causal_chunks
s = int(sys.argv[1])
cfg = load_config(sys.argv[2], {"data.seq_len": s, "data.batch_size": 1})
model = Transformer.init(cfg.model, cfg.moe, jax.random.key(0))
tokens = jax.random.randint(jax.random.key(1), (1, s + 1), 0, cfg.model.vocab_size)
floor = status("VmHWM")
@eqx.filter_jit
def step(m, t):
    def loss(m):
        logits, stats, _ = m(t[:, :-1])
        return objective(logits, t[:, 1:], stats, cfg.loss)[0]
    return eqx.filter_value_and_grad(loss)(m)
jax.block_until_ready(step(model, tokens))  # compile + first run
with_compile = status("VmHWM")
before, peak, done = status("VmRSS"), [0.0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], status("VmRSS"))
        time.sleep(0.0005)
sampler = threading.Thread(target=sample)
sampler.start()
for _ in range(3):
    loss, grads = jax.block_until_ready(step(model, tokens))
done.set()
sampler.join()
print(json.dumps({"seq_len": s, "floor_mib": floor, "hwm_with_compile_mib": with_compile,
                  "rss_before_step_mib": before, "rss_peak_in_step_mib": peak[0],
                  "chunks": len(causal_chunks(s)), "loss": float(loss)}))
"""

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/attention_memory.json")
    args = parser.parse_args()
    preset = ROOT / "src/moelab/presets/tiny.yaml"
    rows = []
    for s in args.lengths:
        done = subprocess.run([sys.executable, "-c", CHILD, str(s), str(preset)],
                              capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        # the kept attention probabilities: lower triangle x heads x layers x 4 bytes
        row["triangle_probs_mib"] = s * (s + 1) / 2 * 4 * 2 * 4 / 2**20  # 4 heads, 2 layers
        row["step_mib"] = row["rss_peak_in_step_mib"] - row["rss_before_step_mib"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({"preset": "tiny", "batch": 1, "rows": rows}, indent=1)
                        + "\n")


if __name__ == "__main__":
    main()
