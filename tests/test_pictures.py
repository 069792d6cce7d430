"""The pictures show the JSON's numbers: each PNG opens at its size, carries the data it plots, and its
pixels follow that data (cell shades, line points, bar heights)."""

import json

import pytest
from PIL import Image

from conftest import copy_runs, read_json, verify
from ddp_no_sync_lab import experiment, files
from ddp_no_sync_lab.report import tables
from ddp_no_sync_lab.report.pictures import COLLECTIVE_COLOURS, MODE_COLOURS


@pytest.fixture(scope="module")
def audited(lab_runs, tmp_path_factory):
    artifacts = copy_runs(lab_runs[0], tmp_path_factory.mktemp("pictures") / "artifacts")
    result = verify(artifacts)
    assert result.returncode == 0, result.stderr
    return artifacts


def picture(path):
    image = Image.open(path)
    image.load()
    return image, json.loads(image.text["data"])


def luminance(pixel):
    return 0.299 * pixel[0] + 0.587 * pixel[1] + 0.114 * pixel[2]


def test_confusion_matrix_picture_shows_the_reports_matrix(audited):
    for mode in experiment.MODES:
        image, data = picture(audited / mode / files.CONFUSION_FILE)
        report = read_json(audited / mode / "report.json")
        assert image.size == (702, 726)
        assert image.text["run_id"] == report["run_id"]
        assert data["matrix"] == report["confusion_matrix"]
        # Within each true-class row, more images means a darker cell.
        for row, counts in enumerate(report["confusion_matrix"]):
            shades = [
                luminance(image.getpixel((x0 + 3, y0 + 3))) for x0, y0, _, _ in data["cells"][row * 10 : row * 10 + 10]
            ]
            for a in range(10):
                for b in range(10):
                    if counts[a] > counts[b]:
                        assert shades[a] < shades[b], (row, counts, shades)


def test_curves_picture_plots_the_histories(audited):
    image, data = picture(audited / tables.CURVES_FILE)
    assert image.size == (1096, 420)
    histories = {mode: read_json(audited / mode / "history.json") for mode in experiment.MODES}
    assert [panel["title"] for panel in data["panels"]] == ["loss per epoch", "accuracy per epoch"]
    for panel, metric in zip(data["panels"], ("loss", "accuracy")):
        assert len(panel["series"]) == 4
        points = []
        for index, series in enumerate(panel["series"]):
            mode, split = series["label"].split()
            assert series["values"] == [row[f"{split}_{metric}"] for row in histories[mode]]
            for (x, y), value in zip(series["points"], series["values"]):
                points.append((y, value))
                covered = any(
                    abs(x - ox) <= later["radius"] and abs(y - oy) <= later["radius"]
                    for later in panel["series"][index + 1 :]
                    for ox, oy in later["points"]
                )
                assert covered or image.getpixel((x, y)) == tuple(series["colour"]), (series["label"], x, y)
        # One linear scale per panel: higher values drawn higher.
        (y_low, low), (y_high, high) = min(points, key=lambda p: p[1]), max(points, key=lambda p: p[1])
        for y, value in points:
            expected = y_low + (value - low) / (high - low) * (y_high - y_low)
            assert abs(y - expected) <= 1.5


def test_communication_picture_plots_the_counts(audited):
    image, data = picture(audited / tables.COMMUNICATION_FILE)
    assert image.size == (1096, 772)
    histories = {mode: read_json(audited / mode / "history.json") for mode in experiment.MODES}
    keys = ("gradient_syncs", "allreduce_bytes", "buffer_broadcast_collectives", "comm_seconds")
    scales = (1, 1e6, 1, 1)
    for panel, key, scale in zip(data["panels"], keys, scales):
        heights = []
        for mode, bars in panel["bars"].items():
            assert bars["values"] == [row[key] / scale for row in histories[mode]]
            for (x0, y0, x1, y1), value in zip(bars["boxes"], bars["values"]):
                assert y1 == panel["zero_y"]
                assert image.getpixel(((x0 + x1) // 2, (y0 + y1) // 2)) == MODE_COLOURS[mode]
                heights.append((y1 - y0, value))
        pixels_per_unit = max(h for h, _ in heights) / max(v for _, v in heights)
        for height, value in heights:
            assert abs(height - value * pixels_per_unit) <= 1.5, (panel["title"], height, value)


def test_timeline_picture_shows_one_window_per_mode_one_lane_per_rank(audited):
    """every's window holds 4 gradient all-reduces on each rank, no_sync's 1; each drawn at its time."""
    image, data = picture(audited / tables.TIMELINE_FILE)
    assert [panel["title"] for panel in data["panels"]] == [
        "every: window 3 of epoch 1 (micro-batches 8-11)",
        "no_sync: window 3 of epoch 1 (micro-batches 8-11)",
    ]
    for panel, mode, gradient_all_reduces in zip(data["panels"], experiment.MODES, (4, 1)):
        profile = read_json(audited / mode / files.PROFILE_FILE)
        assert [lane["label"] for lane in panel["lanes"]] == ["rank 0", "rank 1"]
        for lane, summary in zip(panel["lanes"], profile["ranks"]):
            assert lane["counts"] == {
                "gradient all-reduce": gradient_all_reduces,
                "rank-agreement all-reduce": 1,
                "average-witness all-reduce": 1,
                "broadcast": 2 * gradient_all_reduces,
                "all-gather": 0,  # FSDP's (train.py --strategy fsdp)
                "reduce-scatter": 0,
            }
            assert [c["index"] for c in lane["compute"]] == [8, 9, 10, 11]
            seconds = {index: start for index, start, _ in summary["micro_batches"]}
            for drawn in lane["compute"]:  # one time scale: a micro-batch's left edge at its start
                assert (
                    abs(drawn["box"][0] - (data["origin_x"] + seconds[drawn["index"]] / data["seconds_per_pixel"])) <= 1
                )
            for index, drawn in enumerate(lane["collectives"]):
                x0, y0, x1, y1 = drawn["box"]
                centre = ((x0 + x1) // 2, (y0 + y1) // 2)
                covered = any(
                    later["box"][0] <= centre[0] <= later["box"][2] for later in lane["collectives"][index + 1 :]
                )
                assert covered or image.getpixel(centre) == COLLECTIVE_COLOURS[drawn["kind"]], drawn
