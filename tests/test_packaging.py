"""A non-editable install into a fresh virtualenv gives both packages and the `ember` command,
from any working directory (what the Dockerfiles do); each image's extras hold what its code imports."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tomllib
import venv
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"ember_engine": "engine", "ember_operator": "operator", "ember_router": "router"}
FIRST_PARTY["ember_localcluster"] = "localcluster"

# What each image runs. The engine image runs `ember serve` and `ember router` (the operator deploys routers
# from it); the operator image runs `ember operator` through the `ember` command (ember_engine.cli), which
# imports only the module of the command it runs. The first-party modules these import are followed.
IMAGES = {
    "Dockerfile.engine": ("ember_engine", "ember_router"),
    "Dockerfile.operator": ("ember_operator", "ember_engine.cli"),
}
# Imported by an image's code but deliberately not installed in it, each with its reason.
OPTIONAL = {
    "matplotlib": "`ember bench`'s plots (bench/report.py), a development tool: the dev extra",
    "transformers": "`ember bench throughput`'s transformers baseline (bench/throughput.py): the dev extra",
}
# Imported directly, installed as a dependency of a requirement (checked against the installed metadata).
INDIRECT = {
    "starlette": "fastapi",
    "pydantic_core": "pydantic",
    "llvmlite": "numba",
    "botocore": "boto3",
    "urllib3": "boto3",
    "multidict": "aiohttp",
}


def test_fresh_non_editable_install(tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # The core install: extras hold the heavy dependencies, so this needs nothing but PyYAML.
    subprocess.run([py, "-m", "pip", "install", "-q", str(ROOT)], check=True, timeout=600)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = (
        "import json, ember_engine, ember_operator, ember_localcluster, operator, collections;"
        "print(json.dumps([ember_engine.__file__, ember_operator.__file__, operator.__file__]))"
    )
    out = subprocess.run([py, "-c", probe], cwd=elsewhere, check=True, capture_output=True, text=True)
    engine_file, operator_file, stdlib_operator = json.loads(out.stdout)
    assert "site-packages" in engine_file and "site-packages" in operator_file
    assert str(ROOT) not in engine_file
    assert "site-packages" not in stdlib_operator  # the standard library's operator is untouched
    helped = subprocess.run(
        [env_dir / "bin" / "ember", "--help"], cwd=elsewhere, capture_output=True, text=True
    )
    assert helped.returncode == 0 and "make-test-model" in helped.stdout


def test_operator_extra_does_not_pull_torch(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--report",
            str(report),
            f"{ROOT}[operator]",
        ],
        check=True,
        timeout=600,
    )
    names = {item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"]}
    assert {"kopf", "kubernetes", "pydantic"} <= names
    assert "torch" not in names and "triton" not in names


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
    assert match, requirement
    return _canonical(match.group())


def _extras(dockerfile: str) -> list[str]:
    """The extras of the `pip install "/src[...]"` line."""
    (extras,) = re.findall(r'pip install [^\n]*"/src\[([^\]]*)\]"', (ROOT / dockerfile).read_text())
    return [e.strip() for e in extras.split(",")]


def _required(extras: list[str]) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {_requirement_name(r) for r in requirements}


def _depends_on(parent: str) -> set[str]:
    """The installed distributions `parent` pulls in (without its extras), itself included; a requirement
    not installed here (its marker excludes this Python) is not followed."""
    seen: set[str] = set()
    todo = [parent]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if not re.search(r"\bextra\s*==", requirement):
                todo.append(_requirement_name(requirement))
    return seen


def _file(module: str) -> Path | None:
    base = ROOT / FIRST_PARTY[module.split(".")[0]] / Path(*module.split("."))
    return next((f for f in (base / "__init__.py", base.with_suffix(".py")) if f.exists()), None)


def _runtime_imports(tree: ast.AST) -> Iterator[tuple[str, ...]]:
    """The module names each import statement names (`from a import b` gives a and a.b), including those
    inside functions and try blocks; not under `if TYPE_CHECKING:`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (names for child in node.orelse for names in _runtime_imports(child))
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield (alias.name,)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, f"relative import: {ast.unparse(node)}"
            yield (node.module, *(f"{node.module}.{a.name}" for a in node.names))
        else:
            yield from _runtime_imports(node)


def _third_party_imports(roots: tuple[str, ...]) -> dict[str, set[str]]:
    """Top-level third-party module -> the files (relative to the repository) that import it, over the
    root packages or modules and every first-party module they import."""
    todo = []
    for root in roots:
        path = _file(root)
        assert path is not None, root
        todo += sorted(path.parent.rglob("*.py")) if path.name == "__init__.py" else [path]
    seen: set[Path] = set()
    found: dict[str, set[str]] = {}
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        for names in _runtime_imports(ast.parse(path.read_text(), str(path))):
            top = names[0].split(".")[0]
            if top in FIRST_PARTY:
                todo += [f for name in names if (f := _file(name)) is not None]
            elif top not in sys.stdlib_module_names:
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


@pytest.mark.parametrize("dockerfile", sorted(IMAGES))
def test_each_image_installs_every_distribution_its_code_imports(dockerfile: str) -> None:
    extras = _extras(dockerfile)
    required = _required(extras)
    distributions = metadata.packages_distributions()
    missing = []
    for module, files in sorted(_third_party_imports(IMAGES[dockerfile]).items()):
        if module in OPTIONAL:
            continue
        dists = {_canonical(d) for d in distributions.get(module, [])}
        assert dists, f"{module} (imported by {sorted(files)}) is not installed here: which distribution?"
        if module in INDIRECT:
            parent = _canonical(INDIRECT[module])
            assert parent in required and dists & _depends_on(parent), (
                f"{dockerfile}: {module} is not installed through {parent}"
            )
        elif not dists & required:
            missing.append(f"{module} ({', '.join(sorted(dists))}), imported by {', '.join(sorted(files))}")
    assert not missing, (
        f"{dockerfile} installs ember[{','.join(extras)}], which does not require: " + "; ".join(missing)
    )
