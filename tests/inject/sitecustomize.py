"""Loaded at start-up by the tests' subprocesses (the tests put this folder on PYTHONPATH); it changes
nothing unless a LAB_TEST_* variable asks for it.

LAB_TEST_CIFAR_MD5 (JSON {file name: md5}): torchvision checks the official CIFAR-10 files' md5 sums, and the
  tests write synthetic files in the official pickle format, so the expected sums are replaced by the
  synthetic files' own. All the rest of torchvision's loading runs as it is; tests/test_data.py shows that
  without this replacement torchvision refuses the synthetic files.
LAB_TEST_CIFAR_URL: where torchvision downloads CIFAR-10 from (the tests use a closed local port).
LAB_TEST_RAISE_AT_STEP ("<rank>:<step>"): that rank raises torch.OutOfMemoryError in its <step>th optimizer
  step, as a rank out of memory would.
LAB_TEST_LOSE_GRADIENTS=1: the optimizer finds no gradients (a pipeline that loses them); it updates nothing.
LAB_TEST_FAKE_GPUS ("<node>:<count>"): on that node (torchrun's GROUP_RANK) torch reports <count> visible GPUs,
  as on a node that has them; only the device policy's question is answered, no CUDA call would work.
LAB_TEST_SYNC_DEBUG=1 (gpu_check.sh): torch.cuda.set_sync_debug_mode while DDP is in training mode, that is
  in train.py's training loop: "warn" in the first epoch (where DDP rebuilds its buckets once), "error" from
  the second on, so that a host synchronization in the loop stops the run; off during evaluation.
"""
import json
import os

if os.environ.get("LAB_TEST_CIFAR_MD5") or os.environ.get("LAB_TEST_CIFAR_URL"):
    from torchvision.datasets import CIFAR10

    if os.environ.get("LAB_TEST_CIFAR_MD5"):
        sums = json.loads(os.environ["LAB_TEST_CIFAR_MD5"])
        CIFAR10.train_list = [[name, sums[name]] for name, _ in CIFAR10.train_list]
        CIFAR10.test_list = [[name, sums[name]] for name, _ in CIFAR10.test_list]
        CIFAR10.meta = {**CIFAR10.meta, "md5": sums[CIFAR10.meta["filename"]]}
    if os.environ.get("LAB_TEST_CIFAR_URL"):
        CIFAR10.url = os.environ["LAB_TEST_CIFAR_URL"]

if os.environ.get("LAB_TEST_RAISE_AT_STEP"):
    import torch

    failing_rank, failing_step = map(int, os.environ["LAB_TEST_RAISE_AT_STEP"].split(":"))
    original_step = torch.optim.AdamW.step
    steps_taken = 0

    def step_that_runs_out_of_memory(self, *args, **kwargs):
        global steps_taken
        steps_taken += 1
        if int(os.environ.get("RANK", -1)) == failing_rank and steps_taken == failing_step:
            raise torch.OutOfMemoryError("injected by the test: out of memory in optimizer.step()")
        return original_step(self, *args, **kwargs)

    torch.optim.AdamW.step = step_that_runs_out_of_memory

if os.environ.get("LAB_TEST_LOSE_GRADIENTS"):
    import torch

    original_adamw_step = torch.optim.AdamW.step

    def step_without_gradients(self, *args, **kwargs):
        for group in self.param_groups:
            for parameter in group["params"]:
                parameter.grad = None
        return original_adamw_step(self, *args, **kwargs)

    torch.optim.AdamW.step = step_without_gradients

if os.environ.get("LAB_TEST_FAKE_GPUS"):
    fake_node, fake_count = map(int, os.environ["LAB_TEST_FAKE_GPUS"].split(":"))
    if int(os.environ.get("GROUP_RANK", -1)) == fake_node:
        import torch

        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: fake_count

if os.environ.get("LAB_TEST_SYNC_DEBUG"):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    original_train = DistributedDataParallel.train
    training_epochs = 0

    def train_with_sync_debug(self, mode=True):
        global training_epochs
        training_epochs += mode
        torch.cuda.set_sync_debug_mode(0 if not mode else "warn" if training_epochs == 1 else "error")
        return original_train(self, mode)

    DistributedDataParallel.train = train_with_sync_debug
