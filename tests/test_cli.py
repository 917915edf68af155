"""The `ember` command: version, usage errors, make-test-model's refusals."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ember_engine.cli import main

EMBER = [sys.executable, "-c", "import sys; from ember_engine.cli import main; sys.exit(main())"]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EMBER, *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == "ember 0.1.0"


def test_unknown_arguments_print_usage_and_exit_2() -> None:
    result = run("--no-such-flag")
    assert result.returncode == 2
    assert "usage: ember" in result.stderr


def test_unknown_size_names_the_valid_ones(tmp_path: Path) -> None:
    result = run("make-test-model", str(tmp_path / "m"), "--size", "huge")
    assert result.returncode == 2
    assert "tiny" in result.stderr and "small" in result.stderr


def test_make_test_model_refuses_non_empty_dir_unless_forced(tmp_path: Path) -> None:
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    result = run("make-test-model", str(target))
    assert result.returncode == 1
    assert "not empty" in result.stderr and "--force" in result.stderr
    assert (target / "keep.txt").read_text() == "precious"
    forced = run("make-test-model", str(target), "--force")
    assert forced.returncode == 0, forced.stderr
    assert not (target / "keep.txt").exists()
    assert (target / "model.safetensors").exists()


def test_a_model_that_cannot_load_ends_serve_with_one_fatal_line_last(tmp_path: Path) -> None:
    # The pod's termination message is the tail of its log: the last line must say what failed, not
    # uvicorn's "Finished server process".
    result = run("serve", "--model", str(tmp_path / "missing"), "--port", "0", "--host", "127.0.0.1")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ember serve: fatal: cannot load the model: FileNotFoundError: ")
    assert "config.json not found" in last
    assert "Traceback" not in result.stderr  # a refusal of what was given, not a fault: its line alone


def test_a_quantization_the_model_refuses_ends_serve_with_its_line_and_no_traceback(tiny_model: Path) -> None:
    result = run(
        "serve", "--model", str(tiny_model), "--quantization", "gptq", "--port", "0", "--host", "127.0.0.1"
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ember serve: fatal: cannot load the model: UnsupportedQuantizationError: ")
    assert "'gptq' names a quantized checkpoint's method" in last
    assert "Traceback" not in result.stderr
    assert f"ERROR ember.serve: loading {tiny_model} failed: UnsupportedQuantizationError" in result.stderr
    debug = run(
        "serve", "--model", str(tiny_model), "--quantization", "gptq", "--port", "0", "--log-level", "debug"
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr  # where it was raised, when asked


def test_serve_refuses_speculative_options_no_proposer_uses(tiny_model: Path) -> None:
    """`--num-speculative-tokens 8 --ngram-max 6` without a proposer started a server that never speculated."""
    result = run(
        "serve",
        "--model",
        str(tiny_model),
        "--num-speculative-tokens",
        "8",
        "--ngram-max",
        "6",
        "--port",
        "0",
        "--host",
        "127.0.0.1",
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "ember serve: fatal: cannot load the model: ValueError: num_speculative_tokens, ngram_max: "
    ), last
    assert "nothing would use" in last and "Traceback" not in result.stderr


def test_serve_refuses_an_unknown_quantization_before_it_starts(tmp_path: Path) -> None:
    """As an unknown --kv-cache-dtype is: argparse names the value and what `quantization` takes (the
    online schemes and the quantized checkpoints' own methods), before a server or a model is started."""
    result = run("serve", "--model", str(tmp_path / "missing"), "--quantization", "w8a61", "--port", "0")
    assert result.returncode == 2
    assert "argument --quantization: invalid choice: 'w8a61'" in result.stderr
    assert "fp8" in result.stderr and "gptq_marlin" in result.stderr
    assert "fatal" not in result.stderr and "Traceback" not in result.stderr


def test_demo_engine_never_overwrites_a_directory_that_holds_something(tmp_path: Path) -> None:
    """A directory without `model.safetensors` (a sharded checkpoint, notes) was wiped and a random tiny model
    built in its place. It is served as it is now: here it is no checkpoint, so the server cannot start."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "NOTES.md").write_text("mine\n")
    (mine / "model-00001-of-00002.safetensors").write_bytes(b"not touched")
    ember = Path(sys.executable).with_name("ember")
    run = subprocess.run(
        [str(ember), "demo-engine", "--dir", str(mine)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1 and "exited before it was ready" in run.stderr
    assert sorted(p.name for p in mine.iterdir()) == ["NOTES.md", "model-00001-of-00002.safetensors"]
    assert (mine / "model-00001-of-00002.safetensors").read_bytes() == b"not touched"


def test_written_weights_are_readable_by_others_as_the_other_files(tmp_path: Path) -> None:
    """safetensors writes owner-only files: an engine running as another user (the operator's pods run as
    non-root) could not read a test model's or a quantized copy's weights."""
    src = tmp_path / "m"
    assert main(["make-test-model", str(src), "--size", "tiny"]) == 0
    assert main(["quantize", str(src), str(tmp_path / "q"), "--scheme", "w8a16"]) == 0
    for weights in (src / "model.safetensors", tmp_path / "q" / "model.safetensors"):
        assert weights.stat().st_mode & 0o044 == 0o044, oct(weights.stat().st_mode)


def test_make_test_model_and_quantize_refuse_what_they_cannot_write_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    assert main(["make-test-model", str(a_file)]) == 1  # NotADirectoryError's traceback before
    assert f"{a_file} is not a directory" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # an overflow after the directory was made, before
        main(["make-test-model", str(tmp_path / "seeded"), "--seed", str(2**70)])
    assert refused.value.code == 2 and "--seed" in capsys.readouterr().err
    assert not (tmp_path / "seeded").exists()
    assert main(["quantize", str(tmp_path), str(a_file / "out"), "--scheme", "w8a16"]) == 2
    assert "ember quantize: error:" in capsys.readouterr().err


def test_make_test_model_forced_over_a_linked_directory_writes_into_it(tmp_path: Path) -> None:
    """`--force` on a link to a directory failed: "Cannot call rmtree on a symbolic link"."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    (real / "old.txt").write_text("old")
    link.symlink_to(real, target_is_directory=True)
    assert main(["make-test-model", str(link), "--force"]) == 0
    assert link.is_symlink() and (real / "model.safetensors").exists() and not (real / "old.txt").exists()


def test_quantize_offers_only_the_schemes_it_writes(tiny_model: Path, tmp_path: Path) -> None:
    """`--scheme` listed bitsandbytes, which it then always refused."""
    usage = run("quantize", "--help").stdout
    assert "{fp8,w8a16,w4a16,w8a8}" in usage and "quantizes at load" in usage
    refused = run("quantize", str(tiny_model), str(tmp_path / "q"), "--scheme", "bitsandbytes")
    assert refused.returncode == 2 and "invalid choice: 'bitsandbytes'" in refused.stderr
