"""The repository's layout: each top-level folder holds its import package by name, so nothing in the
repository root shadows the standard library, and the `ember` command imports only what it runs."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "engine": "ember_engine",
    "operator": "ember_operator",
    "localcluster": "ember_localcluster",
    "router": "ember_router",
}


def _run(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_standard_library_operator_module_is_not_shadowed_from_the_repository_root() -> None:
    result = _run("import operator; print(operator.itemgetter(1)([5, 7]), operator.__file__)")
    assert result.returncode == 0, result.stderr
    value, path = result.stdout.split()
    assert value == "7"
    assert not path.startswith(str(ROOT))


@pytest.mark.parametrize("module", ["ember_operator.crd", "ember_localcluster.apiserver"])
def test_python_dash_m_runs_from_the_repository_root(module: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    if module == "ember_operator.crd":  # it prints the CRD and takes no flags
        result = subprocess.run(
            [sys.executable, "-m", module], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert "kind: CustomResourceDefinition" in result.stdout
    else:
        assert result.returncode == 0, result.stderr
        assert "usage:" in result.stdout


def test_each_folder_holds_its_package_by_name() -> None:
    for folder, package in PACKAGES.items():
        assert not (ROOT / folder / "__init__.py").exists(), f"{folder}/ must not itself be a package"
        assert (ROOT / folder / package / "__init__.py").is_file()
    assert not (ROOT / "e2e" / "__init__.py").exists()


def _subpackages(package_dir: Path) -> list[Path]:
    return sorted(p.parent for p in package_dir.rglob("__init__.py") if p.parent != package_dir)


def test_every_subpackage_says_what_lives_there() -> None:
    for folder, package in PACKAGES.items():
        for sub in _subpackages(ROOT / folder / package):
            doc = ast.get_docstring(ast.parse((sub / "__init__.py").read_text()))
            assert doc, f"{sub} has no docstring"
            summary = doc.split("\n\n")[0]
            assert len(summary.splitlines()) <= 2, f"{sub}: the docstring's summary should take two lines"


def test_engine_modules_stay_small() -> None:
    # The Triton kernel file is the one exception: kernels read best whole.
    for path in (ROOT / "engine" / "ember_engine").rglob("*.py"):
        if path.name == "triton_attention.py":
            continue
        lines = len(path.read_text().splitlines())
        assert lines <= 350, f"{path.relative_to(ROOT)} has {lines} lines"


def test_ember_help_imports_no_command_module() -> None:
    code = (
        "import sys, json, contextlib, io\n"
        "from ember_engine import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        cli.main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('ember_') or m in ('torch', 'kopf'))))"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["ember_engine", "ember_engine.cli"]


def test_a_command_imports_only_its_own_module() -> None:
    code = (
        "import sys, json, contextlib, io\n"
        "from ember_engine import cli\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    try:\n"
        "        cli.main(['operator', '--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('ember_') or m == 'torch')))"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    assert "ember_operator.main" in loaded
    assert not any(m.startswith(("ember_engine.server", "ember_localcluster")) for m in loaded)
    assert "torch" not in loaded
