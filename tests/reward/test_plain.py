"""plain: values round-trip with their exact builtin types; nothing else crosses."""

from __future__ import annotations

import math

import pytest

from realscale.reward.plain import MAX_DEPTH, PlainError, decode, encode, from_json


def test_round_trip_keeps_types() -> None:
    value = [None, True, 0, -7, 2**80, 1.5, "é\n", (1, [2, (3,)]), {1, 2}, frozenset({"a"}),
             {1: "x", (2, 3): [4], "k": {"n": None}}, b"\x00\xff", 2 + 3j, float("inf"), -float("inf")]
    back = decode(encode(value))
    assert back == value
    assert [type(v) for v in back] == [type(v) for v in value]
    assert type(back[7]) is tuple and type(back[7][1][1]) is tuple
    assert math.isnan(decode(encode(float("nan"))))
    assert "\n" not in encode(value)  # one line per value on the wire


@pytest.mark.parametrize("bad", [object(), print, iter([1]), type("S", (str,), {})("x"),
                                 type("L", (list,), {"__eq__": lambda s, o: True})(), True.__class__])
def test_non_plain_values_are_refused(bad: object) -> None:
    with pytest.raises(PlainError):
        encode(bad)


def test_depth_is_bounded_both_ways() -> None:
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(PlainError):
        encode(deep)
    with pytest.raises(PlainError):
        decode("[" * 100_000 + "]" * 100_000)


@pytest.mark.parametrize("text", ['{"a": 1}', '{"$t": 5}', '{"$d": [[1]]}', '{"$s": [[1]]}', '{"$b": "!!"}',
                                  '{"$c": ["x", 1]}', '{"$f": "1e400"}', 'nope', '{"$t": [], "$s": []}'])
def test_forged_text_is_refused(text: str) -> None:
    with pytest.raises(PlainError):
        decode(text)


def test_decoded_values_are_builtin() -> None:
    value = from_json({"$d": [[{"$t": [1]}, [True]]]})
    assert value == {(1,): [True]} and type(value) is dict
