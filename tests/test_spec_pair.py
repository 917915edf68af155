"""The trained speculative-decoding pair: the training model means what Hugging Face's Llama means, and
the committed checkpoints load, agree with each other as recorded, and generate as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import ember_engine.tools.spec_pair as spec_pair
import ember_engine.tools.testmodel as testmodel
from ember_engine import LLM, SamplingParams
from ember_engine.model.loader import load_weights
from ember_engine.model.model_config import ModelConfig

PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n    for arg in "
SMALL = testmodel.ModelSize(64, 160, 2, 4, 2, 256)
IDS = {testmodel.BOS: 0, testmodel.EOS: 1, testmodel.PAD: 2}


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return spec_pair.packaged_pair()


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads((spec_pair.PACKAGED_DIR / "training.json").read_text())


def _hf_model(config: dict, state: dict[str, torch.Tensor]) -> LlamaForCausalLM:
    hf = LlamaForCausalLM(LlamaConfig(**config)).eval()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    # A tied model has no lm_head.weight of its own: transformers ties it to the embedding.
    assert unexpected == []
    assert set(missing) <= {"lm_head.weight"}
    if missing:
        assert config["tie_word_embeddings"]
        hf.tie_weights()
    return hf


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_training_model_matches_transformers(tied: bool) -> None:
    config = testmodel.llama_config(SMALL, IDS, tie_word_embeddings=tied)
    model = spec_pair.TrainingLlama(config).eval()
    model.init_weights(torch.Generator().manual_seed(0))
    with torch.no_grad():  # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.2)
    state = model.state_dict()
    assert ("lm_head.weight" in state) is not tied
    hf = _hf_model(config, state)
    # Same parameter names and shapes as Hugging Face's, so the state dict is the checkpoint.
    hf_names = {n for n, _ in hf.named_parameters()}
    assert set(state) == hf_names - ({"lm_head.weight"} if tied else set())
    ids = torch.randint(0, testmodel.VOCAB_SIZE, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids).logits
    assert ours.shape == theirs.shape == (2, 40, testmodel.VOCAB_SIZE)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_packaged_pair_missing_says_how_to_build(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(spec_pair, "PACKAGED_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="ember make-spec-pair"):
        spec_pair.packaged_pair()


def test_pair_is_consistent(pair: tuple[Path, Path], report: dict) -> None:
    target_dir, draft_dir = pair
    assert (target_dir / "tokenizer.json").read_bytes() == (draft_dir / "tokenizer.json").read_bytes()
    target, draft = ModelConfig.from_dir(target_dir), ModelConfig.from_dir(draft_dir)
    assert target.vocab_size == draft.vocab_size == testmodel.VOCAB_SIZE
    assert target.eos_token_ids == draft.eos_token_ids and len(target.eos_token_ids) == 2
    assert draft.num_layers < target.num_layers
    assert (target.num_layers, draft.num_layers) == (
        spec_pair.TARGET_SIZE.num_hidden_layers,
        spec_pair.DRAFT_SIZE.num_hidden_layers,
    )
    counts = {}
    for name, directory in (("target", target_dir), ("draft", draft_dir)):
        state = load_file(str(directory / "model.safetensors"))
        counts[name] = sum(t.numel() for t in state.values())
        assert counts[name] == report[name]["parameters"]
        assert all(t.dtype == torch.float32 for t in state.values())
    assert counts["draft"] < counts["target"]
    total = sum(p.stat().st_size for d in pair for p in d.iterdir())
    assert total <= 18 * 1024 * 1024
    assert 0.0 < report["held_out_agreement"] <= 1.0


def test_ember_loads_both(pair: tuple[Path, Path]) -> None:
    from ember_engine.model.llama import LlamaForCausalLM as EmberLlama

    for directory in pair:
        config = ModelConfig.from_dir(directory)
        model = EmberLlama(config)
        load_weights(model, directory)  # raises on any missing, unknown or mis-shaped tensor


def test_recorded_agreement_holds(pair: tuple[Path, Path], report: dict) -> None:
    """The committed weights give the committed figures: draft/target top-1 agreement and held-out losses,
    recomputed over the whole held-out split."""
    target_dir, _ = pair
    models = []
    for directory in pair:
        config = json.loads((directory / "config.json").read_text())
        model = spec_pair.TrainingLlama(config).eval()
        model.load_state_dict(load_file(str(directory / "model.safetensors")))
        models.append(model)
    eos = json.loads((target_dir / "config.json").read_text())["eos_token_id"]
    _, held_out, names = spec_pair.corpus_tokens(target_dir / "tokenizer.json", eos)
    if names != report["corpus"]["held_out_files"] or len(held_out) != report["corpus"]["held_out_tokens"]:
        pytest.skip("this Python's standard library is not the one the pair was trained on")
    result = spec_pair.evaluate(models[0], models[1], held_out, seq_len=report["eval_seq_len"])
    # Tolerances cover float differences between CPUs (a near-tie argmax may flip), nothing more.
    assert result["agreement"] == pytest.approx(report["held_out_agreement"], abs=0.005)
    assert result["target_loss"] == pytest.approx(report["target"]["held_out_loss"], abs=1e-3)
    assert result["draft_loss"] == pytest.approx(report["draft"]["held_out_loss"], abs=1e-3)
    assert result["agreement"] >= 0.7
    assert result["target_loss"] < 5.5  # trained: below the corpus's unigram entropy (6.5) and log(4096)


def test_ember_greedy_matches_transformers(pair: tuple[Path, Path]) -> None:
    target_dir, _ = pair
    llm = LLM(str(target_dir), max_num_seqs=1)
    prompt = llm.engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ours = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert ours == out[0, len(prompt) :].tolist()


def test_cli_refuses_to_replace_a_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ember_engine import cli

    (tmp_path / "target").mkdir()
    assert cli.main(["make-spec-pair", str(tmp_path)]) == 1  # refused before any training
    assert "--force" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["target"]
