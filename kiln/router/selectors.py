"""Kubernetes label selectors as predicates on a label map: the string form (`[kubernetes] selector`)
and the object form (`matchLabels`, `matchExpressions`, as in an InferencePool). No Kubernetes
client is needed, so the configuration can check a selector at startup."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

Labels = Mapping[str, str]
Matcher = Callable[[Labels], bool]


def match_expressions(selector: Any) -> Matcher:
    """A Kubernetes LabelSelector (`matchLabels`, `matchExpressions`) as a predicate on labels;
    raises ValueError when it is malformed. An empty selector matches everything."""
    if not isinstance(selector, dict):
        raise ValueError("selector: expected an object with matchLabels and/or matchExpressions")
    labels = selector.get("matchLabels") or {}
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError("selector.matchLabels: expected a map of strings")
    tests: list[Matcher] = [lambda got, k=k, v=v: got.get(k) == v for k, v in labels.items()]
    for i, e in enumerate(selector.get("matchExpressions") or ()):
        key, op, values = (e.get("key"), e.get("operator"), e.get("values") or []) if isinstance(e, dict) else (0, 0, 0)
        if not isinstance(key, str) or not isinstance(values, list):
            raise ValueError(f"selector.matchExpressions[{i}]: expected key, operator and values")
        if op == "In" and values:
            tests.append(lambda got, k=key, vs=frozenset(values): got.get(k) in vs)
        elif op == "NotIn" and values:
            tests.append(lambda got, k=key, vs=frozenset(values): got.get(k) not in vs)
        elif op == "Exists" and not values:
            tests.append(lambda got, k=key: k in got)
        elif op == "DoesNotExist" and not values:
            tests.append(lambda got, k=key: k not in got)
        else:
            raise ValueError(f"selector.matchExpressions[{i}]: operator {op!r} with values {values!r}")
    return lambda got: all(t(got) for t in tests)


_TERM = re.compile(
    r"^\s*(?:(!)\s*([^\s!=()]+)|([^\s!=()]+)\s*(?:(==|=|!=)\s*([^\s,()=!]*)|\s+(in|notin)\s*\(([^)]*)\))?)\s*$"
)


def parse_selector(text: str) -> Matcher:
    """A label selector string (`a=b,c!=d,e,!f,g in (x,y),h notin (z)`) as a predicate; ValueError if malformed."""
    tests: list[Matcher] = []
    for term in re.split(r",(?![^(]*\))", text):
        if not term.strip():
            continue
        m = _TERM.match(term)
        if m is None:
            raise ValueError(f"cannot read label selector term {term.strip()!r}")
        absent, key, op, value, set_op, values = m[2], m[3], m[4], m[5], m[6], m[7]
        if absent:
            tests.append(lambda got, k=absent: k not in got)
        elif op in ("=", "=="):
            tests.append(lambda got, k=key, v=value: got.get(k) == v)
        elif op == "!=":
            tests.append(lambda got, k=key, v=value: got.get(k) != v)
        elif set_op:
            vs = frozenset(v.strip() for v in values.split(",") if v.strip())
            if set_op == "in":
                tests.append(lambda got, k=key, vs=vs: got.get(k) in vs)
            else:
                tests.append(lambda got, k=key, vs=vs: got.get(k) not in vs)
        else:
            tests.append(lambda got, k=key: k in got)
    return lambda got: all(t(got) for t in tests)
