"""The two loaders of a rank's training, validation and test images, over tasks/data.py's split.

    train.py --loader tensor   the default: the images decoded once, held on the training device as uint8
                               N x 3 x 32 x 32, cropped, flipped and normalized there, a whole batch at a time
    train.py --loader pil      the document's pipeline: a DataLoader that crops, flips and normalizes each
                               image with PIL and torchvision transforms in the training process

Both take the same seeded split and the same DistributedSampler order; with augmentation off they yield
identical batches (tests/test_loaders.py). A run resumed inside an epoch takes the rest of it from
batches_from: the same batches the uninterrupted run would have taken.
"""

import math
from dataclasses import dataclass

import torch
from PIL import Image
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

import model
from model import CIFAR10_MEAN, CIFAR10_STD, IMAGE_SIZE

LOADERS = ("tensor", "pil")
CROP_PADDING = 4
FLIP_PROBABILITY = 0.5
AUGMENTATION = f"RandomCrop({IMAGE_SIZE}, padding={CROP_PADDING}), RandomHorizontalFlip({FLIP_PROBABILITY})"


def train_transform():
    """The document's per-image augmentation (torchvision is imported only where the PIL loader is used)."""
    from torchvision import transforms

    return transforms.Compose(
        [
            transforms.RandomCrop(IMAGE_SIZE, padding=CROP_PADDING),
            transforms.RandomHorizontalFlip(FLIP_PROBABILITY),
            transforms.ToTensor(),
            model.normalize,
        ]
    )


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
    dataset = Subset(ImageArrayDataset(images, labels, train_transform() if augment else model.eval_transform), indices)
    if not isinstance(order, DistributedSampler):
        dataset, order = Subset(dataset, order), None
    return DataLoader(dataset, sampler=order, batch_size=batch_size, num_workers=0, pin_memory=pin_memory)


def batches_from(loader, start):
    """A training loader's batches of this epoch from batch `start` on (a run resumed inside an epoch): the
    batches before it neither read nor draw random numbers, so those after it are the uninterrupted run's."""
    if start == 0:
        return iter(loader)
    if hasattr(loader, "batches"):  # the tensor loader, and the text task's (tasks/packed.py)
        return loader.batches(start)
    order = list(loader.sampler)[start * loader.batch_size :]  # the PIL loader: its sampler's order, cut
    # A DataLoader's iterator draws its workers' base seed, from the global RNG unless it has a generator of its
    # own: the epoch's loader drew it already, before the saved state; this one must draw nothing more.
    cut = DataLoader(
        loader.dataset,
        sampler=order,
        batch_size=loader.batch_size,
        pin_memory=loader.pin_memory,
        generator=torch.Generator(),
    )
    return iter(cut)


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
        self.mean = torch.as_tensor(CIFAR10_MEAN, device=images.device).view(1, -1, 1, 1)
        self.std = torch.as_tensor(CIFAR10_STD, device=images.device).view(1, -1, 1, 1)

    def __len__(self):
        return math.ceil(len(self.order) / self.batch_size)

    def __iter__(self):
        return self.batches(0)

    def batches(self, start):
        """The epoch's batches from batch `start` on; those before it draw nothing from the generator."""
        epoch_order = torch.tensor([self.indices[position] for position in self.order])
        if self.images.is_cuda:  # one asynchronous copy per epoch (a pageable copy would block the host)
            epoch_order = epoch_order.pin_memory().to(self.images.device, non_blocking=True)
        for batch in epoch_order.split(self.batch_size)[start:]:
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
