"""The README's headline: measured results up front, regenerated from the committed
``benchmarks/results/*.json`` so that it never drifts, with the plots it embeds present,
an architecture diagram, and the three commands a newcomer runs unchanged."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from benchmarks import readme, report

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
RESULTS = REPO / "benchmarks" / "results"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def _block(text: str) -> str:
    return text.split(readme.START, 1)[1].split(readme.END, 1)[0].strip("\n")


def _results() -> dict:
    results = report.load(RESULTS, smoke=False)
    if not results:
        pytest.skip("no committed benchmarks/results/*.json")
    return results


def test_the_headline_is_what_the_committed_results_give() -> None:
    assert _block(README.read_text()) == readme.headline(_results()), (
        "README.md's headline is stale: run python -m benchmarks.readme"
    )


def test_the_headline_comes_before_the_setup() -> None:
    text = README.read_text()
    assert text.index(readme.START) < text.index("## Set up and test")


def _row(block: str, start: str) -> list[str]:
    (line,) = [r for r in block.splitlines() if r.startswith(f"| {start}")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_table_holds_the_measured_numbers_in_the_right_columns() -> None:
    """Read independently of the generator: each cell is the JSON's median, per competitor."""
    block = _block(README.read_text())
    for name, title in [("recovery", "Recovery"), ("preemption", "Preemption")]:
        summary = json.loads((RESULTS / f"{name}.json").read_text())["summary"]
        cells = _row(block, title)
        for cell, who in zip(cells[1:], ("ours", "c10d-tuned", "c10d-default"), strict=True):
            assert cell.strip("*").startswith(f"{summary[who]['seconds']['median']:.2f} s"), who
    lost = json.loads((RESULTS / "recovery.json").read_text())["summary"]["ours"]["lost_steps"]
    expected = f"**{lost['median']:.0f} (max {lost['max']:.0f})**"
    assert _row(block, "Steps lost to that kill")[1] == expected
    scale = json.loads((RESULTS / "rendezvous_scale.json").read_text())["by_agents"]
    cells = _row(block, "First rendezvous round")
    assert f"K = {' / '.join(scale)} agents" in cells[0]
    ours = [scale[k]["summary"]["ours"]["round_seconds"]["median"] for k in scale]
    shown = " / ".join("—" if v is None else f"{v:.2f}" for v in ours)  # —: no round
    assert cells[1] == f"**{shown} s**"
    goodput = json.loads((RESULTS / "goodput.json").read_text())["summary"]
    cells = _row(block, "Goodput")
    for cell, who in zip(cells[1:3], ("ours", "c10d-tuned"), strict=True):
        entry = goodput[who]
        assert cell.strip("*").startswith(f"{entry['goodput']['median']:.3f}"), who
        weighted = entry["goodput_world_weighted"]["median"]
        assert f"({weighted:.3f} world-weighted)" in cell, who
    scaleup = json.loads((RESULTS / "scaleup.json").read_text())
    cells = _row(block, "A node joins")
    for cell, who in zip(cells[1:], ("ours", "c10d-tuned", "c10d-default"), strict=True):
        entry, runs = scaleup["summary"][who], scaleup["repeats"]
        if entry["seconds"]["median"] is None:  # no join within the timeout: said, not hidden
            assert cell == f"{len(entry['errors'])} of {runs} runs failed", who
            continue
        seconds, stall = entry["seconds"]["median"], entry["stall_seconds"]["median"]
        assert cell.strip("*").startswith(f"{seconds:.2f} s"), who
        assert f"; stall {stall:.2f} s" in cell, who
    throughput = json.loads((RESULTS / "throughput.json").read_text())
    (target,) = [t for t in throughput["targets"] if t["name"] == readme.THROUGHPUT_TARGET]
    assert f"{target['value']:.3f}x plain DDP" in _row(block, "Throughput")[1]
    if target["met"] is False:
        assert "below the" in _row(block, "Throughput")[1], "a missed target says so"


def test_the_script_rewrites_a_stale_readme_and_check_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "README.md"
    stale.write_text(f"# x\n\n{readme.START}\n| old | table |\n{readme.END}\n\nrest\n")
    assert readme.main([f"--readme={stale}", "--check"]) == 1
    assert "stale" in capsys.readouterr().err
    assert readme.main([f"--readme={stale}"]) == 0
    assert readme.main([f"--readme={stale}", "--check"]) == 0
    text = stale.read_text()
    assert _block(text) == readme.headline(_results()) and text.endswith("\n\nrest\n")


def test_every_embedded_image_exists_and_the_recovery_plot_is_one() -> None:
    for doc in (README, REPO / "benchmarks" / "README.md"):
        paths = IMAGE.findall(doc.read_text())
        assert paths, doc
        for path in paths:
            png = doc.parent / path
            assert png.is_file(), f"{doc.name} embeds {path}, which does not exist"
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    assert "benchmarks/results/recovery.png" in IMAGE.findall(_block(README.read_text()))


def test_an_architecture_diagram_and_the_three_commands_are_there() -> None:
    text = README.read_text()
    diagram = re.search(r"```mermaid\n(.*?)```", text, re.S)
    assert diagram, "no Mermaid diagram"
    assert diagram.group(1).startswith("flowchart")
    for part in ("torchrun agent", "etcd", "snapshot", "checkpoints", "Prometheus"):
        assert part in diagram.group(1), part
    assert '```bash\npip install -e ".[dev]"\npytest\n```' in text
    commands = {line for block in re.findall(r"```bash\n(.*?)```", text, re.S)
                for line in block.splitlines()}  # fmt: skip
    assert "elastic-train local" in commands
