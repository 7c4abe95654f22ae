"""The installed package holds every module of the working tree (CI installs it with pip)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_arguments(monkeypatch_module: pytest.MonkeyPatch) -> dict:
    captured: dict = {}
    monkeypatch_module.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    runpy.run_path(str(ROOT / "setup.py"))
    return captured


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_every_folder_of_python_modules_is_a_listed_package(setup_arguments: dict) -> None:
    packages = set(setup_arguments["packages"])
    stages = [ROOT / name for name in ("models", "export", "engines", "runtime", "plugins", "tools")]
    folders = {path.parent for stage in stages for path in stage.rglob("*.py") if "__pycache__" not in path.parts}
    assert folders, "no modules found"
    for folder in sorted(folders):
        name = ".".join(("dspark", *folder.relative_to(ROOT).parts))
        assert (folder / "__init__.py").is_file(), f"{folder} holds modules but no __init__.py"
        assert name in packages, f"setup.py does not install {name}"
