"""The document's environment check: what this machine has, and which way the lab will run on it.

    python check_env.py                       # the report (make check)
    python check_env.py --nproc-per-node 1    # for a node of a multi-node run with one process
    python check_env.py --lab-device          # only 'cuda' or 'cpu': what train.py --device auto will take

train.py's device policy (ddp_no_sync_lab/run/launch.py's node_device) decides per node: GPUs (NCCL, one process per
GPU) when the node has at least one visible GPU per process it runs, else CPU (gloo). The precision
(ddp_no_sync_lab/precision.py) follows the device: BF16 autocast where it computes BF16 natively, float32 elsewhere;
this check prints the decision and why, as train.py does at start-up.
"""

import platform
import shutil
import sys
from pathlib import Path

import torch
import torchvision

from ddp_no_sync_lab.cli import ArgumentParser, LabError, exit_with, positive_int
from ddp_no_sync_lab.experiment import DOCUMENTED
from ddp_no_sync_lab.precision import choose_precision
from ddp_no_sync_lab.run.launch import node_device
from ddp_no_sync_lab.tasks.data import TORCHVISION_FOLDER, is_image_folder_tree

DATA_GIGABYTES = 0.35  # CIFAR-10's archive and its extracted batches


def os_name():
    release = Path("/etc/os-release")
    if release.is_file():
        for line in release.read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    return platform.platform()


def data_status(data_dir):
    if is_image_folder_tree(data_dir):
        return f"image folders in {data_dir}/ (train/<class>/, test/<class>/)"
    if (data_dir / TORCHVISION_FOLDER).is_dir():
        return f"torchvision's CIFAR-10 in {data_dir}/"
    return f"absent: the first run downloads CIFAR-10 (163 MB) into {data_dir}/ (one process per node)"


def main():
    parser = ArgumentParser(prog="check_env.py", description="Report this machine and the way the lab will run.")
    parser.add_argument("--lab-device", action="store_true", help="print only cuda or cpu")
    parser.add_argument(
        "--nproc-per-node", type=positive_int, default=DOCUMENTED["world_size"], help="processes this node will run"
    )
    parser.add_argument("--data-dir", type=Path, default=Path("data"))
    args = parser.parse_args()
    processes = args.nproc_per_node
    device, gpus = node_device(processes)
    if args.lab_device:
        print(device)
        return

    print(f"OS:               {os_name()}")
    print(f"Python:           {sys.version.split()[0]}")
    print(f"torch:            {torch.__version__}")
    print(f"torchvision:      {torchvision.__version__}")
    print(f"CUDA runtime:     {torch.version.cuda}")
    print(f"GPU count:        {gpus}" + "".join(f"\n  GPU {i}: {torch.cuda.get_device_name(i)}" for i in range(gpus)))
    if gpus:
        print(f"BF16 (GPU):       {torch.cuda.is_bf16_supported()}")
    print(f"CPU capability:   {torch.backends.cpu.get_cpu_capability()}")
    precision = choose_precision("auto", torch.device(device))
    print(f"precision:        {precision.reason}")
    free = shutil.disk_usage(".").free / 1e9
    print(f"free disk here:   {free:.1f} GB (the data needs about {DATA_GIGABYTES} GB)")
    print(f"data:             {data_status(args.data_dir)}")
    print()
    if device == "cuda":
        print(f"The lab will run on GPUs: {processes} process(es) here, one per GPU, NCCL, {precision.description}.")
    else:
        print(
            f"The lab will run on CPU: {processes} process(es) here with gloo, {precision.description} "
            f"({gpus} GPU(s) visible; the GPU path needs {processes})."
        )
    if free < DATA_GIGABYTES:
        print(f"Not enough free disk for the data: free at least {DATA_GIGABYTES} GB here.")


if __name__ == "__main__":
    try:
        main()
    except LabError as error:
        exit_with(error, "check_env.py")
