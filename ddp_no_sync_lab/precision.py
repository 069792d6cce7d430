"""The numerics a run uses, chosen for the hardware it lands on: BF16 autocast where the device computes in
BF16 natively, float32 elsewhere.

    --precision auto   BF16 autocast on CUDA devices that support it and on CPUs whose oneDNN reports BF16
                       instructions (AVX512-BF16, AMX); float32 elsewhere (an AVX2-only CPU emulates BF16
                       in software: 6.4 s for a training micro-batch of 50 against 0.50 s in float32)
    --precision bf16   BF16 autocast on float32 weights everywhere (the document's numerics)
    --precision fp32   float32 everywhere

The decision reads torch's own capability report, never a list of CPU names. LAB_CPU_BF16=1 or 0 makes
`auto` decide as on a CPU with or without BF16 instructions (the tests use it to take both paths on one
machine). The gradients are float32 either way, so the audit's counts, bytes and positions do not depend on it.
"""

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from ddp_no_sync_lab.cli import LabError

NUMERICS = ("bf16", "fp32")  # what a run records; `auto` resolves to one of them
PRECISIONS = ("auto", *NUMERICS)
CPU_BF16_VARIABLE = "LAB_CPU_BF16"
AUTOCAST_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Precision:
    """What a run computes in (`bf16`: BF16 autocast on float32 weights; `fp32`), on what, and why."""

    name: str
    hardware: str
    reason: str

    @property
    def description(self):
        return "BF16 autocast" if self.name == "bf16" else "float32"

    def autocast(self, device_type):
        """The context every forward and loss runs in."""
        return torch.autocast(device_type, dtype=AUTOCAST_DTYPE) if self.name == "bf16" else nullcontext()


def native_bf16(device):
    """Whether `device` computes BF16 natively, as torch reports it: CUDA's compute capability, oneDNN's check
    of the CPU's instructions. Returns (native, hardware description)."""
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return native, f"GPU {torch.cuda.get_device_name(device)} ({'with' if native else 'without'} native BF16)"
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return native, f"CPU {torch.backends.cpu.get_cpu_capability()} {'with' if native else 'without'} BF16 instructions"


def cpu_bf16_override():
    """LAB_CPU_BF16 as a bool, or None when unset."""
    value = os.environ.get(CPU_BF16_VARIABLE)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise LabError(
            f"{CPU_BF16_VARIABLE}={value!r}: expected 1 (decide as on a CPU with BF16 instructions) or 0 "
            f"(as on one without); unset it to use this CPU's own report"
        )
    return value == "1"


def choose_precision(requested, device):
    """The Precision for --precision `requested` on `device`, with the one line that says why."""
    native, hardware = native_bf16(device)
    override = cpu_bf16_override() if device.type == "cpu" else None
    decided_native = native if override is None else override
    chosen = requested if requested != "auto" else ("bf16" if decided_native else "fp32")
    numerics = "BF16 autocast" if chosen == "bf16" else "float32"
    if requested != "auto":
        emulated = (
            " (emulated: about 13x slower than float32 on such a device)" if chosen == "bf16" and not native else ""
        )
        reason = f"--precision {chosen} on a {hardware}: {numerics}{emulated}"
    elif override is not None:
        reason = (
            f"{hardware}, taken as {'with' if override else 'without'} them ({CPU_BF16_VARIABLE}="
            f"{os.environ[CPU_BF16_VARIABLE]}): {numerics}"
        )
    else:
        reason = f"{hardware}: {numerics}"
        if not native:
            reason += "; --precision bf16 forces emulated BF16, about 13x slower than float32 on such a device"
    return Precision(chosen, hardware, reason)
