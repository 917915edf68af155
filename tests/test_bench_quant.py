"""`ember bench quant` on the packaged trained pair, cut down to seconds: its rows, teacher-forced next-token
agreement beside greedy agreement, and a pre-quantized checkpoint as a row of its own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ember_engine.bench.quant import logprobs_close
from ember_engine.cli import main as ember
from ember_engine.tools.quantize import quantize_checkpoint
from ember_engine.tools.spec_pair import packaged_pair

LABEL = "fp8-checkpoint-file"  # longer than the other labels


def test_rows_report_teacher_forced_agreement_and_a_checkpoint_row(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = quantize_checkpoint(packaged_pair()[0], tmp_path / "fp8", "fp8")
    out = tmp_path / "quant.json"
    args = ["bench", "quant", "--schemes", "fp8", "--no-kv-fp8", "--ppl-windows", "2", "--prompts", "4"]
    args += ["--kv-e5m2", "--repeats", "0", "--checkpoint", f"{LABEL}={ckpt}", "--json", str(out)]
    assert ember(args) == 0
    rows = {r["scheme"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["full", "fp8", "kv-fp8-e5m2", LABEL]
    e5m2 = rows["kv-fp8-e5m2"]
    assert e5m2["kv_cache_dtype"] == "float8_e5m2" and e5m2["weight_bytes"] == rows["full"]["weight_bytes"]
    assert e5m2["kv_blocks"] // 4 == rows["full"]["kv_blocks"]  # one byte an element against float32's four
    assert 0.95 <= e5m2["next_token_agreement"] < 1.0
    full, fp8, file = rows["full"], rows["fp8"], rows[LABEL]
    assert full["next_token_agreement"] == 1.0 and full["greedy_agreement"] == 1.0
    assert full["logprobs_close"] == 1.0 and 0.0 <= fp8["logprobs_close"] <= 1.0
    # FP8 weights and activations move some argmaxes, and few: 2 windows are 1024 positions.
    assert 0.95 <= fp8["next_token_agreement"] < 1.0
    # The checkpoint ember wrote holds what online quantization holds: the same model, row for row.
    for key in ("next_token_agreement", "greedy_agreement", "logprobs_close", "perplexity", "weight_bytes"):
        assert file[key] == fp8[key], key
    assert full["decode_tok_s_b1"] is fp8["b1_speedup"] is None  # --repeats 0: no rates taken
    lines = capsys.readouterr().out.splitlines()
    column = next(line for line in lines if line.startswith("scheme")).index("weight MB")
    for label in rows:  # every label, the long one too, stays in the first column
        assert next(line for line in lines if line.startswith(f"{label} "))[:column].strip() == label
    # The rates it did not take are not printed as measured zeros.
    rates = next(line for line in lines if line.startswith("scheme")).index("b1 tok/s")
    full_line = next(line for line in lines if line.startswith("full "))
    assert full_line[rates:].split()[:2] == ["-", "-"] and "0.0 (0.00)" not in full_line


def test_a_divergence_is_close_only_when_each_token_is_in_the_other_side_s_top() -> None:
    base = {"outputs": [[1, 2, 3], [1, 2, 3], [1, 2, 3], [1, 2, 3]], "tops": [[{1, 9}, {2, 8}, {3, 7}]] * 4}
    row = {
        "outputs": [[1, 2, 3], [1, 8, 5], [1, 6, 3], [1, 8, 3]],
        "tops": [
            [{1}, {2}, {3}],
            [{1}, {8, 2}, {5}],  # 8 in base's top, 2 in ours: close, whatever follows
            [{1}, {6, 2}, {3}],  # 6 not in base's top
            [{1}, {8}, {3}],  # 2 not in ours
        ],
    }
    assert logprobs_close(row, base) == 0.5


def test_the_batch_32_rate_decodes_32_sequences_whatever_the_greedy_prompts(tmp_path: Path) -> None:
    """--prompts sets the greedy-agreement prompts; the batch-32 rate still decodes 32 at once."""
    out = tmp_path / "quant.json"
    args = ["bench", "quant", "--schemes", "", "--no-kv-fp8", "--ppl-windows", "1", "--prompts", "4"]
    assert ember([*args, "--repeats", "1", "--json", str(out)]) == 0
    (full,) = json.loads(out.read_text())["rows"]
    assert full["decode_sequences_b1"] == 1 and full["decode_sequences_b32"] == 32
    assert full["decode_tok_s_b32"] > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schemes", "fp8,w8a61"], "--schemes: unknown 'w8a61'; choose from fp8, w8a16, w4a16, w8a8"),
        (["--prompts", "0"], "argument --prompts: expected a positive integer, got '0'"),
        (["--ppl-windows", "0"], "argument --ppl-windows: expected a positive integer, got '0'"),
        (["--repeats", "-1"], "argument --repeats: expected a non-negative integer, got '-1'"),
        (["--kv-cache-memory", "0"], "argument --kv-cache-memory: expected a positive integer, got '0'"),
        (["--dtype", "bogus"], "argument --dtype: invalid choice: 'bogus'"),
        (["--checkpoint", "x"], "--checkpoint: expected LABEL=PATH, got 'x'"),
        (["--checkpoint", "x=/nonexistent"], "--checkpoint x: /nonexistent has no config.json"),
        # these were refused late (a traceback after every row was measured) or as a bare traceback
        (["--json", "/nonexistent/dir/out.json"], "--json: /nonexistent/dir is not a directory"),
        (["--model", "/nonexistent"], "--model: /nonexistent has no config.json"),
        (["--ppl-windows", "100"], "--ppl-windows 100: the held-out text holds 49 windows of 512 tokens"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_measured(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each refused by name before the first row is measured (minutes, with the defaults), not as a
    traceback after it."""
    with pytest.raises(SystemExit) as refused:
        ember(["bench", "quant", *args])
    assert refused.value.code not in (0, None)
    err = capsys.readouterr().err + str(refused.value.code)
    assert message in err and "measured" not in err


def test_a_checkpoint_of_another_model_is_refused(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --checkpoint row is compared with --model's rows position by position: a checkpoint of another
    model (here the tiny test model against the packaged target) would give a row of nonsense."""
    with pytest.raises(SystemExit) as refused:
        ember(["bench", "quant", "--checkpoint", f"tiny={tiny_model}"])
    err = capsys.readouterr().err + str(refused.value.code)
    assert f"--checkpoint tiny: {tiny_model} is not a checkpoint of" in err
    assert "num_hidden_layers 4 against 12" in err and "measured" not in err


def test_a_gguf_file_is_a_checkpoint_row(tmp_path: Path, tiny_model: Path) -> None:
    """A GGUF file is given as the file itself (it holds its config): taken when it is the same model,
    refused by name when it is another's, or not there."""
    from gguf_build import write

    from ember_engine.bench.quant import checked_checkpoints

    target = packaged_pair()[0]
    ours, theirs = tmp_path / "target.gguf", tmp_path / "tiny.gguf"
    write(target, ours, "Q8_0")
    write(tiny_model, theirs, "Q8_0")
    assert checked_checkpoints([f"q8={ours}"], target) == [("q8", ours)]
    with pytest.raises(
        SystemExit,
        match=rf"--checkpoint tiny: {theirs} is not a checkpoint of .*"
        r"num_hidden_layers 4 against 12",
    ):
        checked_checkpoints([f"tiny={theirs}"], target)
    with pytest.raises(SystemExit, match=r"--checkpoint gone: .*gone\.gguf not found"):
        checked_checkpoints([f"gone={tmp_path / 'gone.gguf'}"], target)
    (tmp_path / "junk.gguf").write_bytes(b"not a model")
    with pytest.raises(SystemExit, match=r"--checkpoint junk: .*junk\.gguf: not a readable GGUF file"):
        checked_checkpoints([f"junk={tmp_path / 'junk.gguf'}"], target)


def test_scheme_names_may_be_spaced(tmp_path: Path) -> None:
    out = tmp_path / "quant.json"
    args = ["bench", "quant", "--schemes", "fp8, w8a16", "--no-kv-fp8", "--ppl-windows", "1"]
    assert ember([*args, "--prompts", "1", "--repeats", "0", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["scheme"] for r in rows] == ["full", "fp8", "w8a16"]
    # --repeats 0 measures no rates: null in the JSON, as "-" in the table (it said 0.0 tok/s)
    assert {r[k] for r in rows for k in ("decode_tok_s_b1", "decode_tok_s_b32", "b1_speedup")} == {None}


def test_a_checkpoint_or_model_it_cannot_run_is_refused_before_anything_is_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --checkpoint whose quantization ember does not run was refused by a traceback after the other
    rows were measured; a --model whose tokenizer has no end-of-text token by a bare StopIteration."""
    from ember_engine.tools.spec_pair import packaged_pair

    target = packaged_pair()[0]
    odd = tmp_path / "hqq"
    shutil.copytree(target, odd)
    config = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps(config | {"quantization_config": {"quant_method": "hqq"}}))
    with pytest.raises(SystemExit, match=r"--checkpoint odd: quantization_config: quant_method 'hqq' is not"):
        ember(["bench", "quant", "--checkpoint", f"odd={odd}"])
    other = tmp_path / "other"
    shutil.copytree(target, other)
    tokenizer = other / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text().replace("<|eos|>", "</s>"))
    with pytest.raises(SystemExit, match=rf"--model: {other}'s tokenizer has no <\|eos\|> token"):
        ember(["bench", "quant", "--model", str(other)])
    assert "measured" not in capsys.readouterr().err


def test_the_perplexity_pass_leaves_the_prefix_cache_true_for_the_rates() -> None:
    """The perplexity windows are written into the cache's first blocks behind the block manager; the
    prompts cached there before must not be reused from them (the rates decoded on overwritten keys)."""
    import argparse

    from ember_engine import SamplingParams
    from ember_engine.bench.quant import GEN_TOKENS, held_out, measure, prompts_from
    from ember_engine.tools.spec_pair import packaged_pair

    target = packaged_pair()[0]
    args = argparse.Namespace(kv_cache_memory=64 << 20, dtype="auto", prompts=4, ppl_windows=2)
    text = held_out(target)
    row, llm, _ = measure(target, None, args, text)
    again = llm.generate(
        prompts_from(text, 4),
        SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True),
        use_tqdm=False,
    )
    assert [list(o.token_ids) for o in again] == row["outputs"]
