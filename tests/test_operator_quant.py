"""spec.model.quantization: validated (schema enum, CEL and pydantic alike), passed to the engine, and part
of the template hash only once set."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from ember_localcluster.apiserver.cel import check_rules
from ember_operator.crd import crd_manifest
from ember_operator.desired import engine_args, template_hash
from ember_operator.spec import InferenceServiceSpec


def _spec(**model: Any) -> dict[str, Any]:
    return {"model": {"name": "m", "source": "/models/m", **model}, "resources": {"gpus": 1}}


def _schema() -> dict[str, Any]:
    version = crd_manifest()["spec"]["versions"][0]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def test_quantization_reaches_the_engine_and_rolls_the_pods() -> None:
    plain = InferenceServiceSpec.model_validate(_spec())
    quant = InferenceServiceSpec.model_validate(_spec(quantization="w8a16"))
    assert "--quantization=w8a16" in engine_args(quant)
    assert not any(a.startswith("--quantization") for a in engine_args(plain))
    assert template_hash(quant) != template_hash(plain)
    other = InferenceServiceSpec.model_validate(_spec(quantization="fp8"))
    assert template_hash(other) != template_hash(quant)


def test_unknown_scheme_is_refused_by_the_schema_enum() -> None:
    prop = _schema()["properties"]["model"]["properties"]["quantization"]
    assert prop["enum"] == ["fp8", "w8a16", "w4a16"]
    with pytest.raises(ValidationError, match="quantization"):
        InferenceServiceSpec.model_validate(_spec(quantization="awq"))


def test_quantization_with_several_ranks_is_refused_by_cel_and_pydantic() -> None:
    rules = _schema()["x-kubernetes-validations"]
    two_gpus = {**_spec(quantization="fp8"), "resources": {"gpus": 2, "nodes": 1}, "engine": {}}
    causes = check_rules(rules, two_gpus, None, "spec", "InferenceService")
    assert any("model.quantization is not supported with tensor parallelism" in str(c) for c in causes)
    one_rank = {**two_gpus, "engine": {"tensorParallelSize": 1}}
    assert not check_rules(rules, one_rank, None, "spec", "InferenceService")
    with pytest.raises(
        ValidationError, match=r"model\.quantization is not supported with tensor parallelism"
    ):
        InferenceServiceSpec.model_validate({**_spec(quantization="fp8"), "resources": {"gpus": 2}})
    assert (
        InferenceServiceSpec.model_validate({**one_rank, "resources": {"gpus": 2}}).model.quantization
        == "fp8"
    )


def test_extra_args_cannot_set_quantization() -> None:
    with pytest.raises(ValidationError, match=r"model\.quantization"):
        InferenceServiceSpec.model_validate({**_spec(), "engine": {"extraArgs": ["--quantization=fp8"]}})
