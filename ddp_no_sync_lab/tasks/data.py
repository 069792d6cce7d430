"""CIFAR-10 for the lab: the two on-disk layouts, the decode cache, the seeded split and the samplers (the
loaders that read them: tasks/loaders.py).

An image-folder tree is decoded once into a cache file beside it (DECODED_CACHE), keyed by the files' names,
sizes and times, rebuilt when they change or when it is damaged (it records the fingerprint of its images
and labels), and written by one process at a time (nodes may share the folder).
"""

import fcntl
import hashlib
import importlib.util
import io
import os
import re
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data.distributed import DistributedSampler

from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.experiment import VALIDATION_FRACTION, split_sizes
from ddp_no_sync_lab.files import write_atomic
from model import CLASSES, IMAGE_SIZE

# The two dataset layouts train.py reads: image folders train/<class>/ and test/<class>/ holding these files,
# or torchvision's CIFAR-10 (its pickled batches in this folder).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
TORCHVISION_FOLDER = "cifar-10-batches-py"
CIFAR10_ARCHIVE_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
DECODED_CACHE = ".decoded-{key}.npz"  # in the image-folder tree's root; the key covers every image file
CACHE_FORMAT = 2  # part of the key: a change to what the cache holds invalidates old caches
CACHE_LOCK = ".decoded.lock"  # held while one process checks or writes the cache (nodes may share the folder)
# Written by tools/synthetic_data.py into the dataset's root: runs on such data say so, and the strict audit
# refuses them as the documented experiment.
SYNTHETIC_MARKER = "synthetic.json"

# ----------------------------------------------------------------------------- the dataset in memory


def is_image_folder_tree(data_dir):
    """Image folders take precedence: a data folder with train/ or test/ is read as one."""
    return (Path(data_dir) / "train").exists() or (Path(data_dir) / "test").exists()


@dataclass
class DataSource:
    """CIFAR-10 in memory as torchvision keeps it: uint8 N x 32 x 32 x 3 images and integer labels."""

    layout: str
    train_images: np.ndarray  # the train source: training and validation images
    train_labels: list
    test_images: np.ndarray
    test_labels: list
    synthetic: bool = False  # written by tools/synthetic_data.py (SYNTHETIC_MARKER)

    @cached_property
    def fingerprint(self):
        digest = hashlib.sha256()
        for array in (self.train_images, np.asarray(self.train_labels), self.test_images, np.asarray(self.test_labels)):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()[:16]

    def summary(self):
        """What every rank compares with rank 0's before training."""
        return {
            "layout": self.layout,
            "train-source images": len(self.train_labels),
            "test images": len(self.test_labels),
            "fingerprint of images and labels": self.fingerprint,
            "synthetic": self.synthetic,
        }


# What Pillow raises for a file it cannot decode: OSError (UnidentifiedImageError, truncated data), SyntaxError
# (a damaged PNG chunk: "broken PNG file"), ValueError, EOFError, and its refusal of a decompression bomb.
IMAGE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError)


def decode_cifar_image(path):
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
    except IMAGE_ERRORS as error:
        raise LabError(f"{path}: not a readable image ({error}); remove or replace it") from None
    if rgb.size != (IMAGE_SIZE, IMAGE_SIZE):
        raise LabError(
            f"{path}: {rgb.size[0]}x{rgb.size[1]} pixels, CIFAR-10 images are {IMAGE_SIZE}x{IMAGE_SIZE}; "
            f"resize or remove it"
        )
    return np.asarray(rgb, dtype=np.uint8)


def image_split_files(split_dir):
    """train/ or test/ of an image-folder tree: one folder per class, PNG or JPEG files.

    [(path as text, label, os.stat_result)], from one scandir per class: 60,000 files take 0.5 s (as
    pathlib objects they took 2).
    """
    if not split_dir.is_dir():
        raise LabError(
            f"{split_dir} is missing: an image-folder dataset needs {split_dir.parent}/train/<class>/ and "
            f"{split_dir.parent}/test/<class>/ with the ten classes ({', '.join(CLASSES)})"
        )
    present = {entry.name for entry in split_dir.iterdir() if entry.is_dir()}
    missing = [name for name in CLASSES if name not in present]
    if missing:
        raise LabError(
            f"{split_dir} lacks class folders: {', '.join(missing)} (it needs one folder per CIFAR-10 class: "
            f"{', '.join(CLASSES)})"
        )
    unknown = sorted(present - set(CLASSES))
    if unknown:
        raise LabError(
            f"{split_dir} has folders that are not CIFAR-10 classes: {', '.join(unknown)}; move them out "
            f"(the classes are {', '.join(CLASSES)})"
        )
    files = []
    for label, name in enumerate(CLASSES):
        with os.scandir(split_dir / name) as entries:
            images = sorted(
                (entry.path, label, entry.stat())
                for entry in entries
                if entry.is_file() and os.path.splitext(entry.name)[1].lower() in IMAGE_SUFFIXES
            )
        if not images:
            raise LabError(f"{split_dir / name} holds no PNG or JPEG images; every class needs some")
        files.extend(images)
    return files


def decode_split(files):
    return np.stack([decode_cifar_image(path) for path, _, _ in files]), [label for _, label, _ in files]


def decoded_cache_path(data_dir, train_files, test_files):
    """The cache file for exactly these files: their names, sizes and modification times make its key."""
    digest = hashlib.sha256(f"format {CACHE_FORMAT}\n".encode())
    prefix = len(os.path.join(data_dir, ""))
    for path, label, stat in train_files + test_files:
        digest.update(f"{path[prefix:]}\t{label}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return data_dir / DECODED_CACHE.format(key=digest.hexdigest()[:16])


class DamagedCache(ValueError):
    """A decode cache that cannot be read, or whose images and labels are not those it recorded."""


def write_decoded_cache(cache, source):
    """Atomically, with the fingerprint of its images and labels, and the caches of earlier versions of the
    files removed. A data folder that cannot be written is used as it is: every run then decodes the images
    again (said once, on stderr)."""
    arrays = io.BytesIO()
    np.savez(
        arrays,
        train_images=source.train_images,
        train_labels=np.asarray(source.train_labels, dtype=np.int64),
        test_images=source.test_images,
        test_labels=np.asarray(source.test_labels, dtype=np.int64),
        fingerprint=np.asarray(source.fingerprint),
    )
    try:
        write_atomic(cache, arrays.getbuffer())
    except OSError as error:
        print(
            f"data: could not cache the decoded images in {cache} ({error.strerror}); every run will decode them",
            file=sys.stderr,
        )
        return
    for stale in cache.parent.glob(DECODED_CACHE.format(key="*")):
        if stale != cache:
            stale.unlink(missing_ok=True)


def read_decoded_cache(cache):
    """The cached DataSource, its images and labels checked against the fingerprint it was written with."""
    try:
        with np.load(cache) as arrays:
            source = DataSource(
                "image-folders",
                arrays["train_images"],
                arrays["train_labels"].tolist(),
                arrays["test_images"],
                arrays["test_labels"].tolist(),
            )
            recorded = str(arrays["fingerprint"])
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as error:
        raise DamagedCache(f"unreadable: {type(error).__name__}: {error}") from None
    if source.fingerprint != recorded:
        raise DamagedCache(f"its images and labels give fingerprint {source.fingerprint}, it recorded {recorded}")
    return source


@contextmanager
def cache_lock(data_dir):
    """One process at a time checks or writes the folder's decode cache; nodes that share the folder wait for
    the one that decodes. A folder where no lock file can be made is used without one (nothing is cached there)."""
    try:
        handle = open(data_dir / CACHE_LOCK, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def decode_image_folders(train_files, test_files):
    train_images, train_labels = decode_split(train_files)
    test_images, test_labels = decode_split(test_files)
    return DataSource("image-folders", train_images, train_labels, test_images, test_labels)


def image_folder_files(data_dir):
    """The tree's files and the cache file that belongs to exactly these files."""
    train_files, test_files = image_split_files(data_dir / "train"), image_split_files(data_dir / "test")
    return train_files, test_files, decoded_cache_path(data_dir, train_files, test_files)


def torchvision_version():
    """torchvision.__version__ (its build's label, +cu128, included) read from its version.py, not imported."""
    source = Path(importlib.util.find_spec("torchvision").origin).with_name("version.py").read_text()
    return re.search(r"^__version__ = '(.+)'$", source, re.M).group(1)


def datasets():
    """torchvision.datasets, imported where the torchvision layout is read: the import costs a process about
    0.9 s (torchvision imports torch._dynamo), and image folders need none of it."""
    from torchvision import datasets

    return datasets


def download_failure(data_dir, error):
    reason = " ".join(f"{type(error).__name__}: {error}".split())
    return LabError(
        f"CIFAR-10 could not be downloaded into {data_dir}/ ({reason}). Provide it without network: put the "
        f"official archive {CIFAR10_ARCHIVE_URL} into {data_dir}/, or an image-folder tree "
        f"{data_dir}/train/<class>/*.png and {data_dir}/test/<class>/*.png, then run again"
    )


def check_data_dir(data_dir):
    if data_dir.exists() and not data_dir.is_dir():
        raise LabError(f"--data-dir {data_dir} is a file; pass the folder that holds the dataset")


def prepare_data(data_dir):
    """Run by one process per node: download torchvision's CIFAR-10 into data_dir unless the data are there
    (torchvision checks the archive's and the files' md5 sums), or decode an image-folder tree into its cache
    unless a sound one is there (a damaged cache is decoded again, with one line saying so)."""
    check_data_dir(data_dir)
    if is_image_folder_tree(data_dir):
        train_files, test_files, cache = image_folder_files(data_dir)
        with cache_lock(data_dir):
            if cache.is_file():
                try:
                    read_decoded_cache(cache)
                    return
                except DamagedCache as damage:
                    print(
                        f"data: the decode cache {cache} is damaged ({damage}); decoding the images again",
                        file=sys.stderr,
                    )
            write_decoded_cache(cache, decode_image_folders(train_files, test_files))
        return
    try:
        for train in (True, False):
            datasets().CIFAR10(data_dir, train=train, download=True)
    except Exception as error:  # network, checksum or archive: every way ends in the same advice
        raise download_failure(data_dir, error) from None


def load_data(data_dir):
    """The images of data_dir, in either layout (prepare_data has run on this node)."""
    check_data_dir(data_dir)
    if is_image_folder_tree(data_dir):
        train_files, test_files, cache = image_folder_files(data_dir)
        if cache.is_file():
            try:
                source = read_decoded_cache(cache)
            except DamagedCache as damage:
                raise LabError(f"the decode cache {cache} is damaged ({damage}); remove it and run again") from None
        else:
            source = decode_image_folders(train_files, test_files)
    else:
        train = datasets().CIFAR10(data_dir, train=True, download=False)
        test = datasets().CIFAR10(data_dir, train=False, download=False)
        source = DataSource("torchvision", train.data, list(train.targets), test.data, list(test.targets))
    source.synthetic = (data_dir / SYNTHETIC_MARKER).is_file()
    return source


# ----------------------------------------------------------------------------- split and samplers


def split_indices(source_size, seed):
    """The seeded permutation of the train source: its first four fifths train, the last fifth validation."""
    permutation = torch.randperm(source_size, generator=torch.Generator().manual_seed(seed)).tolist()
    train_size, _ = split_sizes(source_size)
    return permutation[:train_size], permutation[train_size:]


def majority_class(labels):
    """The most frequent class (the lowest index among ties)."""
    counts = np.bincount(np.asarray(labels), minlength=len(CLASSES))
    return int(np.argmax(counts))


@dataclass
class Split:
    """Which images each part uses (indices into the train source or the test set), and in which order this
    rank reads them: training pads to equal shards (both ranks must run the same number of collectives);
    evaluation takes every world_size-th image, so each image is counted exactly once."""

    train: list
    validation: list
    test: list
    train_sampler: DistributedSampler

    @property
    def sizes(self):
        return {"train": len(self.train), "validation": len(self.validation), "test": len(self.test)}


def make_split(source, seed, rank, world_size):
    train_indices, validation_indices = split_indices(len(source.train_labels), seed)
    split = Split(train_indices, validation_indices, list(range(len(source.test_labels))), None)
    if min(split.sizes.values()) < world_size:
        raise LabError(
            f"too few images for {world_size} ranks: {split.sizes} (the train source is split 4:1 into train and "
            f"validation); provide at least {VALIDATION_FRACTION * world_size} train and {world_size} test images"
        )
    split.train_sampler = DistributedSampler(
        range(len(train_indices)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=False
    )
    return split
