"""Peak host memory of one forward+backward of the tiny preset at 1K/2K/4K tokens on CPU.

    PYTHONPATH=src python bench/attention_memory.py [--lengths 1024 2048 4096]

Each length runs in a fresh subprocess, which reports from /proc/self/status: VmHWM after
importing JAX and building the model (the floor) and after compiling and running one
jitted value_and_grad of the training loss on one sequence (compiler included); then the
RSS sampled every 0.5 ms during three more runs of the compiled step, whose rise over the
RSS before them is the step's own working memory (activations, gradients, buffers). The
child runs with MALLOC_MMAP_THRESHOLD_=65536, so glibc serves large buffers by mmap and
returns them on free: otherwise the first run's peak stays resident and hides the rise.
Beside it, XLA's own figure: the compiled step's temp buffer size (memory_analysis), exact
and independent of load.

Past 512 tokens the causal attention runs its queries in 128-query sub-chunks inside a
checkpointed scan (model/attention.py), so the backward pass keeps q, k, v and recomputes
one sub-chunk's probabilities at a time instead of keeping the S^2/2 triangle: the table
states that triangle's size beside the measurement, to show it is not what grows.

Writes bench/results/benchmarks/attention_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
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
def value_and_grad(m, t):
    def loss(m):
        logits, stats, _ = m(t[:, :-1])
        return objective(logits, t[:, 1:], stats, cfg.loss)[0]
    return eqx.filter_value_and_grad(loss)(m)
step = eqx.filter_jit(value_and_grad)
params, static = eqx.partition(model, eqx.is_array)
plain = jax.jit(lambda p, t: value_and_grad(eqx.combine(p, static), t))
xla_temp_mib = plain.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes / 2**20
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
                  "chunks": len(causal_chunks(s)), "loss": float(loss), "xla_temp_mib":
                  xla_temp_mib}))
"""

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--out", type=Path,
                        default=ROOT / "bench/results/benchmarks/attention_memory.json")
    args = parser.parse_args()
    preset = ROOT / "src/moelab/presets/tiny.yaml"
    rows = []
    for s in args.lengths:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        done = subprocess.run([sys.executable, "-c", CHILD, str(s), str(preset)],
                              capture_output=True, text=True, check=True, env=env)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        # the kept attention probabilities: lower triangle x heads x layers x 4 bytes
        row["triangle_probs_mib"] = s * (s + 1) / 2 * 4 * 2 * 4 / 2**20  # 4 heads, 2 layers
        row["step_mib"] = row["rss_peak_in_step_mib"] - row["rss_before_step_mib"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps({
        "preset": "tiny", "batch": 1, "rss": "VmRSS sampled every 0.5 ms in a fresh "
        "subprocess (MALLOC_MMAP_THRESHOLD_=65536); VmHWM for the compile", "rows": rows},
        indent=1) + "\n")


if __name__ == "__main__":
    main()
