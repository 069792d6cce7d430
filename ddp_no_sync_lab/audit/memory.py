"""Memory: what a forward leaves held for its backward (activations, autocast's weight copies), and what a rank
holds between micro-batches (gradients and parameters, sharded or whole), read from the tensors themselves: the
same on every device.
"""

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def local(tensor):
    """This rank's part of a tensor: its shard of FSDP's DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@dataclass
class SavedTensors:
    """What a forward left held for its backward: activations, and (apart) autocast's low-precision copies of
    the weights, each {storage address: bytes}."""

    activations: dict = field(default_factory=dict)
    weight_copies: dict = field(default_factory=dict)

    @property
    def activation_bytes(self):
        return sum(self.activations.values())

    @property
    def weight_copy_bytes(self):
        return sum(self.weight_copies.values())


# Views autograd records between a weight's cast and the op that saves it (nn.Linear saves the cast weight
# transposed).
VIEW_NODES = {"TBackward0", "TransposeBackward0", "ViewBackward0", "PermuteBackward0"}


def copies_a_parameter(tensor, parameters):
    """Whether a saved tensor is autocast's cast of a parameter (or a view of one): made by a _to_copy whose
    input is the parameter itself."""
    node = tensor.grad_fn
    while node is not None and node.name() in VIEW_NODES:
        node = node.next_functions[0][0]
    if node is None or node.name() != "ToCopyBackward0":
        return False
    source = node.next_functions[0][0]
    return hasattr(source, "variable") and is_parameter(source.variable, parameters)


def is_parameter(tensor, parameters):
    """A parameter of the model by its storage, or (FSDP's unsharded ones, made anew at each all-gather) its type."""
    return isinstance(tensor, nn.Parameter) or tensor.untyped_storage().data_ptr() in parameters


@contextmanager
def saved_activations(model):
    """Count the bytes that a forward run inside this context leaves held for its backward; yields a
    SavedTensors to read afterwards.

    Autograd packs every tensor it saves for the backward through saved_tensors_hooks: each distinct storage is
    counted once, the model's parameters aside (they are held anyway), and autocast's BF16 copies of them apart
    (they are weights in another dtype, not activations; without autocast there are none). Inside a
    checkpointed stage the checkpoint's own hooks save nothing; the checkpoint holds the stage's input instead,
    seen here by a forward pre-hook on the stage's first layer. Independent of the allocator: the same on every
    device.
    """
    parameters = {local(parameter).untyped_storage().data_ptr() for parameter in model.parameters()}
    held = SavedTensors()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if not is_parameter(tensor, parameters):
            kind = held.weight_copies if copies_a_parameter(tensor, parameters) else held.activations
            kind[storage.data_ptr()] = storage.nbytes()
        return tensor

    # A model that recomputes its stages (the lab's, --activation-checkpointing) names them; another has none.
    entries = [stage[0] for stage in model.stages()] if getattr(model, "activation_checkpointing", False) else []
    handles = [entry.register_forward_pre_hook(lambda module, inputs: pack(inputs[0])) for entry in entries]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield held
    finally:
        for handle in handles:
            handle.remove()


def held_bytes(parameters, unsharded=None):
    """[gradient bytes, parameter bytes] this rank holds now: each parameter's own (its shard under FSDP) and its
    gradient's, and FSDP's unsharded parameters and gradients ({id: parameter}) where they are allocated. DDP's
    bucket, a copy of the gradients it all-reduces, is not a tensor of the model's and is not counted."""
    gradients = parameters_held = 0
    for parameter in parameters:
        parameters_held += local(parameter).numel() * parameter.element_size()
        if parameter.grad is not None:
            gradients += local(parameter.grad).numel() * parameter.element_size()
        whole = (unsharded or {}).get(id(parameter))
        if whole is not None:
            parameters_held += whole.untyped_storage().nbytes()  # freed (zero bytes) once resharded
            gradients += whole.grad.numel() * whole.grad.element_size() if whole.grad is not None else 0
    return [gradients, parameters_held]
