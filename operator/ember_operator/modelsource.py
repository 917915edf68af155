"""Where an engine pod's checkpoints come from, as pod parts. Pure.

A path is read where it is (in the image, or on `model.volumeClaim` mounted at /models). A source with a
scheme is fetched before the engine starts, by an init container running `ember fetch-model`, into the model
cache (an emptyDir, or `model.cache.volumeClaim` shared between pods), and the engine reads it there:

- `hf://org/name[@revision]` from the Hugging Face hub (or `model.endpoint`), HF_TOKEN from
  `model.credentialsSecret`;
- `s3://bucket/prefix` from S3 or an S3-compatible `model.endpoint`, AWS_* keys from the Secret;
- `pvc://claim/path`, copied from the claim (mounted read-only in the init container only) onto the cache.

The draft model of `speculative.draftSource` is fetched the same way, by a second init container, and each
LoRA adapter of `model.adapters` with a scheme by one of its own (`fetch-adapter-<i>`). Where
`model.file` names a GGUF file, the fetch takes that file (and its other parts) alone, and the engine serves
it.
"""

from __future__ import annotations

import re
from typing import Any

from ember_operator.spec import SCHEME, InferenceServiceSpec

CACHE_DIR = "/model-cache"
SOURCE_DIR = "/model-source"
CACHE_VOLUME = "model-cache"
SOURCE_VOLUME = "model-source"
FETCH_COMMAND = ["ember", "fetch-model"]
FETCH_CONTAINERS = ("fetch-model", "fetch-draft")
ADAPTER_FETCH = "fetch-adapter-"  # + the adapter's index in model.adapters


def is_fetch_container(name: object) -> bool:
    return name in FETCH_CONTAINERS or (isinstance(name, str) and name.startswith(ADAPTER_FETCH))


def is_fetched(source: str) -> bool:
    return re.match(SCHEME, source) is not None


def _split(source: str) -> tuple[str, str]:
    scheme, rest = source.split("://", 1)
    return scheme.lower(), rest.strip("/")


def cache_path(source: str) -> str:
    """The directory in the model cache that a fetched source lands in: one per source (and revision), so
    that a shared cache holds several models and revisions side by side."""
    scheme, rest = _split(source)
    if scheme == "hf":
        repo, _, revision = rest.partition("@")
        return f"{CACHE_DIR}/hf/{repo}/{(revision or 'main').replace('/', '--')}"
    return f"{CACHE_DIR}/{scheme}/{rest}"


def engine_path(source: str, file: str | None = None) -> str:
    """What the engine's --model (or --draft-model) names for `source`: its directory, or `file` in it."""
    root = cache_path(source) if is_fetched(source) else source
    return root if file is None else f"{root.rstrip('/')}/{file}"


def model_path(spec: InferenceServiceSpec) -> str:
    """The engine's (and the router's) --model."""
    return engine_path(spec.model.source, spec.model.file)


def file_patterns(file: str) -> list[str]:
    """What a fetch takes of a source for a GGUF `file`: the file, and the other parts where it is the
    first part of a split model (NAME-00001-of-0000N.gguf: NAME-*-of-0000N.gguf)."""
    m = re.match(r"^(?P<prefix>.+)-00001-of-(?P<count>\d{5})\.gguf$", file)
    return [file] if m is None else [file, f"{m['prefix']}-[0-9][0-9][0-9][0-9][0-9]-of-{m['count']}.gguf"]


def _fetch_source(source: str) -> str:
    """What `ember fetch-model` is given: the URI, or for pvc:// the claim's directory as mounted."""
    scheme, rest = _split(source)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        return f"{SOURCE_DIR}/{claim}/{path}".rstrip("/")
    return source


def _claim(source: str) -> str | None:
    scheme, rest = _split(source)
    return rest.partition("/")[0] if scheme == "pvc" else None


def _claims(spec: InferenceServiceSpec) -> list[str]:
    """The claims of the pvc:// sources, once each; the i-th is the volume `model-source-<i>`."""
    return list(dict.fromkeys(c for _, source in fetches(spec) if (c := _claim(source)) is not None))


def fetches(spec: InferenceServiceSpec) -> list[tuple[str, str]]:
    """(init container name, source) for each source to fetch: the model, the draft model, then the
    adapters."""
    draft = spec.speculative.draft_source if spec.speculative is not None else None
    sources = (spec.model.source, draft)
    out = [(name, s) for name, s in zip(FETCH_CONTAINERS, sources, strict=True) if s and is_fetched(s)]
    adapters = enumerate(spec.model.adapters)
    return out + [(f"{ADAPTER_FETCH}{i}", a.source) for i, a in adapters if is_fetched(a.source)]


def lora_modules(spec: InferenceServiceSpec) -> list[str]:
    """`ember serve --lora-modules`' values: NAME=PATH of each adapter, where the engine reads it."""
    return [f"{a.name}={engine_path(a.source)}" for a in spec.model.adapters]


def init_containers(spec: InferenceServiceSpec, security_context: dict[str, Any]) -> list[dict[str, Any]]:
    """One `ember fetch-model` init container per fetched source, in order (the kubelet runs them one after
    the other, each to completion, before the engine starts)."""
    m, r = spec.model, spec.resources
    out = []
    for name, source in fetches(spec):
        args = [_fetch_source(source), cache_path(source)]
        if name == FETCH_CONTAINERS[0] and m.file is not None:
            args += [f"--include={p}" for p in file_patterns(m.file)]
        if m.endpoint is not None:
            args.append(f"--endpoint={m.endpoint}")
        mounts: list[dict[str, Any]] = [{"name": CACHE_VOLUME, "mountPath": CACHE_DIR}]
        claim = _claim(source)
        if claim is not None:
            volume = f"{SOURCE_VOLUME}-{_claims(spec).index(claim)}"
            mounts.append({"name": volume, "mountPath": f"{SOURCE_DIR}/{claim}", "readOnly": True})
        container: dict[str, Any] = {
            "name": name,
            "image": r.image,
            "imagePullPolicy": r.image_pull_policy,
            "command": list(FETCH_COMMAND),
            "args": args,
            "volumeMounts": mounts,
            # Its last log lines (the fetch's fatal line) become the status message when it fails.
            "terminationMessagePolicy": "FallbackToLogsOnError",
            "securityContext": security_context,
        }
        if m.credentials_secret is not None:
            container["envFrom"] = [{"secretRef": {"name": m.credentials_secret}}]
        out.append(container)
    return out


def volumes(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The model cache (when anything is fetched) and each pvc:// source's claim."""
    sources = [source for _, source in fetches(spec)]
    if not sources:
        return []
    cache = spec.model.cache
    if cache.volume_claim is not None:
        out = [{"name": CACHE_VOLUME, "persistentVolumeClaim": {"claimName": cache.volume_claim}}]
    else:
        empty_dir = {"sizeLimit": cache.size_limit} if cache.size_limit is not None else {}
        out = [{"name": CACHE_VOLUME, "emptyDir": empty_dir}]
    for i, claim in enumerate(_claims(spec)):
        out.append(
            {"name": f"{SOURCE_VOLUME}-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
    return out


def engine_mounts(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The engine reads the model cache, never writes it."""
    return [{"name": CACHE_VOLUME, "mountPath": CACHE_DIR, "readOnly": True}] if fetches(spec) else []
