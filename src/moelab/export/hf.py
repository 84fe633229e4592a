"""Export a moelab Transformer as a Hugging Face `transformers` Qwen3-MoE or Glm4Moe checkpoint.

Qwen3-MoE (`Qwen3MoeForCausalLM`) computes the same function as our model, term by term:
pre-norm RMSNorm blocks, GQA attention with an RMSNorm over each head's queries and keys
before rotate-half RoPE, a softmax router with top-k and optional renormalization
(`norm_topk_prob`), SwiGLU experts, dense SwiGLU layers listed in `mlp_only_layers`, and
optionally tied embeddings. OLMoE was the other candidate; its QK-norm spans the whole
projection rather than each head, so it cannot express ours.

Models with a sigmoid router go to Glm4Moe (`Glm4MoeForCausalLM`, GLM-4.5's architecture):
the same blocks, plus what DeepSeek-V3-style routing needs: sigmoid scores, a selection
bias `e_score_correction_bias` added to the *scores* (moelab's bias lives in the same
space, so the choice is identical), `routed_scaling_factor`, always-on shared experts
(width n_shared_experts * moe_intermediate_size), optional per-head QK-norm, and dense
first layers (`first_k_dense_replace`). Its router has no softmax; Qwen3-MoE has no shared
expert, bias or scaling: `check_exportable` refuses, naming the field, what neither target
expresses, before anything is written.

RoPE scaling maps onto transformers' `rope_parameters` (what 5.x reads for both targets):
linear, llama3 and yarn by name with their parameters (yarn's attention temperature as an
explicit `attention_factor`); moelab's static ntk is `default` with the NTK-scaled theta.
`model.attn_logit_scale` has no config field in either target, but logits are linear in
the queries, so it is folded into the weights: into each head's q_norm weight (applied
before RoPE), or into q_proj where there is no QK-norm. Nothing rope-related is refused.

Weights are written in the layout of the Qwen3-MoE checkpoints on the Hub (one tensor per
expert, `mlp.experts.{e}.gate_proj.weight`), which `transformers` fuses on load; torch
Linear weights are [out, in], ours are [in, out], so every matrix is transposed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from moelab.config import Config, ConfigError, ModelConfig
from moelab.errors import UserError
from moelab.schema import brief

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from moelab.model import Transformer

WEIGHTS_FILE = "model.safetensors"


def target(cfg: Config) -> str:
    """The transformers architecture that computes this model: by the router's scores."""
    return "Glm4MoeForCausalLM" if cfg.moe.router == "sigmoid" else "Qwen3MoeForCausalLM"


def _refusals(cfg: Config) -> list[tuple[str, str, str]]:
    """(field, why neither target can compute it, the fix) for every blocking field."""
    m, moe = cfg.model, cfg.moe
    if moe.uniform_routing:
        return [("moe.uniform_routing", "a fixed debug routing that neither target computes",
                 "export a model trained with moe.uniform_routing=false")]
    if moe.router == "sigmoid":  # Glm4Moe
        if not moe.shared_expert:
            return [("moe.shared_expert", "Glm4Moe (the sigmoid-router target) always adds a "
                     "shared expert and Qwen3-MoE has no sigmoid router",
                     "train with moe.shared_expert=true or moe.router=softmax")]
        d_shared = moe.d_ff_shared or m.d_ff
        if d_shared % m.d_ff:
            return [("moe.d_ff_shared", f"Glm4Moe's shared expert is a multiple of "
                     f"model.d_ff={m.d_ff} wide, not {d_shared}",
                     "train with a multiple of model.d_ff (or 0)")]
        if moe.n_experts < 2:
            return [("moe.n_experts", "Glm4Moe scores its (one) expert group by its two best "
                     "experts", "train with moe.n_experts >= 2")]
        return []
    out = []  # Qwen3-MoE
    softmax = "Glm4Moe routes with sigmoid only and Qwen3-MoE has no"
    if moe.shared_expert:
        out.append(("moe.shared_expert", f"{softmax} shared expert",
                    "train with moe.shared_expert=false, or moe.router=sigmoid"))
    if moe.balance != "aux_loss":
        out.append(("moe.balance", f"{softmax} selection bias",
                    "train with moe.balance=aux_loss, or moe.router=sigmoid"))
    if moe.routed_scaling != 1.0:
        out.append(("moe.routed_scaling", f"{softmax} routed scaling factor",
                    "train with moe.routed_scaling=1, or moe.router=sigmoid"))
    if moe.n_group > 1:
        out.append(("moe.n_group", f"{softmax} group-limited routing",
                    "train with moe.n_group=1, or moe.router=sigmoid"))
    if not m.qk_norm:
        out.append(("model.qk_norm", "Qwen3-MoE always applies q_norm/k_norm per head",
                    "train with model.qk_norm=true, or moe.router=sigmoid"))
    return out


def check_exportable(cfg: Config) -> None:
    """Raise ConfigError, naming the field, if neither target can compute this model."""
    for name, why, fix in _refusals(cfg):
        value = getattr(getattr(cfg, name.split(".")[0]), name.split(".")[1])
        raise ConfigError(f"{name}={value!r} cannot be exported: {why}; {fix}")


def hf_config(cfg: Config, eos_token_id: int | None = None) -> dict[str, Any]:
    """The config.json of the Qwen3-MoE or Glm4Moe model that computes `cfg`'s transformer."""
    m, moe = cfg.model, cfg.moe
    common = {
        "dtype": "float32",
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "num_key_value_heads": m.n_kv_heads,
        "head_dim": m.resolved_head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rms_norm_eps": m.norm_eps,
        "rope_parameters": hf_rope_parameters(m),
        "max_position_embeddings": cfg.data.seq_len,  # the context it was trained on
        "use_sliding_window": False,
        "tie_word_embeddings": m.tie_embeddings,
        "num_experts_per_tok": moe.top_k,
        "moe_intermediate_size": m.d_ff,
        "norm_topk_prob": moe.normalize_top_k,
        "intermediate_size": m.d_ff_dense or m.d_ff * moe.top_k,  # the dense layers' width
        "initializer_range": m.init_std,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": None,
    }
    if target(cfg) == "Glm4MoeForCausalLM":
        return common | {
            "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
            "rope_parameters": {**common["rope_parameters"], "partial_rotary_factor": 1.0},
            "n_routed_experts": moe.n_experts,
            "n_shared_experts": (moe.d_ff_shared or m.d_ff) // m.d_ff,
            "routed_scaling_factor": moe.routed_scaling,
            "n_group": moe.n_group, "topk_group": moe.topk_group,  # group-limited top-k
            "first_k_dense_replace": m.n_dense_layers,
            "use_qk_norm": m.qk_norm,
            "num_nextn_predict_layers": 0,
        }
    return common | {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "num_experts": moe.n_experts,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(m.n_dense_layers)),
        "router_aux_loss_coef": cfg.loss.aux_weight,
    }


def hf_rope_parameters(m: ModelConfig) -> dict[str, Any]:
    """model.rope as transformers' `rope_parameters` dict (modeling_rope_utils.py)."""
    from moelab.model.rope import ntk_theta, yarn_mscale

    r = m.rope
    if r.type == "default":
        return {"rope_type": "default", "rope_theta": m.rope_theta}
    if r.type == "ntk":  # static: a fixed larger base computes the same frequencies
        return {"rope_type": "default",
                "rope_theta": ntk_theta(m.resolved_head_dim, m.rope_theta, r.factor)}
    out = {"rope_type": r.type, "rope_theta": m.rope_theta, "factor": r.factor}
    if r.type == "llama3":
        out |= {"original_max_position_embeddings": r.original_max_position_embeddings,
                "low_freq_factor": r.low_freq_factor, "high_freq_factor": r.high_freq_factor}
    elif r.type == "yarn":
        out |= {"original_max_position_embeddings": r.original_max_position_embeddings,
                "beta_fast": r.beta_fast, "beta_slow": r.beta_slow, "truncate": True,
                "attention_factor": float(r.attention_factor or yarn_mscale(r.factor))}
    return out


def hf_state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """Our parameters under Qwen3-MoE's checkpoint names, as float32 [out, in] arrays."""
    from moelab.model.moe import MoE

    def t(w) -> np.ndarray:  # ours x @ W with W [in, out] -> torch Linear weight [out, in]
        return np.ascontiguousarray(np.asarray(w, np.float32).T)

    def vec(w) -> np.ndarray:
        return np.asarray(w, np.float32)

    out = {"model.embed_tokens.weight": vec(model.embed), "model.norm.weight":
           vec(model.final_norm.weight)}
    if model.lm_head is not None:
        out["lm_head.weight"] = t(model.lm_head)
    q_scale = model.cfg.attn_logit_scale  # folded into the queries (see the module doc)
    for i, block in enumerate(model.blocks):
        p, attn = f"model.layers.{i}.", block.attn
        q_folded = attn.q_norm is None and q_scale != 1.0
        out |= {
            p + "input_layernorm.weight": vec(block.attn_norm.weight),
            p + "post_attention_layernorm.weight": vec(block.ffn_norm.weight),
            p + "self_attn.q_proj.weight": t(attn.wq * q_scale if q_folded else attn.wq),
            p + "self_attn.k_proj.weight": t(attn.wk),
            p + "self_attn.v_proj.weight": t(attn.wv),
            p + "self_attn.o_proj.weight": t(attn.wo),
        }
        if attn.q_norm is not None:
            out |= {p + "self_attn.q_norm.weight": vec(attn.q_norm.weight * q_scale),
                    p + "self_attn.k_norm.weight": vec(attn.k_norm.weight)}
        if isinstance(block.ffn, MoE):
            experts, moe = block.ffn.experts, block.ffn.moe
            out[p + "mlp.gate.weight"] = t(block.ffn.router)
            if moe.router == "sigmoid":  # Glm4Moe: the bias buffer is always there
                bias = block.ffn.bias if block.ffn.bias is not None else np.zeros(moe.n_experts)
                out[p + "mlp.gate.e_score_correction_bias"] = vec(bias)
            if block.ffn.shared is not None:
                shared = block.ffn.shared
                out |= {p + "mlp.shared_experts.gate_proj.weight": t(shared.w_gate),
                        p + "mlp.shared_experts.up_proj.weight": t(shared.w_up),
                        p + "mlp.shared_experts.down_proj.weight": t(shared.w_down)}
            for e in range(experts.n_experts):
                q = f"{p}mlp.experts.{e}."
                out |= {q + "gate_proj.weight": t(experts.w_gate[e]),
                        q + "up_proj.weight": t(experts.w_up[e]),
                        q + "down_proj.weight": t(experts.w_down[e])}
        else:
            out |= {p + "mlp.gate_proj.weight": t(block.ffn.w_gate),
                    p + "mlp.up_proj.weight": t(block.ffn.w_up),
                    p + "mlp.down_proj.weight": t(block.ffn.w_down)}
    return out


def _check_model_matches(model: Transformer, cfg: Config) -> None:
    """The config.json is written from cfg, the weights from model: they must agree."""
    from moelab.model.moe import MoE

    if model.cfg != cfg.model:
        raise UserError("the model was built with a different `model` config than the one "
                        "given; export the config the checkpoint was trained with")
    for i, block in enumerate(model.blocks):
        if isinstance(block.ffn, MoE) and block.ffn.moe != cfg.moe:
            raise UserError(f"block {i} was built with a different `moe` config than the "
                            "one given; export the config the checkpoint was trained with")


def _tokenizer_files(tokenizer: Tokenizer, cfg: Config, chat_template: str | None = None
                     ) -> tuple[dict[str, str], int | None]:
    """tokenizer.json plus the config that makes `AutoTokenizer.from_pretrained` load it;
    with the corpus's chat template, `apply_chat_template` renders as moelab does (its
    special tokens are in tokenizer.json's added tokens)."""
    from moelab.data.tokenizer import EOS

    if tokenizer.get_vocab_size() > cfg.model.vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.get_vocab_size()} tokens; the checkpoint cannot embed them all")
    eos_id = tokenizer.token_to_id(EOS)
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": cfg.data.seq_len,
        "clean_up_tokenization_spaces": False,
    }
    if eos_id is not None:
        settings["eos_token"] = EOS
    if chat_template is not None:
        from moelab.data.chat import SPECIAL_TOKENS, require_chat_tokens

        require_chat_tokens(tokenizer, "export")
        settings["chat_template"] = chat_template
        settings["additional_special_tokens"] = list(SPECIAL_TOKENS)
    files = {"tokenizer.json": tokenizer.to_str(),
             "tokenizer_config.json": json.dumps(settings, indent=2)}
    return files, eos_id


def check_out(out_dir: Path, force: bool) -> bool:
    """Refuse an --out that export must not write (outputs.check_dir), or that another
    moelab command made; True when it holds an earlier export that `force` replaces."""
    from moelab import outputs

    if not outputs.check_dir(out_dir, force, made_by=("export",)):  # an eval's: refused
        return False
    written = outputs.marker(out_dir).get("files")  # what the earlier export wrote
    if isinstance(written, dict):  # an export's own files, nothing a user added
        added = sorted(p.name for p in out_dir.iterdir()
                       if p.name not in written and p.name != outputs.MARKER)
        if added:
            raise UserError(f"--out {out_dir} holds an earlier export and files it did not "
                            f"write ({', '.join(added[:3])}{', ...' if len(added) > 3 else ''})"
                            "; move them out or choose another --out (--force replaces an "
                            "export, never a user's files)")
    if not force:
        raise UserError(f"--out {out_dir} holds an earlier export; pass --force to replace it, "
                        "or choose another --out")
    return True


def check_export(export_dir: Path) -> tuple[dict[str, Any], list[str]]:
    """(the identity it recorded, the files changed since) of an export `export_hf` wrote;
    a file it wrote that is gone is refused. ({}, []) for an export moelab did not write,
    which only loading it can check."""
    from moelab import outputs

    if not export_dir.is_dir():
        raise UserError(f"--export {export_dir} is not a directory; pass a `moelab export` "
                        "output directory")
    record = outputs.marker(export_dir)
    files = record.get("files")
    if not isinstance(files, dict):
        return {}, []
    missing = [str(name) for name in files if not (export_dir / str(name)).is_file()]
    if missing:
        raise UserError(f"{export_dir} lacks {', '.join(missing)}, which moelab export wrote "
                        "there; export again")
    changed = [str(name) for name, sha in files.items()
               if outputs.file_sha256(export_dir / str(name)) != sha]
    identity = record.get("identity")
    return (identity if isinstance(identity, dict) else {}), changed


def check_export_config(export_dir: Path, cfg: Config) -> None:
    """The export's config.json is JSON and describes this run's model (`hf_config`): an
    edited expert count or width would otherwise load with random weights, or not at all;
    its weights file opens (a truncated one fails its header's length check)."""
    path = export_dir / "config.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path} is not a readable JSON config ({type(err).__name__}); "
                        "export again") from None
    if not isinstance(saved, dict):
        raise UserError(f"{path} is not a JSON object; export again")
    ours = hf_config(cfg)
    differs = [f"{k} {brief(saved.get(k), 20)} (the run's model: {brief(v, 20)})"
               for k, v in ours.items() if k != "eos_token_id" and saved.get(k) != v]
    if differs:
        raise UserError(f"{path} does not describe this run's model: {'; '.join(differs[:3])}"
                        "; export this run again")
    weights = export_dir / WEIGHTS_FILE
    if weights.exists():  # its header and length, without reading the tensors
        from safetensors import safe_open

        try:
            with safe_open(str(weights), "np"):
                pass
        except Exception as err:  # noqa: BLE001 - the library's own error types
            raise UserError(f"{weights} is not a readable safetensors file ({type(err).__name__}:"
                            f" {str(err)[:100]}): truncated or damaged; export again") from None


def export_hf(
    model: Transformer,
    cfg: Config,
    out_dir: str | Path,
    tokenizer: Tokenizer | None = None,
    force: bool = False,
    identity: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> Path:
    """Write `model` (trained with `cfg`) to out_dir as a Qwen3-MoE or Glm4Moe checkpoint
    (with the tokenizer, and its chat template when the corpus has one).

    out_dir must not exist or be empty, or (with `force`) be an earlier export that moelab
    made (it carries `outputs.MARKER`). Everything is written to a temporary sibling that is
    renamed into place last, so a failed export never leaves a partial directory. The
    marker records each file's sha256 and the checkpoint's `identity` (run, corpus and
    tokenizer), which `check_export` checks.
    """
    from moelab import outputs

    check_exportable(cfg)
    _check_model_matches(model, cfg)
    out_dir = Path(out_dir)
    replace = check_out(out_dir, force)
    try:
        from safetensors.numpy import save_file
    except ImportError as err:
        raise UserError("export needs safetensors: pip install -e '.[export]'") from err

    files, eos_id = (_tokenizer_files(tokenizer, cfg, chat_template) if tokenizer is not None
                     else ({}, None))
    files["config.json"] = json.dumps(hf_config(cfg, eos_id), indent=2)
    weights = hf_state_dict(model)

    try:  # a place writable by the mode bits can still refuse (/proc, a read-only mount)
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as err:
        raise UserError(f"--out {out_dir}: cannot create it in {out_dir.parent} "
                        f"({err.strerror or err}); choose another path") from None
    old = None
    try:
        save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name, text in files.items():
            (tmp / name).write_text(text + "\n")
        outputs.mark(tmp, "export", identity=identity or {}, files={
            p.name: outputs.file_sha256(p) for p in sorted(tmp.iterdir())})
        # safetensors creates its file owner-only; give it the mode (umask) of the others
        shutil.copymode(tmp / "config.json", tmp / WEIGHTS_FILE)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only
        if replace:  # an earlier export of moelab's: moved aside, removed once replaced
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
            os.replace(out_dir, old / out_dir.name)
        os.replace(tmp, out_dir)  # atomic; replaces an empty out_dir
    except BaseException:
        if old is not None and not out_dir.exists():
            os.replace(old / out_dir.name, out_dir)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    return out_dir
