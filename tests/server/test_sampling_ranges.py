"""One table of sampling ranges (`SAMPLING_RANGES`): the server's parser and the engine's validation
accept exactly the same values of each field, at each bound and just past it."""

from __future__ import annotations

import math

import pytest

from compiled_engine.sampling_params import SAMPLING_RANGES, SamplingParams
from server.protocol import Limits, ProtocolError, parse_completion


def _candidates(lo: float, hi: float, integer: bool) -> list[float]:
    step = 1 if integer else 1e-6
    return [lo - step, lo, lo + step, hi - step, hi, hi + step]


@pytest.mark.parametrize("name", sorted(SAMPLING_RANGES))
def test_server_and_engine_accept_the_same_values(name: str) -> None:
    allowed = SAMPLING_RANGES[name]
    integer = isinstance(allowed.lo, int) and isinstance(allowed.hi, int)
    for value in _candidates(allowed.lo, allowed.hi, integer):
        value = int(value) if integer else value
        try:
            SamplingParams(**{name: value}).validate()
            engine_ok = True
        except ValueError:
            engine_ok = False
        try:
            body = {"model": "m", "prompt": "x", name: value}
            parsed = parse_completion(body, Limits(4096, 1000)).params
            server_ok = True
        except ProtocolError as e:
            server_ok = False
            assert e.param == name and name in e.message
        assert engine_ok == server_ok == (value in allowed), (name, value)
        if server_ok and not (name == "temperature" and value < 1e-5):
            assert math.isclose(getattr(parsed, name), value)


@pytest.mark.parametrize(
    "name", sorted(n for n, r in SAMPLING_RANGES.items() if isinstance(r.lo, int))
)
def test_integer_fields_refuse_fractions_and_booleans_on_both_sides(name: str) -> None:
    """A fraction inside the range (2.5 logprobs) or a boolean is refused by both: the engine would
    otherwise fail later, inside a step."""
    allowed = SAMPLING_RANGES[name]
    for value in (allowed.lo + 1.5, True):
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            SamplingParams(**{name: value}).validate()
        with pytest.raises(ProtocolError, match=f"'{name}' must be an integer") as e:
            parse_completion({"model": "m", "prompt": "x", name: value}, Limits(4096, 1000))
        assert e.value.param == name
