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
    assert prop["enum"] == ["fp8", "w8a16", "w4a16", "w8a8", "bitsandbytes"]
    with pytest.raises(ValidationError, match="quantization"):
        InferenceServiceSpec.model_validate(_spec(quantization="awq"))


def test_quantization_with_several_ranks_reaches_the_engine() -> None:
    rules = _schema()["x-kubernetes-validations"]
    two_gpus = {**_spec(quantization="fp8"), "resources": {"gpus": 2, "nodes": 1}, "engine": {}}
    spec = InferenceServiceSpec.model_validate(two_gpus)
    # The API server fills in the schema's defaults before it runs the rules.
    defaulted = spec.model_dump(by_alias=True, mode="json", exclude_none=True)
    assert not check_rules(rules, defaulted, None, "spec", "InferenceService")
    args = engine_args(spec)
    assert "--quantization=fp8" in args and "--tensor-parallel-size=2" in args


def test_extra_args_cannot_set_quantization() -> None:
    with pytest.raises(ValidationError, match=r"model\.quantization"):
        InferenceServiceSpec.model_validate({**_spec(), "engine": {"extraArgs": ["--quantization=fp8"]}})


def _engine_spec(**engine: Any) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({**_spec(), "engine": engine})


def test_kv_cache_dtype_reaches_the_engine_and_rolls_the_pods_only_when_set() -> None:
    from ember_engine.cli import build_parser
    from ember_engine.server import serve

    fp8 = _engine_spec(kvCacheDtype="fp8")
    args = engine_args(fp8)
    assert "--kv-cache-dtype=fp8" in args
    parsed = build_parser().parse_args(["serve", *args])
    assert serve.engine_config(parsed).kv_cache_dtype == "fp8"
    plain, auto = InferenceServiceSpec.model_validate(_spec()), _engine_spec(kvCacheDtype="auto")
    assert not any(a.startswith("--kv-cache-dtype") for a in engine_args(plain) + engine_args(auto))
    # Written out at its default, the field leaves the hash as it was (an operator upgrade rolls nothing).
    assert template_hash(auto) == template_hash(plain) != template_hash(fp8)
    # vLLM's names: fp8_e4m3 is another name for fp8 (the same cache: writing it either way rolls no pod),
    # fp8_e5m2 is its own cache.
    e4m3, e5m2 = _engine_spec(kvCacheDtype="fp8_e4m3"), _engine_spec(kvCacheDtype="fp8_e5m2")
    assert "--kv-cache-dtype=fp8" in engine_args(e4m3)
    assert template_hash(e4m3) == template_hash(fp8)
    parsed = build_parser().parse_args(["serve", *engine_args(e5m2)])
    assert serve.engine_config(parsed).kv_cache_dtype == "fp8_e5m2"
    assert template_hash(e5m2) != template_hash(fp8)


def test_unknown_kv_cache_dtype_is_refused_by_the_schema_enum() -> None:
    prop = _schema()["properties"]["engine"]["properties"]["kvCacheDtype"]
    assert prop["enum"] == ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] and prop["default"] == "auto"
    assert "computed" in prop["description"] and "1.0" not in prop["description"]
    with pytest.raises(ValidationError, match="kvCacheDtype"):
        _engine_spec(kvCacheDtype="int8")


def test_extra_args_cannot_set_kv_cache_dtype() -> None:
    with pytest.raises(ValidationError, match=r"engine\.kvCacheDtype"):
        _engine_spec(extraArgs=["--kv-cache-dtype=fp8"])
    rule = _schema()["properties"]["engine"]["properties"]["extraArgs"]["x-kubernetes-validations"]
    where = "spec.engine.extraArgs"
    assert check_rules(rule, ["--kv-cache-dtype=fp8"], None, where, "InferenceService")
    assert not check_rules(rule, ["--log-level=debug"], None, where, "InferenceService")
