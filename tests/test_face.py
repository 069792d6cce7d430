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

MAX_NORM = 0.05  # tests/workers/plain_loop.py's

IMPORT_ALONE = """
import sys
import torch
import torch.distributed as dist
from torch.nn.utils import clip_grad
from torch.utils.data.distributed import DistributedSampler


def wrapped():
    return dist.all_reduce, clip_grad._clip_grads_with_norm_, torch.nn.utils.clip_grads_with_norm_, DistributedSampler.__iter__


originals = wrapped()
from ddp_no_sync_lab.audit import face

loaded = sorted(name for name in sys.modules if name == "model" or name.startswith("ddp_no_sync_lab.tasks"))
untouched = wrapped() == originals
face.install()
installed = wrapped()
face.install()
again = wrapped() == installed
changed = [a is not b for a, b in zip(installed, originals)]
print(loaded, untouched, str(changed).replace(" ", ""), again, sorted(face.__all__))
"""


def test_the_face_loads_no_model_or_task_and_wraps_nothing_until_installed():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_ALONE], capture_output=True, text=True, env=subprocess_env(), cwd=REPO / "tests"
    )
    assert result.returncode == 0, result.stderr
    loaded, untouched, changed, again, public = result.stdout.strip().split(" ", 4)
    assert (loaded, untouched, changed, again) == ("[]", "True", "[True,True,True,True]", "True")
    assert {"install", "counting", "attach", "Audit"} <= set(ast.literal_eval(public))


@pytest.fixture(scope="module")
def plain_loop():
    result = assert_ok(torchrun(WORKERS.relative_to(REPO) / "plain_loop.py"))
    return json.loads(result.stdout.strip().splitlines()[-1])


def observed_alike(variant, syncs=3):
    """Every rank's observations of the variant (3 windows of 4), the same on both ranks but for what is altered
    and which steps took a clipped gradient."""
    ranks = variant["observed"]["ranks"]
    assert len(ranks) == 2 and variant["syncs"] == syncs
    for rank in ranks:
        assert (rank["micro_batches"], rank["samples"], rank["loss_short_of_samples"]) == (12, 48, [])
        assert rank["fresh_at_backward"] == [[0, 9, 4]] and rank["fresh_at_step"] == []
        assert rank["loss_divisors"] == [[0, 12, 4]] and rank["step_samples"] == [[32, 3]]
        assert rank["averages_checked"] == 3 and rank["first_average_off"] is None
    return [rank["altered_at"] for rank in ranks], [rank.get("clip_factors") for rank in ranks]


def clip_factors(norms):
    """torch's factor for each norm the clip found (all above MAX_NORM: each step's gradient really scaled)."""
    assert len(norms) == 3 and min(norms) > MAX_NORM
    return [pytest.approx(MAX_NORM / (norm + 1e-6), rel=1e-6) for norm in norms]


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "variant, syncs",
    [
        ("clipped", 3),
        ("static_graph", 12),
        ("bucket_view", 3),
        ("unused_parameter", 3),
        ("split_api", 3),
        ("keywords", 3),
    ],
)
def test_a_plain_loop_clipped_between_sync_and_step_passes(plain_loop, variant, syncs):
    run = plain_loop[variant]
    assert observed_alike(run, syncs) == ([[], []], [clip_factors(run["norms"])] * 2)


@pytest.mark.torchrun
def test_a_forward_over_more_samples_than_its_loss_is_seen_through_keywords(plain_loop):
    """The forward's batch read from its keyword argument: twice the loss's samples at every micro-batch (item 3)."""
    for rank in plain_loop["keywords_over_more"]["observed"]["ranks"]:
        assert (rank["micro_batches"], rank["samples"], rank["step_samples"]) == (12, 96, [[32, 3]])
        assert rank["loss_short_of_samples"] == list(range(12))


@pytest.mark.torchrun
def test_a_gradient_rescaled_by_hand_before_the_step_is_refused(plain_loop):
    # At each step: micro-batches 3, 7, 11 (a progression); no clip taken.
    assert observed_alike(plain_loop["rescaled"]) == ([[[3, 12, 4]]] * 2, [None, None])


@pytest.mark.torchrun
@pytest.mark.parametrize("variant, syncs", [("clipped_inside", 3), ("every_clipped_each", 12)])
def test_gradients_clipped_before_the_windows_last_backward_are_refused(plain_loop, variant, syncs):
    """Each clip before the window's last backward (local gradients, or a part of the window's synchronized) is
    seen at the next backward's start; the clip after the window's last backward is the step's, and taken."""
    run = plain_loop[variant]
    altered, factors = observed_alike(run, syncs)
    assert altered == [[[1, 4, 1], [5, 8, 1], [9, 12, 1]]] * 2
    assert factors == [clip_factors(run["norms"][3::4])] * 2
