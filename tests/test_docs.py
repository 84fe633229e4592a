"""The documentation: the site builds with --strict, the README stays short and its headline
table matches bench/results, and bench/results keeps one folder per study."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def results_pages():
    spec = importlib.util.spec_from_file_location("results_pages",
                                                  ROOT / "scripts" / "results_pages.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("results_pages", module)  # its dataclass looks its module up
    spec.loader.exec_module(sys.modules["results_pages"])
    return sys.modules["results_pages"]


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # material's banner
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the generated results pages are in the site, with the plots they show
    assert (site / "results" / "ladder_default" / "index.html").exists()
    assert (site / "results" / "ladder_default" / "v5" / "fit.png").exists()
    assert (site / "results" / "benchmarks" / "moe_layer" / "index.html").exists()


def test_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_headline_block_is_generated_and_current():
    rp = results_pages()
    text = (ROOT / "README.md").read_text()
    assert rp.main(["--check"]) == 0, "run `python3 scripts/results_pages.py --readme`"
    # a number edited by hand inside the block is what --check catches
    block = text[text.index(rp.BEGIN):text.index(rp.END)]
    edited = text.replace(block, re.sub(r"\d\.\d{4}", "9.9999", block, count=1))
    assert edited != text
    assert rp.readme_with_headline(edited, rp.headline()) == text


def test_bench_results_is_one_folder_per_study():
    top = sorted(RESULTS.iterdir())
    assert not [p.name for p in top if p.is_file()], "bench/results/ holds only folders"
    assert not [p.name for p in top if re.search(r"_v\d", p.name)], \
        "a study's versions go in bench/results/<study>/v<N>/"
    for folder in top:
        if folder.name != "benchmarks":
            assert (folder / "study.yaml").exists(), f"{folder.name}/study.yaml is missing"


def test_every_result_file_is_on_a_generated_page():
    pages = results_pages().pages()
    text = "\n".join(p.markdown for p in pages)
    for path in RESULTS.rglob("*.json"):
        rel = path.relative_to(ROOT).as_posix()
        assert f"`{rel}`" in text, f"{rel} is on no results page"
    shown = {src for p in pages for src in p.images.values()}
    assert set(RESULTS.rglob("*.png")) == shown
