"""The results forms' verdicts, message for message: where a value departs from its form
(a field of the wrong kind, a list of the wrong length, a missing field), the first place
and what is wrong, and nothing where it does not (the message is written only for a value
that departs: a run's file holds ~10^6 values)."""

import pytest
from normspec.conformance import results
from normspec.conformance.results import ANY, MEASURE, UNIT, ListOf, MapOf, Shape, _problem

POINT = Shape({"index": ListOf(int), "ulp": MEASURE, "tag": (str, None), "any": ANY},
              required=("ulp",))

WRONG = [
    (5, POINT, "worst", ("worst", "= 5, not an object")),
    ({"index": [0]}, POINT, "worst", ("worst.ulp", "missing")),
    ({"ulp": "big"}, POINT, "worst", ("worst.ulp", '= "big", not a number or null')),
    ({"ulp": True}, POINT, "worst", ("worst.ulp", "= true, not a number or null")),
    ({"ulp": 1.0, "index": [0, "1"]}, POINT, "worst",
     ("worst.index[1]", '= "1", not a whole number')),
    ({"ulp": 1.0, "index": 3}, POINT, "", ("index", "= 3, not a list, each a whole number")),
    (["b", "F2"], UNIT, "plan[0]",
     ("plan[0]", '= ["b", "F2"], not a list of 3 items, each a string')),
    ({"a": {"ulp": 1.0}, "b": []}, MapOf(POINT), "details",
     ("details['b']", "= [], not an object")),
    ("x" * 100, ListOf(int), "v", ("v", "= " + '"' + "x" * 76 + "..., not a list, each a whole number")),
]


@pytest.mark.parametrize("value, form, path, expected", WRONG)
def test_a_value_that_departs_is_named_with_what_is_wrong(value, form, path, expected):
    assert _problem(value, form, path) == expected


@pytest.mark.parametrize("value, form", [
    ({"ulp": None, "index": [], "tag": "t", "any": object()}, POINT),
    ({"ulp": 3, "extra": "not read"}, POINT),
    (["b", "F2", "float32"], UNIT),
    ({"a": {"ulp": 1.5}}, MapOf(POINT)),
])
def test_a_value_of_its_form_has_no_problem(value, form, monkeypatch):
    """(and no message is written for it: that was most of a report's time)"""
    def written(*args):
        raise AssertionError("a message was written for a value of its form")

    monkeypatch.setattr(results, "_shown", written)
    monkeypatch.setattr(results, "_describe", written)
    assert _problem(value, form, "p") is None
