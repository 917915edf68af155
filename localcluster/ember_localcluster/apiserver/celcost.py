"""Static cost of `x-kubernetes-validations` rules, estimated the way kube-apiserver does at CRD writes.

When a CustomResourceDefinition is created or updated, apiextensions-apiserver compiles every CEL
rule of its schemas and estimates each one's worst-case cost before any object exists
(`apiextensions/validation/validation.go`, `cel_validation.go` and `apiserver/schema/cel/compilation.go`,
on top of cel-go's `checker/cost.go`). A CRD is refused when

- a rule does not compile (`Invalid`: `compilation failed: ...`, or `cel expression must evaluate
  to a bool`);
- a rule's estimated cost, times the largest number of times it can run, is over
  `StaticEstimatedCostLimit` (10,000,000): `Forbidden: estimated rule cost exceeds budget by factor
  of ...`;
- the sum of those over the whole schema is over `StaticEstimatedCRDCostLimit` (100,000,000): the
  (at most four) rules that contribute at least 1% of it each get `Forbidden: contributed to
  estimated rule & messageExpression cost total exceeding cost limit for entire OpenAPIv3 schema`,
  and the schema itself gets `Forbidden: x-kubernetes-validations estimated rule & messageExpression
  cost total for entire OpenAPIv3 schema exceeds budget by factor of ...`.

The number of times a rule can run is the product of the `maxItems`/`maxProperties` of the lists and
maps above it; with one of them unbounded it is the 3 MiB request size over the smallest serialized
size of the node plus one. The sizes the estimate needs come from the schema (`SchemaDeclType` in
`apiserver/pkg/cel/common/schemas.go`): a string with `maxLength` n is 4n long (a code point can take
4 bytes), one with an `enum` as long as its longest value, any other 3 MiB - 2; a list without
`maxItems` holds as many of its smallest items as 3 MiB can; a map key has length 0.

What is modelled: literals, `self`/`oldSelf` (with `optionalOldSelf`: `hasValue()`, `value()`,
`orValue()`), field selection and `has()`, indexing, `size()`, `matches`, `startsWith`, `endsWith`,
`contains`, the comparisons, `&&`, `||`, `!`, `?:`, arithmetic, `+` on strings and lists, `in` on
lists and maps, list and map literals, and the `all`, `exists`, `exists_one`, `map` and `filter`
macros. Anything else (the Kubernetes CEL library, conversions, `?.` and other optional syntax)
raises `Unsupported` rather than guess a cost; the CRD checks then leave that rule out, so a refusal
is sure but an acceptance covers only the rules estimated. `messageExpression` is neither compiled
nor estimated here (upstream adds its cost to the schema's total too).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import celpy

UINT64_MAX = 2**64 - 1
MAX_REQUEST_SIZE_BYTES = 3 * 1024 * 1024
STATIC_ESTIMATED_COST_LIMIT = 10_000_000
STATIC_ESTIMATED_CRD_COST_LIMIT = 100_000_000

_STRING_TRAVERSAL_COST_FACTOR = 0.1
_REGEX_STRING_LENGTH_COST_FACTOR = 0.25
_LIST_CREATE_BASE_COST = 10
_MAP_CREATE_BASE_COST = 30

# apiserver/pkg/cel/limits.go
_MIN_STRING_SIZE = 2
_MIN_BOOL_SIZE = 4
_MIN_NUMBER_SIZE = 1
_MIN_DURATION_SIZE_JSON = 3
_MAX_DURATION_SIZE_JSON = 32
_JSON_DATE_SIZE = 12
_MIN_DATETIME_SIZE_JSON = 21
_MAX_DATETIME_SIZE_JSON = 32


class CompileError(Exception):
    """The rule does not compile; the message is cel-go's detail."""


class Unsupported(Exception):
    """The rule uses something this estimator does not model."""


def _add(*values: int) -> int:
    return min(sum(values), UINT64_MAX)


def _mul(a: int, b: int) -> int:
    return min(a * b, UINT64_MAX)


def _factor(size: int, factor: float) -> int:
    """cel-go's multiplyByCostFactor: the product, rounded up, saturating at 2^64 - 1."""
    product = math.ceil(float(size) * factor)
    return UINT64_MAX if product >= 2.0**64 else int(product)


# ---------------------------------------------------------------------------------------------------
# Types: the CEL declarations a structural schema becomes.


@dataclass(eq=False)
class DeclType:
    kind: str  # bool int uint double string bytes null duration timestamp list map object dyn optional type
    max_elements: int = 0
    min_size: int = 0
    elem: DeclType | None = None  # list items, map values, optional's value
    key: DeclType | None = None
    fields: dict[str, DeclType] = field(default_factory=dict)

    def describe(self) -> str:
        if self.kind == "list":
            return f"list({self.elem.describe() if self.elem else 'dyn'})"
        if self.kind == "map":
            return f"map(string, {self.elem.describe() if self.elem else 'dyn'})"
        if self.kind == "optional":
            return f"optional_type({self.elem.describe() if self.elem else 'dyn'})"
        return {"object": "object", "dyn": "dyn"}.get(self.kind, self.kind)


_BOOL = DeclType("bool", min_size=_MIN_BOOL_SIZE)
_INT = DeclType("int", min_size=_MIN_NUMBER_SIZE)
_UINT = DeclType("uint", min_size=_MIN_NUMBER_SIZE)
_DOUBLE = DeclType("double", min_size=_MIN_NUMBER_SIZE)
_NULL = DeclType("null")
_DYN = DeclType("dyn")
_MAP_KEY = DeclType("string", min_size=_MIN_STRING_SIZE)  # MaxElements 0, as upstream's StringType
_SCALARS = {"bool", "double", "duration", "int", "timestamp", "uint"}
_NUMBERS = {"int", "uint", "double"}

_RESERVED = {
    "true", "false", "null", "in", "as", "break", "const", "continue", "else", "for", "function", "if",
    "import", "let", "loop", "package", "namespace", "return", "var", "void", "while",
}  # fmt: skip


def escape(name: str) -> str | None:
    """A property's name in CEL (apiserver/pkg/cel/escaping.go), or None when it cannot be one."""
    if name in _RESERVED:
        return f"__{name}__"
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_./-]*", name):
        return None
    out = name.replace("__", "__underscores__")
    return out.replace(".", "__dot__").replace("-", "__dash__").replace("/", "__slash__")


def _string_max(schema: dict[str, Any]) -> int:
    if schema.get("maxLength") is not None:
        return max(int(schema["maxLength"]), 0) * 4
    if schema.get("enum"):
        return max((len(v.encode()) for v in schema["enum"] if isinstance(v, str)), default=0)
    return MAX_REQUEST_SIZE_BYTES - 2


def _with_type_and_object_meta(schema: dict[str, Any]) -> dict[str, Any]:
    props = schema.get("properties") or {}
    meta = props.get("metadata") or {}
    meta_props = meta.get("properties") or {}
    if (
        (props.get("kind") or {}).get("type") == "string"
        and (props.get("apiVersion") or {}).get("type") == "string"
        and meta.get("type") == "object"
        and (meta_props.get("name") or {}).get("type") == "string"
        and (meta_props.get("generateName") or {}).get("type") == "string"
    ):
        return schema
    string = {"type": "string"}
    metadata = {"type": "object", "properties": {"name": string, "generateName": string}}
    return {**schema, "properties": {**props, "kind": string, "apiVersion": string, "metadata": metadata}}


def decl_type(schema: dict[str, Any], resource_root: bool = False) -> DeclType | None:
    """`SchemaDeclType`: the CEL type of a schema node, None where CEL cannot see it."""
    if schema.get("x-kubernetes-int-or-string"):
        size = _string_max(schema) if schema.get("maxLength") is not None else MAX_REQUEST_SIZE_BYTES - 2
        return DeclType("dyn", max_elements=size, min_size=1)
    if resource_root:
        schema = _with_type_and_object_meta(schema)
    kind = schema.get("type")
    if kind == "array":
        items = schema.get("items")
        item_type = decl_type(items, bool(items.get("x-kubernetes-embedded-resource"))) if items else None
        if item_type is None:
            return None
        count = schema.get("maxItems")
        if count is None:
            count = (MAX_REQUEST_SIZE_BYTES - 2) // (item_type.min_size + 1)
        return DeclType("list", max_elements=max(int(count), 0), min_size=2, elem=item_type)
    if kind == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            value_type = decl_type(extra, bool(extra.get("x-kubernetes-embedded-resource")))
            if value_type is None:
                return None
            count = schema.get("maxProperties")
            if count is None:
                count = (MAX_REQUEST_SIZE_BYTES - 2) // (value_type.min_size + 6)
            return DeclType("map", max_elements=max(int(count), 0), min_size=2, elem=value_type, key=_MAP_KEY)
        required = set(schema.get("required") or ())
        fields: dict[str, DeclType] = {}
        min_size = 2
        for name, prop in (schema.get("properties") or {}).items():
            prop_type = decl_type(prop, bool(prop.get("x-kubernetes-embedded-resource")))
            if prop_type is None:
                continue
            escaped = escape(name)
            if escaped is not None:
                fields[escaped] = prop_type
            if name in required and "default" not in prop:
                min_size += len(name) + prop_type.min_size + 4
        return DeclType("object", min_size=min_size, fields=fields)
    if kind == "string":
        fmt = schema.get("format")
        if fmt == "byte":
            length = schema.get("maxLength")
            longest = MAX_REQUEST_SIZE_BYTES - 2 if length is None else max(int(length), 0)
            return DeclType("bytes", max_elements=longest, min_size=2)
        if fmt == "duration":
            return DeclType(
                "duration", max_elements=_MAX_DURATION_SIZE_JSON, min_size=_MIN_DURATION_SIZE_JSON
            )
        if fmt == "date":
            return DeclType("timestamp", max_elements=_JSON_DATE_SIZE, min_size=_JSON_DATE_SIZE)
        if fmt == "date-time":
            return DeclType(
                "timestamp", max_elements=_MAX_DATETIME_SIZE_JSON, min_size=_MIN_DATETIME_SIZE_JSON
            )
        return DeclType("string", max_elements=_string_max(schema), min_size=_MIN_STRING_SIZE)
    if kind == "boolean":
        return _BOOL
    if kind == "number":
        return _DOUBLE
    if kind == "integer":
        return _INT
    return None


# ---------------------------------------------------------------------------------------------------
# Parsing.

_TOKEN = re.compile(
    r"""(?P<space>\s+|//[^\n]*)
    |(?P<string>(?:[rR][bB]?|[bB][rR]?)?(?:'''(?:\\.|[^\\])*?'''|\"\"\"(?:\\.|[^\\])*?\"\"\"|'(?:\\.|[^'\\\n])*'|"(?:\\.|[^"\\\n])*"))
    |(?P<number>0[xX][0-9a-fA-F]+[uU]?|(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+|[0-9]+[uU]?)
    |(?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<op>\|\||&&|==|!=|<=|>=|[<>!+\-*/%?:.,()\[\]{}])""",
    re.VERBOSE | re.DOTALL,
)


@dataclass
class Node:
    kind: str  # literal ident select call list map comprehension
    pos: int
    value: Any = None  # literal value; ident name; select field; call function
    type: DeclType | None = None  # literal type
    target: Node | None = None
    args: list[Node] = field(default_factory=list)
    test_only: bool = False


_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v"}


def _string_value(text: str) -> tuple[str | bytes, bool]:
    prefix = re.match(r"[rRbB]*", text)
    flags = prefix.group(0).lower() if prefix else ""
    body = text[len(flags) :]
    quote = 3 if body[:3] in ("'''", '"""') else 1
    body = body[quote:-quote]
    if "r" not in flags:
        out, i = [], 0
        while i < len(body):
            ch = body[i]
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            nxt = body[i + 1]
            if nxt in _ESCAPES:
                out.append(_ESCAPES[nxt])
            elif nxt in "\\'\"`?":
                out.append(nxt)
            else:
                raise Unsupported(f"string escape \\{nxt}")
            i += 2
        body = "".join(out)
    if "b" in flags:
        return body.encode(), True
    return body, False


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens: list[tuple[str, str, int]] = []
        pos = 0
        while pos < len(text):
            match = _TOKEN.match(text, pos)
            if match is None:
                raise Unsupported(f"token at {pos}")
            kind = match.lastgroup or ""
            if kind != "space":
                self.tokens.append((kind, match.group(0), pos))
            pos = match.end()
        self.tokens.append(("end", "", len(text)))
        self.at = 0

    def peek(self) -> tuple[str, str, int]:
        return self.tokens[self.at]

    def take(self, text: str | None = None) -> tuple[str, str, int]:
        token = self.tokens[self.at]
        if text is not None and token[1] != text:
            raise Unsupported(f"expected {text!r} at {token[2]}")
        self.at += 1
        return token

    def accept(self, text: str) -> tuple[str, str, int] | None:
        token = self.tokens[self.at]
        if token[0] in ("op", "ident") and token[1] == text:
            self.at += 1
            return token
        return None

    def parse(self) -> Node:
        node = self.expr()
        if self.peek()[0] != "end":
            raise Unsupported(f"trailing input at {self.peek()[2]}")
        return node

    def expr(self) -> Node:
        cond = self.binary(0)
        if (token := self.accept("?")) is not None:
            yes = self.binary(0)
            self.take(":")
            no = self.expr()
            return Node("call", token[2], "_?_:_", args=[cond, yes, no])
        return cond

    _LEVELS = (("||",), ("&&",), ("<", "<=", ">", ">=", "==", "!=", "in"), ("+", "-"), ("*", "/", "%"))

    def binary(self, level: int) -> Node:
        if level == len(self._LEVELS):
            return self.unary()
        left = self.binary(level + 1)
        while True:
            token = self.peek()
            if token[0] not in ("op", "ident") or token[1] not in self._LEVELS[level]:
                return left
            self.at += 1
            right = self.binary(level + 1)
            name = "@in" if token[1] == "in" else f"_{token[1]}_"
            left = Node("call", token[2], name, args=[left, right])

    def unary(self) -> Node:
        token = self.peek()
        if token[1] in ("!", "-") and token[0] == "op":
            count = 0
            while self.peek()[1] == token[1] and self.peek()[0] == "op":
                self.at += 1
                count += 1
            operand = self.member()
            if token[1] == "-" and operand.kind == "literal" and operand.type in (_INT, _DOUBLE):
                if count % 2:
                    operand.value = -operand.value
                return operand
            if count % 2 == 0:
                return operand
            return Node("call", token[2], "!_" if token[1] == "!" else "-_", args=[operand])
        return self.member()

    def member(self) -> Node:
        node = self.primary()
        while True:
            if (dot := self.accept(".")) is not None:
                name = self.take()
                if name[0] != "ident":
                    raise Unsupported(f"field name at {name[2]}")
                if self.accept("(") is not None:
                    node = Node("call", dot[2], name[1], target=node, args=self.args(")"))
                else:
                    node = Node("select", dot[2], name[1], target=node)
            elif (bracket := self.accept("[")) is not None:
                index = self.expr()
                self.take("]")
                node = Node("call", bracket[2], "_[_]", args=[node, index])
            else:
                return node

    def args(self, close: str) -> list[Node]:
        items: list[Node] = []
        while self.accept(close) is None:
            items.append(self.expr())
            if self.accept(",") is None:
                self.take(close)
                break
        return items

    def primary(self) -> Node:
        kind, text, pos = self.take()
        if kind == "number":
            if text[-1] in "uU":
                return Node("literal", pos, int(text[:-1], 0), _UINT)
            if re.fullmatch(r"0[xX][0-9a-fA-F]+|[0-9]+", text):
                return Node("literal", pos, int(text, 0), _INT)
            return Node("literal", pos, float(text), _DOUBLE)
        if kind == "string":
            value, is_bytes = _string_value(text)
            literal_type = DeclType("bytes") if is_bytes else DeclType("string")
            return Node("literal", pos, value, literal_type)
        if kind == "ident":
            if text in ("true", "false"):
                return Node("literal", pos, text == "true", _BOOL)
            if text == "null":
                return Node("literal", pos, None, _NULL)
            if self.accept("(") is not None:
                return Node("call", pos, text, args=self.args(")"))
            return Node("ident", pos, text)
        if text == "(":
            node = self.expr()
            self.take(")")
            return node
        if text == "[":
            return Node("list", pos, args=self.args("]"))
        if text == "{":
            entries: list[Node] = []
            while self.accept("}") is None:
                entries.append(self.expr())
                self.take(":")
                entries.append(self.expr())
                if self.accept(",") is None:
                    self.take("}")
                    break
            return Node("map", pos, args=entries)
        raise Unsupported(f"{text!r} at {pos}")


# ---------------------------------------------------------------------------------------------------
# Estimation (cel-go checker/cost.go, with Kubernetes' size estimator and has() at no cost).


@dataclass
class _Value:
    cost: int
    type: DeclType
    path: list[str] | None = None  # field path from a variable, for the size estimator
    size: int | None = None  # computed size (literals, call results)
    local_size: int | None = None  # an iteration variable's size from a literal range
    entry_size: int | None = None  # a literal list's largest item


@dataclass
class _Var:
    type: DeclType
    path: list[str]
    local_size: int | None = None


class _Estimator:
    def __init__(self, text: str, root: DeclType, old_self: DeclType) -> None:
        self.text = text
        self.root = root
        self.scopes: dict[str, list[_Var]] = {
            "self": [_Var(root, ["self"])],
            "oldSelf": [_Var(old_self, ["oldSelf"])],
        }

    def error(self, pos: int, message: str) -> CompileError:
        line_start = self.text.rfind("\n", 0, pos) + 1
        line_end = self.text.find("\n", pos)
        line = self.text[line_start : line_end if line_end >= 0 else len(self.text)]
        row = self.text.count("\n", 0, pos) + 1
        column = pos - line_start
        return CompileError(
            f"compilation failed: ERROR: <input>:{row}:{column + 1}: {message}\n | {line}\n | {'.' * column}^"
        )

    def size(self, value: _Value) -> int:
        if value.size is not None:
            return value.size
        if value.path:
            node: DeclType | None = self.root
            for name in value.path[1:]:
                if node is None:
                    break
                if name in ("@items", "@values"):
                    node = node.elem
                elif name == "@keys":
                    node = node.key
                else:
                    node = node.fields.get(name)
            if node is not None:
                return node.max_elements
        if value.type.kind in _SCALARS or (
            value.type.kind == "optional" and value.type.elem is not None and value.type.elem.kind in _SCALARS
        ):
            return 1
        if value.local_size is not None:
            return value.local_size
        return UINT64_MAX

    def estimate(self, node: Node) -> _Value:
        if node.kind == "literal":
            assert node.type is not None
            size = len(node.value) if isinstance(node.value, (str, bytes)) else 1
            return _Value(0, node.type, size=size)
        if node.kind == "ident":
            stack = self.scopes.get(node.value)
            if not stack:
                raise self.error(node.pos, f"undeclared reference to '{node.value}' (in container '')")
            var = stack[-1]
            return _Value(1, var.type, path=list(var.path), local_size=var.local_size)
        if node.kind == "select":
            assert node.target is not None
            return self.select(node)
        if node.kind == "list":
            items = [self.estimate(item) for item in node.args]
            elem = items[0].type if items else _DYN
            entry = max((self.size(item) for item in items), default=0)
            return _Value(
                _add(_LIST_CREATE_BASE_COST, *(i.cost for i in items)),
                DeclType("list", elem=elem),
                size=len(items),
                entry_size=entry,
            )
        if node.kind == "map":
            parts = [self.estimate(item) for item in node.args]
            value_type = parts[1].type if parts else _DYN
            return _Value(
                _add(_MAP_CREATE_BASE_COST, *(p.cost for p in parts)),
                DeclType("map", elem=value_type, key=parts[0].type if parts else _DYN),
                size=len(parts) // 2,
            )
        return self.call(node)

    def select(self, node: Node) -> _Value:
        assert node.target is not None
        if node.test_only:
            operand = self.estimate(node.target)
            self.field_type(node, operand.type)
            return _Value(operand.cost, _BOOL)  # Kubernetes sets PresenceTestHasCost(false)
        operand = self.estimate(node.target)
        field_type = self.field_type(node, operand.type)
        cost = operand.cost + (1 if operand.type.kind in ("map", "object") else 0)
        return _Value(cost, field_type, path=[*(operand.path or []), node.value])

    def field_type(self, node: Node, operand: DeclType) -> DeclType:
        if operand.kind == "object":
            if node.value not in operand.fields:
                raise self.error(node.pos, f"undefined field '{node.value}'")
            return operand.fields[node.value]
        if operand.kind == "map":
            return operand.elem or _DYN
        if operand.kind == "dyn":
            return _DYN
        raise self.error(node.pos, f"type '{operand.describe()}' does not support field selection")

    def no_overload(self, node: Node, types: list[DeclType]) -> CompileError:
        shown = ", ".join(t.describe() for t in types)
        return self.error(node.pos, f"found no matching overload for '{node.value}' applied to '({shown})'")

    def call(self, node: Node) -> _Value:
        name = node.value
        if node.target is None and name == "has" and len(node.args) == 1:
            arg = node.args[0]
            if arg.kind != "select":
                raise self.error(node.pos, "invalid argument to has() macro")
            arg.test_only = True
            return self.select(arg)
        if node.target is not None and name in ("all", "exists", "exists_one", "map", "filter"):
            return self.comprehension(node)
        target = self.estimate(node.target) if node.target is not None else None
        args = [self.estimate(arg) for arg in node.args]
        arg_cost = _add(*(a.cost for a in args))
        if target is not None:
            arg_cost = _add(arg_cost, target.cost)
        kinds = [a.type.kind for a in args]

        if name in ("_&&_", "_||_"):
            self.expect(node, args, {"bool", "dyn"})
            return _Value(arg_cost, _BOOL)
        if name == "!_":
            self.expect(node, args, {"bool", "dyn"})
            return _Value(_add(1, arg_cost), _BOOL)
        if name == "-_":
            self.expect(node, args, _NUMBERS | {"dyn"})
            return _Value(_add(1, arg_cost), args[0].type)
        if name == "_?_:_":
            self.expect(node, args[:1], {"bool", "dyn"})
            yes, no = args[1], args[2]
            result = _Value(
                _add(args[0].cost, max(yes.cost, no.cost)),
                yes.type if yes.type.kind != "null" else no.type,
                size=max(self.size(yes), self.size(no)),
            )
            return result
        if name in ("_==_", "_!=_"):
            smallest = min(self.size(args[0]), self.size(args[1]))
            return _Value(_add(_factor(smallest, _STRING_TRAVERSAL_COST_FACTOR), arg_cost), _BOOL)
        if name in ("_<_", "_<=_", "_>_", "_>=_"):
            # Every overload the operand types admit counts; the string and bytes ones cost by size.
            textual = all(k in ("string", "dyn") for k in kinds) or all(k in ("bytes", "dyn") for k in kinds)
            ordered = all(k in _SCALARS | {"dyn"} for k in kinds)
            if not (textual or ordered):
                raise self.no_overload(node, [a.type for a in args])
            cost = 1 if ordered else 0
            if textual:
                smallest = min(self.size(args[0]), self.size(args[1]))
                cost = max(cost, _factor(smallest, _STRING_TRAVERSAL_COST_FACTOR))
            return _Value(_add(cost, arg_cost), _BOOL)
        if name in ("_+_", "_-_", "_*_", "_/_", "_%_"):
            known = [k for k in kinds if k != "dyn"]
            if known and all(k in _NUMBERS for k in known):
                numeric = [a.type for a in args if a.type.kind != "dyn"]
                return _Value(_add(1, arg_cost), numeric[0])
            if (
                name == "_+_"
                and known
                and all(k == known[0] for k in known)
                and known[0] in ("string", "bytes")
            ):
                total = _add(self.size(args[0]), self.size(args[1]))
                cost = _add(_factor(total, _STRING_TRAVERSAL_COST_FACTOR), arg_cost)
                return _Value(cost, DeclType(known[0]), size=total)
            if name == "_+_" and kinds == ["list", "list"]:
                total = _add(self.size(args[0]), self.size(args[1]))
                return _Value(_add(1, arg_cost), args[0].type, size=total)
            if not known:
                raise Unsupported(f"{name} on dyn")
            raise self.no_overload(node, [a.type for a in args])
        if name == "@in":
            holder = args[1].type.kind
            if holder == "list":
                return _Value(_add(self.size(args[1]), arg_cost), _BOOL)
            if holder == "map":
                return _Value(_add(1, arg_cost), _BOOL)
            raise Unsupported(f"in on {args[1].type.describe()}")
        if name == "_[_]":
            indexed = args[0]
            if indexed.type.kind == "list":
                item = indexed.type.elem or _DYN
                return _Value(
                    _add(1, arg_cost),
                    item,
                    path=[*(indexed.path or []), "@items"],
                    size=indexed.entry_size,
                )
            if indexed.type.kind == "map":
                return _Value(
                    _add(1, arg_cost), indexed.type.elem or _DYN, path=[*(indexed.path or []), "@values"]
                )
            raise Unsupported(f"index on {indexed.type.describe()}")
        if name == "size" and len(args) + (target is not None) == 1:
            subject = target if target is not None else args[0]
            if subject.type.kind not in ("string", "bytes", "list", "map", "dyn"):
                raise self.no_overload(node, [subject.type])
            return _Value(_add(1, arg_cost), _INT)
        if (
            target is not None
            and name in ("matches", "startsWith", "endsWith", "contains")
            and len(args) == 1
        ):
            if target.type.kind not in ("string", "dyn") or kinds[0] not in ("string", "dyn"):
                raise self.no_overload(node, [target.type, args[0].type])
            if name == "matches":
                text = _factor(_add(self.size(target), 1), _STRING_TRAVERSAL_COST_FACTOR)
                pattern = _factor(self.size(args[0]), _REGEX_STRING_LENGTH_COST_FACTOR)
                return _Value(_add(_mul(text, pattern), arg_cost), _BOOL)
            if name == "contains":
                text = _factor(self.size(target), _STRING_TRAVERSAL_COST_FACTOR)
                part = _factor(self.size(args[0]), _STRING_TRAVERSAL_COST_FACTOR)
                return _Value(_add(_mul(text, part), arg_cost), _BOOL)
            return _Value(_add(_factor(self.size(args[0]), _STRING_TRAVERSAL_COST_FACTOR), arg_cost), _BOOL)
        if target is not None and target.type.kind == "optional" and name in ("hasValue", "value", "orValue"):
            held = target.type.elem or _DYN
            if name == "hasValue" and not args:
                return _Value(_add(1, arg_cost), _BOOL)
            if name == "value" and not args:
                return _Value(_add(1, arg_cost), held)
            if name == "orValue" and len(args) == 1:
                return _Value(_add(1, arg_cost), held)
        raise Unsupported(f"function {name}")

    def expect(self, node: Node, args: list[_Value], kinds: set[str]) -> None:
        if not all(a.type.kind in kinds for a in args):
            raise self.no_overload(node, [a.type for a in args])

    def comprehension(self, node: Node) -> _Value:
        assert node.target is not None
        name = node.value
        arity = (2, 3) if name == "map" else (2,)
        if len(node.args) not in arity or node.args[0].kind != "ident":
            raise Unsupported(f"{name} macro form")
        var = node.args[0].value
        iter_range = self.estimate(node.target)
        kind = iter_range.type.kind
        if kind == "list":
            var_type, step = iter_range.type.elem or _DYN, "@items"
        elif kind == "map":
            var_type, step = iter_range.type.key or _MAP_KEY, "@keys"
        elif kind == "dyn":
            var_type, step = _DYN, "@items"
        else:
            raise self.error(
                node.pos,
                f"expression of type '{iter_range.type.describe()}' cannot be range of a comprehension (must be list, map, or dynamic)",
            )
        path = [*(iter_range.path or []), step]
        self.scopes.setdefault(var, []).append(_Var(var_type, path, iter_range.entry_size))
        try:
            bodies = [self.estimate(arg) for arg in node.args[1:]]
        finally:
            self.scopes[var].pop()
        body = bodies[0]
        if name in ("all", "exists", "exists_one", "filter") and body.type.kind not in ("bool", "dyn"):
            raise self.no_overload(node, [body.type])
        # The macro expansions of cel-go's parser/macro.go: accumulator init, per-item loop condition
        # and step, and the result expression.
        if name == "all":  # init true; cond @not_strictly_false(@result); step @result && p
            init, result, per_item, out = 0, 1, 2 + 1 + body.cost, _BOOL
        elif name == "exists":  # init false; cond @not_strictly_false(!@result); step @result || p
            init, result, per_item, out = 0, 1, 3 + 1 + body.cost, _BOOL
        elif name == "exists_one":  # init 0; cond true; step p ? @result + 1 : @result; result @result == 1
            init, result, per_item, out = 0, 2, body.cost + 2, _BOOL
        elif name == "filter":  # init []; cond true; step p ? @result + [x] : @result
            init, result, per_item, out = _LIST_CREATE_BASE_COST, 1, body.cost + 13, iter_range.type
        elif len(bodies) == 1:  # map: init []; cond true; step @result + [f]
            init, result, per_item = _LIST_CREATE_BASE_COST, 1, 12 + body.cost
            out = DeclType("list", elem=body.type)
        else:  # map with a filter: step p ? @result + [f] : @result
            init, result, per_item = _LIST_CREATE_BASE_COST, 1, body.cost + 12 + bodies[1].cost
            out = DeclType("list", elem=bodies[1].type)
        count = self.size(iter_range)
        cost = _add(iter_range.cost, init, result, _mul(count, per_item))
        return _Value(cost, out, size=count if out.kind == "list" else 1)


def estimate(
    rule: str, schema: dict[str, Any], *, resource_root: bool = False, optional_old_self: bool = False
) -> int:
    """The estimated worst-case cost of one rule on `schema` (cel-go's `CostEstimate.Max`).

    Raises CompileError when the rule does not compile, Unsupported where it is not modelled.
    """
    root = decl_type(schema, resource_root)
    if root is None:
        raise Unsupported("a schema CEL cannot see")
    try:
        tree = _Parser(rule).parse()
    except Unsupported:
        try:
            celpy.Environment().compile(rule)
        except celpy.CELParseError as error:
            raise CompileError(f"compilation failed: ERROR: <input>: Syntax error: {error}") from None
        raise
    old_self = DeclType("optional", elem=root) if optional_old_self else root
    estimator = _Estimator(rule, root, old_self)
    value = estimator.estimate(tree)
    if value.type.kind != "bool":
        raise CompileError("cel expression must evaluate to a bool")
    return value.cost


# ---------------------------------------------------------------------------------------------------
# The whole schema.


@dataclass
class RuleCost:
    path: str  # the rule's field path, e.g. spec.versions[0].schema.openAPIV3Schema.x-kubernetes-validations[0].rule
    cost: int | None  # the rule's own estimated cost; None when not modelled or not compiling
    cardinality: int  # how many times it can run
    total: int  # cost x cardinality, saturating
    rule: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # a compilation failure
    unsupported: str | None = None


def _max_elements(schema: dict[str, Any]) -> int | None:
    """`extractMaxElements`: the factor a node multiplies its children's cardinality by (None: unbounded)."""
    if schema.get("type") == "object":
        if schema.get("additionalProperties") is not None:
            count = schema.get("maxProperties")
            return None if count is None else max(int(count), 0)
        return 1
    if schema.get("type") == "array":
        count = schema.get("maxItems")
        return None if count is None else max(int(count), 0)
    return 1


def rule_costs(schema: dict[str, Any], path: str) -> list[RuleCost]:
    """Every rule of a CRD version's openAPIV3Schema, with its estimated cost and how often it can run."""
    found: list[RuleCost] = []

    def walk(node: dict[str, Any], where: str, cardinality: int | None, root: bool) -> None:
        rules = node.get("x-kubernetes-validations") or []
        resource_root = root or bool(node.get("x-kubernetes-embedded-resource"))
        for index, rule in enumerate(rules):
            at = f"{where}.x-kubernetes-validations[{index}].rule"
            text = rule.get("rule", "")
            if not text.strip():
                continue
            try:
                cost = estimate(
                    text,
                    node,
                    resource_root=resource_root,
                    optional_old_self=rule.get("optionalOldSelf") is True,
                )
            except CompileError as error:
                found.append(RuleCost(at, None, 0, 0, rule, error=str(error)))
                continue
            except (Unsupported, RecursionError) as error:
                found.append(RuleCost(at, None, 0, 0, rule, unsupported=str(error)))
                continue
            if cardinality is None:
                own = decl_type(node, resource_root)
                times = MAX_REQUEST_SIZE_BYTES // ((own.min_size if own else 0) + 1)
            else:
                times = cardinality
            found.append(RuleCost(at, cost, times, 0 if cost == 0 else _mul(cost, times), rule))
        factor = _max_elements(node)
        child = None if cardinality is None or factor is None else _mul(cardinality, factor)
        for key, prop in (node.get("properties") or {}).items():
            if isinstance(prop, dict):
                walk(prop, f"{where}.properties[{key}]", child, False)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{where}.items", child, False)
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{where}.additionalProperties", child, False)

    walk(schema, path, 1, True)
    return found


def _over_budget(what: str, cost: int, limit: int) -> str:
    """`getCostErrorMessage`."""
    factor = cost / limit
    if factor > 100.0:
        shown = "more than 100x"
    elif factor < 1.5:
        shown = f"{factor:f}x"
    else:
        shown = f"{factor:.1f}x"
    return (
        f"{what} exceeds budget by factor of {shown} (try simplifying the rule, or adding maxItems, "
        "maxProperties, and maxLength where arrays, maps, and strings are declared)"
    )


def _go_rule(rule: dict[str, Any]) -> str:
    """A ValidationRule as Go's %#v prints it, the way field.Invalid shows a struct value.

    Go prints a set pointer field as its address; the value stands in for it here.
    """
    reason = rule.get("reason")
    optional = rule.get("optionalOldSelf")
    return (
        f"apiextensions.ValidationRule{{Rule:{json.dumps(rule.get('rule', ''))}, "
        f"Message:{json.dumps(rule.get('message', ''))}, "
        f"MessageExpression:{json.dumps(rule.get('messageExpression', ''))}, "
        "Reason:"
        + (
            f"(*apiextensions.FieldValueErrorReason)({json.dumps(reason)})"
            if reason
            else "(*apiextensions.FieldValueErrorReason)(nil)"
        )
        + f", FieldPath:{json.dumps(rule.get('fieldPath', ''))}, OptionalOldSelf:"
        + ("(*bool)(nil)" if optional is None else f"(*bool)({str(bool(optional)).lower()})")
        + "}"
    )


def schema_problems(schema: dict[str, Any], path: str) -> list[tuple[str, str, str]]:
    """(field, reason, message) for each refusal of kube-apiserver's CEL checks of one version's schema,
    in upstream's order: per rule its cost, then its compilation; the schema's total last."""
    problems: list[tuple[str, str, str]] = []
    costs = rule_costs(schema, path)
    total = 0
    expensive: list[RuleCost] = []
    for item in costs:
        if item.total > STATIC_ESTIMATED_COST_LIMIT:
            problems.append(
                (
                    item.path,
                    "FieldValueForbidden",
                    "Forbidden: "
                    + _over_budget("estimated rule cost", item.total, STATIC_ESTIMATED_COST_LIMIT),
                )
            )
        total = _add(total, item.total)
        if item.total >= STATIC_ESTIMATED_CRD_COST_LIMIT // 100:
            expensive = sorted([*expensive, item], key=lambda c: -c.total)[:4]
        if item.error is not None:
            shown = _go_rule(item.rule)
            problems.append((item.path, "FieldValueInvalid", f"Invalid value: {shown}: {item.error}"))
    if total > STATIC_ESTIMATED_CRD_COST_LIMIT:
        for item in expensive:
            message = "Forbidden: contributed to estimated rule & messageExpression cost total exceeding cost limit for entire OpenAPIv3 schema"
            problems.append((item.path, "FieldValueForbidden", message))
        what = "x-kubernetes-validations estimated rule & messageExpression cost total for entire OpenAPIv3 schema"
        problems.append(
            (
                path,
                "FieldValueForbidden",
                "Forbidden: " + _over_budget(what, total, STATIC_ESTIMATED_CRD_COST_LIMIT),
            )
        )
    return problems
