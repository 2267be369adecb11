"""The package installs whole from both a normal (wheel) and an editable install, ships nothing
named plain `models` or `kernels`, and no folder of the checkout hides an installed package from
the code that runs in it (pytest and `python -m` put the checkout's root first on the path)."""
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import site, sys; site.addsitedir(sys.argv[1]); import jaxengine.models, jaxengine.kernels; "
         "import importlib.util as u; print(jaxengine.models.__file__); print(jaxengine.kernels.__file__); "
         "print(u.find_spec('models'))")


def pip(*args: str, cwd: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
                   cwd=cwd, check=True, env={**os.environ, "PIP_NO_INDEX": "1"})


def probe(site_dir: Path, cwd: Path) -> list[str]:
    # -S: none of this interpreter's site-packages (where the project may already be installed).
    out = subprocess.run([sys.executable, "-S", "-c", PROBE, str(site_dir)], cwd=cwd, check=True,
                         capture_output=True, text=True).stdout
    return out.split()


@pytest.mark.slow
def test_wheel_install_ships_models_and_kernels_inside_jaxengine(tmp_path):
    pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(ROOT), cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("jaxengine-*.whl")
    pip("install", "--no-deps", "--ignore-installed", "--target", str(tmp_path / "site"), str(wheel), cwd=tmp_path)
    models, kernels, plain = probe(tmp_path / "site", tmp_path)
    assert models == str(tmp_path / "site" / "jaxengine" / "models" / "__init__.py")
    assert kernels == str(tmp_path / "site" / "jaxengine" / "kernels" / "__init__.py")
    assert plain == "None" and not (tmp_path / "site" / "models").exists()
    shipped = {p.relative_to(tmp_path / "site" / "jaxengine") for p in (tmp_path / "site" / "jaxengine").rglob("*.py")}
    assert sorted(set(source_modules()) - shipped) == []
    assert (tmp_path / "site" / "jaxengine" / "serve" / "static" / "dashboard.html").is_file()    # package data
    kernels = tmp_path / "site" / "jaxengine" / "kernels"
    for source in ("cpu_pool.h", "fp8.h", "paged_attention/cpu_decode.cc", "matmul/cpu_matmul.cc",
                   "matmul/cpu_quantized_matmul.cc"):
        assert (kernels / source).is_file(), source


def source_modules() -> list[Path]:
    """Every module of the source tree, as it must sit inside the installed jaxengine package."""
    found = [p.relative_to(ROOT / "jaxengine") for p in (ROOT / "jaxengine").rglob("*.py")]
    return [p for p in found if "__pycache__" not in p.parts]


@pytest.mark.slow
def test_editable_install_maps_models_and_kernels_to_the_checkouts_folders(tmp_path):
    pip("install", "--no-deps", "--no-build-isolation", "--ignore-installed", "--prefix", str(tmp_path / "prefix"), "-e", str(ROOT),
        cwd=tmp_path)
    site_dir = Path(sysconfig.get_path("purelib", vars={"base": str(tmp_path / "prefix")}))
    models, kernels, plain = probe(site_dir, tmp_path)
    assert models == str(ROOT / "jaxengine" / "models" / "__init__.py")
    assert kernels == str(ROOT / "jaxengine" / "kernels" / "__init__.py")
    assert plain == "None"


def test_the_checkouts_root_holds_no_package_an_installed_one_could_be_hidden_by():
    """transformers imports the hub's `kernels` package as it loads (its activations module): a
    folder of that name at the root of the checkout, first on the path, answered that import."""
    packages = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")
                      and ((p / "__init__.py").exists() or any(p.glob("*.py"))))
    assert packages == ["jaxengine", "scripts", "tests"]
    run = subprocess.run([sys.executable, "-c", "import kernels, transformers.activations; print(kernels.__file__)"],
                         cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert Path(run.stdout.strip()).parent.parent.name == "site-packages"
