"""bench_worldmodel's command line: overrides after ``--seeds`` still reach the runs."""

import pytest

from benchmarks.bench_worldmodel import split_seeds


def test_overrides_after_seeds_are_overrides() -> None:
    assert split_seeds(["0", "1", "data.future=4", "train.lr=5e-4"]) == (
        [0, 1],
        ["data.future=4", "train.lr=5e-4"],
    )


@pytest.mark.parametrize("tokens", [["a=b"], ["0", "x"], ["-1"]])
def test_bad_seeds_are_refused(tokens: list[str]) -> None:
    with pytest.raises(ValueError, match="--seeds takes integers"):
        split_seeds(tokens)
