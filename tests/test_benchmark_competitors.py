"""``--competitors`` and ``--rdzv-conf``: what the benchmarks run, and the errors
that name a bad value (pure parsing; the smoke tests run the competitors)."""

from __future__ import annotations

import pytest

from benchmarks import harness
from benchmarks.throughput import select


def test_an_override_replaces_one_key_and_adds_another() -> None:
    (tuned,) = harness.select_competitors(
        "c10d-tuned", ["c10d-tuned:keep_alive_max_attempt=5,join_timeout=30"]
    )
    assert tuned.rdzv_conf == (
        "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=30"
    )
    assert harness.COMPETITORS["c10d-tuned"].rdzv_conf == harness.TUNED_CONF


def test_competitors_without_an_override_keep_their_conf() -> None:
    ours, default = harness.select_competitors("ours,c10d-default", ["ours:warm_start=0"])
    assert (ours.rdzv_conf, default.rdzv_conf) == ("warm_start=0", "")


@pytest.mark.parametrize(
    "override",
    ["c10d-default:keep_alive_interval=2", "c10d-tuned", "c10d-tuned:", "c10d-tuned:=1"],
)
def test_a_bad_override_names_itself_and_the_accepted_form(override: str) -> None:
    with pytest.raises(SystemExit) as info:
        harness.select_competitors("ours,c10d-tuned", [override])
    message = str(info.value)
    assert repr(override) in message and "NAME:KEY=VALUE" in message
    assert "(ours, c10d-tuned)" in message


def test_throughput_variants_pass_overrides_to_the_harness_competitors() -> None:
    chosen = select("ours-no-checkpoint,c10d-tuned", ["c10d-tuned:last_call_timeout=3"])
    assert [c.name for c in chosen] == ["ours-no-checkpoint", "c10d-tuned"]
    assert chosen[1].rdzv_conf.startswith("last_call_timeout=3,")


def test_the_option_parses_repeated_values() -> None:
    parser = harness.base_parser("x", default_repeats=1)
    args = parser.parse_args(["--rdzv-conf=a:b=1", "--rdzv-conf", "c:d=2"])
    assert args.rdzv_conf == ["a:b=1", "c:d=2"]
