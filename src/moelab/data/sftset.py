"""A question-answer set built from text on the machine that nobody here wrote.

Two kinds of pairs, each with its provenance (the file it came from):

- man pages (sections 1 and 8): "What does the `ls` command do?" -> the page's NAME line
  ("list directory contents"), as the page's authors wrote it;
- the Python standard library: "What does `json.dumps(obj, *, skipkeys=False, ...)` do?"
  -> the first sentence of that function's docstring (read with `ast`, nothing imported).

An example goes to the held-out split when the sha256 of its question falls in the first
val_fraction of the hash range: the split depends on the question alone, not on the order
files are found, and no question is in both splits. Duplicate questions keep their first
answer (sorted by provenance). The set is what those authors wrote, mechanically turned
into questions; it is not instruction data, not checked by a person, and a man page's NAME
line is a terse summary, not an answer anyone would write.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from moelab.data.shards import write_json, write_text
from moelab.errors import UserError

MAN_GLOBS = ("/usr/share/man/man1/*.gz", "/usr/share/man/man8/*.gz")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
SYSTEM = "Answer in one short sentence."
MAX_ANSWER_CHARS = 120  # a reply of one line: long docstring sentences are left out
MAX_QUESTION_CHARS = 160
SPLIT_FILES = {"train": "train.jsonl", "val": "val.jsonl"}
META = "sft_meta.json"


def man_pairs() -> Iterator[tuple[str, str, str]]:
    """(question, answer, provenance) from each man page's NAME line 'name \\- summary'."""
    for pattern in MAN_GLOBS:
        for path in sorted(Path("/").glob(pattern.lstrip("/"))):
            try:
                with gzip.open(path, "rt", encoding="utf-8", errors="strict") as f:
                    head = f.read(4000)
            except (OSError, UnicodeDecodeError, EOFError):
                continue
            match = re.search(r"^\.SH\s+\"?NAME\"?\s*\n(.+?)\n", head, re.M)
            if not match:
                continue
            line = re.sub(r"\\f[BIRP]|\\&|\\\(..", "", match.group(1)).strip()
            parts = re.split(r"\s+\\?-\s+", line, maxsplit=1)
            if len(parts) != 2 or line.startswith("."):
                continue
            name, summary = (p.replace("\\-", "-").strip() for p in parts)
            name, summary = name.split(",")[0].strip(), summary.rstrip(".")
            if "\\" in name + summary:
                continue
            if not re.fullmatch(r"[\w.+-]+", name) or not 3 <= len(summary) <= MAX_ANSWER_CHARS:
                continue
            yield f"What does the `{name}` command do?", summary, f"man:{path}"


def docstring_pairs() -> Iterator[tuple[str, str, str]]:
    """(question, answer, provenance) from each public module-level function of the stdlib
    with a docstring: its signature -> the docstring's first sentence."""
    for path in sorted(STDLIB.rglob("*.py")):
        rel = path.relative_to(STDLIB)
        if SKIP_DIRS & set(rel.parts) or any(p.startswith("_") for p in rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            sentence = re.split(r"(?<=\.)\s|\n\n", doc.strip(), maxsplit=1)[0]
            sentence = " ".join(sentence.split()).rstrip(".")
            question = f"What does `{module}.{node.name}({ast.unparse(node.args)})` do?"
            if (3 <= len(sentence) <= MAX_ANSWER_CHARS and len(question) <= MAX_QUESTION_CHARS
                    and not sentence.startswith((">>>", ":"))):
                yield question, sentence, f"py:{path}:{node.lineno}"


def split_of(question: str, val_fraction: float) -> str:
    point = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64
    return "val" if point < val_fraction else "train"


def build_sft_set(out: str | Path, val_fraction: float = 0.1,
                  max_examples: int | None = None) -> dict:
    """Write DIR/train.jsonl and DIR/val.jsonl (one {"messages", "source"} a line) and
    DIR/sft_meta.json (sizes, sha256 of each file, the rules); return the meta. The first
    max_examples questions by their hash are kept (None: all), man pages and docstrings
    alike, so a smaller set is a sample of the same mix."""
    if not 0 < val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction} must be in (0, 1)")
    seen: dict[str, tuple[str, str]] = {}
    for question, answer, source in [*man_pairs(), *docstring_pairs()]:
        seen.setdefault(question, (answer, source))
    if not seen:
        raise UserError("found no man pages or stdlib docstrings to build the set from")
    # the sample's order is a hash of its own: the split's hash would put every held-out
    # question first (they are the low end of its range)
    order = sorted(seen, key=lambda q: hashlib.sha256(b"sample\0" + q.encode()).digest())
    kept = order[:max_examples] if max_examples else order
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lines: dict[str, list[str]] = {"train": [], "val": []}
    kinds: dict[str, dict[str, int]] = {"train": {}, "val": {}}
    for question in sorted(kept, key=lambda q: seen[q][1]):
        answer, source = seen[question]
        split = split_of(question, val_fraction)
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer}]
        lines[split].append(json.dumps({"messages": messages, "source": source}))
        kind = source.split(":", 1)[0]
        kinds[split][kind] = kinds[split].get(kind, 0) + 1
    meta = {"examples": {s: len(v) for s, v in lines.items()}, "by_kind": kinds,
            "val_fraction": val_fraction, "max_examples": max_examples,
            "sha256": {}, "rule": __doc__.split("\n\n", 2)[2].strip()}
    for split, name in SPLIT_FILES.items():
        text = "".join(line + "\n" for line in lines[split])
        write_text(out / name, text)
        meta["sha256"][split] = hashlib.sha256(text.encode()).hexdigest()
    write_json(out / META, meta)
    return meta
