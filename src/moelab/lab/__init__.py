"""moelab.lab: the open lab notebook.

records (experiments, runs, status rules), store (one SQLite file per lab), report (the
shared view of an experiment: tables, Markdown, PNG), site (HTML pages with interactive
charts, static publishing, findings), dashboard (the site live, read-only, localhost),
mirror (optional W&B), sink (what training reports to: registered here, on import, so
train never imports the lab), cli; static/ holds charts.js.
"""

from moelab.lab.sink import StoreLab
from moelab.train.sink import use_lab

use_lab(StoreLab())
