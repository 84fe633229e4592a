"""mkdocs hooks (mkdocs.yml `hooks:`): the results pages and the nav's pending entries.

- The Results section is generated at build time from bench/results by
  scripts/results_pages.py (pages, their images, and the nav entries under "Results"), so
  no number on those pages is typed by hand and nothing generated is committed.
- PENDING lists pages that other branches add. Until a page's file is in docs/, its nav
  entry is left out (logged), so `mkdocs build --strict` passes on a branch without it and
  the page appears in the nav as soon as the file lands. Once every one of them is merged,
  the list can be emptied.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_pages  # noqa: E402  (scripts/ is not a package)
from mkdocs.structure.files import File  # noqa: E402

PENDING = {"dispatch.md", "post-training.md", "serving.md", "recipe-options.md",
           "reliability.md", "ladder-heldout.md"}
RESULTS_TITLE = "Results"
log = logging.getLogger("mkdocs.hooks.moelab")
_pages: list[results_pages.Page] = []


def _nav(items: list[Any], docs: Path) -> list[Any]:
    out = []
    for item in items:
        if isinstance(item, dict):
            (title, value), = item.items()
            if title == RESULTS_TITLE:
                out.append({title: results_pages.nav(_pages)})
            elif isinstance(value, list):
                out.append({title: _nav(value, docs)})
            elif value in PENDING and not (docs / value).exists():
                log.info("nav: %r left out until docs/%s is merged", title, value)
            else:
                out.append(item)
        elif item in PENDING and not (docs / item).exists():
            log.info("nav: docs/%s left out until it is merged", item)
        else:
            out.append(item)
    return out


def on_config(config):
    _pages[:] = results_pages.pages()
    config.nav = _nav(config.nav, Path(config.docs_dir))
    return config


def on_files(files, config):
    for page in _pages:
        files.append(File.generated(config, page.path, content=page.markdown))
        for site_path, source in page.images.items():
            files.append(File.generated(config, site_path, abs_src_path=str(source)))
    return files
