"""Evaluation: bits per byte per held-out domain (`bpb`), local held-out tasks (`tasks`)
run through lm-evaluation-harness (`harness`), golden forward files for serving
consistency (`golden`). The trainer, the ladder and the CLI call these; they import none
of them."""
