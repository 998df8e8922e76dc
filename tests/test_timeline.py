"""``timeline.png`` of a local run: a real run with a kill, and the data handed to the plot.

Pixels are not asserted: the PNG must be a valid image, and the series that
:func:`timeline_of` extracts from the run's own records must hold the kill,
its recovery as the summary audited it, and the world-size change.
"""

from __future__ import annotations

import json
import math
import struct
import sys
from pathlib import Path

import pytest

from elastic_train.audit import AuditLog, StepRecord
from elastic_train.errors import ConfigError
from elastic_train.local.chaos import Recovery, parse_schedule
from elastic_train.local.cluster import ClusterSpec
from elastic_train.local.runner import Summary, run_local
from elastic_train.local.timeline import (
    TIMELINE_FILE,
    render_timeline,
    timeline_of,
    write_timeline,
)

STEPS = 20
TRAINER_ARGS = (
    "--data.name=synthetic", "--data.num_samples=96", "--training.global_batch_size=16",
    f"--training.steps={STEPS}", "--checkpoint.interval_steps=4",
    "--model.name=tests.paced_model:paced_mlp", "--model.options.seconds=0.05",
)  # fmt: skip
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Summary:
    """Two nodes, node 1 killed at step 6: the survivor goes on at world size 1."""
    spec = ClusterSpec(
        nodes=2, chaos=parse_schedule("kill:1@step6"), script_args=TRAINER_ARGS,
        metrics_port=None, timeout_s=240,
    )  # fmt: skip
    return run_local(spec, run_dir=tmp_path_factory.mktemp("timeline") / "run")


def _origin(summary: Summary) -> float:
    """Wall time of second 0 (the nodes' start), as every event's time minus its elapsed."""
    return summary.events[0].time - summary.events[0].elapsed


@pytest.mark.slow
def test_the_run_writes_a_png_and_leaves_the_json_summary_as_it_was(killed_run: Summary) -> None:
    assert killed_run.completed and killed_run.exactly_once, killed_run.exactly_once_detail
    path = Path(killed_run.run_dir) / TIMELINE_FILE
    assert killed_run.timeline == str(path)
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1100, 750)  # 11 x 7.5 inches at 100 dpi
    written = json.loads((Path(killed_run.run_dir) / "summary.json").read_text())
    assert written == json.loads(json.dumps(killed_run.to_json()))
    assert "timeline" not in written


@pytest.mark.slow
def test_the_plotted_series_hold_the_kill_its_recovery_and_the_world_size_change(
    killed_run: Summary,
) -> None:
    (recovery,) = killed_run.recoveries
    log = AuditLog.load(Path(killed_run.run_dir) / "audit")
    timeline = timeline_of(log, killed_run.recoveries, origin=_origin(killed_run))

    (event,) = timeline.events
    assert (event.kind, event.node) == ("kill", 1)
    assert event.seconds == pytest.approx(killed_run.events[0].elapsed)
    assert (event.recovery_s, event.lost_steps) == (recovery.seconds, recovery.lost_steps)
    assert f"recovered in {recovery.seconds:.2f} s" in event.label
    assert timeline.world_sizes() == [2, 1]

    before = [p for p in timeline.points if p.seconds < event.seconds]
    after = [p for p in timeline.points if p.seconds > event.seconds]
    resized = [p for p in after if p.world_size == 1]
    assert before and {p.world_size for p in before} == {2}
    # The event's time is taken just before the SIGKILL lands: steps that both
    # nodes finished meanwhile (tens of ms each here) may follow it, within the
    # delivery; from the first step at world size 1 on, every step is at 1.
    assert all(p.seconds < event.seconds + 1.0 for p in after if p.world_size == 2), after
    assert resized and after[-len(resized) :] == resized
    # The first step at the smaller world is the recovery's end, as the summary measured it.
    assert resized[0].seconds == pytest.approx(event.seconds + recovery.seconds)
    assert timeline.points[-1].step == STEPS
    assert all(0 < p.seconds <= killed_run.wall_seconds for p in timeline.points)
    assert all(math.isfinite(p.loss) for p in timeline.points)
    rates = [p.steps_per_second for p in resized[1:]]
    assert rates and all(r is not None and r > 0 for r in rates)


def _record(step: int, rank: int, *, time: float, loss: float, samples: int) -> StepRecord:
    return StepRecord(attempt="a", step=step, epoch=0, rank=rank, world_size=2,
                      node=f"node{rank}", indices=tuple(range(samples)), loss=loss,
                      time=time)  # fmt: skip


def test_series_of_known_records() -> None:
    log = AuditLog()
    for step in range(1, 7):  # one step every 0.5 s from t=100.5
        log.add(_record(step, 0, time=100 + 0.5 * step - 0.01, loss=1.0, samples=3))
        log.add(_record(step, 1, time=100 + 0.5 * step, loss=2.0, samples=1))
    log.add(_record(7, 0, time=104.0, loss=1.0, samples=3))  # rank 1 never recorded step 7
    kill = Recovery("kill", 1, 103.2, 1.5, 2, 1, 4, "snapshot")
    timeline = timeline_of(log, [kill], origin=100.0)
    assert [p.step for p in timeline.points] == [1, 2, 3, 4, 5, 6]  # step 7 is not complete
    assert [p.seconds for p in timeline.points] == pytest.approx([0.5 * s for s in range(1, 7)])
    assert timeline.points[0].loss == pytest.approx((3 * 1.0 + 1 * 2.0) / 4)
    assert timeline.points[0].steps_per_second is None
    assert [p.steps_per_second for p in timeline.points[1:]] == pytest.approx([2.0] * 5)
    (event,) = timeline.events
    assert event.seconds == pytest.approx(3.2)
    assert event.label == "kill node1\nrecovered in 1.50 s\n2 lost steps"


def test_without_matplotlib_no_picture_and_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    audit = tmp_path / "audit"
    audit.mkdir()
    record = {"kind": "step", "attempt": "a", "step": 1, "epoch": 0, "rank": 0, "world_size": 1,
              "node": "node0", "indices": [0], "loss": 1.0, "time": 10.0}  # fmt: skip
    (audit / "worker-node0-1.jsonl").write_text(json.dumps(record) + "\n")
    timeline = timeline_of(AuditLog.load(audit), [], origin=9.0)
    assert len(timeline.points) == 1

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # its import now fails
    path = tmp_path / TIMELINE_FILE
    with pytest.raises(ConfigError, match=r'matplotlib.*pip install "elastic-train\[local\]"'):
        render_timeline(timeline, path)
    assert write_timeline(audit, [], origin=9.0, path=path) is None  # the run goes on
    assert not path.exists()
