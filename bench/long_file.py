"""Memory of `prepare` on one long file, split into pieces, as the file grows.

    python bench/long_file.py [--mb 8,32,128] [--max-chars 1000000] [--workers 2]

For each size, a file of that many MB of made-up paragraphs (a 3,000-word vocabulary, one
blank line between paragraphs) plus four short files is prepared in a fresh process with
`--max-chars` pieces; peak RSS is sampled over the process tree (bench/rss.py) and read per
stage from prepare's own probe. What should hold: the pieces tile the file (their byte
ranges cover it once), every piece is kept, and peak RSS does not grow with the file (one
task holds one shard of at most SHARD_DOCS pieces, whatever the file's size). The tokenizer
trains on a fixed 2M-character sample so that every size pays the same for it. Memory and
counts only, no speed claims. Writes bench/results/benchmarks/long_file.json.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from rss import run_sampled  # bench/rss.py

RESULTS = Path(__file__).parent / "results" / "benchmarks" / "long_file.json"
CHILD = """
import json, sys
from moelab.data.prepare import prepare
from moelab.data.provenance import read_manifest
out, glob, max_chars, workers = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
meta = prepare(out, {"docs": glob}, max_chars=max_chars, workers=workers, vocab_size=1024,
               tokenizer_sample_chars=2_000_000)
pieces = [r for r in read_manifest(out) if r["path"].endswith("long.txt")]
print(json.dumps({"pieces": [[r["byte_start"], r["byte_end"], r["status"], r["reason"]]
                             for r in pieces], "peak_rss_mb": meta["peak_rss_mb"]}))
"""


def write_text(path: Path, n_bytes: int, seed: int) -> int:
    """n_bytes (or a little more) of paragraphs, written as they are made; its size."""
    rng = random.Random(seed)
    vocab = ["".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 9)))
             for _ in range(3000)]
    size = 0
    with open(path, "w") as file:
        while size < n_bytes:
            words = rng.choices(vocab, k=12 * rng.randint(3, 30))
            para = "\n".join(" ".join(words[i : i + 12]) for i in range(0, len(words), 12))
            size += file.write(para + "\n\n")
    return size


def run(tmp: Path, mb: int, max_chars: int, workers: int) -> dict:
    src = tmp / f"src{mb}"
    src.mkdir()
    size = write_text(src / "long.txt", mb * 1_000_000, seed=mb)
    for i in range(4):
        write_text(src / f"short{i}.txt", 5_000, seed=1000 + i)
    stdout, sampled = run_sampled([sys.executable, "-c", CHILD, str(tmp / f"data{mb}"),
                                   str(src / "*.txt"), str(max_chars), str(workers)])
    found = json.loads(stdout.strip().splitlines()[-1])
    spans = [(a, b) for a, b, _, _ in found["pieces"]]
    tiles = spans[0][0] == 0 and spans[-1][1] == size and all(
        x[1] == y[0] for x, y in zip(spans, spans[1:], strict=False))
    probe = found["peak_rss_mb"]
    return {"file_mb": round(size / 1e6, 2), "pieces": len(spans),
            "kept": sum(status == "kept" for _, _, status, _ in found["pieces"]),
            "largest_piece_bytes": max(b - a for a, b in spans), "pieces_tile_the_file": tiles,
            **sampled,
            "probe_driver_mb": max(probe["driver"].values()),
            "probe_largest_task_mb": max(probe["tasks"].values()),
            "probe_tasks_by_stage_mb": probe["tasks"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", default="8,32,128", help="sizes of the long file, MB")
    parser.add_argument("--max-chars", type=int, default=1_000_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--results", type=Path, default=RESULTS, help="JSON to write")
    args = parser.parse_args()
    result: dict = {"max_chars": args.max_chars, "workers": args.workers, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp_name:
        for mb in [int(m) for m in args.mb.split(",")]:
            r = result["runs"][f"{mb}MB"] = run(Path(tmp_name), mb, args.max_chars, args.workers)
            print(f"{r['file_mb']} MB: {r['pieces']} pieces ({r['kept']} kept, largest "
                  f"{r['largest_piece_bytes']} B, tile the file: {r['pieces_tile_the_file']}); "
                  f"peak RSS sampled: tree {r['peak_rss_mb_tree']} MB, one process "
                  f"{r['peak_rss_mb_one_process']} MB; probe: driver {r['probe_driver_mb']} "
                  f"MB, largest task {r['probe_largest_task_mb']} MB", flush=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
