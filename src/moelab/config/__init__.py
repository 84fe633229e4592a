"""Typed, frozen configs for every part of moelab, loaded from YAML and validated up front.

One flat-ish tree of dataclasses (MaxText style): every knob is declared once, with its
meaning next to it. Loading checks unknown keys, types and impossible shapes *before*
anything is compiled, and every error names the field and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from moelab.config.plan import Plan, StageConfig, build_plan
from moelab.errors import ConfigError
from moelab.schema import SchemaError, brief, read_yaml


@dataclass(frozen=True)
class RopeConfig:
    """How rotary frequencies derive from model.rope_theta: context extension (model/rope.py).

    Defaults are the published ones (Levanter / transformers): llama3 low 1, high 4; yarn
    beta_fast 32, beta_slow 1, attention temperature 0.1 ln(factor) + 1.
    """

    # default: plain RoPE; linear: position interpolation; ntk: static NTK-aware theta;
    # llama3: Llama 3.1's per-wavelength blend; yarn: ramped blend + attention temperature
    type: Literal["default", "linear", "ntk", "llama3", "yarn"] = "default"
    factor: float = 1.0  # extension ratio (new context / original context); > 0
    original_max_position_embeddings: int = 0  # the pre-training context; llama3/yarn need it
    low_freq_factor: float = 1.0  # llama3: wavelengths > original / this are divided by factor
    high_freq_factor: float = 4.0  # llama3: wavelengths < original / this are untouched
    beta_fast: float = 32.0  # yarn: pairs turning more than this often are extrapolated ...
    beta_slow: float = 1.0  # ... those turning fewer times interpolated (divided by factor)
    attention_factor: float = 0.0  # yarn: cos/sin multiplier; 0 = 0.1 ln(factor) + 1


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only transformer."""

    vocab_size: int = 4096  # must be >= the tokenizer's vocabulary
    d_model: int = 128  # residual stream width
    n_layers: int = 2
    n_heads: int = 4  # query heads
    n_kv_heads: int = 2  # key/value heads (GQA); must divide n_heads
    head_dim: int = 0  # 0 means d_model // n_heads
    d_ff: int = 256  # hidden width of each routed expert (SwiGLU)
    n_dense_layers: int = 0  # the first layers use a dense SwiGLU instead of MoE
    d_ff_dense: int = 0  # hidden width of dense layers; 0 means d_ff * top_k
    rope_theta: float = 10000.0  # RoPE base; model.rope says how an extension rescales it
    rope: RopeConfig = field(default_factory=RopeConfig)
    # multiplies every attention logit (Marin's qk_mult): a long-context stage raises it,
    # as YaRN's temperature does, to keep attention sharp over more keys
    attn_logit_scale: float = 1.0
    norm_eps: float = 1e-6
    qk_norm: bool = True  # RMSNorm on queries and keys per head: the loss-spike fix
    tie_embeddings: bool = False
    init_std: float = 0.02
    # Repeated layers are stacked on a leading axis either way; scan_layers runs them with
    # jax.lax.scan (compile time independent of depth), false unrolls a Python loop.
    scan_layers: bool = True
    # Rematerialization of each layer in the backward pass: "none" keeps every activation,
    # "full" keeps only the layer's input, "save_moe" also keeps the routing and the MoE
    # dispatch/combine results so routing (and expert-parallel exchanges) are not redone.
    remat: Literal["none", "full", "save_moe"] = "none"
    # Causal attention without a KV cache (training, eval). "dense": query chunks, each
    # against every key it can see, softmax probabilities materialized (past 512 tokens in
    # checkpointed 128-query sub-chunks). "chunked": key/value blocks of attention_chunk
    # positions with an online softmax and a backward that recomputes each block
    # (model/flash.py): no [S, S] array, memory linear in the sequence. Same numbers up to
    # float32 summation order. A stage may switch it (stages[i].model).
    attention_impl: Literal["dense", "chunked"] = "dense"
    attention_chunk: int = 256  # chunked: query and key positions per block

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads


@dataclass(frozen=True)
class MoEConfig:
    """Routing and dispatch of the mixture-of-experts layers."""

    n_experts: int = 8
    top_k: int = 2
    router: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: bool = True  # renormalize the k selected weights to sum to 1
    routed_scaling: float = 1.0  # multiplies the routed weights (DeepSeek-V3/GLM-4.5 style)
    # Group-limited top-k (DeepSeek-V3): the experts form n_group equal groups, each scored
    # by the sum of its two best (biased) scores; only the topk_group best groups' experts
    # can be chosen. 1 / 1 = every expert eligible (no groups)
    n_group: int = 1
    topk_group: int = 1
    # aux_loss: only loss.aux_weight balances. bias_sign / bias_quantile: a per-expert bias,
    # added to the scores for the top-k *selection* only, is updated after every optimizer
    # step from the global batch's expert loads (set loss.aux_weight: 0 for no aux loss).
    balance: Literal["aux_loss", "bias_sign", "bias_quantile"] = "aux_loss"
    bias_rate: float = 1e-3  # bias_sign: bias_e += bias_rate * sign(mean_load - load_e)
    # bias_quantile: bias += quantile_rate * (this batch's fair-share bias - bias); 1.0 is
    # Marin's hard set, smaller averages the one-batch estimate over ~1/rate steps
    quantile_rate: float = 0.1
    # constant: the rates above every step. lr_decay: after warmup they are scaled by
    # lr(step) / optim.lr, so the bias settles as the weights do (DeepSeek-V3 stops its bias
    # updates for the last tokens); during warmup they stay full, against early collapse
    bias_rate_schedule: Literal["constant", "lr_decay"] = "constant"
    shared_expert: bool = False  # an always-on expert beside the routed ones
    d_ff_shared: int = 0  # 0 means d_ff
    # a name in model/dispatch's registry (capacity, pooled, pooled_wave, dropless, or one
    # added in a file of its own there), checked by the registry (see REGISTERED_CHECKS)
    dispatch: str = "dropless"
    # capacity/pooled: each expert takes ceil(capacity_factor * group_tokens * top_k / n_experts)
    capacity_factor: float = 1.25
    pool_size: int = 0  # pooled: sequences per capacity pool; 0 means the whole (local) batch
    # pooled_wave: an expert's capacity is pooled over every sender of the expert group and
    # filled round-robin over them; each sender ships at most
    # ceil(send_capacity_factor * local_tokens * top_k / expert_shards) rows to each peer,
    send_capacity_factor: float = 1.25
    waves: int = 1  # ... in this many all_to_all rounds (less peak memory, same numbers)
    # dropless: "auto" picks ragged_dot on GPU/TPU and block matmuls on CPU; "slab" runs
    # each expert's balanced share of rows as one batched matmul, the rest in blocks
    dropless_impl: Literal["auto", "ragged", "blocked", "slab"] = "auto"
    block_size: int = 64  # rows per block of the CPU dropless path
    # debug, for measurements: position s of each sequence goes to experts (s*K + j) mod E
    # with weights 1/K (perfect balance); the router weights stay but get no gradient
    uniform_routing: bool = False


@dataclass(frozen=True)
class LossConfig:
    """Weights of the auxiliary terms added to next-token cross-entropy."""

    aux_weight: float = 0.01  # Switch load-balancing loss
    # DeepSeek-V3's complementary sequence-wise balance loss (the Switch loss per sequence,
    # averaged); 0 = off. Works beside either moe.balance (DeepSeek-V3 uses ~1e-4 with bias)
    seq_aux_weight: float = 0.0
    router_z_weight: float = 1e-3  # mean logsumexp(router_logits)^2
    logit_z_weight: float = 1e-4  # mean logsumexp(output_logits)^2: keeps grad norm flat


@dataclass(frozen=True)
class MTPConfig:
    """Multi-token prediction (DeepSeek-V3, sec. 2.2): `depth` sequential modules after the
    model, module k predicting the token k+1 ahead of each position from module k-1's
    hidden state and the embedding of the token k ahead (model/mtp.py). Training only:
    eval, generate and export use the model without them."""

    depth: int = 0  # MTP modules; 0 = off (DeepSeek-V3 trains with 1)
    # loss += loss_weight * mean_k(CE_k): DeepSeek-V3 uses 0.3, then 0.1 for the last tokens
    loss_weight: float = 0.3


@dataclass(frozen=True)
class DataConfig:
    """Where the prepared shards are and how batches are drawn from them."""

    # a directory written by `moelab data prepare`; a relative path lives under
    # $MOELAB_HOME (see data_dir), "./" or "../" makes it the working directory's
    path: str = "runs/data/default"
    seq_len: int = 128
    batch_size: int = 8  # sequences per optimizer step (before accumulation splits it)
    # source (or "cell:<domain>/<bucket>" of a curated dataset) -> weight; {} = sources by size
    mixture: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    # at most this many passes over each mixture component's train tokens in the run
    # (weights above the cap move to the other components); 0 = no cap
    max_epochs: float = 0.0
    # source -> how many of its train tokens a run may read (which ones: unique_sample): a
    # fixed unique subset that a longer run passes over again, as in Muennighoff et al.'s
    # repetition ladders (a source not named is read whole; {} = every token). Passes are
    # counted against the subset; a mixture of {} still weighs sources by their full size.
    unique_tokens: dict[str, int] = field(default_factory=dict)
    # which K tokens: "first" (the stream's first K, as every spec before repetition_v4's
    # result read them) or "spread" (K in equal pieces at evenly spaced starts across the
    # stream). A prefix is a few files, narrower than the corpus: at one pass, 195 steps on
    # the first 400K tokens scored 0.75 nats worse than on 800K (bench/repetition_subset.py),
    # which a repetition law then charges to repetition; "spread" keeps the subset's mix.
    unique_sample: str = "first"
    # The first short_rows sequences of every batch are cut into windows of short_len
    # tokens that attend only within themselves: short-context data inside a long-context
    # batch (ProLong's mix; a stage's short_fraction sets both). 0 = none.
    short_rows: int = 0
    short_len: int = 0
    # A JSONL of OpenAI-format conversations (`moelab data sft-set`), "" = none. Set, the
    # train batches are these conversations packed into seq_len rows with the loss on the
    # assistant's tokens (supervised fine-tuning); data.path still names the corpus whose
    # tokenizer and chat template encode them and whose val split is evaluated.
    conversations: str = ""


UNIQUE_SAMPLES = ("first", "spread")  # data.unique_sample
HOME_ENV = "MOELAB_HOME"


def moelab_home() -> Path:
    """$MOELAB_HOME, else ~/.cache/moelab (XDG_CACHE_HOME if set): one place per user for
    prepared data, so `moelab train` from any directory finds the same corpus."""
    if home := os.environ.get(HOME_ENV):
        return Path(home).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moelab"


def data_dir(path: str) -> Path:
    """The directory `data.path` names. Absolute: as given. Starting with "./" or "../":
    relative to the working directory (an explicit choice). Any other relative path:
    under moelab_home(), so the same config never prepares a second copy of a corpus
    because it was started from another directory."""
    if Path(path).expanduser().is_absolute():
        return Path(path).expanduser()
    if path.startswith(("./", "../")) or path in (".", ".."):
        return Path(path)
    return moelab_home() / path


@dataclass(frozen=True)
class OptimConfig:
    """AdamW (or Muon for the hidden matrices) with decoupled weight decay, an LR schedule
    and global-norm clipping."""

    # adamw: every trainable array. muon: attention projections and every SwiGLU matrix
    # (experts, shared expert, dense FFN) get Muon (momentum, then Newton-Schulz
    # orthogonalisation of each 2-D matrix, scaled by 0.2 sqrt(max(fan_in, fan_out)) so its
    # RMS matches AdamW's and lr / weight_decay carry over: Moonlight's rule); embedding,
    # output head, norms and routers keep AdamW (train/optimizer.py)
    name: Literal["adamw", "muon"] = "adamw"
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the orthogonalised matrices
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per update
    lr: float = 3e-3
    # linear: after warmup, straight down to lr * min_lr_ratio at the last step (Marin)
    schedule: Literal["wsd", "cosine", "linear", "constant"] = "wsd"
    warmup_steps: int = 20
    decay_fraction: float = 0.2  # wsd: last fraction of steps decays linearly to min_lr
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    grad_accum: int = 1  # micro-batches per step; must divide data.batch_size
    # Width transfer (muP's Adam rule for hidden weights, Yang et al. 2022): when > 0, every
    # weight matrix that reads the residual stream or the expert hidden layer (attention,
    # experts, shared expert, router, output head) trains at lr * lr_base_width / d_model;
    # the embedding and the norm scales keep lr. One lr then serves every width of a ladder.
    lr_base_width: int = 0
    # The power of that factor: (lr_base_width / d_model) ** lr_width_power. 1 is muP's
    # rule; a measured sweep (bench/width_transfer.py) may put the optimum nearer 0.8 at
    # the widths and lengths a ladder trains. Used only with lr_base_width > 0.
    lr_width_power: float = 1.0


@dataclass(frozen=True)
class TrainConfig:
    """Length of the run, its numerics, and how often it logs, evaluates and saves."""

    steps: int = 200
    seed: int = 0
    dtype: Literal["float32", "bfloat16"] = "float32"  # compute dtype; params stay f32
    log_every: int = 10
    eval_every: int = 50
    eval_batches: int = 4
    checkpoint_every: int = 50
    keep_checkpoints: int = 2
    # also keep the checkpoint at each stage boundary (step = a stage's start), never rotated
    # away: the points a later run branches from (`moelab train --from RUN_DIR@STEP`)
    keep_stage_checkpoints: bool = False
    spike_window: int = 50  # steps in the rolling window of the spike detector
    spike_threshold: float = 6.0  # robust z-score (median/MAD) that flags a spike
    # an expert that received no token for this many steps in a row counts as dead: the
    # dead_experts/layer_i metric and an expert_dead (expert_revived) event (train/health.py)
    dead_expert_window: int = 100
    peak_flops: float = 0.0  # device peak FLOP/s for MFU; 0 = a nominal figure per backend


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: the batch is split over data x fsdp x expert devices, routed experts over
    `expert`, and every parameter and its optimizer state over `fsdp` (ZeRO-3 style)."""

    data: int = 1  # pure data parallelism: parameters replicated
    fsdp: int = 1  # data parallelism with parameters and optimizer state sharded
    expert: int = 1  # expert parallelism: routed experts split, tokens exchanged
    # how tokens reach experts on other devices: padded/ragged all_to_all (dropless),
    # or ring (all-gather tokens, compute local experts, psum-scatter back); auto picks
    # ragged on GPU/TPU and padded elsewhere. moe.dispatch pooled_wave brings its own.
    exchange: Literal["auto", "padded", "ragged", "ring"] = "auto"


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-host set-up for jax.distributed; empty fields fall back to the environment."""

    coordinator_address: str = ""  # host:port of process 0, or env MOELAB_COORDINATOR
    num_processes: int = 0  # or env MOELAB_NUM_PROCESSES; 0/1 = single process
    process_id: int = -1  # or env MOELAB_PROCESS_ID


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    mtp: MTPConfig = field(default_factory=MTPConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    # pre-training -> mid-training -> ...: what changes at which step (config/plan.py)
    stages: list[StageConfig] = field(default_factory=list)

    @functools.cached_property
    def plan(self) -> Plan:
        """The stages resolved to absolute steps, built once per config (validation builds
        it first, so a config that loaded has a plan that resolves)."""
        return build_plan(self)


# ----------------------------------------------------------------------------- loading


# A number PyYAML (YAML 1.1) leaves as a string: 1e30, -2E-5, 3e+4 (no dot, or no sign).
_YAML11_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check `value` against a field's type annotation; ints widen to floats, nothing else."""
    origin = typing.get_origin(annotation)
    if annotation is Any:  # checked by the code that owns the field (stages[i].model)
        return value
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping of fields, got {brief(value)}")
        return _build(annotation, value, where)
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{where}: {brief(value)} is not one of {list(allowed)}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {brief(value)}")
        return {
            _coerce(k, key_type, f"{where} key"): _coerce(v, value_type, f"{where}.{k}")
            for k, v in value.items()
        }
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(annotation):
            try:
                return _coerce(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {brief(value)} matches none of {annotation}")
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is float and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        return float(value)  # "1e30": YAML 1.1 wants a dot in exponent floats; people don't
    if annotation is type(None):
        if value is not None:
            raise ConfigError(f"{where}: expected null, got {brief(value)}")
        return value
    if not isinstance(value, annotation) or (annotation is int and isinstance(value, bool)):
        raise ConfigError(
            f"{where}: expected {annotation.__name__}, got {type(value).__name__} {brief(value)}"
        )
    return value


def _build(cls: type, raw: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        meant = [repr(m[0]) for u in unknown if (m := difflib.get_close_matches(str(u), names, 1))]
        hint = f" (did you mean {', '.join(meant)}?)" if meant else ""
        if not where:  # the top level: its keys are the sections
            raise ConfigError(f"unknown section(s) {unknown}{hint}; sections are {sorted(names)}")
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}{hint}; valid keys are {sorted(names)}"
        )
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in raw.items()}
    return cls(**kwargs)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Build and validate a Config from a plain dict (e.g. parsed YAML)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping at the top level, got {brief(raw)}")
    config = _build(Config, raw, "")
    validate(config)
    return config


def preset_or_file(name: str | Path, presets: dict[str, Path], what: str) -> Path:
    """The file of preset `name`, else `name` as a path. A name that is neither gets the
    list of presets and the nearest one: `Tiny` and `small.yaml` are how people spell
    the presets `tiny` and `small`."""
    if str(name) in presets:
        return presets[str(name)]
    path = Path(name)
    if path.is_file() or not presets:
        return path
    stem = path.name.lower().removesuffix(".yaml").removesuffix(".yml")
    meant = difflib.get_close_matches(stem, presets, 1)
    hint = f"; did you mean {meant[0]!r}?" if meant else ""
    raise ConfigError(f"{what} {name} is neither a file nor a preset (presets: "
                      f"{', '.join(presets)}){hint}")


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """Load a YAML config file, apply dotted overrides ({"train.steps": 10}), validate."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        raw = read_yaml(path, "config file")
    except SchemaError as err:
        raise ConfigError(f"{err}; pass a YAML config") from None
    if raw is None:
        raise ConfigError(f"config file {path} is empty; write the fields to change (or {{}} "
                          "for every default) in it")
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections at the top "
                          f"level, got {brief(raw)}")
    for dotted, value in (overrides or {}).items():
        set_dotted(raw, dotted, value)
    return config_from_dict(raw)


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Set raw["a"]["b"] = value for dotted = "a.b", creating sections as needed."""
    *sections, leaf = dotted.split(".")
    node = raw
    for i, name in enumerate(sections):
        node = node.setdefault(name, {})
        if not isinstance(node, dict):
            where = ".".join(sections[: i + 1])
            raise ConfigError(f"{dotted}: {where} is a value, not a section; set {where}=...")
    node[leaf] = value


def config_to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def replace(config: Config, **sections: dict[str, Any]) -> Config:
    """A copy of `config` with some fields of some sections changed, re-validated."""
    raw = config_to_dict(config)
    for name, fields_ in sections.items():
        raw[name].update(fields_)
    return config_from_dict(raw)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config_to_dict(config), sort_keys=False)


# -------------------------------------------------------------------------- validation


def _require(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{field_name}: {message}")


INT_LIMIT = 2**31  # beyond this, counts overflow the int32 indices of JAX and NumPy

# Lower bounds of numeric fields (">" strict, ">=" inclusive); fields not named only need
# to be finite (floats) and below INT_LIMIT in size (ints).
BOUNDS = {
    "model.vocab_size": (">", 0), "model.d_model": (">", 0), "model.n_layers": (">", 0),
    "model.n_heads": (">", 0), "model.n_kv_heads": (">", 0), "model.head_dim": (">=", 0),
    "model.d_ff": (">", 0), "model.d_ff_dense": (">=", 0), "model.rope_theta": (">", 0),
    "model.attn_logit_scale": (">", 0), "model.attention_chunk": (">", 0),
    "model.norm_eps": (">", 0), "model.init_std": (">", 0),
    "moe.n_experts": (">", 0), "moe.top_k": (">", 0), "moe.d_ff_shared": (">=", 0),
    "moe.capacity_factor": (">", 0), "moe.block_size": (">", 0),
    "loss.aux_weight": (">=", 0), "loss.router_z_weight": (">=", 0),
    "loss.seq_aux_weight": (">=", 0),
    "loss.logit_z_weight": (">=", 0), "mtp.depth": (">=", 0), "mtp.loss_weight": (">=", 0),
    "data.seq_len": (">", 0), "data.batch_size": (">", 0), "data.seed": (">=", 0),
    "optim.lr": (">", 0), "optim.warmup_steps": (">=", 0), "optim.weight_decay": (">=", 0),
    "optim.b1": (">=", 0), "optim.b2": (">=", 0), "optim.eps": (">", 0),
    "optim.clip_norm": (">", 0), "optim.grad_accum": (">", 0),
    "optim.lr_base_width": (">=", 0),
    "train.steps": (">", 0), "train.seed": (">=", 0), "train.log_every": (">", 0),
    "train.eval_every": (">", 0), "train.eval_batches": (">", 0),
    "train.checkpoint_every": (">", 0), "train.keep_checkpoints": (">", 0),
    "train.spike_window": (">", 0), "train.spike_threshold": (">", 0),
    "train.peak_flops": (">=", 0), "mesh.data": (">", 0), "mesh.fsdp": (">", 0),
    "mesh.expert": (">", 0),
    "moe.send_capacity_factor": (">", 0), "moe.waves": (">", 0),
    "moe.routed_scaling": (">", 0), "moe.bias_rate": (">=", 0),
    "moe.n_group": (">", 0), "moe.topk_group": (">", 0),
    "optim.muon_ns_steps": (">", 0), "train.dead_expert_window": (">", 0),
    "distributed.num_processes": (">=", 0),
}


def _numbers(config: Config) -> dict[str, int | float]:
    """Every numeric field by dotted name (bools and the mixture's weights excluded)."""
    return {f"{section}.{name}": value
            for section, fields_ in config_to_dict(config).items() if isinstance(fields_, dict)
            for name, value in fields_.items()
            if isinstance(value, int | float) and not isinstance(value, bool)}


def _validate_numbers(config: Config) -> None:
    for name, value in _numbers(config).items():
        if isinstance(value, float):
            _require(math.isfinite(value), name, f"must be a finite number, got {value}")
        else:
            _require(abs(value) < INT_LIMIT, name, f"{value} is too large (limit 2**31)")
        op, bound = BOUNDS.get(name, (None, None))
        if op == ">":
            _require(value > bound, name, f"must be > {bound}, got {value}")
        elif op == ">=":
            _require(value >= bound, name, f"must be >= {bound}, got {value}")
    moe, o = config.moe, config.optim
    _require(0 < moe.quantile_rate <= 1, "moe.quantile_rate", "must be in (0, 1]")
    _require(o.b1 < 1, "optim.b1", f"must be in [0, 1), got {o.b1}")
    _require(o.b2 < 1, "optim.b2", f"must be in [0, 1), got {o.b2}")
    _require(0 <= o.muon_momentum < 1, "optim.muon_momentum",
             f"must be in [0, 1), got {o.muon_momentum}")
    _require(o.name != "muon" or not o.lr_base_width, "optim.lr_base_width",
             "is muP's Adam rule; optim.name=muon carries lr over widths by its own RMS "
             "matching (0.2 sqrt(max(fan_in, fan_out))): set optim.lr_base_width=0")
    _require(0 < o.lr_width_power <= 2, "optim.lr_width_power",
             f"must be in (0, 2], got {o.lr_width_power}")
    _require(o.lr_width_power == 1.0 or o.lr_base_width > 0, "optim.lr_width_power",
             "scales the width rule's factor; set optim.lr_base_width > 0 with it")
    _require(0 <= o.decay_fraction <= 1, "optim.decay_fraction", "must be in [0, 1]")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")


# Checks that a higher layer adds when it is imported, (Config) -> None raising a
# ConfigError that names the field: the dispatch registry (model/dispatch) adds the check
# of moe.dispatch, so a dispatch's name is written in its own file only and this layer
# imports nothing above it. Every command imports the model before it loads a config.
REGISTERED_CHECKS: list[typing.Callable[[Config], None]] = []


def register_check(check: typing.Callable[[Config], None]) -> typing.Callable[[Config], None]:
    REGISTERED_CHECKS.append(check)
    return check


def validate(config: Config) -> None:
    """Raise ConfigError for shapes and combinations that cannot work."""
    _validate_numbers(config)
    m, moe, d = config.model, config.moe, config.data
    _require(m.head_dim > 0 or m.d_model % m.n_heads == 0, "model.d_model",
             f"{m.d_model} is not divisible by model.n_heads={m.n_heads}; "
             "change one of them or set model.head_dim")
    _require(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads",
             f"{m.n_kv_heads} must divide model.n_heads={m.n_heads} for grouped-query attention")
    _require(m.resolved_head_dim % 2 == 0, "model.head_dim",
             f"head dim {m.resolved_head_dim} must be even for RoPE")
    _require(0 <= m.n_dense_layers <= m.n_layers, "model.n_dense_layers",
             f"must be between 0 and model.n_layers={m.n_layers}")
    _require(moe.top_k <= moe.n_experts, "moe.top_k",
             f"{moe.top_k} exceeds moe.n_experts={moe.n_experts}")
    _require(moe.pool_size >= 0, "moe.pool_size", "must be >= 0 (0 = whole batch)")
    _validate_groups(moe)
    _require(moe.bias_rate_schedule == "constant" or moe.balance != "aux_loss",
             "moe.bias_rate_schedule", "schedules the selection bias's rate, so it needs "
             "moe.balance bias_sign or bias_quantile (aux_loss has no bias)")
    _require(moe.balance != "bias_quantile" or moe.top_k < moe.n_experts, "moe.balance",
             "bias_quantile needs a (top_k+1)-th choice: moe.top_k must be < moe.n_experts")
    _require(moe.pool_size == 0 or d.batch_size % moe.pool_size == 0, "moe.pool_size",
             f"{moe.pool_size} must divide data.batch_size={d.batch_size}")
    _require(d.batch_size % config.optim.grad_accum == 0, "optim.grad_accum",
             f"{config.optim.grad_accum} must divide data.batch_size={d.batch_size}")
    for source, weight in d.mixture.items():
        _require(math.isfinite(weight) and weight >= 0, f"data.mixture.{source}",
                 f"weight must be a finite number >= 0, got {weight}")
    _require(not d.mixture or sum(d.mixture.values()) > 0, "data.mixture",
             "weights must not all be zero")
    _validate_rope(m, d.seq_len)
    _require(config.mtp.depth < d.seq_len, "mtp.depth",
             f"{config.mtp.depth} leaves no position to predict in data.seq_len={d.seq_len} "
             "tokens; use fewer MTP modules")
    _require(not (config.mtp.depth and d.conversations), "mtp.depth",
             "multi-token prediction does not take packed conversations' loss mask and "
             "restarting positions; set mtp.depth: 0 for a run on data.conversations")
    _require(math.isfinite(d.max_epochs) and d.max_epochs >= 0, "data.max_epochs",
             f"must be a finite number >= 0 (0 = no cap), got {d.max_epochs}")
    for source, n in d.unique_tokens.items():
        _require(isinstance(n, int) and not isinstance(n, bool) and n > d.seq_len,
                 "data.unique_tokens", f"{source}: must be a whole number of tokens > "
                 f"data.seq_len={d.seq_len} (one window), got {n!r}")
        _require(not source.startswith("cell:"), "data.unique_tokens",
                 f"{source}: names sources only, not cells")
    _require(d.unique_sample in UNIQUE_SAMPLES, "data.unique_sample",
             f"must be one of {list(UNIQUE_SAMPLES)}, got {d.unique_sample!r}")
    _require(not (d.unique_tokens and d.conversations), "data.unique_tokens",
             "limits the corpus's train tokens, which a run on data.conversations does not read")
    _require(0 <= d.short_rows <= d.batch_size, "data.short_rows",
             f"must be in 0..data.batch_size={d.batch_size}, got {d.short_rows}")
    _require(not d.short_rows or (0 < d.short_len < d.seq_len and d.seq_len % d.short_len == 0),
             "data.short_len", f"must divide data.seq_len={d.seq_len} and be shorter than it "
             f"(the short windows of data.short_rows), got {d.short_len}")
    _validate_mesh(config)
    _ = config.plan  # built once (cached): stages order, ends, mixtures, shapes, LR restarts
    for check in REGISTERED_CHECKS:
        check(config)


def _validate_groups(moe: MoEConfig) -> None:
    """Group-limited top-k: equal groups of at least two experts (a group is scored by its
    two best), no more top groups than groups, and enough eligible experts for top_k."""
    _require(moe.n_experts % moe.n_group == 0, "moe.n_group",
             f"{moe.n_group} must divide moe.n_experts={moe.n_experts} (equal groups)")
    per_group = moe.n_experts // moe.n_group
    _require(moe.n_group == 1 or per_group >= 2, "moe.n_group",
             f"{moe.n_group} groups of {per_group} expert: a group is scored by its two best "
             "experts, so each needs at least 2; use fewer groups")
    _require(moe.topk_group <= moe.n_group, "moe.topk_group",
             f"{moe.topk_group} exceeds moe.n_group={moe.n_group}")
    _require(moe.top_k <= moe.topk_group * per_group, "moe.top_k",
             f"{moe.top_k} exceeds the {moe.topk_group * per_group} experts of the "
             f"moe.topk_group={moe.topk_group} eligible groups; raise moe.topk_group")


def _validate_rope(model: ModelConfig, seq_len: int, where: str = "model",
                   seq_field: str = "data.seq_len") -> None:
    """The rope parameters each type reads must make sense for the length trained at
    (`seq_len`, named `seq_field`); errors name `{where}.rope.<field>` (a stage's
    `stages[i].model`, or the run's `model`)."""
    r = model.rope
    for name in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                 "attention_factor"):
        _require(math.isfinite(getattr(r, name)), f"{where}.rope.{name}",
                 f"must be a finite number, got {getattr(r, name)}")
    _require(r.factor > 0, f"{where}.rope.factor", f"must be > 0, got {r.factor}")
    _require(r.type != "default" or r.factor == 1, f"{where}.rope.factor",
             f"{r.factor} is unused by {where}.rope.type=default; choose linear, ntk, llama3 "
             "or yarn to extend the context")
    _require(r.attention_factor >= 0, f"{where}.rope.attention_factor",
             f"must be >= 0 (0 = YaRN's 0.1 ln(factor) + 1), got {r.attention_factor}")
    _require(r.attention_factor == 0 or r.type == "yarn", f"{where}.rope.attention_factor",
             f"only {where}.rope.type=yarn scales cos/sin; use {where}.attn_logit_scale")
    _require(0 <= r.original_max_position_embeddings < INT_LIMIT,
             f"{where}.rope.original_max_position_embeddings",
             f"must be >= 0 and < 2**31, got {r.original_max_position_embeddings}")
    original = r.original_max_position_embeddings
    if r.type in ("llama3", "yarn"):
        _require(original > 0, f"{where}.rope.original_max_position_embeddings",
                 f"{where}.rope.type={r.type} needs the pre-training context length (e.g. the "
                 "seq_len it was pre-trained at)")
        _require(original <= seq_len, f"{where}.rope.original_max_position_embeddings",
                 f"{original} exceeds {seq_field}={seq_len}: an extension trains longer "
                 "than the original context, not shorter")
    if r.type == "llama3":
        _require(0 < r.low_freq_factor < r.high_freq_factor, f"{where}.rope.high_freq_factor",
                 f"llama3 needs 0 < low_freq_factor ({r.low_freq_factor}) < "
                 f"high_freq_factor ({r.high_freq_factor})")
    if r.type == "yarn":
        _require(0 < r.beta_slow < r.beta_fast, f"{where}.rope.beta_fast",
                 f"yarn needs 0 < beta_slow ({r.beta_slow}) < beta_fast ({r.beta_fast})")
    if r.type == "ntk":
        _require(model.resolved_head_dim > 2, f"{where}.head_dim",
                 "ntk scaling needs a head dim > 2 (theta * factor^(d/(d-2)))")


def stage_model(model: ModelConfig, overrides: dict[str, Any], seq_len: int,
                where: str) -> ModelConfig:
    """The run's `model` with a stage's `model:` overrides (`where` = "stages[i]"), checked
    as model.* is but against the stage's own seq_len. `rope` is a whole section: the fields
    it leaves out take RopeConfig's defaults, not the run's (a new type has new meanings)."""
    raw = {**dataclasses.asdict(model), **overrides}
    new = _build(ModelConfig, raw, f"{where}.model")
    for name in ("rope_theta", "attn_logit_scale"):
        value = getattr(new, name)
        _require(math.isfinite(value) and value > 0, f"{where}.model.{name}",
                 f"must be a finite number > 0, got {value}")
    _require(0 < new.attention_chunk < INT_LIMIT, f"{where}.model.attention_chunk",
             f"must be > 0, got {new.attention_chunk}")
    _validate_rope(new, seq_len, f"{where}.model", f"{where}.seq_len")
    return new


def _validate_mesh(config: Config) -> None:
    mesh, moe, d = config.mesh, config.moe, config.data
    _require(moe.n_experts % mesh.expert == 0, "mesh.expert",
             f"{mesh.expert} must divide moe.n_experts={moe.n_experts}")
    shards = mesh.data * mesh.fsdp * mesh.expert
    micro = d.batch_size // config.optim.grad_accum
    _require(micro % shards == 0, "data.batch_size",
             f"the micro-batch of {micro} sequences must split evenly over "
             f"mesh.data x mesh.fsdp x mesh.expert = {shards} devices")
    # each dispatch's own mesh checks: its registry entry (model/dispatch), at the trainer's start


def capacity(group_tokens: int, moe: MoEConfig) -> int:
    """Slots per expert per group: ceil(capacity_factor * tokens * top_k / n_experts)."""
    return max(1, math.ceil(moe.capacity_factor * group_tokens * moe.top_k / moe.n_experts))
