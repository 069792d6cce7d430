"""The CIFAR-10 CNN, its class names and its preprocessing, used identically by training and inference.

    python -c "from model import CifarCNN; print(sum(p.numel() for p in CifarCNN().parameters()))"
    558538

(The document says 445,834; the network it defines has 558,538 parameters: convolutions 1,728 + 36,864 +
73,728 + 147,456 + 294,912, BatchNorm 1,280, linear 2,570. tests/test_model.py checks the true count.)
"""

import pickle
import zipfile
from contextlib import contextmanager, nullcontext
from functools import partial
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)

# Per-channel mean and standard deviation of the CIFAR-10 training images.
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
IMAGE_SIZE = 32

# Training's and evaluation's memory format (train.py; infer.py --numerics evaluation): the model and its inputs
# in NHWC. channels_last runs a training micro-batch 1.2x faster with BF16 autocast and 1.1x in float32 on CPU
# (docs); the counts, the split and the equivalence tests are unchanged. What they compute in: precision.py.
MEMORY_FORMAT = torch.channels_last

TRANSFORMS = ("normalize", "eval_transform", "inference_transform")


def __getattr__(name):
    """normalize, eval_transform and inference_transform, made at their first use (`from model import
    eval_transform` is one): they need torchvision, whose import costs a process about 0.9 s (it imports
    torch._dynamo), and training's default loader needs none of them."""
    if name not in TRANSFORMS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from torchvision import transforms

    normalize = transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)
    eval_transform = transforms.Compose([transforms.ToTensor(), normalize])
    # Any picture a user hands to infer.py: made RGB by the caller, then brought to the training size.
    inference_transform = transforms.Compose([transforms.Resize((IMAGE_SIZE, IMAGE_SIZE)), eval_transform])
    globals().update(normalize=normalize, eval_transform=eval_transform, inference_transform=inference_transform)
    return globals()[name]


# The stages that activation checkpointing recomputes (train.py --activation-checkpointing), as [start, stop)
# slices of CifarCNN.features: each ends where the resolution drops (the two max-pools, the global average),
# so that a checkpoint holds one small tensor, its stage's input, in place of every activation inside it.
STAGES = ((0, 7), (7, 14), (14, 18))


def batchnorm_buffers(module):
    return [
        buffer
        for layer in module.modules()
        if isinstance(layer, nn.modules.batchnorm._BatchNorm)
        for buffer in layer.buffers()
    ]


@contextmanager
def statistics_kept(stage):
    """Around a stage's recomputation: puts its BatchNorm buffers back as the forward left them. Recomputed in
    training mode, BatchNorm would update its running statistics (and num_batches_tracked) a second time; its
    output uses the batch's own statistics, so the recomputation is exact either way."""
    buffers = batchnorm_buffers(stage)
    kept = [buffer.clone() for buffer in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in zip(buffers, kept):
                buffer.copy_(value)


def recompute_context(stage):
    """torch.utils.checkpoint's context_fn: nothing around the forward, statistics_kept around the recomputation."""
    return nullcontext(), statistics_kept(stage)


class CifarCNN(nn.Module):
    def __init__(self, activation_checkpointing=False) -> None:
        super().__init__()
        self.activation_checkpointing = activation_checkpointing
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(128),
            nn.ReLU(inplace=True),
            nn.Conv2d(128, 128, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(128),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(128, 256, kernel_size=3, padding=1, bias=False),
            nn.BatchNorm2d(256),
            nn.ReLU(inplace=True),
            # A mean over H and W: its backward is deterministic on CUDA too.
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Linear(256, len(CLASSES))

    def stages(self):
        return [self.features[start:stop] for start, stop in STAGES]

    def forward(self, inputs):
        if self.activation_checkpointing and torch.is_grad_enabled():
            # Non-reentrant: a stage whose input needs no gradient (the images) still gives its parameters theirs,
            # and DDP sees each parameter's gradient once (docs/checkpointing.md).
            features = inputs
            for stage in self.stages():
                features = checkpoint(
                    stage, features, use_reentrant=False, context_fn=partial(recompute_context, stage)
                )
        else:
            features = self.features(inputs)
        return self.classifier(features.flatten(1))


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and what is wrong with it."""


def load_checkpoint(path):
    """Load model.pt safely (weights_only: tensors and plain data, never pickled code) into a CifarCNN.

    Returns (model in eval mode, the checkpoint dict).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path} (train first, or pass the path of a model.pt)")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint is empty: {path} (it was not written completely; train again)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        first_line = str(error).strip().splitlines()[0]
        raise CheckpointError(
            f"checkpoint refused: {path} holds objects other than tensors and plain data "
            f"({first_line}); it was not executed. Use a model.pt written by train.py"
        ) from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as error:
        raise CheckpointError(
            f"checkpoint unreadable: {path} is truncated or not a PyTorch file ({error}); train again"
        ) from None
    if not isinstance(checkpoint, dict) or "model" not in checkpoint:
        raise CheckpointError(f"checkpoint has no 'model' state dict: {path}; use a model.pt written by train.py")
    if tuple(checkpoint.get("classes", ())) != CLASSES:
        raise CheckpointError(
            f"checkpoint classes differ from model.CLASSES: {path}; use a model.pt written by train.py"
        )
    model = CifarCNN()
    try:
        model.load_state_dict(checkpoint["model"])
    except (RuntimeError, TypeError, AttributeError) as error:
        summary = " ".join(str(error).split())[:300]
        raise CheckpointError(f"checkpoint does not fit CifarCNN: {path} ({summary})") from None
    model.eval()
    return model, checkpoint
