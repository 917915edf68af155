"""Label keys and values as kube-apiserver checks them (`IsQualifiedName`, `IsValidLabelValue` of
k8s.io/apimachinery's validation), with its messages: as CEL conditions for the CRD, and in Python.

A condition is CEL over a string expression `v`; each comes with the message kube-apiserver gives when it
fails. Regular expressions avoid backslashes (a `.` is `[.]`), which a CEL string would have to escape again.
"""

from __future__ import annotations

import re

QUALIFIED_NAME_FORMAT = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
QUALIFIED_NAME_MESSAGE = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
    f"character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    f"'{QUALIFIED_NAME_FORMAT}')"
)
SUBDOMAIN_MESSAGE = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
DNS_LABEL_MESSAGE = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
DNS_1035_MESSAGE = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
LABEL_VALUE_FORMAT = "(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?"
LABEL_VALUE_MESSAGE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
    f"for validation is '{LABEL_VALUE_FORMAT}')"
)
LABEL_VALUE_MAX = 63
# A prefix (a DNS subdomain, at most 253), '/', and a name of at most 63.
LABEL_KEY_MAX = 253 + 1 + 63

_SUBDOMAIN = "[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_DNS_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_1035 = "[a-z]([-a-z0-9]*[a-z0-9])?"
_TOO_MANY_SLASHES = "/.*/"


def label_key_conditions(v: str) -> list[tuple[str, str]]:
    """(CEL condition over the string `v`, kube-apiserver's message) for a label key (a qualified name)."""
    many = f"{v}.matches('{_TOO_MANY_SLASHES}')"
    return [
        (
            f"!{many}",
            f"a qualified name {QUALIFIED_NAME_MESSAGE} with an optional DNS subdomain prefix and '/' "
            "(e.g. 'example.com/MyName')",
        ),
        (f"{many} || !{v}.startsWith('/')", "prefix part must be non-empty"),
        (f"{many} || !{v}.matches('^[^/]{{254,}}/')", "prefix part must be no more than 253 characters"),
        (
            f"{many} || !{v}.matches('^[^/]+/') || {v}.matches('^{_SUBDOMAIN}/')",
            f"prefix part {SUBDOMAIN_MESSAGE}",
        ),
        (f"{many} || !{v}.matches('(^|/)$')", "name part must be non-empty"),
        (f"{many} || !{v}.matches('(^|/)[^/]{{64,}}$')", "name part must be no more than 63 characters"),
        (f"{many} || {v}.matches('(^|/){QUALIFIED_NAME_FORMAT}$')", f"name part {QUALIFIED_NAME_MESSAGE}"),
    ]


def label_value_condition(v: str) -> tuple[str, str]:
    return f"{v}.matches('^{LABEL_VALUE_FORMAT}$')", LABEL_VALUE_MESSAGE


def label_key_errors(key: str) -> list[str]:
    """kube-apiserver's messages for a label key (empty: a valid one)."""
    parts = key.split("/")
    if len(parts) > 2:
        return [label_key_conditions("v")[0][1]]
    errors = []
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errors.append("prefix part must be non-empty")
        else:
            if len(prefix) > 253:
                errors.append("prefix part must be no more than 253 characters")
            if not re.fullmatch(_SUBDOMAIN, prefix):
                errors.append(f"prefix part {SUBDOMAIN_MESSAGE}")
    if not name:
        errors.append("name part must be non-empty")
    elif len(name) > 63:
        errors.append("name part must be no more than 63 characters")
    if not re.fullmatch(QUALIFIED_NAME_FORMAT, name):
        errors.append(f"name part {QUALIFIED_NAME_MESSAGE}")
    return errors


def label_value_errors(value: str) -> list[str]:
    errors = []
    if len(value) > LABEL_VALUE_MAX:
        errors.append(f"must be no more than {LABEL_VALUE_MAX} characters")
    if not re.fullmatch(LABEL_VALUE_FORMAT, value):
        errors.append(LABEL_VALUE_MESSAGE)
    return errors


def subdomain_errors(name: str) -> list[str]:
    """IsDNS1123Subdomain's messages (empty: a valid name)."""
    errors = ["must be no more than 253 characters"] if len(name) > 253 else []
    return errors + ([] if re.fullmatch(_SUBDOMAIN, name) else [SUBDOMAIN_MESSAGE])


def dns_label_errors(name: str) -> list[str]:
    """IsDNS1123Label's messages: Namespace names."""
    errors = ["must be no more than 63 characters"] if len(name) > 63 else []
    return errors + ([] if re.fullmatch(_DNS_LABEL, name) else [DNS_LABEL_MESSAGE])


def dns_1035_errors(name: str) -> list[str]:
    """IsDNS1035Label's messages: Service names."""
    errors = ["must be no more than 63 characters"] if len(name) > 63 else []
    return errors + ([] if re.fullmatch(_DNS_1035, name) else [DNS_1035_MESSAGE])


def path_segment_errors(name: str) -> list[str]:
    """IsValidPathSegmentName's messages: names of RBAC objects."""
    if name in (".", ".."):
        return [f"may not be '{name}'"]
    return [f"may not contain '{c}'" for c in ("/", "%") if c in name]
