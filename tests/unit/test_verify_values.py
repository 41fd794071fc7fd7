"""`cdc verify` reads source values as text and must hand the warehouse's converters the event
encoding: floats as numbers, their special values as the strings the events carry (found by the fault
suite: a double precision column made every verify fail)."""

from __future__ import annotations

import math

import pytest

from cdc.cli.verify.compare import _from_text, _normalise
from sinks.types import to_array


@pytest.mark.parametrize("pg_type", ["double precision", "real"])
def test_float_text_becomes_the_event_encoding(pg_type: str) -> None:
    values = [
        _from_text(t, pg_type) for t in ("816126.3591200314", "-1e-300", "NaN", "Infinity", "-Infinity")
    ]
    assert values[:2] == [816126.3591200314, -1e-300]
    stored = to_array([*values, None], pg_type).to_pylist()
    assert stored[0] == pytest.approx(816126.3591200314, rel=1e-6 if pg_type == "real" else 0)
    assert math.isnan(stored[2]) and stored[3] == math.inf and stored[4] == -math.inf and stored[5] is None


def test_other_types_stay_text() -> None:
    assert _from_text("12.50", "numeric(20,6)") == "12.50"
    assert _from_text("2020-01-01", "date") == "2020-01-01"
    assert _from_text(None, "double precision") is None


def test_numeric_special_values_are_compared_not_hidden() -> None:
    """The source's numeric NaN/Infinity are read as those strings (the events carry them), not as
    null; one the warehouse cannot hold (numeric(p,s)) becomes a marker no stored value equals."""
    cols = [("big", "numeric"), ("price", "numeric(10,2)")]
    rows = _normalise(cols, [("NaN", "1.50"), ("-Infinity", "NaN"), (None, None)], None)
    assert [r[0] for r in rows] == ["NaN", "-Infinity", None]
    assert str(rows[0][1]) == "1.50" and rows[2][1] is None
    assert isinstance(rows[1][1], str) and rows[1][1].startswith("<not storable as numeric(10,2)")
