"""mkdocs hook (mkdocs.yml `hooks:`): the results pages.

- The Results section is generated at build time from bench/results by
  scripts/results_pages.py (pages, their images, and the nav entries under "Results"), so
  no number on those pages is typed by hand and nothing generated is committed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import results_pages  # noqa: E402  (scripts/ is not a package)
from mkdocs.structure.files import File  # noqa: E402

RESULTS_TITLE = "Results"
_pages: list[results_pages.Page] = []


def _nav(items: list[Any]) -> list[Any]:
    """The nav with the generated Results section in place of its placeholder."""
    out = []
    for item in items:
        if isinstance(item, dict):
            (title, value), = item.items()
            if title == RESULTS_TITLE:
                out.append({title: results_pages.nav(_pages)})
            elif isinstance(value, list):
                out.append({title: _nav(value)})
            else:
                out.append(item)
        else:
            out.append(item)
    return out


def on_config(config):
    _pages[:] = results_pages.pages()
    config.nav = _nav(config.nav)
    return config


def on_files(files, config):
    for page in _pages:
        files.append(File.generated(config, page.path, content=page.markdown))
        for site_path, source in page.images.items():
            files.append(File.generated(config, site_path, abs_src_path=str(source)))
    return files
