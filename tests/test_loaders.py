"""The two loaders: the tensor loader's crop, flip and normalization, both loaders' order, the decode cache."""

import json
import os
import shutil
import time

import numpy as np
import pytest
import torch

from conftest import SOURCE_IMAGES, assert_one_line_error, read_json, verify
from ddp_no_sync_lab import cli, files
from ddp_no_sync_lab.tasks import data, loaders
from tools import synthetic_data

CPU = torch.device("cpu")
SIZE = 32


def position_images(count):
    """uint8 images whose channel 0 holds row + 1 and channel 1 column + 1 (never 0): a cropped and flipped
    copy tells from which offsets it came, and a 0 can only be padding."""
    steps = torch.arange(1, SIZE + 1, dtype=torch.uint8)
    image = torch.stack(
        [
            steps[:, None].expand(SIZE, SIZE),
            steps[None, :].expand(SIZE, SIZE),
            torch.full((SIZE, SIZE), 7, dtype=torch.uint8),
        ]
    )
    return image.expand(count, 3, SIZE, SIZE).contiguous()


def crop_offsets_and_flips(cropped):
    """(row offset, column offset, flipped) of each cropped position image, in the padded image's 0..8."""
    found = []
    for image in cropped:
        rows, columns = image[0], image[1]
        r, c = [int(index) for index in torch.nonzero(rows * columns)[0]]  # the first pixel that is not padding
        flipped = bool(columns[r, c + 1] < columns[r, c])  # columns grow left to right in the original
        row_offset = int(rows[r, c]) - 1 - r + loaders.CROP_PADDING
        column = SIZE - 1 - c if flipped else c
        column_offset = int(columns[r, c]) - 1 - column + loaders.CROP_PADDING
        found.append((row_offset, column_offset, flipped))
    return found


def test_crop_pads_with_zeros_covers_every_offset_and_flips_half():
    images = position_images(2000)
    cropped = loaders.crop_and_flip(images, torch.Generator().manual_seed(1))
    assert cropped.shape == images.shape and cropped.dtype == torch.uint8
    found = crop_offsets_and_flips(cropped)
    assert {row for row, _, _ in found} == set(range(9))
    assert {column for _, column, _ in found} == set(range(9))
    flip_rate = sum(flipped for _, _, flipped in found) / len(found)
    assert 0.46 < flip_rate < 0.54, flip_rate
    for image, (row_offset, column_offset, flipped) in zip(cropped, found):
        # Rebuild the expected crop from the offsets: the padding is zero, the rest the image's own pixels.
        padded = torch.nn.functional.pad(images[0], (loaders.CROP_PADDING,) * 4)
        expected = padded[:, row_offset : row_offset + SIZE, column_offset : column_offset + SIZE]
        assert torch.equal(image, expected.flip(2) if flipped else expected)
        assert image[2].unique().tolist() in ([7], [0, 7])  # padding is 0 and nothing else


def test_crop_draws_from_its_generator_only():
    images = position_images(64)
    first = loaders.crop_and_flip(images, torch.Generator().manual_seed(5))
    torch.manual_seed(123)  # the global generator plays no part
    assert torch.equal(first, loaders.crop_and_flip(images, torch.Generator().manual_seed(5)))
    assert not torch.equal(first, loaders.crop_and_flip(images, torch.Generator().manual_seed(6)))


@pytest.fixture(scope="module")
def small_source(tmp_path_factory):
    root = tmp_path_factory.mktemp("loaders") / "data"
    synthetic_data.write_dataset(root, "image-folders", 200, 60)
    return data.load_data(root)


@pytest.mark.parametrize("rank", [0, 1])
def test_without_augmentation_both_loaders_yield_identical_batches(small_source, rank):
    split = data.make_split(small_source, seed=47, rank=rank, world_size=2)
    pil = loaders.build_loaders("pil", small_source, split, 16, rank, 2, CPU, augment_seed=47, augment=False)
    tensor = loaders.build_loaders("tensor", small_source, split, 16, rank, 2, CPU, augment_seed=47, augment=False)
    for epoch in range(2):
        split.train_sampler.set_epoch(epoch)
        for part in ("train", "validation", "test"):
            pil_batches, tensor_batches = list(getattr(pil, part)), list(getattr(tensor, part))
            assert len(pil_batches) == len(tensor_batches) == len(getattr(tensor, part)) > 1
            for (pil_images, pil_labels), (tensor_images, tensor_labels) in zip(pil_batches, tensor_batches):
                assert tensor_images.dtype == pil_images.dtype == torch.float32
                assert torch.equal(tensor_images, pil_images), part
                assert torch.equal(tensor_labels, pil_labels), part


def test_with_augmentation_both_loaders_keep_the_samplers_order(small_source):
    split = data.make_split(small_source, seed=47, rank=0, world_size=2)
    pil = loaders.build_loaders("pil", small_source, split, 16, 0, 2, CPU, augment_seed=47)
    tensor = loaders.build_loaders("tensor", small_source, split, 16, 0, 2, CPU, augment_seed=47)
    epochs = []
    for epoch in range(2):
        split.train_sampler.set_epoch(epoch)
        pil_labels = torch.cat([labels for _, labels in pil.train])
        tensor_batches = list(tensor.train)
        assert torch.equal(torch.cat([labels for _, labels in tensor_batches]), pil_labels)
        epochs.append(pil_labels)
        unaugmented = loaders.build_loaders("tensor", small_source, split, 16, 0, 2, CPU, 47, augment=False).train
        changed = [not torch.equal(a, b) for (a, _), (b, _) in zip(tensor_batches, unaugmented)]
        assert all(changed)  # every batch was cropped or flipped
    assert not torch.equal(epochs[0], epochs[1])  # set_epoch reshuffles


@pytest.mark.parametrize("kind", ["pil", "tensor"])
def test_an_epoch_resumed_inside_goes_on_with_the_uninterrupted_batches(small_source, kind):
    """A resumed run restores the RNG states saved after batch 3 and reads the epoch on from there
    (loaders.batches_from): the same augmented batches as the run that never stopped."""
    split = data.make_split(small_source, seed=47, rank=1, world_size=2)
    train = loaders.build_loaders(kind, small_source, split, 8, 1, 2, CPU, augment_seed=47).train
    generator = getattr(train, "generator", None)  # the tensor loader's augmentation draws from its own

    def start_the_run():
        torch.manual_seed(5)
        if generator is not None:
            generator.manual_seed(47)

    start_the_run()
    uninterrupted = [images for images, _ in loaders.batches_from(train, 0)]
    start_the_run()
    batches = loaders.batches_from(train, 0)
    for _ in range(3):
        next(batches)
    saved = torch.get_rng_state(), generator.get_state() if generator is not None else None
    torch.manual_seed(6)  # the restarted process starts elsewhere
    torch.set_rng_state(saved[0])
    if generator is not None:
        generator.set_state(saved[1])
    resumed = [images for images, _ in loaders.batches_from(train, 3)]
    assert len(resumed) == len(uninterrupted) - 3 > 0
    assert all(torch.equal(a, b) for a, b in zip(resumed, uninterrupted[3:]))


def test_the_decode_cache_is_built_once_used_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    root = tmp_path / "data"
    synthetic_data.write_dataset(root, "image-folders", 40, 20)
    decoded = data.load_data(root)  # no cache yet: load_data decodes and does not write
    assert not list(root.glob(".decoded-*"))
    data.prepare_data(root)
    (cache,) = root.glob(".decoded-*.npz")

    def no_decoding(path):
        raise AssertionError(f"decoded {path} although the cache is current")

    monkeypatch.setattr(data, "decode_cifar_image", no_decoding)
    cached = data.load_data(root)
    assert cached.summary() == decoded.summary()
    assert np.array_equal(cached.train_images, decoded.train_images) and cached.test_labels == decoded.test_labels
    monkeypatch.undo()

    changed = next((root / "train" / "cat").iterdir())
    replacement = next((root / "train" / "dog").iterdir())
    shutil.copyfile(replacement, changed)
    os.utime(changed, ns=(time.time_ns(), time.time_ns()))
    data.prepare_data(root)
    (rebuilt,) = root.glob(".decoded-*.npz")  # the stale cache is gone
    assert rebuilt != cache
    assert data.load_data(root).fingerprint != decoded.fingerprint


def test_a_cache_that_cannot_be_written_is_said_once_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    root = tmp_path / "data"
    synthetic_data.write_dataset(root, "image-folders", 40, 20)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(files.os, "fsync", full_disk)
    data.prepare_data(root)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"data: could not cache the decoded images in {root}/.decoded-")
    assert line.endswith("(No space left on device); every run will decode them")
    assert not list(root.glob(".decoded-*")) and not list(root.glob(".*tmp-*"))
    assert data.load_data(root).summary()["train-source images"] == 40


def test_a_damaged_cache_is_decoded_again_with_one_line(tmp_path, capsys):
    """A cache cut short (a node that died while copying it, a full disk elsewhere) is not read as data: the
    node's first process decodes the images again and says so once; a rank that meets it is one line."""
    root = tmp_path / "data"
    synthetic_data.write_dataset(root, "image-folders", 40, 20)
    data.prepare_data(root)
    (cache,) = root.glob(".decoded-*.npz")
    sound = data.load_data(root)
    cache.write_bytes(cache.read_bytes()[: cache.stat().st_size // 2])
    with pytest.raises(cli.LabError) as caught:
        data.load_data(root)
    assert str(caught.value).startswith(f"the decode cache {cache} is damaged (unreadable: ")
    assert str(caught.value).endswith("; remove it and run again")
    capsys.readouterr()
    data.prepare_data(root)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"data: the decode cache {cache} is damaged (unreadable: ") and line.endswith(
        "decoding the images again"
    )
    assert data.load_data(root).fingerprint == sound.fingerprint


def test_a_cache_whose_contents_changed_is_not_taken(tmp_path):
    """A readable cache whose images are not those it recorded (written over in place): its fingerprint says so."""
    root = tmp_path / "data"
    synthetic_data.write_dataset(root, "image-folders", 40, 20)
    data.prepare_data(root)
    (cache,) = root.glob(".decoded-*.npz")
    with np.load(cache) as arrays:
        parts = dict(arrays)
    parts["train_images"][0, 0, 0, 0] ^= 1
    with open(cache, "wb") as handle:
        np.savez(handle, **parts)
    with pytest.raises(data.DamagedCache, match="its images and labels give fingerprint"):
        data.read_decoded_cache(cache)


def test_temporary_names_are_unique_even_for_equal_pids(tmp_path, monkeypatch):
    """Nodes that share a folder may run processes of equal pid (containers): their temporary files differ."""
    used = []
    real_replace = os.replace
    monkeypatch.setattr(files.os, "getpid", lambda: 7)
    monkeypatch.setattr(files.os, "replace", lambda source, target: used.append(source) or real_replace(source, target))
    for _ in range(2):
        files.write_atomic(tmp_path / "cache.npz", b"data")
    assert len(set(used)) == 2


def test_the_pil_loader_trains_with_the_same_counts_and_verify_refuses_to_mix_loaders(lab_runs, pil_run, tmp_path):
    artifacts, _ = lab_runs
    mixed = tmp_path / "artifacts"
    shutil.copytree(artifacts / "every", mixed / "every")
    output, result = pil_run
    shutil.copytree(output, mixed / "no_sync")
    rows = [json.loads(line) for line in result.stdout.splitlines()[:2]]
    tensor_rows = read_json(artifacts / "no_sync" / files.HISTORY_FILE)
    counts = ("optimizer_steps", "gradient_syncs", "allreduce_bytes", "buffer_broadcast_collectives", "broadcast_bytes")
    assert [[row[key] for key in counts] for row in rows] == [[row[key] for key in counts] for row in tensor_rows]
    record = read_json(mixed / "no_sync" / files.RUN_RECORD_FILE)
    assert record["config"]["loader"] == "pil" and record["config"]["train_size"] == SOURCE_IMAGES * 4 // 5
    audit = verify(mixed)
    assert_one_line_error(audit, "come from different configurations (loader: 'tensor' vs 'pil')", code=1)
