""".ci/run runs the README's test command and fails unless pytest ran tests and they passed. The
script runs here in a copy whose `python3` makes a stand-in venv: its pip does nothing and its
python is this interpreter, so pytest really runs, on the copy's (empty or given) tests."""
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_PYTHON3 = f"""#!/bin/sh
# python3 -m venv .venv: a venv whose pip succeeds and whose python is the test's interpreter
[ "$1 $2 $3" = "-m venv .venv" ] || exit 99
mkdir -p .venv/bin
printf '#!/bin/sh\\nexit 0\\n' > .venv/bin/pip
printf '#!/bin/sh\\nexec {sys.executable} "$@" -p no:cacheprovider\\n' > .venv/bin/python
chmod +x .venv/bin/pip .venv/bin/python
"""


def run_ci(tmp_path: Path, tests: dict[str, str], tools: dict[str, str] | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``tools``: scripts that stand in for commands; given any, PATH holds only them, the fake
    python3 and the few real commands the script needs (so no chromium is found)."""
    checkout = tmp_path / "checkout"
    (checkout / ".ci").mkdir(parents=True)
    shutil.copy(ROOT / ".ci" / "run", checkout / ".ci" / "run")
    for name, text in tests.items():
        (checkout / name).write_text(text)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON3)
    (bin_dir / "python3").chmod(stat.S_IRWXU)
    for name, text in (tools or {}).items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    for name in ("dirname", "mkdir", "chmod") if tools else ():
        (bin_dir / name).symlink_to(shutil.which(name))
    path = str(bin_dir) if tools else f"{bin_dir}:{os.environ['PATH']}"
    # -n auto as one process (xdist's worker count from its environment): what is checked is the
    # script's handling of pytest's status, and two workers starting would only add seconds.
    env = {**os.environ, "PYTEST_XDIST_AUTO_NUM_WORKERS": "0", **(env or {}), "PATH": path}
    return subprocess.run([shutil.which("bash"), str(checkout / ".ci" / "run")], env=env, capture_output=True,
                          text=True, timeout=120)


def test_no_tests_collected_fails(tmp_path):
    result = run_ci(tmp_path, {})
    assert result.returncode == 5
    assert "pytest collected no tests" in result.stderr


@pytest.mark.parametrize("body, status", [("assert True", 0), ("assert False", 1)])
def test_the_tests_status_is_the_scripts(tmp_path, body, status):
    result = run_ci(tmp_path, {"test_one.py": f"def test_one():\n    {body}\n"})
    assert result.returncode == status
    assert "collected no tests" not in result.stderr


def test_it_runs_the_readmes_test_command():
    command = "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/python -m pytest -n auto --maxprocesses 4 --dist worksteal"
    assert command in (ROOT / "README.md").read_text()
    assert command in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.parametrize("ci, uid, installs", [("true", "0", True), ("true", "1000", False), ("", "0", False)])
def test_chromium_is_installed_for_the_browser_test_only_as_root_under_ci(tmp_path, ci, uid, installs):
    log = tmp_path / "apt-get.log"
    tools = {"id": f"#!/bin/sh\necho {uid}\n", "apt-get": f"#!/bin/sh\necho \"$*\" >> {log}\n"}
    result = run_ci(tmp_path, {"test_one.py": "def test_one():\n    assert True\n"}, tools, {"CI": ci})
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines() if log.exists() else []
    assert calls == (["update -q", "install -y -q chromium"] if installs else [])
