"""The docs site: mkdocs builds it in strict mode with no network, it opens from disk (relative links,
no CDN), every heads.csv column is on the measures page from the detectors' own declarations, and the
README stays a screen's worth that links into it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from storylens.looking.detectors import BUILTIN_DETECTORS, table_columns

ROOT = Path(__file__).resolve().parents[1]
MKDOCS = Path(sys.executable).with_name("mkdocs")
README_MAX_LINES = 250


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    if not MKDOCS.exists():
        pytest.skip("mkdocs is not installed: pip install -c constraints.txt -r requirements-dev.txt")
    out = tmp_path_factory.mktemp("site")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(out), "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    env |= {"PYTHONPATH": str(ROOT), "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}
    run = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return out


def test_every_column_is_defined_once_from_its_declaration(site):
    page = (site / "measures.html").read_text()
    for c in table_columns(BUILTIN_DETECTORS):
        assert page.count(f"<td><code>{c.name}</code></td>") == 1, c.name  # one row each
    assert "<!-- columns -->" not in (site / "measures.html").read_text()


def test_the_api_page_renders_every_export(site):
    import storylens

    page = (site / "api.html").read_text()
    for name in storylens.__all__:
        assert f'id="{storylens._WHERE[name]}.{name}"' in page, name


def test_the_site_opens_from_disk(site):
    """Pages link to pages as files (use_directory_urls: false) and load nothing from the network."""
    for html in (p for p in site.glob("*.html") if p.name != "404.html"):  # 404 is for a web server
        text = html.read_text()
        assert "fonts.googleapis" not in text and "fonts.gstatic" not in text, html.name
        for ref in re.findall(r'(?:src|href)="([^"#]+)"', text):
            if not ref.startswith(("http://", "https://", "mailto:", "data:")):
                assert (html.parent / ref.split("?")[0]).exists(), (html.name, ref)
        remote = re.findall(r'<(?:script|link|img)\b[^>]*(?:src|href)="(https?://[^"]+)"', text)
        assert not remote, (html.name, remote)  # only <a> links may leave the site
        assert "api.github.com" not in text and "unpkg.com" not in text, html.name


def test_the_readme_fits_and_links_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((ROOT / link).exists() for link in links), links
    nav = (ROOT / "mkdocs.yml").read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f": {page.name}\n" in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_the_long_story_paragraph_is_the_benchmark_run_regenerated():
    """docs/benchmarks.md's long-story figures are scripts/docs_long_table.py over benchmarks/long.json."""
    import json

    from scripts.docs_long_table import paragraph
    from scripts.readme_tables import shown_between

    run = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "long.json").read_text())
    assert shown_between("long") == paragraph(run), (
        "regenerate it: python scripts/docs_long_table.py benchmarks/long.json"
    )
