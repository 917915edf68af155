"""CRD validation rules' results are kept for a write that brings the same values again (a status update
re-validates an unchanged spec): what is kept never stands in for another value, old value, rule set or
path."""

from __future__ import annotations

from ember_localcluster.apiserver.cel import check_rules


def _messages(rules: list[dict[str, str]], value: object, old: object, path: str = "spec.n") -> list[str]:
    return [c.message for c in check_rules(rules, value, old, path, "integer")]


def test_a_transition_rule_is_judged_by_each_old_value() -> None:
    rules = [{"rule": "self >= oldSelf", "message": "may not shrink"}]
    assert _messages(rules, 5, 3) == []
    assert _messages(rules, 5, 7) == ['Invalid value: "integer": may not shrink']
    assert _messages(rules, 5, 3) == []
    assert _messages(rules, 5, None) == []  # on create a transition rule is skipped


def test_rules_of_another_schema_and_other_paths_are_evaluated_as_theirs() -> None:
    low, high = [{"rule": "self > 1"}], [{"rule": "self > 10"}]
    assert _messages(low, 5, None) == []
    assert _messages(high, 5, None) == ['Invalid value: "integer": failed rule: self > 10']
    causes = check_rules(high, 5, None, "spec.m", "integer")
    assert [c.field for c in causes] == ["spec.m"]


def test_a_caller_changing_its_list_of_causes_changes_nothing_kept() -> None:
    rules = [{"rule": "self < 3"}]
    first = check_rules(rules, 4, None, "spec.k", "integer")
    first.clear()
    assert len(check_rules(rules, 4, None, "spec.k", "integer")) == 1
