"""What the training core costs on this machine, measured side by side in one run.

    python3 bench/train_step.py [--steps 40] [--force]

1. Compile time of the whole train step (forward, backward, AdamW) at 2, 8 and 16 layers
   of the tiny preset's shape, with layers scanned vs unrolled.
2. The tiny preset's training throughput: tokens/s over `--steps` donated, asynchronous
   steps (timed after a real sync), and MFU against this machine's *measured* float32
   matmul peak (a 2048^2 jnp.dot timed in this same run), not a nominal figure.
3. Bytes of parameters + optimizer state held by one device on 8 fake CPU devices, fsdp 1
   vs fsdp 8 (a subprocess, since the device count is fixed when jax starts).
4. What `keep_freed_memory` (moelab/train/memory.py, applied by the trainer) is worth: the
   tiny preset's throughput and minor page faults per step in fresh processes with glibc's
   default malloc and with the setting, alternating, 3 of each (a process-wide setting
   cannot be switched off inside one process). Parts 1, 2 and 5 run with it, as `moelab
   train` does.
5. The tiny preset against its earlier form, side by side in this process: layers scanned
   and the blocked expert kernel (before 2026-12-05), layers unrolled, and the preset
   (unrolled, the slab kernel). `--rounds` rounds of `--steps / 4` steps of each,
   alternating, with two 2048^2 matmuls timed in every round; per form the median step
   time, and the MFU as the median over rounds of each round's against that round's peak.

The load average is recorded before and after; on a busy machine (above 0.5 per core) the
run refuses to write results unless given --force, since timings would be distorted.
Results: bench/results/benchmarks/train_step.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import equinox as eqx
import jax
from machine import (  # bench/machine.py
    describe,
    load_per_core,
    matmul_peak,
    matmul_timer,
    refuse_if_busy,
    settle,
)

from moelab.config import Config, load_config, replace
from moelab.model import Transformer
from moelab.train.cli import config_path
from moelab.train.memory import keep_freed_memory
from moelab.train.metrics import flops_per_token
from moelab.train.optimizer import make_optimizer, trainable
from moelab.train.step import make_train_step

RESULTS = Path(__file__).parent / "results" / "benchmarks" / "train_step.json"


def setup(cfg: Config, donate: bool = True):
    """The tiny preset's model, optimizer state, one batch and its train step (`moelab
    train`'s own, donating its inputs unless told not to)."""
    model = Transformer.init(cfg.model, cfg.moe, jax.random.key(0))
    optimizer = make_optimizer(cfg.optim, cfg.train.steps, None)
    opt_state = optimizer.init(trainable(model))
    batch = jax.random.randint(jax.random.key(1), (cfg.data.batch_size, cfg.data.seq_len + 1),
                               0, cfg.model.vocab_size)
    return model, opt_state, batch, make_train_step(cfg, optimizer, donate)


def compile_seconds(cfg: Config) -> float:
    model, opt_state, batch, step = setup(cfg)
    t = time.perf_counter()
    step.lower(model, opt_state, batch).compile()
    return time.perf_counter() - t


def run_steps(state: list, steps: int) -> float:
    """Seconds per step of `steps` steps from `state` = [model, opt_state, batch, step]
    (after a sync), which is left holding the new model and optimizer state."""
    model, opt_state, batch, step = state
    t = time.perf_counter()
    for _ in range(steps):
        model, opt_state, parts = step(model, opt_state, batch)
    jax.block_until_ready((model, opt_state, parts))
    state[0], state[1] = model, opt_state
    return (time.perf_counter() - t) / steps


def throughput(cfg: Config, steps: int) -> dict:
    state = list(setup(cfg))
    run_steps(state, 1)  # compile
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    seconds = run_steps(state, steps)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps
    tokens_per_s = cfg.data.batch_size * cfg.data.seq_len / seconds
    return {"step_ms": 1e3 * seconds, "tokens_per_s": tokens_per_s,
            "flops_per_s": tokens_per_s * flops_per_token(cfg), "minor_faults_per_step": faults}


def malloc_compare(steps: int, rounds: int = 3) -> dict:
    """The tiny preset's throughput in fresh processes, glibc's default malloc vs
    `keep_freed_memory`, alternating (this file with --throughput-only MODE)."""
    runs: dict[str, list[dict]] = {"default": [], "kept": []}
    for _ in range(rounds):
        for mode in runs:
            done = subprocess.run([sys.executable, __file__, "--throughput-only", mode,
                                   "--steps", str(steps)], capture_output=True, text=True,
                                  check=True)
            runs[mode].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"malloc {mode:8s} {runs[mode][-1]['tokens_per_s']:8.0f} tokens/s, "
                  f"{runs[mode][-1]['minor_faults_per_step']:7.0f} minor faults a step", flush=True)
    median = {m: statistics.median(r["tokens_per_s"] for r in v) for m, v in runs.items()}
    return {"runs": runs, "median_tokens_per_s": median,
            "speed_kept_over_default": median["kept"] / median["default"]}


FORMS = {  # name -> model / moe changes to the tiny preset
    "scanned_blocked": {"model": {"scan_layers": True}, "moe": {"dropless_impl": "blocked"}},
    "unrolled_blocked": {"model": {"scan_layers": False}, "moe": {"dropless_impl": "blocked"}},
    "preset": {},
}


def forms_compare(cfg: Config, steps: int, rounds: int) -> dict:
    """Step time and MFU of the FORMS of `cfg`, rounds alternating."""
    forms = {name: list(setup(replace(cfg, **changes))) for name, changes in FORMS.items()}
    for state in forms.values():
        run_steps(state, 1)  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in forms}
    peak_rate, peaks = matmul_timer(), []
    for _ in range(rounds):
        peaks += [peak_rate(), peak_rate()]
        for name, state in forms.items():
            times[name].append(run_steps(state, steps))
    median = {name: statistics.median(t) for name, t in times.items()}
    # each round's MFU against the peak timed in that round (the machine's speed drifts by
    # several % within a minute, and a round's steps and matmuls see the same drift)
    flops_per_step = cfg.data.batch_size * cfg.data.seq_len * flops_per_token(cfg)
    round_peak = [statistics.mean(peaks[2 * r:2 * r + 2]) for r in range(rounds)]
    mfu = {name: statistics.median(flops_per_step / t / p
                                   for t, p in zip(v, round_peak, strict=True))
           for name, v in times.items()}
    for name in forms:
        print(f"{name:17s} {1e3 * median[name]:6.1f} ms a step, MFU {mfu[name]:.1%} (median "
              f"of {rounds} rounds)", flush=True)
    print(f"median matmul peak between them {statistics.median(peaks) / 1e9:.0f} GFLOP/s")
    return {"forms": FORMS, "steps_per_round": steps, "rounds": rounds,
            "step_ms": {name: [round(1e3 * t, 2) for t in v] for name, v in times.items()},
            "median_step_ms": {name: round(1e3 * t, 2) for name, t in median.items()},
            "speed_over_scanned_blocked": {name: median["scanned_blocked"] / t
                                           for name, t in median.items()},
            "matmul_peak_flops_per_s": {"median": statistics.median(peaks), "each": peaks},
            "mfu_vs_peak_of_same_round": mfu}


def fsdp_bytes() -> dict:
    """Run this file with --fsdp-bytes on 8 fake devices; parse its JSON line."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__, "--fsdp-bytes"], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_fsdp_bytes() -> None:
    from moelab.parallel.mesh import init_sharded, make_mesh

    cfg = load_config(config_path("tiny"))
    device, out = jax.devices()[0], {}
    for fsdp in (1, 8):
        mesh = make_mesh(dataclasses.replace(cfg.mesh, fsdp=fsdp))
        model = init_sharded(lambda k: Transformer.init(cfg.model, cfg.moe, k), mesh,
                             jax.random.key(0))
        opt_state = init_sharded(make_optimizer(cfg.optim, 10, None).init, mesh, trainable(model))
        leaves = jax.tree.leaves(eqx.filter((model, opt_state), eqx.is_array))
        out[f"fsdp{fsdp}"] = sum(s.data.nbytes for a in leaves for s in a.addressable_shards
                                 if s.device == device)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps (default 40)")
    parser.add_argument("--rounds", type=int, default=10,
                        help="alternating rounds of the tiny preset's forms (default 10)")
    parser.add_argument("--force", action="store_true",
                        help="write results even if the machine is busy")
    parser.add_argument("--fsdp-bytes", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--throughput-only", choices=("default", "kept"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.fsdp_bytes:
        return measure_fsdp_bytes()
    if args.throughput_only:
        applied = args.throughput_only == "kept" and keep_freed_memory()
        print(json.dumps({**throughput(load_config(config_path("tiny")), args.steps),
                          "keep_freed_memory": applied}))
        return None
    keep_freed_memory()  # as the trainer does, before this process's first computation
    load_before, waited = settle()
    tiny = load_config(config_path("tiny"))
    compile_s = {}
    for layers in (2, 8, 16):
        for scan in (True, False):
            cfg = replace(tiny, model={"n_layers": layers, "scan_layers": scan})
            name = f"{'scan' if scan else 'unrolled'}/{layers}"
            compile_s[name] = compile_seconds(cfg)
            print(f"compile {name:12s} {compile_s[name]:6.1f} s", flush=True)
    malloc = malloc_compare(args.steps)
    forms = forms_compare(tiny, max(args.steps // 4, 1), args.rounds)
    peak = matmul_peak()
    speed = throughput(tiny, args.steps)
    speed["mfu_vs_measured_matmul_peak"] = speed["flops_per_s"] / peak
    malloc["mfu_vs_measured_matmul_peak"] = {  # of the fresh processes' medians
        mode: tokens_per_s * flops_per_token(tiny) / peak
        for mode, tokens_per_s in malloc["median_tokens_per_s"].items()}
    memory = fsdp_bytes()
    load_after = load_per_core()
    result = {
        "compile_s": compile_s,
        "compile_ratio_16_over_2": {k: compile_s[f"{k}/16"] / compile_s[f"{k}/2"]
                                    for k in ("scan", "unrolled")},
        "matmul_peak_flops_per_s": peak,
        "tiny_preset": speed,
        "param_opt_bytes_per_device": memory,
        "fsdp8_over_fsdp1": memory["fsdp8"] / memory["fsdp1"],
        "keep_freed_memory": malloc,
        "tiny_preset_vs_earlier_forms": forms,
        "machine": describe(load_before, load_after, waited),
    }
    print(json.dumps(result, indent=2))
    refuse_if_busy(result["machine"], args.force)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
