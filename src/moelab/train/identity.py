"""Which run wrote a checkpoint, and from which corpus and tokenizer.

A checkpoint alone does not say where it came from: copied into another run's directory it
resumes as that run, and read while `data.path` names another corpus (a relative path from
another directory, a re-prepared dataset) it evaluates, samples and exports with the wrong
tokens, silently. So every checkpoint records its identity: the run's id (RUN_ID_FILE in
the run directory, made on the run's first start), the corpus's `content_sha256` and the
sha256 of its tokenizer.json. Readers (resume, eval, generate, export, export verify) check
it against the run directory and the corpus they are about to use and refuse a mismatch,
naming both. Checkpoints written before identities were recorded are accepted with a
one-line warning.
"""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path
from typing import Any

from moelab.errors import UserError
from moelab.outputs import file_sha256
from moelab.train.rundir import RUN_ID_FILE

IDENTITY_KEY = "identity"  # where a checkpoint's run state holds it


def run_id(run_dir: Path) -> str | None:
    """The run's id, or None for a run directory that has none (yet, or from before)."""
    try:
        value = json.loads((Path(run_dir) / RUN_ID_FILE).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def ensure_run_id(run_dir: Path, inherited: str | None = None) -> str:
    """The run's id, made on its first start (`inherited`: the id its checkpoints already
    carry, for a run that predates RUN_ID_FILE)."""
    found = run_id(run_dir)
    if found is None:
        found = inherited or uuid.uuid4().hex
        (Path(run_dir) / RUN_ID_FILE).write_text(json.dumps({"run_id": found}) + "\n")
    return found


def corpus_identity(data_dir: Path) -> dict[str, str | None]:
    """The corpus's content_sha256 and its tokenizer.json's sha256 (None where absent)."""
    from moelab.data.loader import META_FILE
    from moelab.data.tokenizer import TOKENIZER_FILE

    try:
        meta = json.loads((Path(data_dir) / META_FILE).read_text())
        corpus = meta.get("content_sha256") if isinstance(meta, dict) else None
    except (OSError, ValueError):
        corpus = None
    tokenizer = Path(data_dir) / TOKENIZER_FILE
    return {"corpus_sha256": corpus if isinstance(corpus, str) else None,
            "tokenizer_sha256": file_sha256(tokenizer) if tokenizer.is_file() else None}


def check(meta: dict[str, Any], run_dir: Path, data_dir: Path, step: int) -> None:
    """Refuse checkpoint `step` (its run state `meta`) if another run wrote it, or if the
    corpus or tokenizer at data_dir is not the one it was trained on."""
    where = f"checkpoint {step} in {run_dir}"
    saved = meta.get(IDENTITY_KEY)
    if not isinstance(saved, dict):
        print(f"warning: {where} predates identity records; it cannot be checked against "
              "this run and its corpus", file=sys.stderr)
        return
    own = run_id(run_dir)
    if own is not None and saved.get("run_id") not in (None, own):
        raise UserError(f"{where} was written by run {saved.get('run_id')}, not by this run "
                        f"({own}): a checkpoint of another run; move it out of this run")
    now = corpus_identity(data_dir)
    for key, what in (("corpus_sha256", "corpus"), ("tokenizer_sha256", "tokenizer")):
        was, is_ = saved.get(key), now[key]
        if was and is_ and was != is_:
            if key == "tokenizer_sha256" and not _loads(data_dir):
                return  # a damaged file, not another tokenizer: its reader says so
            raise UserError(f"{where} was trained on the {what} with sha256 {was[:12]}, but "
                            f"{data_dir} holds the {what} {is_[:12]}; point data.path at the "
                            "run's own corpus")


def _loads(data_dir: Path) -> bool:
    from moelab.data.tokenizer import load_tokenizer

    try:
        load_tokenizer(data_dir)
    except UserError:
        return False
    return True
