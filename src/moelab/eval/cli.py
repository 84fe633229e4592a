"""`moelab eval`: evaluate a run's latest checkpoint.

    moelab eval tasks RUN_DIR [--tasks cont_code,cont_prose]   lm-evaluation-harness tasks
    moelab eval bpb RUN_DIR                                   bits per byte per domain
    moelab eval longctx RUN_DIR                   loss by position, passkey, short context

Results go to RUN_DIR/eval/ and, with --experiment, to the lab (plotted over training when
several checkpoints are evaluated). JAX and the harness are imported inside the handlers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from moelab.config import data_dir
from moelab.schema import add_run_dir, int_in


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval", help="evaluate a run: held-out tasks, bits per byte")
    actions = p.add_subparsers(dest="action", required=True)
    tasks = actions.add_parser(
        "tasks", help="multiple-choice tasks (ranked classification) through "
        "lm-evaluation-harness: acc, acc_norm with standard errors")
    add_run_dir(tasks)
    tasks.add_argument("--tasks", default="",
                       help="comma-separated: local cont_<domain> tasks built from held-out "
                            "data (default: all of them), or the harness's own (e.g. "
                            "hellaswag, where its dataset is available)")
    tasks.add_argument("--items", type=int_in(1, 1_000_000), default=200,
                       help="items per local task")
    tasks.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                       help="draws the local tasks' items")
    tasks.add_argument("--tokenizer", type=Path,
                       help="tokenizer.json to use (default: the run's dataset's)")
    _common(tasks)
    tasks.set_defaults(func=_tasks)
    bpb = actions.add_parser("bpb", help="bits per byte (and loss) per held-out domain over "
                             "the whole val split, with the macro average")
    add_run_dir(bpb)
    _common(bpb)
    bpb.set_defaults(func=_bpb)
    add_longctx(actions)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="results directory (default RUN_DIR/eval)")
    p.add_argument("--experiment", help="also log the results to this lab experiment, at the "
                   "checkpoint's step")


def _load(run_dir: Path):
    from moelab.errors import UserError
    from moelab.train.checkpoint import load_latest

    if not run_dir.is_dir():
        raise UserError(f"{run_dir} is not a run directory; pass the run dir of a training run")
    return load_latest(run_dir)


def _tokenizer(cfg, path: Path | None):
    """The tokenizer to score with, refused (one line) if it is not the one the run's
    tokens were made with."""
    from tokenizers import Tokenizer

    from moelab.data.tokenizer import TOKENIZER_FILE, load_tokenizer
    from moelab.errors import UserError

    data = load_tokenizer(data_dir(cfg.data.path))
    try:
        tokenizer = data if path is None else Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - the tokenizers library raises bare Exception
        raise UserError(f"--tokenizer {path}: not a tokenizer.json file") from None
    if tokenizer.get_vocab_size() > cfg.model.vocab_size or (
            path is not None and tokenizer.get_vocab() != data.get_vocab()):
        where = path or data_dir(cfg.data.path) / TOKENIZER_FILE
        raise UserError(f"tokenizer mismatch: {where} ({tokenizer.get_vocab_size()} tokens) is "
                        f"not the tokenizer of {data_dir(cfg.data.path)} that the model "
                        f"(vocab_size "
                        f"{cfg.model.vocab_size}) was trained with")
    return tokenizer


def _out(args: argparse.Namespace) -> Path:
    """The results directory, checked before any loading: RUN_DIR/eval is the run's own, a
    given --out must be new, empty or an earlier eval's (outputs.check_dir)."""
    from moelab import outputs
    from moelab.errors import UserError

    if args.out is None and args.run_dir.exists() and not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir} is a file, not a run directory; pass the directory "
                        "`moelab train` wrote")  # not "--out FILE/eval", a flag never given
    out = args.out or args.run_dir / "eval"
    outputs.check_dir(out, ours=True if args.out is None else None, made_by=("eval",))
    return out


def _write(out: Path, name: str, record: dict) -> Path:
    from moelab import outputs

    outputs.mark(out, "eval")
    path = out / name
    path.write_text(json.dumps(record, indent=1) + "\n")
    with open(out / "evals.jsonl", "a") as f:  # every eval of this run, in order
        f.write(json.dumps(record) + "\n")
    return path


def _check_experiment(experiment: str | None) -> None:
    """Before any evaluating: an --experiment the lab does not hold is one line now, not
    after minutes of scoring."""
    if not experiment:
        return
    from moelab.lab.store import Store, default_lab_path

    with Store(default_lab_path(), "ro") as store:
        store.get_experiment(experiment)  # a UserError naming it if unknown


def _to_lab(experiment: str | None, run_dir: Path, cfg, step: int,
            metrics: dict[str, float]) -> None:
    """Log to the lab run of this run dir (a new run of the experiment if it has none)."""
    if not experiment:
        return
    from moelab.config import config_to_dict
    from moelab.lab.store import Store, default_lab_path

    with Store(default_lab_path()) as store:
        store.get_experiment(experiment)  # a UserError naming it if unknown
        run_id = next((r.id for r in store.runs(experiment)
                       if Path(r.run_dir).resolve() == run_dir.resolve()), None)
        if run_id is None:
            run_id = store.start_run(experiment, str(run_dir), config_to_dict(cfg))
            store.finish_run(run_id, "succeeded", "evaluation of a checkpoint")
        store.log_metrics(run_id, step, metrics)
    print(f"logged to lab experiment {experiment}, run {run_id}, step {step}")


def _tasks(args: argparse.Namespace) -> None:
    from moelab.errors import UserError
    from moelab.eval import harness
    from moelab.eval.tasks import PREFIX, task_names

    if args.items < 1:
        raise UserError(f"--items must be >= 1, got {args.items}")
    _check_experiment(args.experiment)
    out = _out(args)
    model, cfg, step = _load(args.run_dir)
    available = task_names(data_dir(cfg.data.path))
    names = [n.strip() for n in args.tasks.split(",") if n.strip()] or available
    unknown = [n for n in names if n.startswith(PREFIX) and n not in available]
    if unknown:  # before the harness indexes its own tasks (seconds)
        raise UserError(f"unknown local task(s) {unknown}; this run's dataset has {available}")
    tokenizer = _tokenizer(cfg, args.tokenizer)
    scores = harness.score_tasks(model, cfg, tokenizer, names, out / "tasks", args.items,
                                 args.seed)
    record = {"run_dir": str(args.run_dir), "step": step, "kind": "tasks", "seed": args.seed,
              "items": args.items, "scores": scores}
    path = _write(out, f"tasks-step{step}.json", record)
    print(f"step {step} of {args.run_dir} (chance 0.25 for the local 4-way tasks):")
    for name, s in scores.items():
        gold = f"   gold bpb {s['gold_bpb']:.3f}" if "gold_bpb" in s else ""
        print(f"  {name:<16} acc {s['acc']:.3f} +- {s['acc_stderr']:.3f}   acc_norm "
              f"{s['acc_norm']:.3f} +- {s['acc_norm_stderr']:.3f}   n={s['n']}{gold}")
    print(f"wrote {path}")
    _to_lab(args.experiment, args.run_dir, cfg, step, harness.lab_metrics(scores))


def _bpb(args: argparse.Namespace) -> None:
    from moelab.eval.bpb import whole_split_evaluator

    _check_experiment(args.experiment)
    out = _out(args)
    model, cfg, step = _load(args.run_dir)
    _tokenizer(cfg, None)
    evaluate = whole_split_evaluator(data_dir(cfg.data.path), cfg.data.seq_len, cfg.train.dtype)
    metrics = evaluate(model)
    path = _write(out, f"bpb-step{step}.json",
                  {"run_dir": str(args.run_dir), "step": step, "kind": "bpb",
                   "metrics": metrics})
    print(f"step {step} of {args.run_dir}, whole held-out split:")
    for key, value in metrics.items():
        print(f"  {key:<22} {value:.4f}")
    print(f"wrote {path}")
    _to_lab(args.experiment, args.run_dir, cfg, step, metrics)


def add_longctx(evals: argparse._SubParsersAction) -> None:
    """The `longctx` subcommand, on whichever `moelab eval` parser holds the others."""
    from moelab.eval.longctx import TRIALS

    p = evals.add_parser("longctx", help="loss by position, passkey retrieval and short-"
                         "context loss of a run's newest checkpoint (JSON; lab if attached)")
    add_run_dir(p)
    p.add_argument("--original", type=int_in(0), default=0,
                   help="the pre-extension context (0: model.rope's original length, else "
                   "data.seq_len / model.rope.factor)")
    p.add_argument("--max-multiple", type=int_in(1, 64), default=8,
                   help="longest passkey/position eval, in multiples of the original")
    p.add_argument("--trials", type=int_in(1, 10_000), default=TRIALS,
                   help="passkey pairs (key vs another key, same text) per length and depth")
    p.add_argument("--out", type=Path, help="JSON path (default RUN_DIR/longctx.json)")
    p.set_defaults(func=_longctx)


def _longctx(args: argparse.Namespace) -> int:
    from moelab.errors import UserError
    from moelab.eval.longctx import run

    if not args.run_dir.is_dir():
        raise UserError(f"{args.run_dir} is not a run directory; pass a training run's dir")
    result = run(args.run_dir, args.original or None, args.max_multiple, args.trials, args.out)
    last = result["loss_by_position"]["buckets"]
    print(f"step {result['step']}: short-context loss {result['short_context_loss']['mean']:.4f}"
          + (f", last-bucket loss {last[-1]['loss']:.4f}" if last else "")
          + f"; written to {args.out or args.run_dir / 'longctx.json'}")
    return 0
