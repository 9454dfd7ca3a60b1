import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_taper.taper import multipliers, taper_widths

SCHEDULES = ["uniform", "linear", "cosine", "sigmoid"]


def test_default_cosine_goes_from_1_5x_to_0_5x():
    m = multipliers(5, "cosine", 1.5)
    assert m[0] == pytest.approx(1.5) and m[-1] == pytest.approx(0.5) and sum(m) == pytest.approx(5)
    result = taper_widths(4, 192, "cosine", 1.5, 16)
    assert result.widths == [288, 240, 144, 96] and result.shortfall == 0


@settings(max_examples=400, deadline=None)
@given(layers=st.integers(1, 48), units=st.integers(1, 64), unit=st.sampled_from([1, 8, 16, 64, 128]),
       schedule=st.sampled_from(SCHEDULES), start=st.floats(0.05, 1.95), extra=st.integers(0, 127))
def test_widths_properties(layers, units, unit, schedule, start, extra):
    width = units * unit * 2 + (extra % unit if unit > 1 else 0)
    try:
        result = taper_widths(layers, width, schedule, start, unit)
    except ValueError as e:
        assert "below one alignment unit" in str(e)
        # the error is only raised when the ideal smallest width is really below one unit
        smallest = min(multipliers(layers, schedule, start if start >= 1 else 2 - start)) * width
        assert smallest < 1.5 * unit
        return
    w = result.widths
    assert all(x % unit == 0 and x >= unit for x in w)
    if (layers * width) % unit == 0:
        assert sum(w) == layers * width and result.shortfall == 0
    else:
        assert abs(result.shortfall) < unit
    diffs = [b - a for a, b in zip(w, w[1:])]
    if schedule == "uniform" or start == 1.0:
        assert max(w) - min(w) <= unit
    elif start > 1:
        assert all(d <= 0 for d in diffs), w
    else:
        assert all(d >= 0 for d in diffs), w
    if schedule != "uniform" and start != 1.0:
        assert taper_widths(layers, width, schedule, 2 - start, unit).widths == w[::-1]


@pytest.mark.parametrize("start", [0.0, 2.0, -1.0, 2.5])
def test_start_outside_range_is_an_error(start):
    from megatron_taper.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.taper.start"):
        load_config(None, [f"model.taper.start={start}"])


def test_width_below_one_unit_is_an_error():
    with pytest.raises(ValueError, match=r"below one alignment unit \(model.taper.multiple=64\)"):
        taper_widths(8, 64, "cosine", 1.9, 64)


def test_unknown_schedule_is_an_error():
    from megatron_taper.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.taper.schedule='exp'"):
        load_config(None, ["model.taper.schedule=exp"])
