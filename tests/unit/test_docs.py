"""The guide (docs/, mkdocs.yml) builds as a site with no warning (strict: a broken link, a page missing
from the nav, a nav entry without its page all fail), and the README stays a front page that links into it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_guide_builds_strictly_and_the_readme_stays_short(tmp_path):
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})
    assert r.returncode == 0, r.stderr
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert all((tmp_path / "site" / p.removesuffix(".md") / "index.html").exists() or p == "index.md" for p in pages)
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert all(f"docs/{p}" in readme for p in pages if p != "index.md")  # every page is linked from the front


def test_a_broken_link_fails_the_build(tmp_path):
    import shutil

    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "mkdocs.yml").write_text((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs" / "metrics.md").write_text("# Metrics\n\nSee [the cluster](no-such-page.md).\n")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=tmp_path, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1", "PATH": ""})
    assert r.returncode != 0 and "no-such-page.md" in r.stderr
