"""The ``autoscaling`` config section: off by default, validated at the edge with the
field named, converted once to the policy's targets."""

from __future__ import annotations

import pytest

from orchestrator.config import parse_config
from orchestrator.errors import ConfigError
from policies.autoscale import PoolBounds


def test_autoscaling_is_off_by_default() -> None:
    assert parse_config({}).autoscaling.enabled is False


def test_the_section_becomes_the_policys_targets() -> None:
    cfg = parse_config(
        {
            "prefill": {"num_engines": 2},
            "autoscaling": {
                "enabled": True,
                "ttft_p90_s": 1.5,
                "itl_p90_s": 0.05,
                "prefill": {"min_replicas": 1, "max_replicas": 8},
                "decode": {"min_replicas": 1, "max_replicas": 3},
                "engine_start_s": 90,
                "scale_down_window_s": 120,
                "headroom": 0.25,
            },
        }
    )
    targets = cfg.autoscaling.targets()
    assert targets.ttft_p90_s == 1.5 and targets.itl_p90_s == 0.05
    assert targets.prefill == PoolBounds(min_replicas=1, max_replicas=8)
    assert targets.decode == PoolBounds(min_replicas=1, max_replicas=3)
    assert targets.engine_start_s == 90 and targets.scale_down_window_s == 120
    assert targets.headroom == 0.25
    assert parse_config({}).autoscaling.targets().headroom == 0.5  # the default
    # The start time measured at the last start replaces the configured one.
    assert cfg.autoscaling.targets(engine_start_s=42.0).engine_start_s == 42.0


@pytest.mark.parametrize(
    ("section", "field", "match"),
    [
        ({"autoscaling": {"ttft_p90_s": 0}}, "autoscaling.ttft_p90_s", "greater than 0"),
        ({"autoscaling": {"bogus": 1}}, "autoscaling.bogus", "remove it"),
        ({"autoscaling": {"headroom": -0.5}}, "autoscaling.headroom", "greater than or equal"),
        (
            {"autoscaling": {"decode": {"min_replicas": 3, "max_replicas": 2}}},
            "autoscaling.decode",
            r"set max_replicas to at least 3",
        ),
        (
            {"autoscaling": {"scale_down_utilization": 0.9, "scale_up_utilization": 0.8}},
            "autoscaling",
            r"set it at or below scale_up_utilization",
        ),
        (
            {
                "autoscaling": {"enabled": True, "decode": {"max_replicas": 2}},
                "decode": {"num_engines": 3},
            },
            "decode.num_engines",
            r"within autoscaling.decode: 1 to 2",
        ),
        (
            {"autoscaling": {"enabled": True}, "placement": {"mode": "domain"}},
            "autoscaling.enabled",
            r"placement.mode: off",
        ),
    ],
)
def test_a_bad_value_is_refused_naming_its_field(
    section: dict[str, object], field: str, match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        parse_config(section)
    assert err.value.field == field


def test_a_pool_size_outside_the_bounds_is_fine_with_autoscaling_off() -> None:
    cfg = parse_config({"decode": {"num_engines": 6}})
    assert cfg.decode.num_engines == 6
