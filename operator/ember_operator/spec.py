"""The InferenceService custom resource: spec and status as pydantic models, the single source of truth.

`ember_operator.crd` derives the CustomResourceDefinition's schema from these models. Each cross-field rule
is written twice on purpose, side by side: as a pydantic validator (for the operator and tests) and as a CEL
rule in `x-kubernetes-validations` (so the API server rejects a bad object before the operator sees it).

The policy fields (`loadShedding`, `fallback`, `requestTimeoutSeconds`) use the engine's policy-file names, so
the operator writes the policy ConfigMap by copying them.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.alias_generators import to_camel

from ember_operator.kubetypes import (
    MAX_ENV,
    QUANTITY,
    QUANTITY_MAX,
    SUBDOMAIN,
    SUBDOMAIN_MAX,
    EnvFromSource,
    EnvVar,
    KeySelector,
    byte_rules,
    check_bytes,
)
from ember_operator.labels import (
    LABEL_KEY_MAX,
    LABEL_VALUE_MAX,
    LABEL_VALUE_MESSAGE,
    label_key_conditions,
    label_key_errors,
    label_value_condition,
    label_value_errors,
)
from ember_operator.podsettings import Lifecycle, PodSettings, PodTemplate

GROUP = "ember.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ["eis"]  # not "isvc": KServe's InferenceService already claims it

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# Bounded so that the API server's CEL cost estimate for rules over these lists stays within its budget.
MAX_PRIORITY_CLASSES = 16
NAME_MAX = 63
DEFAULT_DESIRED = 1  # replicas.desired until an HPA, KEDA or kubectl scale writes it


def _cel(rule: str, message: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


def _list_map(key: str) -> dict[str, Any]:
    # Tells the API server (and server-side apply) that items are keyed by `key`, which also makes it unique.
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}


# A sub-object defaulted to {} in the CRD, so that the API server then fills in its fields' defaults.
_OBJECT_DEFAULT: dict[str, Any] = {"default": {}}


def _full_default(model: type[BaseModel]) -> dict[str, Any]:
    """The CRD default of a sub-object whose own CEL rules read its fields: spelled out in full. The API
    server runs a schema's rules on its `default` as written when the CRD is created, without filling in
    the fields' defaults first, so `{}` would fail `self.min <= self.max` with "no such key"."""
    return {"default": _as_json(model().model_dump(by_alias=True, mode="json", exclude_none=True))}


def _as_json(value: Any) -> Any:
    """A whole float as the integer a JSON encoder (and the children's own defaults) write: 0, not 0.0."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_json(v) for v in value]
    return value


class _Object(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


# A source with a scheme must be one of these; anything else is a path in the pod.
SCHEME = r"^[a-zA-Z][a-zA-Z0-9+.-]*://"
SOURCE_URI = (
    r"^(hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[^@ ]+)?"
    r"|s3://[a-z0-9][-a-z0-9.]{1,61}[a-z0-9](/[^ ]*)?"
    r"|pvc://[a-z0-9]([-a-z0-9.]*[a-z0-9])?(/[^ ]*)?)$"
)
SOURCE_MESSAGE = "source must be a path, hf://org/name[@revision], s3://bucket[/prefix] or pvc://claim[/path]"
# A .gguf file under the source: path segments that do not start with a dot (so none is "..").
GGUF_FILE = r"^[A-Za-z0-9_][-A-Za-z0-9_.+]*(/[A-Za-z0-9_][-A-Za-z0-9_.+]*)*\.gguf$"


# Bounded, as priority classes are, for the CEL cost of the rules over them.
MAX_ADAPTERS = 32
# An adapter's name: what clients send as `model` (org/name style allowed); no "=", which ends a name on
# the engine's command line, and no spaces.
ADAPTER_NAME = r"^[A-Za-z0-9][-A-Za-z0-9_.:/]*$"
ADAPTER_SOURCE_MESSAGE = "adapters[].source" + SOURCE_MESSAGE.removeprefix("source")
ADAPTER_NAMED_AS_MODEL = (
    "an adapter may not take the model's own name: a request naming it would be ambiguous"
)


class LoraAdapter(_Object):
    """A LoRA adapter (PEFT's format) served beside the model: a request naming it runs on it."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            f"!self.source.matches('{SCHEME}') || self.source.matches('{SOURCE_URI}')", ADAPTER_SOURCE_MESSAGE
        )
    )

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=ADAPTER_NAME,
        description="The name clients send as the model to run on this adapter.",
    )
    source: str = Field(
        min_length=1,
        max_length=1024,
        description="The adapter's directory (adapter_config.json, adapter_model.safetensors), as model.source "
        "takes one: a path in the pod, or hf://, s3://, pvc:// fetched into the model cache before the engine "
        "starts (with model.endpoint and model.credentialsSecret).",
    )

    @model_validator(mode="after")
    def _source_shape(self) -> Self:
        if re.match(SCHEME, self.source) and not re.match(SOURCE_URI, self.source):
            raise ValueError(f"{ADAPTER_SOURCE_MESSAGE} (got {self.source!r})")
        return self


class ModelCache(_Object):
    """Where a fetched model is kept: an emptyDir per pod (the default), or a PersistentVolumeClaim that
    pods share (ReadWriteMany), so that a model is fetched once."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "!has(self.volumeClaim) || !has(self.sizeLimit)", "cache takes volumeClaim or sizeLimit, not both"
        )
    )

    volume_claim: str | None = Field(default=None, max_length=SUBDOMAIN_MAX, pattern=SUBDOMAIN)
    size_limit: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description="The emptyDir's sizeLimit.",
        max_length=QUANTITY_MAX,
        json_schema_extra=byte_rules("model.cache.sizeLimit"),
    )

    @field_validator("size_limit")
    @classmethod
    def _size_in_bytes(cls, value: str | None) -> str | None:
        return check_bytes("model.cache.sizeLimit", value)

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        if self.volume_claim is not None and self.size_limit is not None:
            raise ValueError("cache takes volumeClaim or sizeLimit, not both")
        return self


class Model(_Object):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"!self.source.matches('{SCHEME}') || self.source.matches('{SOURCE_URI}')",
                    "message": SOURCE_MESSAGE,
                },
                {
                    "rule": f"!has(self.volumeClaim) || !self.source.matches('{SCHEME}')",
                    "message": "volumeClaim goes with a path source; pvc://claim/path names its claim itself",
                },
                {
                    "rule": "!has(self.adapters) || self.adapters.all(a, a.name != self.name)",
                    "message": ADAPTER_NAMED_AS_MODEL,
                },
            ]
        }
    )

    name: str = Field(min_length=1, description="The model name that clients send in requests.")
    source: str = Field(
        min_length=1,
        max_length=1024,
        description="Where the checkpoint is: a directory in the pod (in the image, or under /models with "
        "volumeClaim), or fetched before the engine starts into the model cache by an init container "
        "(`ember fetch-model`): hf://org/name[@revision] (the Hugging Face hub, or `endpoint`), "
        "s3://bucket/prefix (S3 or an S3-compatible `endpoint`), pvc://claim/path (copied from a "
        "PersistentVolumeClaim onto the cache).",
    )
    file: str | None = Field(
        default=None,
        max_length=1024,
        pattern=GGUF_FILE,
        description="A GGUF file of the source to serve (a path relative to it, e.g. "
        "model-Q4_K_M.gguf; for a model split into parts, its first part, NAME-00001-of-0000N.gguf): "
        "the engine serves that file, with the tokenizer it carries, and a fetched source brings that file "
        "(and its other parts) alone.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["fp8", "w8a16", "w4a16", "w8a8", "bitsandbytes"] | None = Field(
        default=None,
        description="Quantize the weights as the engine loads them (`ember serve --quantization`): fp8 "
        "(FP8 weights and activations), w8a16 (int8 weights), w4a16 (int4 weights, groups of 128), w8a8 "
        "(int8 weights and activations), bitsandbytes (NF4 weights, blocks of 64). A "
        "checkpoint that is already quantized runs in its own scheme and needs none. With tensor "
        "parallelism each rank quantizes its shard as the whole model's is quantized.",
    )
    volume_claim: str | None = Field(
        default=None,
        max_length=253,
        description="A PersistentVolumeClaim holding the checkpoints, mounted read-only at /models "
        "(so source is then a path under /models). Without one, source must exist in the image.",
    )
    endpoint: str | None = Field(
        default=None,
        max_length=1024,
        pattern=r"^https?://",
        description="hf://: the hub's address (default https://huggingface.co, or a mirror); s3://: the "
        "S3-compatible endpoint (default AWS S3).",
    )
    credentials_secret: str | None = Field(
        default=None,
        max_length=SUBDOMAIN_MAX,
        pattern=SUBDOMAIN,
        description="A Secret whose keys become the fetch's environment: HF_TOKEN for hf://; "
        "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN, AWS_REGION) for s3://. The "
        "engine container never sees it.",
    )
    cache: ModelCache = Field(default_factory=lambda: ModelCache(), json_schema_extra={"default": {}})
    adapters: list[LoraAdapter] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        description="LoRA adapters served beside the model (`ember serve --lora-modules`), each under its own "
        "name: every engine loads them all, and one batch mixes requests on the model and on any of them.",
        json_schema_extra=_list_map("name"),
    )

    @model_validator(mode="after")
    def _source_shape(self) -> Self:
        if re.match(SCHEME, self.source) and not re.match(SOURCE_URI, self.source):
            raise ValueError(f"{SOURCE_MESSAGE} (got {self.source!r})")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapters names must be unique, got {names}")
        if self.name in names:
            raise ValueError(ADAPTER_NAMED_AS_MODEL)
        if self.volume_claim is not None and re.match(SCHEME, self.source):
            raise ValueError("volumeClaim goes with a path source; pvc://claim/path names its claim itself")
        return self


DRAFT_SOURCE_MESSAGE = "speculative.draftSource" + SOURCE_MESSAGE.removeprefix("source")
NGRAM_MESSAGE = (
    "speculative.draftSource goes with method draft: ngram proposes tokens from the prompt and runs no draft "
    "model, so nothing would use it"
)


class Speculative(_Object):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.method != 'draft' || has(self.draftSource)",
                    "message": "draftSource is required when method is draft",
                },
                {"rule": "self.method != 'ngram' || !has(self.draftSource)", "message": NGRAM_MESSAGE},
                {
                    "rule": f"!has(self.draftSource) || !self.draftSource.matches('{SCHEME}') || "
                    f"self.draftSource.matches('{SOURCE_URI}')",
                    "message": DRAFT_SOURCE_MESSAGE,
                },
            ]
        }
    )

    method: Literal["draft", "ngram"]
    draft_source: str | None = Field(
        default=None,
        min_length=1,
        max_length=1024,
        description="The draft model: a path, or like model.source a URI to fetch (hf://, s3://, pvc://).",
    )
    num_tokens: int = Field(default=4, ge=1, le=16)

    @model_validator(mode="after")
    def _draft_needs_source(self) -> Self:
        if self.method == "draft" and self.draft_source is None:
            raise ValueError("draftSource is required when method is draft")
        if self.method == "ngram" and self.draft_source is not None:
            raise ValueError(NGRAM_MESSAGE)
        source = self.draft_source
        if source is not None and re.match(SCHEME, source) and not re.match(SOURCE_URI, source):
            raise ValueError(f"{DRAFT_SOURCE_MESSAGE} (got {source!r})")
        return self


# `ember serve` options the operator sets, and where each comes from: extraArgs may not set them.
PROTECTED_FLAGS = {
    "model": "model.source",
    "served-model-name": "model.name",
    "dtype": "model.dtype",
    "host": "the operator (the pod's address)",
    "port": "the operator (the engine port, 8000)",
    "policy": "the operator (the policy ConfigMap)",
    "drain-timeout": "lifecycle.drainSeconds",
    "max-num-seqs": "engine.maxNumSeqs",
    "max-num-batched-tokens": "engine.maxNumBatchedTokens",
    "block-size": "engine.blockSize",
    "enable-prefix-caching": "engine.prefixCaching",
    "no-enable-prefix-caching": "engine.prefixCaching",
    "gpu-memory-utilization": "engine.gpuMemoryUtilization",
    "max-model-len": "engine.maxModelLen",
    "kv-cache-memory": "engine.kvCacheMemory",
    "kv-cache-dtype": "engine.kvCacheDtype",
    "draft-model": "speculative.draftSource",
    "speculative-method": "speculative.method",
    "num-speculative-tokens": "speculative.numTokens",
    "tensor-parallel-size": "engine.tensorParallelSize",
    "quantization": "model.quantization",
    "lora-modules": "model.adapters",
    "nnodes": "resources.nodes",
    "node-rank": "the operator (the pod's place in its group)",
    "master-addr": "the operator (the group leader's address)",
    "master-port": "the operator (the group's rendezvous port)",
}


def _any_prefix(words: list[str]) -> str:
    """A regular expression for every non-empty prefix of the words (a trie of them, each node optional
    below the first character): what argparse would take as one of those options. Letters and hyphens
    only, which stand for themselves (no escapes, which a CEL string would have to escape again)."""
    trie: dict[str, Any] = {}
    for word in words:
        assert re.fullmatch(r"[a-z-]+", word), word
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})

    def below(node: dict[str, Any]) -> str:
        parts = [ch + below(child) for ch, child in sorted(node.items())]
        return f"({'|'.join(parts)})?" if parts else ""

    return below(trie).removesuffix("?")


# extraArgs' rule on the API server: an item naming a protected option, or a prefix argparse would take
# for one, with or without `=value` (`_not_protected` is the same rule in Python).
PROTECTED_PATTERN = f"^--{_any_prefix(sorted(PROTECTED_FLAGS))}(=|$)"


class Engine(_Object):
    max_num_seqs: int = Field(default=256, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=2048, ge=1, le=1048576)
    block_size: Literal[8, 16, 32, 64, 128] = 16
    prefix_caching: bool = True
    max_model_len: int | None = Field(default=None, ge=1)
    kv_cache_memory: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=QUANTITY_MAX,
        json_schema_extra=byte_rules("engine.kvCacheMemory", at_least_one=True),
    )  # None: sized from gpuMemoryUtilization
    gpu_memory_utilization: float = Field(default=0.9, ge=0.1, le=1.0)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] = Field(
        default="auto",
        description="The KV cache's element type (`ember serve --kv-cache-dtype`): auto (the model's dtype) "
        "or fp8 (E4M3, one K and one V scale per layer or per KV head: the checkpoint's, else computed from "
        "the model at start-up), which holds about twice the blocks of a bfloat16 cache in the same memory; "
        "fp8_e4m3 is fp8, fp8_e5m2 is E5M2 with the same scales (as many blocks, less precise).",
    )
    tensor_parallel_size: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Ranks the model is split across (one per GPU). Default: every GPU of the replica, "
        "resources.gpus times resources.nodes. The model's attention heads must divide by it (and its KV "
        "heads divide by it, or it by them): the engine refuses a split that does not, naming the numbers.",
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="More `ember serve` options, appended after the operator's. Options the operator sets "
        "itself (from the fields above, the model, the port, the policy, the drain timeout) are refused.",
        json_schema_extra={
            "items": {"type": "string", "maxLength": 1024},
            "x-kubernetes-validations": [
                {
                    "rule": f"self.all(a, !a.matches('{PROTECTED_PATTERN}'))",
                    "message": "extraArgs may not set an option the operator sets: use its field instead",
                }
            ],
        },
    )

    @field_validator("kv_cache_memory")
    @classmethod
    def _kv_cache_in_bytes(cls, value: str | None) -> str | None:
        return check_bytes("engine.kvCacheMemory", value, at_least_one=True)

    @field_validator("kv_cache_dtype")
    @classmethod
    def _one_name_for_e4m3(cls, dtype: str) -> str:
        # fp8_e4m3 and fp8 are the same cache: one name keeps the pod template (and its hash) the same.
        return "fp8" if dtype == "fp8_e4m3" else dtype

    @field_validator("extra_args")
    @classmethod
    def _not_protected(cls, args: list[str]) -> list[str]:
        for arg in args:
            name = arg.split("=", 1)[0].removeprefix("--")
            if not arg.startswith("--") or not name:
                continue
            # argparse takes any unambiguous prefix of an option, so a prefix would set it too.
            taken = [flag for flag in PROTECTED_FLAGS if flag.startswith(name)]
            if taken:
                field = PROTECTED_FLAGS[taken[0]]
                raise ValueError(
                    f"extraArgs may not set an option the operator sets: --{taken[0]} (got {arg!r}) comes from "
                    f"{field}"
                )
        return args


def _keyed(condition: str) -> str:
    return f"!has(self.key) || self.key == '' || ({condition})"


# kube-apiserver's ValidateTolerations, with its messages and fields (a bad label value is reported on
# `operator`, as there): a pod the operator makes from a toleration it refuses would be refused.
_TOLERATION_RULES: list[Any] = [
    *(
        {"rule": _keyed(condition), "message": message, "fieldPath": ".key"}
        for condition, message in label_key_conditions("self.key")
    ),
    {
        "rule": "(has(self.key) && self.key != '') || (has(self.operator) && self.operator == 'Exists')",
        "message": 'operator must be Exists when `key` is empty, which means "match all values and all keys"',
        "fieldPath": ".operator",
    },
    {
        "rule": "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
        "message": "effect must be 'NoExecute' when `tolerationSeconds` is set",
        "fieldPath": ".effect",
    },
    {
        "rule": "!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
        "message": "value must be empty when `operator` is 'Exists'",
        "fieldPath": ".operator",
    },
    {
        "rule": "(has(self.operator) && self.operator == 'Exists') || !has(self.value) || "
        + label_value_condition("self.value")[0],
        "message": LABEL_VALUE_MESSAGE,
        "fieldPath": ".operator",
    },
]


class Toleration(_Object):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _TOLERATION_RULES})

    key: str | None = Field(default=None, max_length=LABEL_KEY_MAX)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(default=None, max_length=LABEL_VALUE_MAX)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None

    @model_validator(mode="after")
    def _as_kube_apiserver_takes_it(self) -> Self:
        errors = [f"key: {e}" for e in label_key_errors(self.key)] if self.key else []
        if not self.key and self.operator != "Exists":
            errors.append(f"operator: {_TOLERATION_RULES[-4]['message']}")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            errors.append(f"effect: {_TOLERATION_RULES[-3]['message']}")
        if self.operator == "Exists" and self.value:
            errors.append(f"operator: {_TOLERATION_RULES[-2]['message']}")
        if self.operator != "Exists" and self.value is not None:
            errors += [f"operator: {e}" for e in label_value_errors(self.value)]
        if errors:
            raise ValueError("; ".join(errors))
        return self


# An extended resource name: a domain prefix (not kubernetes.io's) and a name.
EXTENDED_RESOURCE = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)+[a-z0-9]([-a-z0-9]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"


_NODE_SELECTOR_VALUE_RULE: dict[str, Any] = dict(
    zip(("rule", "message"), label_value_condition("self"), strict=True)
)
MAX_NODE_SELECTOR = 64
MAX_TOLERATIONS = 64
_NODE_SELECTOR_SCHEMA: dict[str, Any] = {
    "additionalProperties": {
        "type": "string",
        "maxLength": LABEL_VALUE_MAX,
        "x-kubernetes-validations": [_NODE_SELECTOR_VALUE_RULE],
    }
}
_NODE_SELECTOR_CHECKS = (
    "The API server checks the values as label values; the operator checks the keys as label keys."
)


def check_node_selector(selector: dict[str, str]) -> dict[str, str]:
    """A nodeSelector's keys as label keys and values as label values (kube-apiserver's checks)."""
    for key, value in selector.items():
        errors = label_key_errors(key) + label_value_errors(value)
        if errors:
            raise ValueError(f"nodeSelector {key!r}: {value!r}: {'; '.join(errors)}")
    return selector


class Resources(_Object):
    gpus: int = Field(default=1, ge=0, le=16, description="GPUs of each pod (each node of a replica).")
    nodes: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Nodes one replica spans. Above 1, each replica is a LeaderWorkerSet group of this many "
        "pods (the leader serves, the others join its tensor-parallel group): the LeaderWorkerSet "
        "controller (leaderworkerset.x-k8s.io) must be installed.",
    )
    cpu: str | None = Field(default=None, pattern=QUANTITY)
    memory: str | None = Field(
        default=None,
        pattern=QUANTITY,
        max_length=QUANTITY_MAX,
        json_schema_extra=byte_rules("resources.memory"),
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_NODE_SELECTOR,
        description="The pods' nodeSelector. " + _NODE_SELECTOR_CHECKS,
        json_schema_extra=_NODE_SELECTOR_SCHEMA,
    )
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_TOLERATIONS)
    image: str = Field(default="ghcr.io/ember-dev/ember-engine:0.1.0", min_length=1)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    env: list[EnvVar] = Field(default_factory=list, max_length=MAX_ENV, json_schema_extra=_list_map("name"))
    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=32)
    gpu_resource: str = Field(
        default="nvidia.com/gpu",
        max_length=253,
        pattern=EXTENDED_RESOURCE,
        description="The extended resource a GPU is requested as: nvidia.com/gpu, amd.com/gpu, or any other "
        "a device plugin advertises.",
    )
    shared_memory: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description="Size of the memory-backed emptyDir mounted at /dev/shm (a container's own is 64 MiB, "
        "too little for torch's inter-process buffers and NCCL's intra-node transport). Default: 1Gi per "
        'tensor-parallel rank on the pod; "0" for none. Counts against the pod\'s memory.',
        max_length=QUANTITY_MAX,
        json_schema_extra=byte_rules("resources.sharedMemory"),
    )

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, selector: dict[str, str]) -> dict[str, str]:
        return check_node_selector(selector)

    @field_validator("memory", "shared_memory")
    @classmethod
    def _in_bytes(cls, value: str | None, info: ValidationInfo) -> str | None:
        return check_bytes(f"resources.{to_camel(info.field_name or '')}", value)


class Replicas(_Object):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            "self.min <= self.max", "replicas.min must be less than or equal to replicas.max"
        )
    )

    min: int = Field(default=1, ge=0, le=1000)
    max: int = Field(default=1, ge=1, le=1000)
    # Written through the scale subresource by an HPA or KEDA when autoscaling.mode is External; clamped to
    # min..max. Always present, because the API server answers GET /scale with a 500 when the spec replicas
    # path holds no value; 1, not 0, because an HPA reads a target of 0 as "scaling is disabled" and never
    # writes one (a 0 stored by an older CRD still means min).
    desired: int = Field(default=DEFAULT_DESIRED, ge=0)

    @model_validator(mode="after")
    def _min_le_max(self) -> Self:
        if self.min > self.max:
            raise ValueError(f"replicas.min ({self.min}) must be <= replicas.max ({self.max})")
        return self


class WarmPool(_Object):
    size: int = Field(default=0, ge=0, le=100)
    failover_after_seconds: float = Field(
        default=5,
        ge=0,
        le=600,
        description="An active pod whose engine still runs but that has not been Ready this long is replaced "
        "by a Ready warm pod; one whose engine is down (exited, restarting) is replaced at once.",
    )


class Rollout(_Object):
    """How a template change replaces pods (Deployment's rolling-update semantics, counted in active pods)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "self.maxSurge > 0 || self.maxUnavailable > 0",
            "rollout.maxSurge and rollout.maxUnavailable may not both be 0",
        )
    )

    max_surge: int = Field(
        default=1,
        ge=0,
        le=100,
        description="Pods a roll may create beyond replicas + warmPool.size. Surge pods that no node can take "
        "(Unschedulable) do not hold the roll up: maxUnavailable then frees room.",
    )
    max_unavailable: int = Field(
        default=1,
        ge=0,
        le=100,
        description="Ready active pods a roll may take below the target to free room for new ones; used only "
        "when neither the warm pool nor a schedulable surge pod can make progress.",
    )

    @model_validator(mode="after")
    def _can_progress(self) -> Self:
        if self.max_surge == 0 and self.max_unavailable == 0:
            raise ValueError("rollout.maxSurge and rollout.maxUnavailable may not both be 0")
        return self


class Router(_Object):
    """`spec.router`: the `ember router` Deployment in front of the engines (prefix- and load-aware)."""

    enabled: bool = Field(
        default=True,
        description="Run the router and point the Service at it; false: the Service selects the engines.",
    )
    replicas: int = Field(default=2, ge=1, le=100)
    cpu: str | None = Field(default=None, pattern=QUANTITY, description="Each router pod's CPU request.")
    memory: str | None = Field(
        default=None,
        pattern=QUANTITY,
        description="Each router pod's memory request and limit.",
        max_length=QUANTITY_MAX,
        json_schema_extra=byte_rules("router.memory"),
    )
    epsilon: float = Field(
        default=0.25,
        ge=0,
        le=10,
        description="Bounded load: an engine above (1 + epsilon) x the mean load is skipped even when it "
        "holds the prompt's prefix (above twice that, while the engine reports no queue).",
    )
    hold_seconds: float = Field(
        default=30,
        ge=0,
        le=3600,
        description="With no engine Ready, how long a router holds a request for one (the demand that wakes "
        "a service with replicas.min 0); 0: answer 503 at once.",
    )
    stream_idle_timeout_seconds: float | None = Field(
        default=None,
        ge=0,
        le=86400,
        description="How long a stream may pass with nothing from its engine before a router ends it with an "
        "error event (code upstream_timeout) and [DONE]; 0: no limit. Unset: the router's own, 300.",
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        max_length=MAX_NODE_SELECTOR,
        description="The router pods' nodeSelector (they take none of resources'). " + _NODE_SELECTOR_CHECKS,
        json_schema_extra=_NODE_SELECTOR_SCHEMA,
    )
    tolerations: list[Toleration] = Field(
        default_factory=list,
        max_length=MAX_TOLERATIONS,
        description="The router pods' tolerations (they take none of resources').",
    )

    @field_validator("memory")
    @classmethod
    def _in_bytes(cls, value: str | None) -> str | None:
        return check_bytes("router.memory", value)

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, selector: dict[str, str]) -> dict[str, str]:
        return check_node_selector(selector)


class RoutingRule(_Object):
    """One `spec.routing` rule: requests meeting every condition set go to `service` instead."""

    name: str = Field(
        max_length=NAME_MAX, pattern=DNS_LABEL, description="Names the rule in metrics and headers."
    )
    service: str = Field(
        max_length=NAME_MAX,
        pattern=DNS_LABEL,
        description="The InferenceService (same namespace) to send to.",
    )
    min_prompt_tokens: int | None = Field(default=None, ge=0)
    max_prompt_tokens: int | None = Field(default=None, ge=0)
    min_max_tokens: int | None = Field(default=None, ge=0, description="Bounds on the request's max_tokens.")
    max_max_tokens: int | None = Field(default=None, ge=0)
    header: str | None = Field(default=None, max_length=256, pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")
    header_value: str | None = Field(
        default=None, max_length=1024, description="Without it, the header's presence is enough."
    )
    models: list[str] = Field(
        default_factory=list, max_length=16, description="Requested model names that match (any of them)."
    )


class Autoscaling(_Object):
    mode: Literal["Builtin", "External"] = "Builtin"
    queue_depth_per_replica: float = Field(default=4, gt=0)
    kv_cache_utilization: float = Field(default=0.8, gt=0, le=1)
    interval_seconds: int = Field(default=15, ge=1, le=3600)
    tolerance: float = Field(default=0.1, ge=0, le=1)
    scale_up_stabilization_seconds: int = Field(default=0, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(default=120, ge=0, le=3600)
    scale_up_max_step: int = Field(default=4, ge=1, le=100)
    scale_down_max_step: int = Field(default=1, ge=1, le=100)


class PriorityClass(_Object):
    name: str = Field(min_length=1, max_length=NAME_MAX)
    priority: int  # lower is more important, as in the engine's scheduler


_DEFAULT_CLASSES = [
    PriorityClass(name="critical", priority=0),
    PriorityClass(name="standard", priority=1),
    PriorityClass(name="batch", priority=2),
]


class LoadShedding(_Object):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.priorityClasses.exists(c, c.name == self.defaultPriorityClass)",
                    "message": "defaultPriorityClass must name one of the priorityClasses",
                },
                {
                    # The engine rejects two classes at one priority; catch it at admission instead.
                    "rule": "self.priorityClasses.all(c, self.priorityClasses.exists_one(d, d.priority == c.priority))",
                    "message": "priorityClasses must have distinct priorities",
                },
            ]
        }
    )

    max_queue_depth: int = Field(default=0, ge=0)
    max_queue_wait_seconds: float = Field(default=0, ge=0)
    retry_after_seconds: int = Field(default=1, ge=0)
    max_concurrent_per_client: int = Field(default=0, ge=0)
    priority_classes: list[PriorityClass] = Field(
        default=_DEFAULT_CLASSES,  # pydantic copies it per instance
        min_length=1,
        max_length=MAX_PRIORITY_CLASSES,
        json_schema_extra=_list_map("name"),
    )
    default_priority_class: str = Field(default="standard", min_length=1, max_length=NAME_MAX)

    @model_validator(mode="after")
    def _classes_consistent(self) -> Self:
        names = [c.name for c in self.priority_classes]
        if len(set(names)) != len(names):
            raise ValueError(f"priorityClasses names must be unique, got {names}")
        priorities = [c.priority for c in self.priority_classes]
        if len(set(priorities)) != len(priorities):
            raise ValueError(f"priorityClasses must have distinct priorities, got {priorities}")
        if self.default_priority_class not in names:
            raise ValueError(
                f"defaultPriorityClass {self.default_priority_class!r} is not one of the priorityClasses: {names}"
            )
        return self


_KEY_ENVS = ("EMBER_API_KEY", "EMBER_FALLBACK_API_KEY")
_KEY_NOT_OPTIONAL = (
    "secretKeyRef.optional cannot be true: without its Secret the server would take requests without a key"
)


class ApiKey(_Object):
    """An API key, from a Secret: `Authorization: Bearer KEY` is then needed (ember serve and ember router
    --api-key)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "!has(self.secretKeyRef.optional) || !self.secretKeyRef.optional", _KEY_NOT_OPTIONAL
        )
    )

    secret_key_ref: KeySelector

    @model_validator(mode="after")
    def _required(self) -> Self:
        if self.secret_key_ref.optional:
            raise ValueError(_KEY_NOT_OPTIONAL)
        return self


class Fallback(_Object):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            "has(self.service) != has(self.url)", "fallback needs exactly one of service or url"
        )
    )

    service: str | None = Field(default=None, max_length=NAME_MAX, pattern=DNS_LABEL)  # same namespace
    url: str | None = Field(default=None, pattern=r"^https?://")
    model: str | None = Field(default=None, min_length=1)  # None: keep the request's model name
    when: list[Literal["Overloaded", "Unavailable"]] = ["Overloaded", "Unavailable"]
    timeout_seconds: float = Field(default=30, gt=0)
    api_key: ApiKey | None = Field(
        default=None,
        description="The key the engines and routers present to the fallback (as EMBER_FALLBACK_API_KEY); "
        "never the client's own credentials.",
    )

    @model_validator(mode="after")
    def _one_target(self) -> Self:
        if (self.service is None) == (self.url is None):
            raise ValueError("fallback needs exactly one of service or url")
        return self


_PARALLEL_RULES: list[dict[str, Any]] = [
    {
        "rule": "self.resources.nodes == 1 || self.resources.gpus >= 1",
        "message": "resources.nodes > 1 needs resources.gpus >= 1 (a rank per GPU on each node)",
    },
    {
        "rule": "!has(self.engine.tensorParallelSize) || "
        "(self.engine.tensorParallelSize % self.resources.nodes == 0 && (self.resources.gpus == 0 || "
        "self.engine.tensorParallelSize / self.resources.nodes <= self.resources.gpus))",
        "message": "engine.tensorParallelSize must be a multiple of resources.nodes, with at most "
        "resources.gpus ranks on each node",
    },
]


_WAKE_RULE: dict[str, Any] = {
    "rule": "self.autoscaling.mode != 'Builtin' || self.replicas.min > 0 || self.router.enabled",
    "message": "replicas.min 0 in Builtin mode needs router.enabled: only requests the router holds wake a "
    "service scaled to zero, so without it the service would never serve",
    "fieldPath": ".replicas.min",
}


_KEY_ENV_RULE: dict[str, Any] = {
    "rule": "!has(self.resources.env) || !self.resources.env.exists(e, e.name in "
    + str(list(_KEY_ENVS)).replace('"', "'")
    + ")",
    "message": "resources.env may not set EMBER_API_KEY or EMBER_FALLBACK_API_KEY: give apiKey and "
    "fallback.apiKey (they reach the routers too)",
    "fieldPath": ".resources.env",
}


class InferenceServiceSpec(_Object):
    # A transition rule, so CEL only: pydantic sees one object, never the change. The scale subresource
    # (kubectl scale, an HPA, KEDA) writes replicas.desired; in Builtin mode nothing would follow it, so the
    # write is refused rather than silently ignored. optionalOldSelf (Kubernetes 1.30+) runs it on create
    # too, where anything but the default is refused.
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                *_PARALLEL_RULES,
                _WAKE_RULE,
                _KEY_ENV_RULE,
                {
                    "rule": "self.autoscaling.mode == 'External' || (oldSelf.hasValue() ? "
                    "self.replicas.desired == oldSelf.value().replicas.desired : "
                    f"self.replicas.desired == {DEFAULT_DESIRED})",
                    "optionalOldSelf": True,
                    "message": "replicas.desired (what kubectl scale, an HPA or KEDA writes through the scale "
                    "subresource) is followed only when autoscaling.mode is External; in Builtin mode ember's "
                    "own autoscaler sets the replica count between replicas.min and replicas.max",
                    "fieldPath": ".replicas.desired",
                },
            ]
        }
    )

    model: Model
    api_key: ApiKey | None = Field(
        default=None,
        description="Requests to the engines and routers need 'Authorization: Bearer KEY' with this Secret's "
        "key (EMBER_API_KEY); /health, /ready, /metrics and /version stay open. The pods read it at start: "
        "after a change to the Secret, roll them (e.g. with a pod annotation).",
    )
    speculative: Speculative | None = None
    engine: Engine = Field(default_factory=Engine, json_schema_extra=_OBJECT_DEFAULT)
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_OBJECT_DEFAULT)
    replicas: Replicas = Field(default_factory=Replicas, json_schema_extra=_full_default(Replicas))
    warm_pool: WarmPool = Field(default_factory=WarmPool, json_schema_extra=_OBJECT_DEFAULT)
    rollout: Rollout = Field(default_factory=Rollout, json_schema_extra=_full_default(Rollout))
    capacity_wait_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="How long pods may stay Unschedulable (waiting for a node, e.g. from a cluster "
        "autoscaler) while Reconciling reports WaitingForCapacity, before the service is Stalled.",
    )
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, json_schema_extra=_OBJECT_DEFAULT)
    router: Router = Field(default_factory=Router, json_schema_extra=_OBJECT_DEFAULT)
    routing: list[RoutingRule] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=_list_map("name"),
        description="Model routing at the router (spec.router must be enabled): the first rule a request "
        "meets sends it to another InferenceService.",
    )
    load_shedding: LoadShedding = Field(
        default_factory=LoadShedding, json_schema_extra=_full_default(LoadShedding)
    )
    fallback: Fallback | None = None
    request_timeout_seconds: float = Field(default=0, ge=0)  # 0: no deadline
    pod: PodSettings = Field(default_factory=PodSettings, json_schema_extra=_OBJECT_DEFAULT)
    lifecycle: Lifecycle = Field(default_factory=Lifecycle, json_schema_extra=_OBJECT_DEFAULT)
    pod_template: PodTemplate | None = Field(
        default=None,
        description="A strategic-merge patch over each engine pod (metadata.labels, metadata.annotations "
        "and spec), applied after every other field: for what no field covers.",
    )

    @model_validator(mode="after")
    def _wakes_from_zero(self) -> Self:
        if self.autoscaling.mode == "Builtin" and self.replicas.min == 0 and not self.router.enabled:
            raise ValueError(_WAKE_RULE["message"])
        return self

    @model_validator(mode="after")
    def _keys_by_their_fields(self) -> Self:
        if any(e.name in _KEY_ENVS for e in self.resources.env):
            raise ValueError(_KEY_ENV_RULE["message"])
        return self

    @model_validator(mode="after")
    def _parallel_fits(self) -> Self:
        r, tp = self.resources, self.engine.tensor_parallel_size
        if r.nodes > 1 and r.gpus < 1:
            raise ValueError(_PARALLEL_RULES[0]["message"])
        if tp is not None and (tp % r.nodes or (r.gpus and tp // r.nodes > r.gpus)):
            raise ValueError(
                f"{_PARALLEL_RULES[1]['message']}: got tensorParallelSize {tp} for {r.nodes} node(s) "
                f"of {r.gpus} GPU(s)"
            )
        return self

    @property
    def tensor_parallel_size(self) -> int:
        """The engine's ranks: as set, else one per GPU of the replica (1 without GPUs)."""
        r = self.resources
        return self.engine.tensor_parallel_size or max(1, r.gpus * r.nodes)


class Condition(_Object):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str | None = None
    message: str | None = None
    last_transition_time: datetime | None = None
    observed_generation: int | None = None


class AutoscalerInputs(_Object):
    queue_depth: float | None = None
    kv_cache_utilization: float | None = None
    ready_pods: int | None = None


class ScalingDecision(_Object):
    time: datetime
    desired: int
    reason: str
    inputs: AutoscalerInputs | None = None


class AutoscalerStatus(_Object):
    inputs: AutoscalerInputs | None = None
    decisions: list[ScalingDecision] = Field(default_factory=list, max_length=10)  # the latest last


class RouterStatus(_Object):
    ready: int = 0
    desired: int = 0
    summary: str | None = None  # "ready/desired", for the Routers printer column


class InferenceServiceStatus(_Object):
    observed_generation: int | None = None
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra=_list_map("type"))
    replicas: int | None = None
    warm_replicas: int | None = None
    ready_replicas: int | None = None
    desired_replicas: int | None = None
    selector: str | None = None  # for the scale subresource's labelSelectorPath
    endpoint: str | None = None
    cold_start_seconds: float | None = None
    autoscaler: AutoscalerStatus | None = None
    router: RouterStatus | None = None
