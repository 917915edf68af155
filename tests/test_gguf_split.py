"""Split GGUF files (`model/gguf/split.py`): a model written as several parts runs, named by its first part,
exactly as the same model in one file; a part named instead of the first, a missing part and a first
part not named as one are refused by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_quant_modelopt import _forward

from ember_engine import LLM, SamplingParams
from ember_engine.model import gguf


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


def split(src: Path, dst: Path, per_part: int) -> list[Path]:
    """`src` rewritten as parts of at most `per_part` tensors, as gguf-split writes them (the metadata in
    the first; split.no, split.count and split.tensors.count in each), with the tokenizer files beside."""
    import gguf as package

    reader = package.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = package.GGUFWriter(str(dst / "model.gguf"), arch, split_max_tensors=per_part)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        array = f.types[0] == package.GGUFValueType.ARRAY
        w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if array else None)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src.with_name(name), dst / name)
    return sorted(dst.glob("model-*-of-*.gguf"))


def test_a_split_file_runs_as_the_whole_one(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    whole = quantized_model("tiny", "Q4_K_M", "gguf_build.py") / "model.gguf"
    parts = split(whole, tmp_path, 12)
    assert [p.name for p in parts] == [
        f"model-{i:05d}-of-{len(parts):05d}.gguf" for i in range(1, len(parts) + 1)
    ]
    assert len(parts) >= 3
    one = LLM(str(whole), dtype="float32", num_kv_blocks=32, max_num_seqs=2)
    many = LLM(str(parts[0]), dtype="float32", num_kv_blocks=32, max_num_seqs=2)
    assert many.engine.runner.quant.groups == one.engine.runner.quant.groups
    oracle = torch.load(whole.with_name("oracle.pt"))
    for prompt in oracle["prompts"]:
        assert torch.equal(_forward(many.engine.runner, prompt), _forward(one.engine.runner, prompt))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = many.generate(oracle["prompts"][:6], params, use_tqdm=False)
    assert [g.token_ids for g in got] == oracle["greedy"]


def test_what_is_not_a_whole_split_file_is_refused(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    whole = quantized_model("tiny", "Q4_0", "gguf_build.py") / "model.gguf"
    parts = split(whole, tmp_path, 12)
    n = len(parts)
    with pytest.raises(
        gguf.GGUFError,
        match=rf"is part 2 of {n} of a split GGUF file: give the first, model-00001-of-0000{n}.gguf",
    ):
        LLM(str(parts[1]), num_kv_blocks=16)
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(parts[0], renamed)
    with pytest.raises(gguf.GGUFError, match=rf"is not named as one \(PREFIX-00001-of-0000{n}.gguf\)"):
        LLM(str(renamed), num_kv_blocks=16)
    parts[-1].unlink()
    with pytest.raises(
        gguf.GGUFError, match=rf"part\(s\) model-0000{n}-of-0000{n}.gguf of the split GGUF file not found"
    ):
        LLM(str(parts[0]), num_kv_blocks=16)
