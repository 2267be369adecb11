"""Every dependency pyproject declares is imported by the project, or says why it is there."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IMPORT_NAMES = {"prometheus-client": "prometheus_client", "orbax-checkpoint": "orbax"}   # distribution -> module
WHY = "nothing imports it:"                                    # the comment a non-imported one carries


def declared() -> list[tuple[str, str]]:
    """(distribution name, its line in pyproject) for the runtime and the test dependencies."""
    text = (ROOT / "pyproject.toml").read_text()
    project = tomllib.loads(text)["project"]
    lines = {re.split(r"[<>=!~ ;\[]", line.strip().strip('",'))[0]: line
             for line in text.splitlines() if line.strip().startswith('"')}
    specs = project["dependencies"] + [d for extra in project["optional-dependencies"].values() for d in extra]
    names = [re.split(r"[<>=!~ ;\[]", spec)[0] for spec in specs]
    return [(name, lines[name]) for name in names]


def imported_modules() -> set[str]:
    found = set()
    for folder in ("jaxengine", "tests", "scripts"):
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"^\s*(?:import|from)\s+(\w+)", path.read_text(), re.MULTILINE))
    return found


def test_every_dependency_is_imported_or_says_why():
    modules = imported_modules()
    unused = [name for name, line in declared()
              if IMPORT_NAMES.get(name, name.replace("-", "_")) not in modules and WHY not in line]
    assert unused == []
