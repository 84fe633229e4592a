"""moelab.lab: the open lab notebook.

records (experiments, runs, status rules), store (one SQLite file per lab), report
(HTML/Markdown/PNG), dashboard (read-only, localhost), mirror (optional W&B), cli.
"""
