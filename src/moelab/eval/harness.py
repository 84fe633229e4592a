"""lm-evaluation-harness on moelab's own JAX model, through a small `LM` adapter.

Why an adapter on the JAX model rather than the harness's `hf` model on the export: it
scores exactly the checkpoint that trained (no conversion in between; the export's
fidelity is a separate check, `moelab export verify`), it needs neither torch nor an
export directory, and it batches all requests into one compiled shape. The harness still
does everything else: it reads the task definitions, builds the requests, and computes
acc / acc_norm and their standard errors, so the numbers are the harness's.

Only `loglikelihood` is implemented: the local tasks and the ranked-classification form
of the standard ones (hellaswag, arc, piqa, ... as the harness defines them) need nothing
else. Offline: the harness reads the local JSONL through `datasets`' json builder; the
standard tasks need their datasets (Hugging Face hub or its cache).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from moelab.config import data_dir
from moelab.errors import UserError

ROWS = 16  # requests per forward pass

LogitsFn = Callable[[np.ndarray], np.ndarray]  # tokens int32 [B, S] -> logits [B, S, V]


def _lm_base():
    try:
        from lm_eval.api.model import LM
    except ModuleNotFoundError as err:
        raise UserError("lm-evaluation-harness is not installed: pip install -e '.[eval]'"
                        ) from err
    return LM


def make_lm(logits_fn: LogitsFn, tokenizer: Tokenizer, max_len: int):
    """An lm_eval `LM` scoring continuations with logits_fn; a context longer than max_len
    tokens (the training length) keeps its last tokens, as the harness's own models do."""

    from moelab.data.tokenizer import EOS

    eos = tokenizer.token_to_id(EOS) or 0

    class MoelabLM(_lm_base()):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            pairs = [self._encode(*r.args) for r in requests]
            out = []
            for start in range(0, len(pairs), ROWS):
                out += self._score(pairs[start : start + ROWS])
            return out

        @staticmethod
        def _encode(context: str, continuation: str) -> tuple[list[int], list[int]]:
            # an empty context is a document start: EOS precedes every document in training
            ctx = tokenizer.encode(context).ids if context else [eos]
            return ctx, tokenizer.encode(continuation).ids

        @staticmethod
        def _score(pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
            """(sum of the continuation's log-probs, whether it is the greedy choice).

            The context is cut from the left to fit max_len; the continuation is always
            scored whole (a longer one runs past max_len). Rows are right-padded to a
            multiple of max_len, so a few shapes compile."""
            fulls = [ctx[-max(max_len + 1 - len(cont), 1):] + cont for ctx, cont in pairs]
            width = max(len(f) - 1 for f in fulls)
            width = -(-width // max_len) * max_len
            tokens = np.zeros((ROWS, width), np.int32)
            for row, full in enumerate(fulls):
                tokens[row, : len(full) - 1] = full[:-1]
            logits = np.asarray(logits_fn(tokens), np.float64)
            out = []
            for row, ((_, cont), full) in enumerate(zip(pairs, fulls, strict=True)):
                end = len(full) - 1
                rows = logits[row, end - len(cont) : end]
                logz = np.log(np.exp(rows - rows.max(-1, keepdims=True)).sum(-1)) \
                    + rows.max(-1)
                picked = rows[np.arange(len(cont)), cont] - logz
                greedy = bool((rows.argmax(-1) == np.asarray(cont)).all())
                out.append((float(picked.sum()), greedy))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("moelab's adapter scores multiple-choice tasks only")

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("moelab's adapter scores multiple-choice tasks only")

    return MoelabLM()


def model_logits_fn(model, dtype: str = "float32") -> LogitsFn:
    """moelab's forward (dropless dispatch, as served), jitted once per shape."""
    import equinox as eqx
    import jax.numpy as jnp

    from moelab.model.transformer import with_dropless_dispatch
    from moelab.train.step import cast_floats

    model = cast_floats(with_dropless_dispatch(model), jnp.dtype(dtype))
    forward = eqx.filter_jit(lambda m, t: m(t)[0].astype(jnp.float32))
    return lambda tokens: np.asarray(forward(model, jnp.asarray(tokens)))


def run_tasks(lm, task_dir: Path, names: list[str], seed: int = 0) -> dict[str, dict]:
    """Run the named tasks (local ones in task_dir, else the harness's own registry) and
    return {task: {acc, acc_stderr, acc_norm, acc_norm_stderr, n}}."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSONL: never the network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    missing = [n for n in names if n not in manager.all_tasks]
    if missing:  # a standard task: index the harness's own definitions (seconds)
        manager = TaskManager(include_path=str(task_dir))
        unknown = [n for n in missing if n not in manager.all_tasks]
        if unknown:
            raise UserError(f"unknown task(s) {unknown}: neither a local task of this run "
                            "(cont_<domain>) nor one of lm-evaluation-harness's")
    # bootstrap_iters > 0 is what makes the harness report standard errors; for a mean
    # (acc, acc_norm) it uses the closed form sqrt(var / (n - 1)), no resampling
    results = simple_evaluate(model=lm, tasks=names, task_manager=manager, num_fewshot=0,
                              random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                              fewshot_random_seed=seed, bootstrap_iters=1000,
                              log_samples=False)
    out = {}
    for name in names:
        r = results["results"][name]
        out[name] = {"acc": r["acc,none"], "acc_stderr": r["acc_stderr,none"],
                     "acc_norm": r["acc_norm,none"],
                     "acc_norm_stderr": r["acc_norm_stderr,none"],
                     "n": int(results["n-samples"][name]["effective"])}
    return out


def gold_bpb(lm, jsonl: Path) -> float:
    """Bits per byte of each item's gold continuation after its context, pooled over the
    task: a smooth downstream score that does not sit at chance for small models."""
    import json

    from moelab.train.bpb import bits_per_byte

    class _Request:  # the one field of lm_eval's Instance the adapter reads
        def __init__(self, args: tuple[str, str]):
            self.args = args

    items = [json.loads(line) for line in Path(jsonl).read_text().splitlines()]
    pairs = [(it["context"], it["choices"][it["gold"]]) for it in items]
    lls = lm.loglikelihood([_Request(p) for p in pairs])
    return bits_per_byte(-sum(ll for ll, _ in lls),
                         sum(len(c.encode("utf-8")) for _, c in pairs))


def score_tasks(model, cfg, tokenizer: Tokenizer, names: list[str], task_dir: Path,
                items: int, seed: int) -> dict[str, dict]:
    """Write the local tasks among names, run all of them through the harness on the
    model, and add each local task's gold-answer bits per byte."""
    from moelab.eval.tasks import task_names, write_tasks

    local = [n for n in names if n in task_names(data_dir(cfg.data.path))]
    written = write_tasks(data_dir(cfg.data.path), tokenizer, local, task_dir, items, seed)
    lm = make_lm(model_logits_fn(model, cfg.train.dtype), tokenizer, cfg.data.seq_len)
    scores = run_tasks(lm, task_dir, names, seed)
    for name, jsonl in written.items():
        scores[name]["gold_bpb"] = gold_bpb(lm, jsonl)
    return scores


def lab_metrics(scores: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The lab's names: task_acc/<task>, task_acc_norm/<task> and their _stderr."""
    out = {}
    for task, s in scores.items():
        for key in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr", "gold_bpb"):
            if isinstance(s.get(key), float) and math.isfinite(s[key]):
                out[f"task_{key}/{task}"] = s[key]
    return out
