"""A non-editable install into a fresh virtualenv gives both packages and the `ember` command,
from any working directory (what the Dockerfiles do)."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
