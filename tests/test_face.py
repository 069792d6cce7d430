"""The audit's public face (ddp_no_sync_lab/audit/face.py): importable alone, inert until installed, and attached by
hand to a plain DDP loop written outside the lab (tests/workers/plain_loop.py), whose gradient is clipped between
the sync and the step: the witnesses read the synchronized gradient at the sync, so the clip is no alteration, while
a gradient halved by hand, or local gradients clipped inside the window, are refused beside it."""

import ast
import json
import subprocess
import sys

import pytest

from conftest import REPO, WORKERS, assert_ok, subprocess_env, torchrun

IMPORT_ALONE = """
import sys
import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad

originals = dist.all_reduce, clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad_norm_
from ddp_no_sync_lab.audit import face

loaded = sorted(name for name in sys.modules if name == "model" or name.startswith("ddp_no_sync_lab.tasks"))
untouched = (dist.all_reduce, clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad_norm_) == originals
face.install()
installed = (dist.all_reduce, clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad_norm_)
face.install()
again = (dist.all_reduce, clip_grad.clip_grad_norm_, torch.nn.utils.clip_grad_norm_) == installed
changed = [a is not b for a, b in zip(installed, originals)]
print(loaded, untouched, str(changed).replace(" ", ""), again, sorted(face.__all__))
"""


def test_the_face_loads_no_model_or_task_and_wraps_nothing_until_installed():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALONE], capture_output=True, text=True, env=subprocess_env(), cwd=REPO / "tests"
    )
    assert result.returncode == 0, result.stderr
    loaded, untouched, changed, again, public = result.stdout.strip().split(" ", 4)
    assert (loaded, untouched, changed, again) == ("[]", "True", "[True,True,True]", "True")
    assert {"install", "counting", "attach", "Audit"} <= set(ast.literal_eval(public))


@pytest.fixture(scope="module")
def plain_loop():
    result = assert_ok(torchrun(WORKERS.relative_to(REPO) / "plain_loop.py"))
    return json.loads(result.stdout.strip().splitlines()[-1])


def observed_alike(variant):
    """Every rank's observations of the variant, the same on both ranks but for what is altered; 3 windows of 4."""
    ranks = variant["observed"]["ranks"]
    assert len(ranks) == 2 and variant["syncs"] == 3
    for rank in ranks:
        assert rank["fresh_at_backward"] == [[0, 9, 4]] and rank["fresh_at_step"] == []
        assert rank["loss_divisors"] == [[0, 12, 4]] and rank["step_samples"] == [[32, 3]]
        assert rank["averages_checked"] == 3 and rank["first_average_off"] is None
    return [rank["altered_at"] for rank in ranks]


@pytest.mark.torchrun
def test_a_plain_loop_clipped_between_sync_and_step_passes(plain_loop):
    clipped = plain_loop["clipped"]
    assert len(clipped["norms"]) == 3 and min(clipped["norms"]) > 0.05  # each step's gradient really scaled down
    assert observed_alike(clipped) == [[], []]


@pytest.mark.torchrun
def test_a_gradient_rescaled_by_hand_before_the_step_is_refused(plain_loop):
    assert observed_alike(plain_loop["rescaled"]) == [[[3, 12, 4]], [[3, 12, 4]]]  # at each step: 3, 7, 11


@pytest.mark.torchrun
def test_local_gradients_clipped_inside_the_window_are_refused(plain_loop):
    inside = plain_loop["clipped_inside"]
    assert len(inside["norms"]) == 12
    # Each local backward's clip is seen at the next backward's start; the window's synchronized clip passes.
    assert observed_alike(inside) == [[[1, 4, 1], [5, 8, 1], [9, 12, 1]]] * 2
