"""What a run reports: FLOPs per token, MFU, and the JSONL metrics file.

FLOPs per token (training, forward + backward = 3x forward), after PaLM (Chowdhery et
al. 2022, appendix B):
    6 * N_active  +  12 * n_layers * n_heads * head_dim * seq_len
N_active counts the weights one token multiplies: attention projections, the router,
top_k routed experts (not all n_experts), the shared expert, dense FFNs, and the output
head. The embedding lookup is a gather, not a matmul, and is not counted. The second
term is attention's QK^T and AV, counted for the full (not causal-halved) square.
Multi-token prediction (mtp.depth modules) adds per module its projection [2D, D], one
dense block (attention included) and the shared output head: `mtp_params`, and one more
layer of the attention term. N_active (active_params) stays the served model's.
MFU = achieved FLOPs/s / peak FLOPs/s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax

from moelab.config import Config
from moelab.errors import UserError
from moelab.schema import check

# Nominal peaks when train.peak_flops is 0 (FLOP/s). CPU: a rough figure for two modern
# x86 cores in f32; set train.peak_flops for the machine you report on.
NOMINAL_PEAK = {"cpu": 1.0e11, "gpu": 9.89e14, "tpu": 2.75e14}


def active_params(cfg: Config) -> int:
    m, moe = cfg.model, cfg.moe
    hd = m.resolved_head_dim
    attn = m.d_model * hd * (2 * m.n_heads + 2 * m.n_kv_heads)
    routed = moe.top_k * 3 * m.d_model * m.d_ff + m.d_model * moe.n_experts
    shared = 3 * m.d_model * (moe.d_ff_shared or m.d_ff) if moe.shared_expert else 0
    dense = 3 * m.d_model * (m.d_ff_dense or m.d_ff * moe.top_k)
    n_moe = m.n_layers - m.n_dense_layers
    return (m.n_layers * attn + n_moe * (routed + shared) + m.n_dense_layers * dense
            + m.d_model * m.vocab_size)


def total_params(cfg: Config) -> int:
    """Every matmul weight, all experts and the embedding included (norm scales are not)."""
    m, moe = cfg.model, cfg.moe
    idle_per_layer = (moe.n_experts - moe.top_k) * 3 * m.d_model * m.d_ff
    idle_experts = (m.n_layers - m.n_dense_layers) * idle_per_layer
    embedding = 0 if m.tie_embeddings else m.vocab_size * m.d_model  # a tied head is counted
    return active_params(cfg) + idle_experts + embedding


def mtp_params(cfg: Config) -> int:
    """The weights one token multiplies in the MTP modules (training only)."""
    m = cfg.model
    attn = m.d_model * m.resolved_head_dim * (2 * m.n_heads + 2 * m.n_kv_heads)
    dense = 3 * m.d_model * (m.d_ff_dense or m.d_ff * cfg.moe.top_k)
    return cfg.mtp.depth * (2 * m.d_model * m.d_model + attn + dense + m.d_model * m.vocab_size)


def flops_per_token(cfg: Config) -> float:
    m = cfg.model
    layers = m.n_layers + cfg.mtp.depth  # each MTP module runs one block's attention
    attention = 12 * layers * m.n_heads * m.resolved_head_dim * cfg.data.seq_len
    return 6.0 * (active_params(cfg) + mtp_params(cfg)) + attention


def peak_flops(cfg: Config) -> float:
    if cfg.train.peak_flops > 0:
        return cfg.train.peak_flops
    per_device = NOMINAL_PEAK.get(jax.default_backend(), NOMINAL_PEAK["cpu"])
    return per_device * cfg.mesh.data * cfg.mesh.fsdp * cfg.mesh.expert


def mfu(cfg: Config, tokens_per_s: float) -> float:
    return tokens_per_s * flops_per_token(cfg) / peak_flops(cfg)


# What each line of metrics.jsonl / events.jsonl must hold: their readers (resume, the
# supervisor, the ladder) index these fields.
METRIC_SPEC = {"step": int}
EVENT_SPEC = {"step": int, "kind": str, "message": str}


class JsonlLog:
    """Append-only JSON lines, flushed and fsynced per record: a crash loses at most one.

    A write that fails part-way (a full disk) is cut back to the previous line, and a
    line torn by a kill mid-write is ignored by `read` and removed by `repair`, so one
    bad moment never makes the file unreadable.
    """

    def __init__(self, path: Path, spec: Any = dict):
        """`spec`: the structure every record must have (moelab.schema), checked on read."""
        self.path, self.spec = path, spec
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        with open(self.path, "ab") as f:
            end = f.tell()
            try:
                f.write((json.dumps(record) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
            except OSError:
                f.truncate(end)  # shrinking needs no space: leave no torn line behind
                raise

    def _lines(self) -> tuple[list[dict], int, bytes]:
        """(records of the whole lines, byte length they span, the torn tail if any)."""
        data = self.path.read_bytes() if self.path.exists() else b""
        records, good = [], 0
        lines = data.splitlines(keepends=True)
        for number, line in enumerate(lines, 1):
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no newline")
                if line.strip():
                    records.append(json.loads(line))
            except (ValueError, UnicodeDecodeError) as err:
                if number < len(lines):  # writes are appends: only the last can be torn
                    raise UserError(f"{self.path} line {number} is not JSON ({err}); it was "
                                    "edited by hand: fix or delete that line") from None
                break
            good += len(line)
            if line.strip():
                check(records[-1], self.spec, self.path, f"line {number}")
        return records, good, data[good:]

    def read(self) -> list[dict]:
        return self._lines()[0]

    def repair(self) -> bytes:
        """Cut a torn last line off the file; returns what was cut (b"" if nothing)."""
        _, good, tail = self._lines()
        if tail:
            with open(self.path, "r+b") as f:
                f.truncate(good)
                os.fsync(f.fileno())
        return tail

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (written after the checkpoint a run resumes from)."""
        kept = [r for r in self.read() if r.get("step", -1) <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)
