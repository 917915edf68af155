"""The serving policy: load shedding, fallback and request deadlines, read from a YAML file that the operator
writes into a ConfigMap, and re-read whenever that file changes (no restart).

Keys are camelCase to match the operator's CRD. Unknown keys and ill-typed values are errors rather than
silently ignored or coerced: a typo in a shedding limit should be loud, not a limit that never applies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel
from pydantic_core import ErrorDetails

from ember_engine.server.content_watch import ContentWatch

logger = logging.getLogger("ember.policy")

FallbackCondition = Literal["Overloaded", "Unavailable"]


class PolicyError(ValueError):
    """An unreadable or invalid policy; the message names the offending field path."""


class _Section(BaseModel):
    # Strict: YAML `maxQueueDepth: "64"` or `true` is a mistake, not something to coerce.
    model_config = ConfigDict(
        strict=True, extra="forbid", frozen=True, allow_inf_nan=False, alias_generator=to_camel
    )


class PriorityClass(_Section):
    name: str = Field(min_length=1)
    priority: int  # lower is more important, the scheduler's convention


def _default_classes() -> list[PriorityClass]:
    return [
        PriorityClass(name="critical", priority=0),
        PriorityClass(name="standard", priority=1),
        PriorityClass(name="batch", priority=2),
    ]


class LoadShedding(_Section):
    # The limits default to off: the right numbers depend on the model and the hardware.
    max_queue_depth: int = Field(default=0, ge=0)
    max_queue_wait_seconds: float = Field(default=0.0, ge=0)
    retry_after_seconds: int = Field(default=1, ge=0)  # an integer because the Retry-After header carries one
    max_concurrent_per_client: int = Field(default=0, ge=0)
    priority_classes: list[PriorityClass] = Field(default_factory=_default_classes, min_length=1)
    default_priority_class: str = "standard"

    @field_validator("priority_classes")
    @classmethod
    def _distinct(cls, classes: list[PriorityClass]) -> list[PriorityClass]:
        names = [c.name for c in classes]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be unique, got {names}")
        # Two classes at one priority would be indistinguishable to the scheduler and to shedding.
        priorities = [c.priority for c in classes]
        if len(set(priorities)) != len(priorities):
            raise ValueError(f"class priorities must be unique, got {priorities}")
        return classes

    @field_validator("default_priority_class")
    @classmethod
    def _names_a_class(cls, name: str, info: ValidationInfo) -> str:
        classes = info.data.get("priority_classes")  # absent when the classes themselves were invalid
        if classes is not None and name not in {c.name for c in classes}:
            raise ValueError(
                f"{name!r} is not one of the priorityClasses: {', '.join(c.name for c in classes)}"
            )
        return name


def _default_when() -> list[FallbackCondition]:
    return ["Overloaded", "Unavailable"]


class Fallback(_Section):
    url: str | None = None  # base URL of any OpenAI-compatible server; None: no fallback
    model: str | None = None  # the model name to send there; None: keep the request's
    when: list[FallbackCondition] = Field(default_factory=_default_when)
    timeout_seconds: float = Field(default=30.0, gt=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError(f"must be an http:// or https:// URL, got {url!r}")
        # Stripped so that the server can append "/v1/..." without doubling the slash.
        return url.rstrip("/") if url is not None else None


class Policy(_Section):
    load_shedding: LoadShedding = Field(default_factory=LoadShedding)
    fallback: Fallback = Field(default_factory=Fallback)
    request_timeout_seconds: float = Field(default=0.0, ge=0)  # 0: no deadline

    @field_validator("load_shedding", "fallback", mode="before")
    @classmethod
    def _null_section(cls, value: object) -> object:
        # `fallback:` with every child commented out reads as null; it means "all defaults".
        return {} if value is None else value

    def priority_of(self, class_name: str | None) -> tuple[str, int]:
        """The (name, numeric priority) of a class; None means the default class."""
        shedding = self.load_shedding
        name = shedding.default_priority_class if class_name is None else class_name
        for c in shedding.priority_classes:
            if c.name == name:
                return c.name, c.priority
        valid = ", ".join(c.name for c in shedding.priority_classes)
        raise PolicyError(f"unknown priority class {name!r}; valid classes: {valid}")


def _describe(error: ErrorDetails) -> str:
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    where = path or "policy"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    if error["type"] == "value_error":  # our validators: their message already shows the value
        return f"{where}: {error.get('ctx', {}).get('error', error['msg'])}"
    if error["type"] == "missing":
        return f"{where}: {error['msg']}"
    shown = repr(error["input"])
    return f"{where}: {error['msg']} (got {shown if len(shown) <= 60 else shown[:57] + '...'})"


def parse_policy(text: str) -> Policy:
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as e:  # one line for the log, rather than PyYAML's drawing of the spot
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PolicyError(f"not valid YAML{where}: {e.problem or e.context}") from e
    except yaml.YAMLError as e:
        raise PolicyError(f"not valid YAML: {e}") from e
    if data is None:  # an empty file (or only comments)
        data = {}
    if not isinstance(data, dict):
        raise PolicyError(f"the policy must be a YAML mapping of fields, got a {type(data).__name__}")
    try:
        return Policy.model_validate(data)
    except ValidationError as e:
        raise PolicyError("; ".join(_describe(err) for err in e.errors())) from e


def _decode(data: bytes) -> Policy:
    try:
        return parse_policy(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise PolicyError(f"not UTF-8 text: {e}") from e


def load_policy(path: str | Path) -> Policy:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise PolicyError(f"cannot read policy file {path}: {e}") from e
    return _decode(data)


class PolicyWatcher:
    """Holds the current good policy and swaps in a new one when the file's content changes."""

    def __init__(self, path: str | Path | None, on_change: Callable[[Policy], None] | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self.on_change = on_change
        self.policy = Policy()
        self._watch = ContentWatch(self.path) if self.path is not None else None
        if self._watch is not None:
            _, data, error = self._watch.look()
            if data is None:
                raise PolicyError(f"cannot read policy file {self.path}: {error}")
            self.policy = _decode(data)

    def check(self) -> bool:
        """Re-read the file; True when a different policy took effect (and on_change was called)."""
        if self._watch is None:
            return False
        changed, data, error = self._watch.look()
        if not changed:  # also keeps a bad file from being reported on every poll
            return False
        if data is None:
            logger.warning("cannot read policy file %s: %s; keeping the last good policy", self.path, error)
            return False
        try:
            policy = _decode(data)
        except PolicyError as e:
            logger.warning("invalid policy file %s, keeping the last good policy: %s", self.path, e)
            return False
        if policy == self.policy:  # e.g. only comments changed, or a bad write was reverted
            return False
        self.policy = policy
        logger.info("policy from %s took effect", self.path)
        if self.on_change is not None:
            self.on_change(policy)
        return True

    async def run(self, interval: float = 1.0) -> None:
        while True:
            try:
                self.check()
            except Exception:  # an on_change bug must not stop later policies from being picked up
                logger.exception("policy on_change callback failed")
            await asyncio.sleep(interval)

    def priority_of(self, class_name: str | None) -> tuple[str, int]:
        return self.policy.priority_of(class_name)
