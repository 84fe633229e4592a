"""Throughput of `prepare` on a slice of the default corpus: documents/s and tokens/s.

    python3 bench/data_throughput.py [--max-docs 1500] [--workers N]

Prints the rates and seconds per phase, and writes bench/results/data_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

from moelab.data.prepare import DEFAULT_MAX_CHARS, DEFAULT_SOURCES, prepare

RESULTS = Path(__file__).parent / "results" / "data_throughput.json"


def run(max_docs: int, workers: int | None) -> dict:
    with tempfile.TemporaryDirectory() as out:
        summary = prepare(out, DEFAULT_SOURCES, max_docs_per_source=max_docs,
                          max_chars=DEFAULT_MAX_CHARS, workers=workers)
    seconds = summary["seconds"]
    docs = sum(c["docs"] for c in summary["documents"].values())
    tokens = sum(summary[f"{split}_tokens"][s] for split in ("train", "val")
                 for s in summary["sources"])
    total = sum(seconds.values())
    return {
        "max_docs_per_source": max_docs,
        "workers": workers or os.cpu_count(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "documents": docs,
        "documents_by_source": summary["documents"],
        "tokens": tokens,
        "seconds": seconds,
        "seconds_total": round(total, 3),
        "documents_per_s": round(docs / total, 1),
        "tokens_per_s": round(tokens / total),
        "ingest_documents_per_s": round(docs / seconds["ingest"], 1),
        "tokenize_tokens_per_s": round(tokens / seconds["tokenize"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-docs", type=int, default=1500, help="documents per source")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    result = run(args.max_docs, args.workers)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['documents']} documents, {result['tokens']} tokens "
          f"in {result['seconds_total']} s", file=sys.stderr)
    print(f"{result['documents_per_s']} documents/s, {result['tokens_per_s']} tokens/s "
          f"(ingest {result['ingest_documents_per_s']} documents/s, "
          f"tokenize {result['tokenize_tokens_per_s']} tokens/s)")
    print("seconds per phase:", result["seconds"])


if __name__ == "__main__":
    main()
