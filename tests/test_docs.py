"""The documentation: the README stays a way in, the configuration page is the options' own, and
the MkDocs site builds with --strict (a broken link, anchor or a page left out of the nav fails)."""
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_is_a_way_in():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for page in ("serving", "offline", "batch", "configuration", "testing"):
        assert f"(docs/{page}.md)" in readme


def test_the_configuration_page_is_generated_from_the_engine_options():
    spec = importlib.util.spec_from_file_location("docs_configuration", ROOT / "scripts" / "docs_configuration.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == module.reference(), "docs/configuration.md is stale: run python scripts/docs_configuration.py"
    assert "| `--cpu-matmul-kernels / --no-cpu-matmul-kernels` | `cpu_matmul_kernels` | `True` |" in page


def test_the_docs_build_strictly(tmp_path):
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    assert (tmp_path / "site" / "configuration" / "index.html").exists()
