"""SFT on the man-page / docstring QA set: held-out assistant-token loss and exact match,
base against SFT, over seeds.

For each seed: pre-train a tiny base on a chat-token corpus (stdlib code and man pages,
`prepare --chat-tokens`), then branch from its last checkpoint (`--from BASE
--weights-only`) onto the QA set's train split (`data.conversations`) under its own LR
schedule (a stage with a restart). Both are scored on the held-out split: the mean
cross-entropy of the assistant's tokens (their <|im_end|> included) given the prompt, and
exact match: the greedy reply to (system, user) with the generation prompt, stopped at
<|im_end|>, equals the reference answer character for character.

    PYTHONPATH=src python bench/sft.py [--seeds 2] [--out bench/results/sft/sft.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from machine import run_main  # bench/machine.py

from moelab.config import config_from_dict
from moelab.data.chat import (
    END_OF_TURN,
    chat_template_of,
    encode_all,
    encode_chat,
    pack,
    read_conversations,
)
from moelab.data.loader import read_meta
from moelab.data.prepare import DEFAULT_SOURCES, prepare
from moelab.data.sftset import META, SPLIT_FILES, build_sft_set
from moelab.data.tokenizer import load_tokenizer
from moelab.export.generate import generate
from moelab.train.checkpoint import load_latest
from moelab.train.step import make_loss
from moelab.train.trainer import Parent, train

SEQ_LEN = 128  # pre-training
SFT_SEQ_LEN = 192  # the longest conversation of the sample is ~130 tokens
BASE_STEPS, SFT_STEPS = 300, 300
EXAMPLES = 1200  # a hash-ordered sample of the set: ~1080 train, ~120 held out
TRAIN_PROBE = 100  # train conversations whose exact match is also measured
MAX_NEW = 40  # tokens of a greedy reply: the longest reference is ~30
METRICS = ("loss", "exact_match", "stops", "train_exact_match")


def model_config(corpus: Path, seed: int, **sections) -> dict:
    raw = {
        "model": {"vocab_size": 2048, "d_model": 96, "n_layers": 2, "n_heads": 4,
                  "n_kv_heads": 2, "d_ff": 96},
        "moe": {"n_experts": 4, "top_k": 2, "dispatch": "dropless"},
        "data": {"path": str(corpus), "seq_len": SEQ_LEN, "batch_size": 16, "seed": seed},
        "optim": {"lr": 3e-3, "warmup_steps": 20},
        "train": {"steps": BASE_STEPS, "seed": seed, "log_every": 50, "eval_every": 100,
                  "eval_batches": 1, "checkpoint_every": 100, "keep_checkpoints": 1},
    }
    for name, fields in sections.items():
        raw[name] = fields if isinstance(fields, list) else {**raw.get(name, {}), **fields}
    return raw


def held_out_scores(run_dir: Path, data: Path, val_path: Path, train_path: Path) -> dict:
    """{loss, exact_match, stops} of the run's last checkpoint on the held-out
    conversations, and train_exact_match on the first TRAIN_PROBE train ones (seen in SFT:
    whether greedy decoding can reproduce an answer at all at this size)."""
    model, cfg, _ = load_latest(run_dir)
    tokenizer, template = load_tokenizer(data), chat_template_of(data)
    conversations = read_conversations(val_path)
    packed = pack(encode_all(tokenizer, conversations, SFT_SEQ_LEN, template), SFT_SEQ_LEN,
                  read_meta(data)["eos_id"])
    loss = eqx.filter_jit(make_loss(cfg))
    nll = targets = 0.0
    for start in range(0, len(packed), 16):
        rows = np.arange(start, min(start + 16, len(packed)))
        batch = {k: jnp.asarray(v) for k, v in packed.batch(rows).items()}
        n = float(packed.loss_mask[rows, 1:].sum())
        nll += float(loss(model, batch)[1]["ce"]) * n
        targets += n
    end = tokenizer.token_to_id(END_OF_TURN)

    def replies(convs) -> tuple[float, float]:
        """(exact match, share of replies that end with <|im_end|> within MAX_NEW)."""
        hits = stops = 0
        for conv in convs:
            prompt, _ = encode_chat(tokenizer, conv.messages[:-1], add_generation_prompt=True,
                                    template=template)
            out = generate(model, prompt, MAX_NEW, eos_id=end)
            reply = tokenizer.decode(out[:-1]) if out and out[-1] == end else None
            hits += reply == conv.messages[-1]["content"]
            stops += reply is not None
        return hits / len(convs), stops / len(convs)

    exact, stops = replies(conversations)
    train_exact, _ = replies(read_conversations(train_path)[:TRAIN_PROBE])
    return {"loss": nll / targets, "exact_match": exact, "stops": stops,
            "train_exact_match": train_exact}


def summary(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values),
            "sd": statistics.stdev(values) if len(values) > 1 else 0.0, "values": values}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results/sft/sft.json"))
    parser.add_argument("--work", type=Path, default=None, help="keep the runs here")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="moelab-sft-"))
    started = time.time()
    qa = work / "qa"
    if not (qa / META).is_file():
        build_sft_set(qa, val_fraction=0.1, max_examples=EXAMPLES)
    qa_meta = json.loads((qa / META).read_text())
    data = work / "corpus"
    if not (data / "meta.json").is_file():
        prepare(data, DEFAULT_SOURCES, vocab_size=2048, max_docs_per_source=200,
                max_chars=20_000, chat_tokens=True)
    scores: dict[str, list[dict]] = {"base": [], "sft": []}
    for seed in range(args.seeds):
        base, sft = work / f"base{seed}", work / f"sft{seed}"
        train(config_from_dict(model_config(data, seed)), base)
        sft_raw = model_config(
            data, seed, data={"conversations": str(qa / SPLIT_FILES["train"]),
                              "seq_len": SFT_SEQ_LEN},
            optim={"lr": 1e-3}, train={"steps": BASE_STEPS + SFT_STEPS},
            stages=[{"mixture": {}},  # the base's steps, skipped by the branch
                    {"start": BASE_STEPS, "optimizer": "fresh",
                     "restart": {"warmup": 20, "decay": "cosine"}}])
        train(config_from_dict(sft_raw), sft, parent=Parent(base, None, weights_only=True))
        for name, run in (("base", base), ("sft", sft)):
            scores[name].append(held_out_scores(run, data, qa / SPLIT_FILES["val"],
                                                qa / SPLIT_FILES["train"]))
            print(seed, name, scores[name][-1], flush=True)
    corpus = read_meta(data)
    result = {
        **{name: {metric: summary([s[metric] for s in runs]) for metric in METRICS}
           for name, runs in scores.items()},
        "seeds": args.seeds,
        "set": {"examples": qa_meta["examples"], "by_kind": qa_meta["by_kind"],
                "sha256": qa_meta["sha256"]},
        "corpus": {"content_sha256": corpus["content_sha256"],
                   "tokenizer_sha256": hashlib.sha256(
                       (data / "tokenizer.json").read_bytes()).hexdigest(),
                   "train_tokens": corpus["train_tokens"]},
        "model": model_config(data, 0)["model"] | {"moe": model_config(data, 0)["moe"]},
        "base_steps": BASE_STEPS, "sft_steps": SFT_STEPS, "seq_len": SEQ_LEN,
        "sft_seq_len": SFT_SEQ_LEN,
        "batch_size": 16, "max_new_tokens": MAX_NEW,
        "metrics": {"loss": "mean cross-entropy (nats) of the held-out assistant tokens, "
                            "<|im_end|> included, given the conversation before them",
                    "exact_match": "greedy reply stopped at <|im_end|> equals the reference",
                    "stops": "share of greedy replies that end with <|im_end|> within "
                             "max_new_tokens",
                    "train_exact_match": f"exact match on the first {TRAIN_PROBE} train "
                                         "conversations (seen in SFT)"},
        "wall_s": round(time.time() - started),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("base", "sft")}, indent=1))


if __name__ == "__main__":
    run_main(main)
