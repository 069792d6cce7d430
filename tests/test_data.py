"""Loading: the seeded split, both on-disk layouts, and the clear errors for data that cannot be used."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import CIFAR10

from conftest import (
    MODES,
    SMALL_RUN,
    SOURCE_IMAGES,
    TEST_IMAGES,
    assert_refused,
    md5_sums,
    module_runs,
    module_start,
    verify,
    write_png_with_a_damaged_chunk,
)
from ddp_no_sync_lab import cli
from ddp_no_sync_lab.tasks import data
from tools import synthetic_data


def test_split_is_the_documents_seeded_permutation_deterministic_and_disjoint():
    train_indices, validation_indices = data.split_indices(50_000, 47)
    permutation = torch.randperm(50_000, generator=torch.Generator().manual_seed(47)).tolist()
    assert (train_indices, validation_indices) == (permutation[:40_000], permutation[40_000:])
    assert data.split_indices(50_000, 47) == (train_indices, validation_indices)
    assert not set(train_indices) & set(validation_indices)
    assert sorted(train_indices + validation_indices) == list(range(50_000))
    assert data.split_indices(50_000, 48)[0] != train_indices


def test_both_layouts_load_the_same_images(tmp_path, monkeypatch):
    (train_images, train_labels), (test_images, test_labels) = synthetic_data.write_dataset(
        tmp_path / "pickles", "torchvision", 100, 30
    )
    synthetic_data.write_dataset(tmp_path / "folders", "image-folders", 100, 30)
    sums = md5_sums(tmp_path / "pickles" / data.TORCHVISION_FOLDER)
    monkeypatch.setattr(CIFAR10, "train_list", [[name, sums[name]] for name, _ in CIFAR10.train_list])
    monkeypatch.setattr(CIFAR10, "test_list", [[name, sums[name]] for name, _ in CIFAR10.test_list])
    monkeypatch.setattr(CIFAR10, "meta", {**CIFAR10.meta, "md5": sums["batches.meta"]})

    for prepared in ("pickles", "folders"):
        data.prepare_data(tmp_path / prepared)  # the data are there: nothing to download
    pickles = data.load_data(tmp_path / "pickles")
    folders = data.load_data(tmp_path / "folders")
    assert (pickles.layout, folders.layout) == ("torchvision", "image-folders")
    assert np.array_equal(pickles.train_images, train_images) and pickles.train_labels == train_labels
    assert np.array_equal(pickles.test_images, test_images) and pickles.test_labels == test_labels
    # Image folders hold the same images grouped by class (file names keep the original order).
    order = np.argsort(train_labels, kind="stable")
    assert np.array_equal(folders.train_images, train_images[order])
    assert folders.train_labels == sorted(train_labels)


def test_torchvision_refuses_files_that_fail_its_checksums(tmp_path, monkeypatch):
    """Why the end-to-end tests replace the expected md5 sums: without that, torchvision rejects the
    synthetic batches and tries to download the archive (here from a closed port, failing at once)."""
    synthetic_data.write_dataset(tmp_path / "pickles", "torchvision", 50, 10)
    monkeypatch.setattr(CIFAR10, "url", "http://127.0.0.1:9/cifar-10-python.tar.gz")
    with pytest.raises(cli.LabError) as caught:
        data.prepare_data(tmp_path / "pickles")
    message = str(caught.value)
    assert message.startswith(f"CIFAR-10 could not be downloaded into {tmp_path / 'pickles'}/")
    assert "cifar-10-python.tar.gz" in message and "train/<class>" in message


def test_a_jpeg_image_folder_tree_loads(tmp_path):
    synthetic_data.write_dataset(tmp_path / "data", "image-folders", 20, 10)
    png = next((tmp_path / "data" / "train" / "cat").iterdir())
    Image.open(png).save(png.with_suffix(".JPG"), quality=95)
    png.unlink()
    source = data.load_data(tmp_path / "data")
    assert source.train_images.shape == (20, 32, 32, 3)


@pytest.mark.parametrize(
    "damage, fragments",
    [
        ("missing_class", ("train lacks class folders: dog",)),
        ("unknown_folder", ("has folders that are not CIFAR-10 classes: kittens",)),
        ("empty_class", ("holds no PNG or JPEG images",)),
        ("text_as_png", ("not a readable image", "remove or replace it")),
        ("damaged_chunk", ("damaged.png: not a readable image (broken PNG file", "remove or replace it")),
        ("wrong_size", ("64x64 pixels, CIFAR-10 images are 32x32",)),
        ("no_test_split", ("test is missing",)),
    ],
)
def test_unusable_image_folders_are_named_with_the_remedy(tmp_path, damage, fragments):
    root = tmp_path / "data"
    synthetic_data.write_dataset(root, "image-folders", 40, 20)
    if damage == "missing_class":
        shutil.rmtree(root / "train" / "dog")
    elif damage == "unknown_folder":
        (root / "train" / "kittens").mkdir()
    elif damage == "empty_class":
        for path in (root / "test" / "frog").iterdir():
            path.unlink()
    elif damage == "text_as_png":
        (root / "train" / "cat" / "notes.png").write_text("not an image")
    elif damage == "damaged_chunk":
        write_png_with_a_damaged_chunk(root / "train" / "cat" / "damaged.png")
    elif damage == "wrong_size":
        Image.new("RGB", (64, 64)).save(root / "train" / "cat" / "big.png")
    elif damage == "no_test_split":
        shutil.rmtree(root / "test")
    with pytest.raises(cli.LabError) as caught:
        data.load_data(root)
    assert all(fragment in str(caught.value) for fragment in fragments), str(caught.value)


def test_a_data_dir_that_is_a_file(tmp_path):
    (tmp_path / "data").write_text("not a folder")
    with pytest.raises(cli.LabError, match="--data-dir .* is a file; pass the folder that holds the dataset"):
        data.load_data(tmp_path / "data")


def test_too_few_images_for_the_ranks(tmp_path):
    synthetic_data.write_dataset(tmp_path / "data", "image-folders", 10, 10)
    source = data.load_data(tmp_path / "data")
    source.test_images, source.test_labels = source.test_images[:1], source.test_labels[:1]
    with pytest.raises(cli.LabError, match="too few images for 2 ranks: .*'test': 1"):
        data.make_split(source, seed=47, rank=0, world_size=2)


def test_a_missing_class_or_an_unreadable_image_is_one_error(tmp_path):
    """data.load_data's refusals, each a LabError (one line, exit 2, from train.py: its plumbing under torchrun
    is test_train_py_says_how_to_provide_cifar10_when_the_download_fails's)."""
    missing, broken = tmp_path / "missing", tmp_path / "broken"
    for root in (missing, broken):
        synthetic_data.write_dataset(root, "image-folders", 40, 20)
    shutil.rmtree(missing / "test" / "ship")
    (broken / "train" / "horse" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(cli.LabError, match="test lacks class folders: ship"):
        data.load_data(missing)
    with pytest.raises(cli.LabError, match="broken.png: not a readable image"):
        data.load_data(broken)


def test_train_py_says_how_to_provide_cifar10_when_the_download_fails(shared_refusals):
    line = assert_refused(shared_refusals[1]["download"], "CIFAR-10 could not be downloaded into")
    assert "image-folder tree" in line and "cifar-10-python.tar.gz" in line


def write_torchvision_layout(folder):
    synthetic_data.write_dataset(folder / "cifar", "torchvision", SOURCE_IMAGES, TEST_IMAGES)


@module_runs("torchvision-layout", prepare=write_torchvision_layout)
def torchvision_layout_runs(folder, image_data):
    """Both modes for one epoch on CIFAR-10 in torchvision's own format (pickled batches), its md5 sums the
    synthetic files' own (tests/inject), in the session's module start."""
    sums = f"LAB_TEST_CIFAR_MD5={json.dumps(md5_sums(folder / 'cifar' / data.TORCHVISION_FOLDER))}"
    return [
        [sums, "--mode", mode, "--output", folder / "artifacts" / mode, "--data-dir", folder / "cifar", *SMALL_RUN]
        + ["--epochs", "1", "--quiet"]
        for mode in MODES
    ]


@pytest.mark.torchrun
def test_torchvision_layout_end_to_end_counts(tmp_path_factory, image_data):
    """train.py on CIFAR-10 in torchvision's own format, both modes, audited."""
    folder, results = module_start(tmp_path_factory, image_data, "torchvision-layout")
    for syncs, result in zip((20, 5), results):
        row = json.loads(result.stdout.splitlines()[0])
        assert (row["optimizer_steps"], row["gradient_syncs"]) == (5, syncs)
    report = json.loads((folder / "artifacts" / "every" / "report.json").read_text())
    assert report["config"]["data_layout"] == "torchvision"
    audit = verify(folder / "artifacts")
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert audit.stdout.splitlines()[-1] == "AUDIT PASSED: no_sync reduced gradient synchronizations by 4x"
