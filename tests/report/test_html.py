"""`--format html` of estimate, compare, plan, measure and validate, read in headless Chromium with the
network off: the page loads nothing (its policy forbids it, and no src or href leads out), its DOM holds the
figures of the command's JSON (every element tied to a JSON key shows that key's value), and its screenshot
has the bars drawn.

Needs Debian's `chromium` (.ci/run installs it where apt-get exists); skipped with the reason where absent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest
from click.testing import CliRunner

from zeroplan.cli import cli
from zeroplan.report.html.page import CATEGORY_COLORS
from tests.paths import REPO

CHROMIUM = next((found for name in ("chromium", "chromium-browser") if (found := shutil.which(name))), None)
NO_CHROMIUM = "headless Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it where apt-get exists)"

# nothing reaches a network: every proxied request goes to a closed port and no name resolves
OFFLINE = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
           "--disable-background-networking", "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND"]


class Elements(HTMLParser):
    """Every start tag of a document with its attributes, and its text."""

    def __init__(self, document: str):
        super().__init__()
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.feed(document)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, {name: value or "" for name, value in attrs}))

    def handle_data(self, data):
        self.text.append(data)


def browse(tmp_path: Path, document: str, name: str = "page") -> tuple[Elements, Path]:
    """The page as Chromium builds it (its DOM, serialised) and a screenshot of it."""
    if CHROMIUM is None:
        pytest.skip(NO_CHROMIUM)
    path = tmp_path / f"{name}.html"
    path.write_text(document)
    flags = [*OFFLINE, f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", path.as_uri()], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    shot = tmp_path / f"{name}.png"
    subprocess.run([CHROMIUM, *flags, "--hide-scrollbars", "--window-size=1300,1800", f"--screenshot={shot}",
                    path.as_uri()], capture_output=True, timeout=120, check=True)
    assert "</body></html>" in dom.replace("\n", "")
    return Elements(dom), shot


def lookup(data, key: str):
    for part in key.split("."):
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


def figures(page: Elements, data: dict) -> set[str]:
    """Every figure the DOM ties to the JSON equals the JSON's value there; returns the keys shown."""
    shown = set()
    for _, attrs in page.tags:
        if "data-key" not in attrs:
            continue
        key, raw = attrs["data-key"], attrs["data-value"]
        expected = lookup(data, key)
        value = raw if isinstance(expected, str) else json.loads(raw)
        assert value == expected, f"{key}: the page shows {raw}, the JSON has {expected!r}"
        shown.add(key)
    return shown


def offline_and_drawn(page: Elements, shot: Path, colors: tuple[str, ...] = ("params", "activations")) -> None:
    """Nothing on the page can load from anywhere (no script, link, image or frame; no src or href out of the page;
    a policy that forbids loads), and its screenshot is a drawing: bars in category colours, not a blank page."""
    tags = {tag for tag, _ in page.tags}
    assert not tags & {"script", "link", "img", "iframe", "object", "embed", "base"}
    for tag, attrs in page.tags:
        for name in ("src", "href", "action", "srcset", "xlink:href"):
            assert not attrs.get(name, "").lower().startswith(("http:", "https:", "//", "ftp:")), (tag, attrs)
    policies = [attrs["content"] for tag, attrs in page.tags if tag == "meta" and attrs.get("http-equiv") ==
                "Content-Security-Policy"]
    assert policies and policies[0].startswith("default-src 'none'")
    image = pytest.importorskip("PIL.Image").open(shot).convert("RGB")
    counts = {rgb: count for count, rgb in image.getcolors(maxcolors=1 << 24)}
    total = image.width * image.height
    assert total - counts.get((255, 255, 255), 0) > 0.03 * total, "the screenshot is (nearly) blank"
    for category in colors:
        rgb = tuple(int(CATEGORY_COLORS[category][i:i + 2], 16) for i in (1, 3, 5))
        assert counts.get(rgb, 0) > 200, f"no {category} bar in the screenshot"


def run(*args: str) -> str:
    result = CliRunner().invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_compare_page_renders_offline(tmp_path):
    """The issue's check: `zeroplan compare llama-2-7b --zero 0,1,2,3 --gpus 8,64 --format html > page.html`."""
    args = ["compare", "llama-2-7b", "--zero", "0,1,2,3", "--gpus", "8,64"]
    with open(tmp_path / "page.html", "w") as out:
        subprocess.run([sys.executable, "-m", "zeroplan", *args, "--format", "html"], stdout=out, cwd=tmp_path,
                       timeout=120, check=True)
    data = json.loads(run(*args, "--format", "json"))
    page, shot = browse(tmp_path, (tmp_path / "page.html").read_text())
    offline_and_drawn(page, shot, ("params", "grads", "optimizer_states", "activations"))
    shown = figures(page, data)
    for i, row in enumerate(data["rows"]):
        assert {f"rows.{i}.per_gpu.{c}" for c in (*CATEGORY_COLORS, "peak")} <= shown
        assert {f"rows.{i}.config", f"rows.{i}.gpus", f"rows.{i}.saving_vs_stage0_percent"} <= shown
    assert len(data["rows"]) == 8


def test_estimate_page_has_phases_terms_ranks_and_the_gpu(tmp_path):
    args = ["estimate", "llama-2-7b", "--gpus", "8", "--zero", "3", "--gpu-memory", "h100-80gb"]
    data = json.loads(run(*args, "--format", "json"))
    page, shot = browse(tmp_path, run(*args, "--format", "html"))
    offline_and_drawn(page, shot, ("params", "grads", "optimizer_states", "activations", "buffers"))
    shown = figures(page, data)
    assert {f"per_gpu.{c}" for c in (*CATEGORY_COLORS, "peak", "allocated", "reserved", "device")} <= shown
    assert {f"phases.{i}.{c}" for i in range(len(data["phases"])) for c in (*CATEGORY_COLORS, "total")} <= shown
    assert {f"terms.{i}.bytes" for i in range(len(data["terms"]))} <= shown
    assert {f"device_memory.outside.{i}.bytes" for i in range(len(data["device_memory"]["outside"]))} <= shown
    assert {"per_node.cpu", "per_node.pinned", "per_node.nvme", "device_memory.cublas_workspaces"} <= shown
    assert "Fits in 80.00 GiB per GPU: yes" in "".join(page.text)


def test_an_estimate_that_does_not_fit_shows_its_step_and_the_changes_that_would(tmp_path):
    args = ["estimate", "llama-2-70b", "--gpus", "8", "--zero", "3", "--gpu", "h100-80gb"]
    data = json.loads(run(*args, "--format", "json"))
    assert data["fits"] is False and data["suggestions"]
    page, _ = browse(tmp_path, run(*args, "--format", "html"))
    shown = figures(page, data)
    assert {f"suggestions.{i}.peak" for i in range(len(data["suggestions"]))} <= shown
    assert {"step.seconds"} | {f"step.terms.{t}" for t, seconds in data["step"]["terms"].items() if seconds > 0} <= shown
    assert "Fits in 80.00 GiB per GPU: no" in "".join(page.text)


def test_a_mesh_estimate_shows_every_rank_kind(tmp_path):
    args = ["estimate", "llama-3-8b", "--gpus", "32", "--pp", "4", "--grad-accum", "8", "--zero", "3", "--engine",
            "fsdp2", "--recipe", "torchtitan", "--units", "GB"]
    data = json.loads(run(*args, "--format", "json"))
    page, shot = browse(tmp_path, run(*args, "--format", "html"))
    offline_and_drawn(page, shot)
    shown = figures(page, data)
    assert len(data["ranks"]) > 1
    assert {f"ranks.{i}.per_gpu.{c}" for i in range(len(data["ranks"])) for c in (*CATEGORY_COLORS, "peak", "reserved")} <= shown


@pytest.mark.parametrize("mesh", [False, True], ids=["configurations", "meshes"])
def test_plan_page_ranks_with_reasons(tmp_path, mesh):
    args = (["plan", "llama-3-8b", "--gpu", "h100-80gb", "--gpus", "16", "--mesh", "--engine", "fsdp2", "--top", "3"] if mesh
            else ["plan", "llama-2-7b", "--gpu", "h100-80gb", "--gpus", "8"])
    data = json.loads(run(*args, "--format", "json"))
    page, shot = browse(tmp_path, run(*args, "--format", "html"))
    offline_and_drawn(page, shot)
    shown = figures(page, data)
    assert data["top"]
    for i, plan in enumerate(data["top"]):
        assert {f"top.{i}.rank", f"top.{i}.reason", f"top.{i}.per_gpu.peak", f"top.{i}.step.seconds"} <= shown
        assert {f"top.{i}.step.terms.{term}" for term, seconds in plan["step"]["terms"].items() if seconds > 0} <= shown
        assert plan["reason"] in "".join(page.text)
    assert {f"assumptions.{name}" for name in data["assumptions"]} <= shown


def test_plan_page_when_nothing_fits_lists_the_changes(tmp_path):
    args = ["plan", "llama-3-70b", "--gpu", "rtx4090-24gb", "--gpus", "1"]
    data = json.loads(run(*args, "--format", "json"))
    assert not data["top"] and data["suggestions"]
    page, _ = browse(tmp_path, run(*args, "--format", "html"))
    figures(page, data)
    assert all(suggestion in "".join(page.text) for suggestion in data["suggestions"])


@pytest.mark.distributed
def test_measure_page_sets_the_estimate_beside_the_run(tmp_path):
    """A tiny run on two gloo ranks: the page (standard output) and the JSON (--output) of one run."""
    pytest.importorskip("torch")
    args = ["measure", "tiny-llama", "--engine", "torch", "--zero", "1", "--nproc", "2", "--precision", "fp32",
            "--seq-len", "64", "--units", "MiB"]
    document = run(*args, "--format", "html", "--output", str(tmp_path / "m.json"))
    data = json.loads((tmp_path / "m.json").read_text())
    page, shot = browse(tmp_path, document)
    offline_and_drawn(page, shot)
    shown = figures(page, data)
    for step, compared in data["comparison"].items():
        assert {f"comparison.{step}.{what}.{name}" for what in ("estimated", "measured") for name in compared["estimated"]} <= shown
        assert {f"error.{step}.{name}" for name, error in data["error"][step].items()} <= shown
    assert {f"ranks.{i}.peak" for i in range(len(data["ranks"]))} <= shown
    assert {f"ranks.{i}.allocator_replay.reserved_peak_bytes" for i in range(len(data["ranks"]))} <= shown


def test_validate_page_has_every_row_and_the_error_distribution(tmp_path):
    """`validate --measure none` re-estimates every row against the committed measurements (a copy of the cache)."""
    shutil.copy(REPO / "docs" / "accuracy.json", tmp_path / "accuracy.json")
    document = run("validate", "--measure", "none", "--format", "html", "--output-md", str(tmp_path / "accuracy.md"),
                   "--output-json", str(tmp_path / "accuracy.json"))
    data = json.loads((tmp_path / "accuracy.json").read_text())
    page, shot = browse(tmp_path, document)
    offline_and_drawn(page, shot, ())
    shown = figures(page, data)
    assert {f"rows.{i}.id" for i in range(len(data["rows"]))} <= shown
    compared = [i for i, row in enumerate(data["rows"]) if row.get("comparison")]
    assert compared and {f"rows.{i}.comparison.steady_error" for i in compared} <= shown
    counts = {}
    for _, attrs in page.tags:
        if "data-histogram" in attrs:
            counts[attrs["data-histogram"]] = counts.get(attrs["data-histogram"], 0) + int(attrs["data-count"])
    steady = [data["rows"][i]["comparison"]["steady_error"] for i in compared]
    assert counts["steady"] == sum(error is not None for error in steady)
    # the bins hold what they say: the rows within the 3% target are the bins from -3% to +3%
    within = sum(-0.03 <= error < 0.03 for error in steady if error is not None)
    bins = [int(attrs["data-count"]) for _, attrs in page.tags if attrs.get("data-histogram") == "steady"]
    assert sum(bins[3:7]) == within


def test_the_api_renders_the_same_page():
    import zeroplan

    result = zeroplan.compare("llama-2-7b", zero=[0, 1, 2, 3], gpus=[8, 64])
    assert result.render("html") == run("compare", "llama-2-7b", "--zero", "0,1,2,3", "--gpus", "8,64", "--format", "html")
