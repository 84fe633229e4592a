"""Golden forward files: what moelab computes on fixed inputs, to check any other engine
that serves the export against (Marin's serving-consistency check).

For each input (lengths around the training length L: L-1, L, L+1, plus short ones) the
golden file holds, per position, the log-probability of the next input token, the top-k
log-probs and ids, and per MoE layer the experts each token is routed to, their combine
weights, and the router's margin between its k-th and (k+1)-th choice. Parity is then:

  * the max per-token probability error, over each position's target and gold top-k ids,
    is <= the bound (1e-4 for a native float32 engine, ~0.075 for a served bf16 one);
  * a different argmax is allowed only where the engine's argmax is in the gold top-k and
    its gold probability is within the error bound of the gold argmax's (a near tie);
  * a different route is explained only where the gold margin between the k-th and
    (k+1)-th expert is within `margin_tol` (a near tie the engine's rounding can flip);
    an unexplained route flip is a bug even when the probabilities agree.

Only the golden file and the engine's outputs enter the comparison, so the same file can
check any backend. The transformers backend reads routes from the router modules' own
outputs (forward hooks), not from a recomputation of ours.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

GOLDEN_FILE, VERIFY_FILE = "golden.json", "verify.json"
TOP_K = 25  # gold top-k kept per position: the argmax rule looks inside it
SHORT_LENGTHS = (1, 7, 33)
FORMAT = 1


def input_lengths(seq_len: int) -> list[int]:
    """The fixed input lengths: short ones, then the training length's boundary L-1, L, L+1."""
    return sorted({*(n for n in SHORT_LENGTHS if n < seq_len - 1),
                   seq_len - 1, seq_len, seq_len + 1} - {0})


def fixed_inputs(seq_len: int, vocab_size: int, val_streams: list[np.ndarray],
                 seed: int = 0) -> list[np.ndarray]:
    """One int32 token array per length of input_lengths: the start of a held-out stream
    (alternating domains) where one is long enough, else seeded random ids."""
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(input_lengths(seq_len)):
        usable = [s for s in val_streams if len(s) >= n]
        if usable:
            out.append(np.asarray(usable[i % len(usable)][:n], np.int32))
        else:
            out.append(rng.integers(0, vocab_size, n).astype(np.int32))
    return out


def _forward_with_routes(model, tokens):
    """(logits [B, S, V] from the model's own forward, and per MoE layer: experts [B, S, K],
    combine weights [B, S, K], k vs k+1 margin of the selection scores [B, S]).

    Walks the blocks as Block.__call__ does to reach each router's input; the logits are
    not taken from this walk but from the model's own forward."""
    import jax
    import jax.numpy as jnp

    from moelab.model.layers import rope_angles
    from moelab.model.moe import MoE
    from moelab.model.router import route

    cfg = model.cfg
    x = model.embed[tokens]
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = rope_angles(positions, cfg.resolved_head_dim, cfg.rope_theta)
    routes = []
    for block in model.blocks:
        attended, _ = block.attn(block.attn_norm(x), cos, sin, None, 0)
        h = x + attended
        normed = block.ffn_norm(h)
        if isinstance(block.ffn, MoE):
            moe = block.ffn
            logits = jnp.einsum("bsd,de->bse", normed.astype(jnp.float32),
                                moe.router.astype(jnp.float32))
            routing, _ = route(logits, moe.moe, moe.bias)
            # the selection scores route() ranks: softmax or sigmoid, plus the bias
            scores = (jax.nn.softmax(logits, -1) if moe.moe.router == "softmax"
                      else jax.nn.sigmoid(logits))
            choice = scores if moe.bias is None else scores + moe.bias
            k = moe.moe.top_k
            ranked = jax.lax.top_k(choice, min(k + 1, choice.shape[-1]))[0]
            margin = (ranked[..., k - 1] - ranked[..., k] if k < choice.shape[-1]
                      else jnp.full(choice.shape[:-1], jnp.inf))
            routes.append((routing.experts, routing.weights, margin))
            h = h + block.ffn(normed)[0]
        else:
            h = h + block.ffn(normed)
        x = h
    return model(tokens)[0], routes


def log_softmax64(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def golden_record(tokens: np.ndarray, logprobs: np.ndarray,
                  routes: list[dict[str, np.ndarray]], top_k: int = TOP_K) -> dict[str, Any]:
    """The golden entry of one input from its log-probs [S, V] and routes."""
    ids = np.argsort(-logprobs, axis=-1, kind="stable")[:, :top_k]
    return {"tokens": tokens.tolist(),
            "target_logprobs": logprobs[np.arange(len(tokens) - 1), tokens[1:]].tolist(),
            "topk_ids": ids.tolist(),
            "topk_logprobs": np.take_along_axis(logprobs, ids, -1).tolist(),
            "layers": [{k: v.tolist() for k, v in r.items()} for r in routes]}


def write_golden(model, cfg, inputs: list[np.ndarray], path: Path) -> dict[str, Any]:
    """Run moelab's forward (dropless, float32: what the export computes) on each input
    and write the golden file; returns its contents."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from moelab.model.transformer import with_dropless_dispatch

    model = with_dropless_dispatch(model)
    # One compiled forward: every input padded at the end to the longest. The model is
    # causal and dropless routing is per token, so the padding changes no earlier position.
    longest = max(len(t) for t in inputs)
    padded = np.zeros((len(inputs), longest), np.int32)
    for i, tokens in enumerate(inputs):
        padded[i, : len(tokens)] = tokens
    logits, routes = eqx.filter_jit(_forward_with_routes)(model, jnp.asarray(padded))
    logits, routes = np.asarray(logits), jax.tree.map(np.asarray, routes)
    records = []
    for i, tokens in enumerate(inputs):
        n = len(tokens)
        layers = [{"experts": e[i, :n], "weights": w[i, :n].astype(np.float64),
                   "margin": m[i, :n].astype(np.float64)} for e, w, m in routes]
        records.append(golden_record(tokens, log_softmax64(logits[i, :n]), layers))
    golden = {"format": FORMAT, "top_k": TOP_K, "seq_len": cfg.data.seq_len,
              "router": cfg.moe.router, "experts_per_token": cfg.moe.top_k,
              "vocab_size": cfg.model.vocab_size, "inputs": records}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(golden))
    return golden


# ----------------------------------------------------------------------------- compare


@dataclass
class Verdict:
    """The comparison of one backend's outputs with a golden file."""

    backend: str
    bound: float
    margin_tol: float
    max_prob_error: float = 0.0
    worst: dict[str, Any] = field(default_factory=dict)  # where max_prob_error occurs
    positions: int = 0
    argmax_differ: int = 0
    argmax_bad: list[dict[str, Any]] = field(default_factory=list)
    routes: int = 0  # token-layer routing decisions compared
    route_flips: int = 0
    route_flips_explained: int = 0
    route_flips_bad: list[dict[str, Any]] = field(default_factory=list)
    max_weight_error: float = 0.0  # combine weights, where the routes agree
    by_length: dict[int, float] = field(default_factory=dict)  # max prob error per length

    @property
    def passed(self) -> bool:
        return (self.max_prob_error <= self.bound and not self.argmax_bad
                and not self.route_flips_bad and self.max_weight_error <= self.bound)

    def problems(self) -> list[str]:
        out = []
        if self.max_prob_error > self.bound:
            w = self.worst
            out.append(f"max per-token probability error {self.max_prob_error:.3g} > bound "
                       f"{self.bound:g} (input length {w.get('length')}, position "
                       f"{w.get('position')}, token {w.get('token')})")
        if self.argmax_bad:
            b = self.argmax_bad[0]
            out.append(f"{len(self.argmax_bad)} argmax disagreement(s) not explained by a near "
                       f"tie (first: length {b['length']}, position {b['position']}: gold "
                       f"{b['gold']}, {self.backend} {b['theirs']})")
        if self.route_flips_bad:
            b = self.route_flips_bad[0]
            out.append(f"{len(self.route_flips_bad)} route flip(s) with a gold k vs k+1 margin "
                       f"above {self.margin_tol:g} (first: length {b['length']}, layer "
                       f"{b['layer']}, position {b['position']}: gold {b['gold']}, "
                       f"{self.backend} {b['theirs']}, margin {b['margin']:.3g})")
        if self.max_weight_error > self.bound:
            out.append(f"combine weights differ by up to {self.max_weight_error:.3g} "
                       f"(> {self.bound:g}) where the routes agree")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()}
        d["by_length"] = {str(k): v for k, v in self.by_length.items()}
        return {**d, "passed": self.passed, "problems": self.problems()}


def compare(golden: dict[str, Any], outputs: list[dict[str, Any]], backend: str,
            bound: float, margin_tol: float) -> Verdict:
    """Compare a backend's outputs (per input: "logprobs" [S, V] and optionally "layers":
    per MoE layer "experts" [S, K] and "weights" [S, K]) with the golden file."""
    v = Verdict(backend, bound, margin_tol)
    for gold, theirs in zip(golden["inputs"], outputs, strict=True):
        tokens = np.asarray(gold["tokens"])
        n = len(tokens)
        lp = np.asarray(theirs["logprobs"], np.float64)
        ids = np.asarray(gold["topk_ids"])
        gold_top = np.exp(np.asarray(gold["topk_logprobs"]))
        err = np.abs(gold_top - np.exp(np.take_along_axis(lp, ids, -1))).max(-1)
        if n > 1:
            target = np.abs(np.exp(np.asarray(gold["target_logprobs"]))
                            - np.exp(lp[np.arange(n - 1), tokens[1:]]))
            err[: n - 1] = np.maximum(err[: n - 1], target)
        at = int(err.argmax())
        v.by_length[n] = max(v.by_length.get(n, 0.0), float(err[at]))
        if err[at] > v.max_prob_error:
            v.max_prob_error = float(err[at])
            v.worst = {"length": n, "position": at, "token": int(tokens[at])}
        v.positions += n
        mine = lp.argmax(-1)
        for pos in np.nonzero(mine != ids[:, 0])[0]:
            v.argmax_differ += 1
            inside = np.nonzero(ids[pos] == mine[pos])[0]
            gap = gold_top[pos, 0] - gold_top[pos, inside[0]] if len(inside) else math.inf
            if gap > bound:  # only a near tie (within the allowed error) may flip
                v.argmax_bad.append({"length": n, "position": int(pos),
                                     "gold": int(ids[pos, 0]), "theirs": int(mine[pos])})
        _compare_routes(v, n, gold["layers"], theirs.get("layers"))
    return v


def _compare_routes(v: Verdict, n: int, gold_layers: list[dict], their_layers: list | None):
    if their_layers is None:
        return
    for layer, (g, t) in enumerate(zip(gold_layers, their_layers, strict=True)):
        ge, te = np.asarray(g["experts"]), np.asarray(t["experts"])
        gw, tw = np.asarray(g["weights"]), np.asarray(t["weights"], np.float64)
        go, to = np.argsort(ge, -1), np.argsort(te, -1)  # compare as sets, by expert id
        ge, gw = np.take_along_axis(ge, go, -1), np.take_along_axis(gw, go, -1)
        te, tw = np.take_along_axis(te, to, -1), np.take_along_axis(tw, to, -1)
        same = (ge == te).all(-1)
        v.routes += n
        if same.any():
            v.max_weight_error = max(v.max_weight_error, float(np.abs(gw - tw)[same].max()))
        for pos in np.nonzero(~same)[0]:
            v.route_flips += 1
            margin = float(g["margin"][pos])
            if margin <= v.margin_tol:
                v.route_flips_explained += 1
            else:
                v.route_flips_bad.append({"length": n, "layer": layer, "position": int(pos),
                                          "gold": ge[pos].tolist(), "theirs": te[pos].tolist(),
                                          "margin": margin})


# --------------------------------------------------------------------------- backends


def transformers_outputs(export_dir: Path, golden: dict[str, Any]) -> list[dict[str, Any]]:
    """Log-probs and per-layer routes of the export run in transformers (float32, CPU).

    Routes come from each MoE layer's router module (`mlp.gate`: Qwen3-MoE's and
    Glm4Moe's both return (router_logits, top-k weights, top-k ids)) through forward
    hooks, so they are transformers' own decisions."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    from moelab.errors import UserError

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(export_dir,
                                                                  dtype=torch.float32)
    except Exception as err:  # noqa: BLE001 - a damaged export fails in any of its parsers
        raise UserError(f"{export_dir} does not load in transformers ({type(err).__name__}: "
                        f"{str(err)[:200]}); export again") from None
    model.eval()
    if model.config.vocab_size != golden["vocab_size"]:
        raise UserError(f"{export_dir} has vocab_size {model.config.vocab_size} but the run's "
                        f"model has {golden['vocab_size']}: this export is of another model")
    captured: list[tuple[np.ndarray, np.ndarray]] = []
    gates = [m for name, m in model.named_modules() if name.endswith("mlp.gate")]

    def hook(_module, _inputs, output):
        _, weights, experts = output
        captured.append((experts.detach().numpy(), weights.detach().double().numpy()))

    handles = [g.register_forward_hook(hook) for g in gates]
    outputs = []
    try:
        for record in golden["inputs"]:
            captured.clear()
            try:
                with torch.no_grad():
                    logits = model(torch.tensor([record["tokens"]])).logits[0].double().numpy()
            except Exception as err:  # noqa: BLE001 - a config that loads but cannot run
                raise UserError(f"{export_dir} loads but does not run in transformers "
                                f"({type(err).__name__}: {str(err)[:200]}); export again"
                                ) from None
            outputs.append({"logprobs": log_softmax64(logits),
                            "layers": [{"experts": e, "weights": w} for e, w in captured]})
    finally:
        for h in handles:
            h.remove()
    return outputs


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except Exception:  # not installed, or installed without a usable GPU build
        return False
    return True


VLLM_NOTE = ("vLLM is not installed here: it needs a CUDA GPU build (`pip install vllm` on a "
             "GPU machine); serve the export with it there and compare against this golden file")


def verdict_text(verdicts: list[Verdict], golden: dict[str, Any], notes: list[str]) -> str:
    """The one-screen summary."""
    lines = [f"golden: {len(golden['inputs'])} inputs, lengths "
             f"{[len(r['tokens']) for r in golden['inputs']]} (training seq_len "
             f"{golden['seq_len']}), top-{golden['top_k']}, router {golden['router']}"]
    for v in verdicts:
        lines += [
            f"[{v.backend}] {'PASS' if v.passed else 'FAIL'}",
            f"  max per-token probability error {v.max_prob_error:.3g} (bound {v.bound:g}); "
            "per length: " + ", ".join(f"{n}: {e:.2g}" for n, e in sorted(v.by_length.items())),
            f"  argmax differs at {v.argmax_differ}/{v.positions} positions, "
            f"{len(v.argmax_bad)} outside the near-tie rule",
            f"  routes: {v.route_flips}/{v.routes} token-layer choices differ, "
            f"{v.route_flips_explained} explained by a k vs k+1 margin <= {v.margin_tol:g}; "
            f"combine weights max error {v.max_weight_error:.3g}",
        ]
        lines += [f"  problem: {p}" for p in v.problems()]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
