"""Where the train step's time goes: XLA's own per-op profile, grouped by model part.

    python3 bench/profile_step.py [--steps 5] [--label NAME] [--set KEY=VALUE ...] [--force]

Two programs are profiled with `jax.profiler.trace`: the tiny preset's whole train step
(forward, backward, AdamW) and one MoE decoder block's forward + backward at the shape of
bench/vs_transformers.py. Every op XLA:CPU runs is an event in the trace, named after its
HLO instruction; the compiled HLO gives each instruction the JAX name stack it came from,
and the model's `jax.named_scope`s (attention, norm, router, dispatch, experts, dense_ffn,
embed, head, loss, optimizer) put it in a group. Per group: the op time (exclusive: a
loop's time excludes the ops of its body, which are counted where they belong) summed
over the threads that ran it, its share of all op time, and how much of it is matmuls
(instructions that are or contain a `dot`). Profiling adds a cost per op, so shares are
the figure to read, not absolute milliseconds; the step time beside them is measured
without the profiler, in the same run.

Results: bench/results/benchmarks/profile_step.json, one entry per --label (e.g. "before", "after"),
so a change is shown as two tables measured with the same script. `--set` changes the
tiny preset (dotted keys, YAML values: `--set model.scan_layers=true`), so an earlier
form of it can be profiled beside the current one. The process keeps freed memory
(`moelab.train.memory.keep_freed_memory`), as `moelab train` does; the entries labelled
"before" and "after" were written before it did.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import yaml
from machine import describe, load_per_core, matmul_peak, settle  # bench/machine.py
from train_step import setup  # bench/train_step.py

from moelab.config import Config, ModelConfig, MoEConfig, load_config
from moelab.model import Transformer
from moelab.train.cli import config_path
from moelab.train.memory import keep_freed_memory
from moelab.train.metrics import flops_per_token

RESULTS = Path(__file__).parent / "results" / "benchmarks" / "profile_step.json"
# the model's named scopes, innermost wins ("dispatch/experts" is "experts")
GROUPS = ("attention", "norm", "router", "dispatch", "experts", "dense_ffn", "embed", "head",
          "loss", "optimizer")
TOP = 6  # ops listed per group
SKIP = ("ThunkExecutor", "ThreadpoolListener", "end: ")  # runtime bookkeeping, not ops


def instructions(hlo: str) -> dict[str, tuple[str, bool, str]]:
    """{instruction name: (group, is a matmul, JAX name stack)} from a compiled module's
    HLO text."""
    called: dict[str, str] = {}  # computation name -> its body text
    name, body = None, []
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and "->" in line:
            if name:
                called[name] = "\n".join(body)
            name, body = head.group(1), []
        else:
            body.append(line)
    if name:
        called[name] = "\n".join(body)
    table = {}
    for m in re.finditer(r"%([\w.\-]+) = \S+ ([\w\-]+)\((.*)", hlo):
        inst, op, rest = m.groups()
        path = re.search(r'op_name="([^"]*)"', rest)
        group = _group(path.group(1) if path else "")
        calls = re.search(r"calls=%([\w.\-]+)", rest)
        matmul = op == "dot" or bool(calls and re.search(r"\sdot\(", called.get(calls.group(1),
                                                                                 "")))
        table[inst] = (group, matmul, path.group(1) if path else "")
    return table


def _group(op_name: str) -> str:
    """The innermost named scope of a JAX name stack, through transform wrappers
    ("transpose(jvp(head))/norm" is "norm"); the scanned layers' weight slicing and grad
    stacking is "layer_scan"."""
    words = re.findall(r"[A-Za-z_]+", op_name)
    group = next((w for w in reversed(words) if w in GROUPS), None)
    if group is None and ("dynamic_index_in_dim" in words or
                          "dynamic_update_index_in_dim" in words):
        return "layer_scan"
    return group or "other"


def exclusive_times(trace_dir: str) -> dict[str, float]:
    """{event name: exclusive seconds} summed over every thread of the host plane."""
    path = sorted(glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True))[-1]
    data = jax.profiler.ProfileData.from_file(path)
    totals: dict[str, float] = defaultdict(float)
    for plane in data.planes:
        if not plane.name.startswith("/host:CPU"):
            continue
        for line in plane.lines:
            events = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events
                             if not e.name.startswith(SKIP)), key=lambda e: (e[0], -e[1]))
            stack: list[list] = []  # [end, name, child time] of the enclosing events
            for start, duration, name in events:
                while stack and stack[-1][0] <= start:
                    end, outer, child = stack.pop()
                    totals[outer] -= child * 1e-9
                stack and stack[-1].__setitem__(2, stack[-1][2] + duration)
                totals[name] += duration * 1e-9
                stack.append([start + duration, name, 0.0])
            for _, outer, child in stack:
                totals[outer] -= child * 1e-9
    return totals


def profile(fn, args: tuple, steps: int) -> dict:
    """Run fn(*args) `steps` times under the profiler; the grouped table per call."""
    compiled = fn.lower(*args).compile()
    table = instructions(compiled.as_text())
    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as out:
        with jax.profiler.trace(out):
            for _ in range(steps):
                jax.block_until_ready(fn(*args))
        times = exclusive_times(out)
    groups: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "matmul_ms": 0.0})
    ops: dict[str, list] = defaultdict(list)
    unknown = 0.0
    for name, seconds in times.items():
        if name not in table:
            unknown += seconds
            continue
        group, matmul, where = table[name]
        groups[group]["ms"] += 1e3 * seconds / steps
        groups[group]["matmul_ms"] += 1e3 * seconds / steps * matmul
        ops[group].append((1e3 * seconds / steps, f"{name} <- {where}"))
    total = sum(g["ms"] for g in groups.values())
    rows = {k: {"ms": round(v["ms"], 3), "share": round(v["ms"] / total, 4),
                "matmul_share_of_group": round(v["matmul_ms"] / v["ms"], 3) if v["ms"] else 0,
                # where to look next: the group's costliest ops and the code they came from
                "top_ops": [f"{ms:.2f} ms {what}" for ms, what in sorted(ops[k])[::-1][:TOP]]}
            for k, v in sorted(groups.items(), key=lambda kv: -kv[1]["ms"])}
    matmul = sum(v["matmul_ms"] for v in groups.values())
    return {"op_ms_per_call_all_threads": round(total, 2), "matmul_share": round(matmul / total, 4),
            "groups": rows, "unmatched_event_ms": round(1e3 * unknown / steps, 3)}


def timed(fn, args: tuple, reps: int) -> float:
    """Median seconds of fn(*args) without the profiler."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def train_step_program(cfg: Config):
    import equinox as eqx

    model, opt_state, batch, step = setup(cfg, donate=False)  # bench/train_step.py's
    params, static = eqx.partition(model, eqx.is_array)
    jitted = step._jit(params, opt_state)  # the exact jitted program `moelab train` runs
    return jitted, (params, static, opt_state, batch)


def block_program(batch: int = 8, seq: int = 256, d_model: int = 256, d_ff: int = 512):
    """One MoE block, forward + backward of sum(out * g) (bench/vs_transformers.py's)."""
    import equinox as eqx

    from moelab.model.layers import rope_angles

    cfg = ModelConfig(vocab_size=512, d_model=d_model, n_layers=1, n_heads=4, n_kv_heads=2,
                      d_ff=d_ff)
    model = Transformer.init(cfg, MoEConfig(n_experts=8, top_k=2, dispatch="dropless"),
                             jax.random.key(0))
    block = model.blocks[0]
    x = jax.random.normal(jax.random.key(1), (batch, seq, d_model))
    g = jax.random.normal(jax.random.key(2), (batch, seq, d_model))
    cos, sin = rope_angles(jnp.broadcast_to(jnp.arange(seq), (batch, seq)), cfg.resolved_head_dim,
                           cfg.rope_theta)
    params, static = eqx.partition(block, eqx.is_array)

    def loss(params, x):
        out, _, _ = eqx.combine(params, static)(x, cos, sin)
        return jnp.sum(out * g)

    return jax.jit(jax.grad(loss, argnums=(0, 1))), (params, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="profiled calls of each program")
    parser.add_argument("--label", default="current", help="name of this table in the JSON")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change a field of the tiny preset (repeatable)")
    parser.add_argument("--force", action="store_true", help="write results on a busy machine")
    parser.add_argument("--settle", type=float, default=300.0, metavar="SECONDS",
                        help="wait at most this long for the machine to be quiet")
    args = parser.parse_args()
    keep_freed_memory()  # as the trainer does, before this process's first computation
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item!r}: write KEY=VALUE, e.g. model.scan_layers=true")
        overrides[key] = yaml.safe_load(value)
    before, waited = settle(args.settle)
    tiny = load_config(config_path("tiny"), overrides)
    step, step_args = train_step_program(tiny)
    block, block_args = block_program()
    peak = matmul_peak()
    step_s = timed(step, step_args, 10)
    tokens = tiny.data.batch_size * tiny.data.seq_len
    result = {
        "tiny_preset_changes": overrides,
        "keep_freed_memory": True,
        "train_step_tiny": {
            "step_ms_without_profiler": round(1e3 * step_s, 2),
            "tokens_per_s": round(tokens / step_s),
            "mfu_vs_measured_matmul_peak": round(tokens * flops_per_token(tiny) / step_s / peak, 4),
            **profile(step, step_args, args.steps)},
        "moe_block_fwd_bwd": {"ms_without_profiler": round(1e3 * timed(block, block_args, 7), 2),
                              "shape": "B8 S256 D256 F512 E8 top-2 dropless",
                              **profile(block, block_args, args.steps)},
        "matmul_peak_flops_per_s": peak,
    }
    result["machine"] = describe(before, load_per_core(), waited)
    for name in ("train_step_tiny", "moe_block_fwd_bwd"):
        part = result[name]
        print(f"\n{name}: matmuls {100 * part['matmul_share']:.1f}% of op time")
        print(f"  {'group':<12} {'ms/call':>9} {'share':>7} {'matmul':>7}")
        for group, row in part["groups"].items():
            print(f"  {group:<12} {row['ms']:>9.2f} {100 * row['share']:>6.1f}% "
                  f"{100 * row['matmul_share_of_group']:>6.1f}%")
    print(json.dumps({k: v for k, v in result.items() if k == "machine"}, indent=1))
    if result["machine"]["busy"] and not args.force:
        raise SystemExit("machine busy: results not written (rerun idle, or --force)")
    saved = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    saved[args.label] = result
    RESULTS.write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
