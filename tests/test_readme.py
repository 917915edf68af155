"""README's commands work as written for someone who has run only the quickstart (`make demo`, `make test`):
nothing was activated, so the virtualenv's `ember` is not on PATH."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What a shell has after the quickstart, besides make: the cluster tools README names, and shell words.
ON_PATH = {"make", "kubectl", "curl", "export", "cd", "echo"}


def _section(title: str) -> str:
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _shell_lines(section: str) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", section, flags=re.S)
    joined = [block.replace("\\\n", " ") for block in blocks]  # continuation lines belong to their command
    lines = [line.split("  #", 1)[0].strip() for block in joined for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_local_cluster_commands_need_nothing_the_quickstart_did_not_set_up() -> None:
    lines = _shell_lines(_section("Try it without a cluster: `ember dev`"))
    assert lines, "the section shows its commands"
    for line in lines:
        word = re.sub(r"^[A-Z_]+=\$\(", "", line).split()[0]  # VAR=$(cmd ...) runs cmd
        assert word in ON_PATH or word.startswith(".venv/bin/"), (
            f"README's local-cluster section runs {word!r} ({line!r}), which is not on PATH after the "
            "quickstart: use a make target or .venv/bin/"
        )
    targets = [line.split()[1] for line in lines if line.startswith("make ")]
    assert targets, "the section starts and stops the cluster through make"
    for target in targets:
        dry = subprocess.run(["make", "-n", target], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert dry.returncode == 0, f"make {target}: {dry.stderr}"


def test_the_serve_synopsis_names_every_option_serve_takes() -> None:
    """README's `ember serve` synopsis left out options `ember serve --help` lists (the speculative ones,
    --seed, --device, --tokenizer, --log-level)."""
    import argparse

    from ember_engine.server.serve import add_arguments

    section = _section("Serving: `ember serve`")
    synopsis = re.search(r"```sh\n(ember serve .*?)```", section, flags=re.S)
    assert synopsis is not None
    text = re.sub(r"--\[no-\]([\w-]+)", r"--\1 --no-\1", synopsis.group(1))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    missing = [
        action.option_strings[-1]
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction)
        and not any(re.search(re.escape(o) + r"(?![\w-])", text) for o in action.option_strings)
    ]
    assert not missing, f"README's `ember serve` synopsis omits {missing}"
