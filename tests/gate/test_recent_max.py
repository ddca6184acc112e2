"""RecentMax: the highest of the last few values, kept as they come and go."""

import random

from kvgate.gate.recent_max import RecentMax


def test_the_highest_of_the_last_values_as_they_come_and_go():
    recent = RecentMax(3)
    assert recent.value is None
    seen: list[float] = []
    rng = random.Random(7)
    for _ in range(200):
        value = rng.choice([1, 2, 3, 5, 8, 8, 13])
        recent.add(value)
        seen.append(value)
        assert recent.value == max(seen[-3:])


def test_the_highest_leaving_the_window_gives_way_to_the_next():
    recent = RecentMax(2)
    for value in (9, 4, 6):
        recent.add(value)
    assert recent.value == 6  # 9 left the window
