"""CIFAR-10 for the lab: the two on-disk layouts, the seeded split, the samplers and the two loaders.

    train.py --loader tensor   the default: the images decoded once, held on the training device as uint8
                               N x 3 x 32 x 32, cropped, flipped and normalized there, a whole batch at a time
    train.py --loader pil      the document's pipeline: a DataLoader that crops, flips and normalizes each
                               image with PIL and torchvision transforms in the training process

Both take the same seeded split and the same DistributedSampler order; with augmentation off they yield
identical batches (tests/test_loaders.py). An image-folder tree is decoded once into a cache file beside it
(DECODED_CACHE), keyed by the files' names, sizes and times, and rebuilt when they change.
"""

import hashlib
import io
import math
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from lab.cli import LabError
from lab.experiment import VALIDATION_FRACTION, split_sizes
from lab.records import write_atomic
from model import CLASSES, IMAGE_SIZE, eval_transform, normalize

# The two dataset layouts train.py reads: image folders train/<class>/ and test/<class>/ holding these files,
# or torchvision's CIFAR-10 (its pickled batches in this folder).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
TORCHVISION_FOLDER = "cifar-10-batches-py"
LOADERS = ("tensor", "pil")
CIFAR10_ARCHIVE_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CROP_PADDING = 4
FLIP_PROBABILITY = 0.5
DECODED_CACHE = ".decoded-{key}.npz"  # in the image-folder tree's root; the key covers every image file
CACHE_FORMAT = 1  # part of the key: a change to what the cache holds invalidates old caches

train_transform = transforms.Compose(
    [
        transforms.RandomCrop(IMAGE_SIZE, padding=CROP_PADDING),
        transforms.RandomHorizontalFlip(FLIP_PROBABILITY),
        transforms.ToTensor(),
        normalize,
    ]
)


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
        }


def decode_cifar_image(path):
    try:
        with Image.open(path) as image:
            rgb = image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
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


def write_decoded_cache(cache, source):
    """Atomically, and the caches of earlier versions of the files removed. A data folder that cannot be
    written is used as it is: every run then decodes the images again (said once, on stderr)."""
    arrays = io.BytesIO()
    np.savez(
        arrays,
        train_images=source.train_images,
        train_labels=np.asarray(source.train_labels, dtype=np.int64),
        test_images=source.test_images,
        test_labels=np.asarray(source.test_labels, dtype=np.int64),
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
    with np.load(cache) as arrays:
        return DataSource(
            "image-folders",
            arrays["train_images"],
            arrays["train_labels"].tolist(),
            arrays["test_images"],
            arrays["test_labels"].tolist(),
        )


def decode_image_folders(train_files, test_files):
    train_images, train_labels = decode_split(train_files)
    test_images, test_labels = decode_split(test_files)
    return DataSource("image-folders", train_images, train_labels, test_images, test_labels)


def image_folder_files(data_dir):
    """The tree's files and the cache file that belongs to exactly these files."""
    train_files, test_files = image_split_files(data_dir / "train"), image_split_files(data_dir / "test")
    return train_files, test_files, decoded_cache_path(data_dir, train_files, test_files)


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
    (torchvision checks the archive's and the files' md5 sums), or decode an image-folder tree into its cache."""
    check_data_dir(data_dir)
    if is_image_folder_tree(data_dir):
        train_files, test_files, cache = image_folder_files(data_dir)
        if not cache.is_file():
            write_decoded_cache(cache, decode_image_folders(train_files, test_files))
        return
    try:
        for train in (True, False):
            datasets.CIFAR10(data_dir, train=train, download=True)
    except Exception as error:  # network, checksum or archive: every way ends in the same advice
        raise download_failure(data_dir, error) from None


def load_data(data_dir):
    """The images of data_dir, in either layout (prepare_data has run on this node)."""
    check_data_dir(data_dir)
    if is_image_folder_tree(data_dir):
        train_files, test_files, cache = image_folder_files(data_dir)
        return read_decoded_cache(cache) if cache.is_file() else decode_image_folders(train_files, test_files)
    train = datasets.CIFAR10(data_dir, train=True, download=False)
    test = datasets.CIFAR10(data_dir, train=False, download=False)
    return DataSource("torchvision", train.data, list(train.targets), test.data, list(test.targets))


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


def rank_share(size, rank, world_size):
    return range(rank, size, world_size)


# ----------------------------------------------------------------------------- the PIL loader


class ImageArrayDataset(Dataset):
    """Images held in memory, served as PIL images through a transform, as torchvision's CIFAR10 does."""

    def __init__(self, images, labels, transform):
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.transform(Image.fromarray(self.images[index])), self.labels[index]


def pil_loader(images, labels, indices, order, batch_size, augment, pin_memory):
    dataset = Subset(ImageArrayDataset(images, labels, train_transform if augment else eval_transform), indices)
    if not isinstance(order, DistributedSampler):
        dataset, order = Subset(dataset, order), None
    return DataLoader(dataset, sampler=order, batch_size=batch_size, num_workers=0, pin_memory=pin_memory)


# ----------------------------------------------------------------------------- the tensor loader


def crop_and_flip(images, generator):
    """RandomCrop(32, padding=4) with zero padding and RandomHorizontalFlip(0.5), for a uint8 B x C x 32 x 32
    batch at once: one random offset in 0..8 per image and axis, the flip folded into the column index, and
    one gather from the padded batch."""
    count, channels, size = images.size(0), images.size(1), images.size(-1)
    device = images.device
    padded = F.pad(images, (CROP_PADDING,) * 4)  # zeros, as RandomCrop's default fill
    padded_size = padded.size(-1)
    offsets = torch.randint(0, 2 * CROP_PADDING + 1, (2, count, 1), device=device, generator=generator)
    flipped = torch.rand(count, 1, device=device, generator=generator) < FLIP_PROBABILITY
    steps = torch.arange(size, device=device)
    rows = offsets[0] + steps
    columns = offsets[1] + torch.where(flipped, size - 1 - steps, steps)
    planes = torch.arange(count * channels, device=device).view(count, channels, 1, 1)  # image and channel
    flat_index = (planes * padded_size + rows.view(count, 1, size, 1)) * padded_size + columns.view(count, 1, 1, size)
    return padded.reshape(-1).take(flat_index)


class TensorLoader:
    """Batches of the device's uint8 images in the sampler's order: cropped and flipped (when augmenting),
    then scaled and normalized exactly as ToTensor and Normalize do, with no host synchronization."""

    def __init__(self, images, labels, indices, order, batch_size, generator):
        self.images, self.labels = images, labels
        self.indices, self.order = indices, order
        self.batch_size = batch_size
        self.generator = generator  # None: no augmentation
        self.mean = torch.as_tensor(normalize.mean, device=images.device).view(1, -1, 1, 1)
        self.std = torch.as_tensor(normalize.std, device=images.device).view(1, -1, 1, 1)

    def __len__(self):
        return math.ceil(len(self.order) / self.batch_size)

    def __iter__(self):
        epoch_order = torch.tensor([self.indices[position] for position in self.order])
        if self.images.is_cuda:  # one asynchronous copy per epoch (a pageable copy would block the host)
            epoch_order = epoch_order.pin_memory().to(self.images.device, non_blocking=True)
        for batch in epoch_order.split(self.batch_size):
            images = self.images[batch]
            if self.generator is not None:
                images = crop_and_flip(images, self.generator)
            yield images.float().div(255).sub(self.mean).div(self.std), self.labels[batch]


def device_images(images, labels, device):
    """torchvision's N x H x W x C uint8 as N x C x H x W on the device, and the labels as int64."""
    return (
        torch.from_numpy(images).permute(0, 3, 1, 2).contiguous().to(device),
        torch.as_tensor(labels, dtype=torch.int64).to(device),
    )


@dataclass
class Loaders:
    train: object
    validation: object
    test: object


def build_loaders(kind, source, split, batch_size, rank, world_size, device, augment_seed, augment=True):
    """The train, validation and test loaders of one kind over split. augment=False: the training images as
    evaluation sees them (the tests compare the two kinds so)."""
    validation_order = rank_share(len(split.validation), rank, world_size)
    test_order = rank_share(len(split.test), rank, world_size)
    if kind == "pil":
        common = {"batch_size": batch_size, "pin_memory": device.type == "cuda"}
        train_images, train_labels = source.train_images, source.train_labels
        return Loaders(
            pil_loader(train_images, train_labels, split.train, split.train_sampler, augment=augment, **common),
            pil_loader(train_images, train_labels, split.validation, validation_order, augment=False, **common),
            pil_loader(source.test_images, source.test_labels, split.test, test_order, augment=False, **common),
        )
    train_images, train_labels = device_images(source.train_images, source.train_labels, device)
    test_images, test_labels = device_images(source.test_images, source.test_labels, device)
    generator = torch.Generator(device).manual_seed(augment_seed) if augment else None
    return Loaders(
        TensorLoader(train_images, train_labels, split.train, split.train_sampler, batch_size, generator),
        TensorLoader(train_images, train_labels, split.validation, validation_order, batch_size, None),
        TensorLoader(test_images, test_labels, split.test, test_order, batch_size, None),
    )
