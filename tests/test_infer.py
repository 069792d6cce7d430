"""infer.py: the document's one-image form, many images and folders, top-k, and every bad input."""

import json
import os
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

from conftest import (
    TEST_IMAGES,
    assert_one_line_error,
    png_header_only,
    read_json,
    run_in_process,
    write_png_with_a_damaged_chunk,
)
from model import CLASSES


@pytest.fixture
def checkpoint(lab_runs):
    artifacts, _ = lab_runs
    return artifacts / "no_sync" / "model.pt"


def infer(checkpoint, *images, extra=()):
    return run_in_process("infer.py", "--checkpoint", checkpoint, "--image", *images, *extra)


def test_any_picture_mode_and_size_is_classified(checkpoint, tmp_path):
    pictures = {
        "gray.png": Image.new("L", (32, 32), 128),
        "rgba.png": Image.new("RGBA", (50, 20), (10, 200, 30, 128)),
        "palette.png": Image.new("RGB", (32, 32), "red").convert("P"),
        "photo.jpg": Image.new("RGB", (640, 480), "blue"),
    }
    for name, picture in pictures.items():
        picture.save(tmp_path / name)
        result = infer(checkpoint, tmp_path / name)
        assert result.returncode == 0, result.stderr
        output = json.loads(result.stdout)
        assert output["class"] in CLASSES and set(output["probabilities"]) == set(CLASSES)
        assert abs(sum(output["probabilities"].values()) - 1) < 1e-5
        assert output["confidence"] == max(output["probabilities"].values())


def test_folders_are_searched_recursively_one_line_per_image(checkpoint, lab_runs, tmp_path):
    (tmp_path / "album" / "inner").mkdir(parents=True)
    Image.new("RGB", (32, 32), "green").save(tmp_path / "album" / "a.png")
    Image.new("RGB", (32, 32), "white").save(tmp_path / "album" / "inner" / "b.JPEG")
    (tmp_path / "album" / "notes.txt").write_text("not an image, not an image suffix: skipped")
    sample = lab_runs[0] / "every" / "sample_test.png"
    result = infer(checkpoint, tmp_path / "album", sample, extra=("--top-k", "3"))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["path"] for line in lines] == [
        str(tmp_path / "album" / "a.png"),
        str(tmp_path / "album" / "inner" / "b.JPEG"),
        str(sample),
    ]
    for line in lines:
        ranked = sorted(line["probabilities"].items(), key=lambda item: -item[1])[:3]
        assert [(entry["class"], entry["probability"]) for entry in line["top_k"]] == ranked


def test_bad_files_are_reported_on_their_own_lines_and_the_rest_go_on(checkpoint, tmp_path):
    Image.new("RGB", (32, 32), "green").save(tmp_path / "good.png")
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "text.png").write_text("hello")
    Image.effect_noise((64, 64), 50).convert("RGB").save(tmp_path / "noise.png")
    (tmp_path / "truncated.png").write_bytes((tmp_path / "noise.png").read_bytes()[:300])
    png_header_only(tmp_path / "bomb.png", 20_000, 20_000)
    png_header_only(tmp_path / "huge.png", 10_000, 10_000)  # only a warning in Pillow: refused too
    files = ["good.png", "empty.png", "text.png", "truncated.png", "missing.png", "bomb.png", "huge.png"]
    result = infer(checkpoint, *(tmp_path / name for name in files))
    assert result.returncode == 1
    lines = {json.loads(line)["path"]: json.loads(line) for line in result.stdout.splitlines()}
    assert list(lines) == [str(tmp_path / name) for name in files]
    assert lines[str(tmp_path / "good.png")]["class"] in CLASSES
    errors = {name: lines[str(tmp_path / name)]["error"] for name in files[1:]}
    assert errors["empty.png"] == "not a readable image (the file is empty)"
    assert "cannot identify image file" in errors["text.png"]
    assert "truncated" in errors["truncated.png"]
    assert errors["missing.png"] == "no such file or folder"
    assert "could be decompression bomb" in errors["bomb.png"]
    assert "refused, too many pixels" in errors["huge.png"]


def test_a_png_with_a_damaged_chunk_is_one_line_and_the_good_image_is_classified(checkpoint, tmp_path):
    """Pillow raises SyntaxError, not OSError, for a damaged chunk: still one error line for that file."""
    Image.new("RGB", (32, 32), "green").save(tmp_path / "a_good.png")
    write_png_with_a_damaged_chunk(tmp_path / "b_damaged.png")
    result = infer(checkpoint, tmp_path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    good, damaged = (json.loads(line) for line in result.stdout.splitlines())
    assert good["path"] == str(tmp_path / "a_good.png") and good["class"] in CLASSES
    assert damaged == {
        "path": str(tmp_path / "b_damaged.png"),
        "error": "not a readable image (broken PNG file (chunk b'ID#T'))",
    }


@pytest.mark.parametrize(
    "make, fragment",
    [
        (lambda path: None, "image not found:"),
        (write_png_with_a_damaged_chunk, "not a readable image (broken PNG file"),
        (lambda path: path.write_bytes(b""), "not a readable image (the file is empty)"),
        (lambda path: path.write_text("just text"), "not a readable image (cannot identify image file"),
        (lambda path: png_header_only(path, 20_000, 20_000), "could be decompression bomb"),
    ],
)
def test_one_bad_image_is_one_line(checkpoint, tmp_path, make, fragment):
    make(tmp_path / "picture.png")
    line = assert_one_line_error(infer(checkpoint, tmp_path / "picture.png"), fragment)
    assert line.startswith("infer.py: error: ")


def test_a_folder_without_images(checkpoint, tmp_path):
    (tmp_path / "empty").mkdir()
    assert_one_line_error(
        infer(checkpoint, tmp_path / "empty"), f"no PNG or JPEG images found in: {tmp_path / 'empty'}"
    )


def test_checkpoint_problems(checkpoint, tmp_path):
    picture = tmp_path / "p.png"
    Image.new("RGB", (32, 32)).save(picture)
    assert_one_line_error(infer(tmp_path / "none.pt", picture), f"checkpoint not found: {tmp_path / 'none.pt'}")

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(checkpoint.read_bytes()[:4096])
    assert_one_line_error(infer(truncated, picture), f"checkpoint unreadable: {truncated} is truncated")

    other = tmp_path / "other.pt"
    torch.save({"model": nn.Linear(3, 10).state_dict(), "classes": CLASSES}, other)
    assert_one_line_error(infer(other, picture), f"checkpoint does not fit CifarCNN: {other}", "Missing key(s)")


class RunsAShellCommand:
    """Pickled, it asks to call os.system on load: what a malicious checkpoint carries."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_with_pickled_code_is_refused_not_executed(checkpoint, tmp_path):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    state = torch.load(checkpoint, weights_only=True)
    torch.save({**state, "extra": RunsAShellCommand(marker)}, evil)
    picture = tmp_path / "p.png"
    Image.new("RGB", (32, 32)).save(picture)
    line = assert_one_line_error(infer(evil, picture), f"checkpoint refused: {evil}", "it was not executed")
    assert "weights_only" in line.lower() or "Unsupported global" in line
    assert not marker.exists()


def test_device_cuda(checkpoint, tmp_path):
    picture = tmp_path / "p.png"
    Image.new("RGB", (32, 32)).save(picture)
    result = infer(checkpoint, picture, extra=("--device", "cuda"))  # the tests' subprocesses see no GPU
    assert_one_line_error(result, "--device cuda: no CUDA device is visible", "--device cpu")


def test_top_k_out_of_range(checkpoint, tmp_path):
    assert_one_line_error(
        infer(checkpoint, tmp_path, extra=("--top-k", "0")), "argument --top-k: must be at least 1, got 0"
    )


def test_evaluation_numerics_give_the_evaluations_classes(checkpoint, lab_runs, image_data):
    """--numerics evaluation on the test images: the confusion matrix of its classes is the one train.py's
    evaluation (two ranks, channels_last, the run's precision) wrote into report.json, count for count."""
    artifacts, _ = lab_runs
    result = infer(checkpoint, image_data / "test", extra=("--numerics", "evaluation"))
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    matrix = [[0] * len(CLASSES) for _ in CLASSES]
    for line in lines:
        matrix[CLASSES.index(Path(line["path"]).parent.name)][CLASSES.index(line["class"])] += 1
    assert len(lines) == TEST_IMAGES and matrix == read_json(artifacts / "no_sync" / "report.json")["confusion_matrix"]
