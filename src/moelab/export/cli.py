"""`moelab export` (a run's latest checkpoint -> Hugging Face directory) and
`moelab generate` (text from a run's latest checkpoint).

JAX, torch and safetensors are imported inside the handlers, so `moelab --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moelab.config import data_dir
from moelab.schema import RUN_DIR_HELP, add_run_dir, float_in, int_in


class RunDirOrAction(argparse._SubParsersAction):
    """`moelab export RUN_DIR --out HF` beside `moelab export verify RUN_DIR`: a first
    positional that names no action is the run directory, the rest is export's own."""

    class _AnyWord(dict):
        """argparse's choices: any first word passes (the run directory when it names no
        action); the actions themselves stay in _name_parser_map."""

        def __contains__(self, word: object) -> bool:
            return True

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choices = self._AnyWord()

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if values[0] in self._name_parser_map:
            return super().__call__(parser, namespace, values, option_string)
        namespace.run_dir = Path(values[0])
        parsed, extras = parser.parse_known_args(values[1:], None)
        if getattr(parsed, self.dest) is not None:
            raise argparse.ArgumentError(self, f"the run directory goes after the action: "
                                               f"{parser.prog} {getattr(parsed, self.dest)} "
                                               f"{values[0]}")
        for key, value in vars(parsed).items():  # what the options before RUN_DIR set stays
            if key != "run_dir" and (value is not None or not hasattr(namespace, key)):
                setattr(namespace, key, value)
        if extras:
            vars(namespace).setdefault(argparse._UNRECOGNIZED_ARGS_ATTR, []).extend(extras)


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export", help="write a run's latest checkpoint as a transformers Qwen3-MoE model "
        "(`moelab export verify RUN_DIR` checks an export against golden files)")
    add_run_dir(export, positional=False)
    export.add_argument("--out", type=Path,
                        help="output directory (must not exist or be empty; required)")
    export.add_argument("--force", action="store_true",
                        help="replace --out when it holds an earlier moelab export (never a "
                        "directory moelab did not make)")
    export.set_defaults(func=_export)
    actions = export.add_subparsers(dest="action", action=RunDirOrAction, metavar="RUN_DIR",
                                    help=f"{RUN_DIR_HELP}, or `verify RUN_DIR`")
    verify = actions.add_parser(
        "verify", help="golden forward files from moelab vs the export in transformers: "
        "probabilities, argmax, routes; exit 1 if they disagree")
    add_run_dir(verify)
    verify.add_argument("--export", type=Path,
                        help="an existing export of this run to check (default: export the "
                             "latest checkpoint into OUT/hf)")
    verify.add_argument("--out", type=Path,
                        help="where golden.json, verify.json and the export hf/ go (default "
                        "RUN_DIR/verify; a directory moelab made, or empty, or new)")
    verify.add_argument("--bound", type=float_in(0.0, 1.0), default=1e-4,
                        help="max per-token probability error allowed (float32: 1e-4)")
    verify.add_argument("--margin-tol", type=float_in(0.0), default=1e-4,
                        help="a route flip is explained when the gold k vs k+1 router margin "
                             "is at most this")
    verify.add_argument("--backend", choices=("transformers", "vllm"), action="append",
                        help="backends to compare (default: transformers, and vllm when "
                             "installed)")
    verify.set_defaults(func=_verify)

    gen = subparsers.add_parser("generate", help="sample text from a run's latest checkpoint")
    add_run_dir(gen)
    gen.add_argument("--prompt", default="",
                     help="text to continue (default: '', a new document)")
    gen.add_argument("--max-new-tokens", type=int_in(1), default=64, help="tokens to sample")
    gen.add_argument("--temperature", type=float_in(0.0, 100.0), default=0.8,
                     help="softmax temperature; 0 = greedy")
    gen.add_argument("--top-p", type=float_in(0.0, 1.0), default=0.95,
                     help="nucleus mass to sample from")
    gen.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0,
                     help="sampling seed (same seed, same text)")
    gen.set_defaults(func=_generate)


def _load(run_dir: Path):
    from moelab.errors import UserError

    if not run_dir.is_dir():  # checked here: the loader would create it
        raise UserError(f"{run_dir} is not a run directory; pass the RUN_DIR of a training run")
    try:
        from moelab.train.checkpoint import load_latest
    except ModuleNotFoundError as err:
        if err.name != "moelab.train.checkpoint":
            raise
        raise UserError("this moelab has no checkpoint loader (moelab.train.checkpoint)") from err
    return load_latest(run_dir)


def _tokenizer_or_none(data_path: Path):
    """The run's tokenizer, or None (with a note) when its data directory is gone."""
    from moelab.data.tokenizer import load_tokenizer
    from moelab.errors import UserError

    try:
        return load_tokenizer(data_path)
    except UserError as err:
        print(f"note: no tokenizer exported: {err}", file=sys.stderr)
        return None


def _chat_template_or_none(data_path: Path) -> str | None:
    """The corpus's chat template, or None when it has none (a corpus without chat tokens)."""
    from moelab.data.chat import CHAT_TEMPLATE_FILE, chat_template_of

    return chat_template_of(data_path) if (data_path / CHAT_TEMPLATE_FILE).is_file() else None


def _export_run(model, cfg, out: Path, *, force: bool = False,
                identity: dict | None = None) -> Path:
    """export_hf with the run's tokenizer and chat template, when its corpus is there."""
    from moelab.export.hf import export_hf

    path = data_dir(cfg.data.path)
    tokenizer = _tokenizer_or_none(path)
    return export_hf(model, cfg, out, tokenizer, force=force, identity=identity,
                     chat_template=_chat_template_or_none(path) if tokenizer else None)


def _export(args: argparse.Namespace) -> None:
    from moelab.errors import UserError
    from moelab.export.hf import check_exportable, check_out
    from moelab.model.dispatch import entry_of

    if args.out is None:
        raise UserError("export needs --out HFDIR: moelab export RUN_DIR --out HFDIR (or "
                        "`moelab export verify RUN_DIR`)")
    check_out(args.out, args.force)  # before any loading
    model, cfg, step = _load(args.run_dir)
    check_exportable(cfg)  # before the tokenizer is looked for
    if entry_of(cfg.moe).drops:
        print(f"note: trained with moe.dispatch={cfg.moe.dispatch}; the export (like "
              "`moelab generate`) computes every expert assignment, dropping none",
              file=sys.stderr)
    from moelab.train.checkpoint import checkpoint_identity

    out = _export_run(model, cfg, args.out, force=args.force,
                      identity=checkpoint_identity(args.run_dir, step))
    print(f"exported step {step} of {args.run_dir} to {out}")


def _generate(args: argparse.Namespace) -> None:
    from moelab.data.tokenizer import load_tokenizer
    from moelab.errors import UserError
    from moelab.export.generate import check_length_fits, check_sampling, iter_text

    check_sampling(args.temperature, args.top_p)
    if args.max_new_tokens < 0:
        raise UserError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as err:  # argv bytes that are not UTF-8 arrive as surrogates
        raise UserError(f"--prompt is not UTF-8 text (a byte that is not UTF-8 at character "
                        f"{err.start}); pass the prompt as UTF-8") from None
    model, cfg, _ = _load(args.run_dir)
    tokenizer = load_tokenizer(data_dir(cfg.data.path))
    prompt = len(tokenizer.encode(args.prompt).ids) or 1  # '' starts with end-of-text
    check_length_fits(cfg, prompt + args.max_new_tokens, prompt)
    if prompt + args.max_new_tokens > cfg.data.seq_len:
        print(f"note: {prompt} prompt + {args.max_new_tokens} new tokens run past the "
              f"{cfg.data.seq_len}-token context the model trained on (data.seq_len); text "
              "beyond it is out of what training saw", file=sys.stderr, flush=True)
    # each piece as it is decoded: a long generation shows its progress
    print(args.prompt, end="", flush=True)
    for piece in iter_text(model, tokenizer, args.prompt, args.max_new_tokens,
                           args.temperature, args.top_p, args.seed):
        print(piece, end="", flush=True)
    print()


def _verify(args: argparse.Namespace) -> int:
    """Golden files from the run's latest checkpoint, compared with the export's outputs."""
    import json

    import numpy as np

    from moelab import outputs
    from moelab.data.shards import shard_path
    from moelab.errors import EXIT_FAILED, EXIT_OK, UserError
    from moelab.eval import golden as g
    from moelab.export.hf import check_export, check_exportable
    from moelab.train.checkpoint import checkpoint_identity

    if not args.bound > 0 or not args.margin_tol >= 0:
        raise UserError(f"--bound must be > 0 and --margin-tol >= 0, got {args.bound}, "
                        f"{args.margin_tol}")
    backends = args.backend or ["transformers", "vllm"]
    notes = []
    if "vllm" in backends and not g.vllm_available():
        if args.backend and "vllm" in args.backend:
            raise UserError(g.VLLM_NOTE)
        backends.remove("vllm")
        notes.append(g.VLLM_NOTE)
    elif "vllm" in backends:
        raise UserError("vLLM is installed, but moelab's vLLM backend is not written yet (no "
                        "GPU here to test it); compare its prompt log-probs with golden.json")
    out = args.out or args.run_dir / "verify"
    outputs.check_dir(out, ours=True if args.out is None else None,  # before any loading
                      made_by=("export verify",))
    if args.export is None and (out / "hf").exists() and not outputs.is_ours(out / "hf"):
        raise UserError(f"{out / 'hf'} was not made by moelab export (no {outputs.MARKER}); "
                        "move it away or choose another --out (verify exports into OUT/hf)")
    if args.export is not None:
        check_export(args.export)  # a file gone: refused before any loading
    model, cfg, step = _load(args.run_dir)
    check_exportable(cfg)
    ours = checkpoint_identity(args.run_dir, step)
    changed = [] if args.export is None else _check_given_export(args.export, cfg, ours,
                                                                 f"checkpoint {step} of "
                                                                 f"{args.run_dir}")
    streams = []
    for source in _sources(data_dir(cfg.data.path)):
        streams.append(np.load(shard_path(data_dir(cfg.data.path), source, "val"), mmap_mode="r"))
    if not streams:
        notes.append(f"no held-out data at {data_dir(cfg.data.path)}: the inputs are seeded "
                     "random tokens")
    inputs = g.fixed_inputs(cfg.data.seq_len, cfg.model.vocab_size, streams)
    outputs.mark(out, "export verify")
    chat = _chat_prompt(data_dir(cfg.data.path), cfg.data.seq_len)
    if chat is not None:  # its logits are compared like the others'
        inputs.append(chat)
    golden = g.write_golden(model, cfg, inputs, out / g.GOLDEN_FILE)
    export_dir = args.export
    if export_dir is None:
        if (out / "hf").exists():
            outputs.remove_ours(out / "hf")  # an earlier verify's export
        export_dir = _export_run(model, cfg, out / "hf", identity=ours)
    chat_problem = _chat_ids_differ(export_dir, chat) if chat is not None else None
    verdicts = [g.compare(golden, g.transformers_outputs(export_dir, golden), "transformers",
                          args.bound, args.margin_tol)]
    if changed:
        notes.append(f"changed since moelab export wrote them: {', '.join(changed)}")
    report = {"run_dir": str(args.run_dir), "step": step, "export": str(export_dir),
              "golden": str(out / g.GOLDEN_FILE), "notes": notes, "changed_files": changed,
              "passed": all(v.passed for v in verdicts) and not changed and chat_problem is None,
              "backends": [v.to_dict() for v in verdicts]}
    (out / g.VERIFY_FILE).write_text(json.dumps(report, indent=1) + "\n")
    print(f"export verify: step {step} of {args.run_dir} vs {export_dir}")
    print(g.verdict_text(verdicts, golden, notes))
    print(f"wrote {out / g.GOLDEN_FILE} and {out / g.VERIFY_FILE}")
    if not report["passed"]:
        failed = [f"{v.backend}: {'; '.join(v.problems())}" for v in verdicts if not v.passed]
        failed += [f"files changed since export: {', '.join(changed)}"] if changed else []
        failed += [chat_problem] if chat_problem else []
        print(f"moelab export verify: FAILED: {' | '.join(failed)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def _check_given_export(export_dir: Path, cfg, ours: dict, where: str) -> list[str]:
    """An --export checked against the run before anything is computed: its files (a file
    gone is refused), the run, corpus and tokenizer it recorded, and its config.json.
    Returns the files changed since moelab export wrote them."""
    from moelab.errors import UserError
    from moelab.export.hf import check_export, check_export_config

    theirs, changed = check_export(export_dir)
    for key, what in (("run_id", "run"), ("tokenizer_sha256", "tokenizer"),
                      ("corpus_sha256", "corpus")):
        if theirs.get(key) and ours.get(key) and theirs[key] != ours[key]:
            raise UserError(f"{export_dir} is an export of {what} {theirs[key][:12]}, but "
                            f"{where} has {what} {ours[key][:12]}; verify an export of "
                            "this run")
    if not (export_dir / "config.json").is_file():
        raise UserError(f"--export {export_dir} has no config.json; pass a `moelab export` "
                        "output directory")
    check_export_config(export_dir, cfg)
    return changed


def _sources(data_path: str) -> list[str]:
    """The dataset's sources, or [] when its directory is gone."""
    from moelab.data.loader import read_meta
    from moelab.errors import UserError

    try:
        return list(read_meta(data_path)["sources"])
    except UserError:
        return []


# The chat prompt `export verify` adds to its inputs when the corpus has a chat template.
CHAT_PROBE = [{"role": "system", "content": "Answer in one short sentence."},
              {"role": "user", "content": "What does the `ls` command do?"}]


def _chat_prompt(data_path: Path, seq_len: int):
    """CHAT_PROBE with the generation prompt, as moelab encodes it (int32, at most seq_len
    tokens), or None when the corpus has no chat template."""
    import numpy as np

    from moelab.data.chat import encode_chat
    from moelab.data.tokenizer import load_tokenizer

    template = _chat_template_or_none(data_path)
    if template is None:
        return None
    ids, _ = encode_chat(load_tokenizer(data_path), CHAT_PROBE, add_generation_prompt=True,
                         template=template)
    return np.asarray(ids[:seq_len], np.int32)


def _chat_ids_differ(export_dir: Path, chat) -> str | None:
    """A problem line when the export's `apply_chat_template` encodes CHAT_PROBE otherwise."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(export_dir)).apply_chat_template(
        CHAT_PROBE, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    if list(ids[:len(chat)]) != chat.tolist():
        return ("chat template: the export's apply_chat_template gives other token ids than "
                "moelab's encode_chat for the chat probe")
    return None

