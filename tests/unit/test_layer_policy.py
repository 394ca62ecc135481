import pytest

from backends.stages.policy import LayerGroupPolicy


def covers(groups, layers):
    assert groups[0][0] == 0 and groups[-1][1] == layers
    for (_, b), (c, _) in zip(groups[:-1], groups[1:], strict=True):
        assert b == c
    assert all(b > a for a, b in groups)


def test_short_prompts_and_disabled_use_one_group():
    p = LayerGroupPolicy(min_tokens=256, min_groups=2, max_groups=8)
    assert p.groups(255, 30) == [(0, 30)]
    assert LayerGroupPolicy(enabled=False).groups(10_000, 30) == [(0, 30)]


def test_groups_fall_linearly_from_max_to_min():
    p = LayerGroupPolicy(min_tokens=100, min_groups=2, max_groups=8, sat_multiplier=4.0)
    counts = [len(p.groups(n, 30)) for n in (100, 150, 200, 250, 300, 400, 10_000)]
    assert counts == [8, 7, 6, 5, 4, 2, 2]
    assert counts == sorted(counts, reverse=True)
    for n in (100, 180, 333, 5000):
        covers(p.groups(n, 30), 30)


def test_remainder_goes_to_last_group_and_never_empty():
    p = LayerGroupPolicy(min_tokens=1, min_groups=7, max_groups=7)
    g = p.groups(10, 30)
    assert len(g) == 7 and g[:-1] == [(i * 4, i * 4 + 4) for i in range(6)] and g[-1] == (24, 30)
    # more groups than layers: one layer per group
    assert LayerGroupPolicy(min_tokens=1, min_groups=8, max_groups=8).groups(5, 3) == [
        (0, 1),
        (1, 2),
        (2, 3),
    ]
    assert LayerGroupPolicy(min_tokens=1).groups(5000, 1) == [(0, 1)]


def test_fixed_group_size_overrides():
    p = LayerGroupPolicy(fixed_group_size=8)
    assert p.groups(1, 30) == [(0, 8), (8, 16), (16, 24), (24, 30)]
    covers(p.groups(1, 30), 30)


@pytest.mark.parametrize(
    "kw",
    [
        dict(min_groups=0),
        dict(min_groups=5, max_groups=4),
        dict(sat_multiplier=0.5),
        dict(fixed_group_size=0),
        dict(min_tokens=-1),
    ],
)
def test_validation(kw):
    with pytest.raises(ValueError):
        LayerGroupPolicy(**kw)
