"""--precision: BF16 autocast where the device computes BF16 natively, float32 elsewhere, decided from torch's
own capability report; the decision is stated, recorded, agreed between nodes and checked by verify.py."""

import json
import os

import pytest
import torch

from conftest import (
    assert_one_line_error,
    injected,
    module_runs,
    module_start,
    read_json,
    run_in_process,
    run_python,
    subprocess_env,
    verify,
)
from ddp_no_sync_lab import precision
from tools import synthetic_data

CPU = torch.device("cpu")
# oneDNN's and ATen's own switches that make this machine's CPU look and run like an AVX2-only one.
AVX2_ONLY = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}


def test_auto_follows_this_cpus_own_bf16_report(monkeypatch):
    """The probe: on the machine at hand, auto is BF16 exactly where oneDNN reports BF16 instructions."""
    monkeypatch.delenv(precision.CPU_BF16_VARIABLE, raising=False)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    chosen = precision.choose_precision("auto", CPU)
    assert chosen.name == ("bf16" if native else "fp32")
    capability = torch.backends.cpu.get_cpu_capability()
    assert chosen.hardware == f"CPU {capability} {'with' if native else 'without'} BF16 instructions"
    assert chosen.reason.startswith(f"{chosen.hardware}: {chosen.description}")
    assert ("forces emulated BF16" in chosen.reason) == (not native)


def test_a_cpu_limited_to_avx2_takes_float32():
    """oneDNN and ATen limited to AVX2 on this machine: torch reports no BF16, and auto takes float32."""
    result = run_python("check_env.py", env=subprocess_env(**AVX2_ONLY))
    assert result.returncode == 0, result.stderr
    assert "CPU capability:   AVX2" in result.stdout
    assert (
        "precision:        CPU AVX2 without BF16 instructions: float32; --precision bf16 forces emulated BF16, "
        "about 13x slower than float32 on such a device" in result.stdout
    )
    assert "The lab will run on CPU: 2 process(es) here with gloo, float32" in result.stdout


@pytest.mark.parametrize("value, name", [("1", "bf16"), ("0", "fp32")])
def test_the_override_decides_auto_as_on_the_other_kind_of_cpu(monkeypatch, value, name):
    monkeypatch.setenv(precision.CPU_BF16_VARIABLE, value)
    chosen = precision.choose_precision("auto", CPU)
    assert chosen.name == name
    assert f"({precision.CPU_BF16_VARIABLE}={value})" in chosen.reason
    # The recorded hardware stays what torch reports: the override moves the decision only.
    assert chosen.hardware == precision.native_bf16(CPU)[1]


@pytest.mark.parametrize("requested", ["bf16", "fp32"])
def test_an_explicit_precision_is_taken_as_given(monkeypatch, requested):
    monkeypatch.setenv(precision.CPU_BF16_VARIABLE, "0")
    chosen = precision.choose_precision(requested, CPU)
    assert chosen.name == requested
    assert chosen.reason.startswith(f"--precision {requested} on a CPU ")
    assert ("emulated" in chosen.reason) == (requested == "bf16" and not torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_autocast_is_bf16_or_nothing():
    layer = torch.nn.Linear(4, 4)
    inputs = torch.randn(2, 4)
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        with precision.choose_precision(name, CPU).autocast("cpu"):
            assert layer(inputs).dtype == dtype


def test_a_bad_override_is_one_line():
    result = run_python("check_env.py", env=subprocess_env(LAB_CPU_BF16="yes"))
    assert_one_line_error(result, "check_env.py: error: LAB_CPU_BF16='yes': expected 1", "unset it")


def test_train_states_and_records_its_precision(lab_runs):
    artifacts, results = lab_runs
    chosen = precision.choose_precision("auto", CPU)
    for mode, result in results.items():
        assert f"train.py: precision: {chosen.reason}" in result.stderr
        config = read_json(artifacts / mode / "run.json")["config"]
        assert (config["precision"], config["hardware"]) == (chosen.name, [chosen.hardware])
        checkpoint = torch.load(artifacts / mode / "model.pt", weights_only=True)
        assert checkpoint["precision"] == chosen.name


def test_verify_prints_the_precision(lab_runs):
    artifacts, _ = lab_runs
    config = read_json(artifacts / "every" / "run.json")["config"]
    result = verify(artifacts)
    assert result.returncode == 0, result.stderr
    assert f"  precision {config['precision']} on {config['hardware'][0]}" in result.stdout


# every in float32 and no_sync in BF16 on a tiny dataset (BF16 is emulated on CPUs without BF16 instructions, 13x
# slower).
MIXED_PRECISIONS = {"every": "fp32", "no_sync": "bf16"}


def write_tiny_data(folder):
    synthetic_data.write_dataset(folder / "data", "image-folders", 100, 20)


@module_runs("precision", prepare=write_tiny_data)
def mixed_precision_runs(folder, image_data):
    """Each mode in its precision of MIXED_PRECISIONS, on the tiny data, in the session's module start."""
    tiny = ["--batch-size", "10", "--accum-steps", "2", "--epochs", "1", "--device", "cpu", "--quiet"]
    return [
        ["--mode", mode, "--output", folder / "artifacts" / mode, "--data-dir", folder / "data", "--precision", chosen]
        + tiny
        for mode, chosen in MIXED_PRECISIONS.items()
    ]


@pytest.mark.torchrun
def test_verify_refuses_runs_of_different_precision(tmp_path_factory, image_data):
    """Both runs of MIXED_PRECISIONS pass alone, and verify.py refuses the pair, naming the precision."""
    folder, _ = module_start(tmp_path_factory, image_data, "precision")
    for mode, chosen in MIXED_PRECISIONS.items():
        assert read_json(folder / "artifacts" / mode / "run.json")["config"]["precision"] == chosen
    line = assert_one_line_error(
        verify(folder / "artifacts"), "come from different configurations", "precision: 'fp32' vs 'bf16'", code=1
    )
    assert "rerun both modes with the same settings" in line


def test_a_runs_own_override_is_put_back_after_it(monkeypatch):
    """LAB_TEST_CPU_BF16 (a run's own LAB_CPU_BF16 in tests/workers/runs.py) is undone as the run ends: the value
    the process had comes back, set or unset."""
    monkeypatch.setenv("LAB_CPU_BF16", "1")
    with injected(LAB_TEST_CPU_BF16="0"):
        assert os.environ["LAB_CPU_BF16"] == "0"
    assert os.environ["LAB_CPU_BF16"] == "1" and "LAB_CPU_BF16" not in vars(os.environ)
    monkeypatch.delenv("LAB_CPU_BF16")
    with injected(LAB_TEST_CPU_BF16="1"):
        assert os.environ["LAB_CPU_BF16"] == "1"
    assert "LAB_CPU_BF16" not in os.environ


def test_infer_evaluates_in_the_runs_precision(lab_runs, tmp_path):
    artifacts, _ = lab_runs
    checkpoint = artifacts / "no_sync" / "model.pt"
    sample = artifacts / "no_sync" / "sample_test.png"
    recorded = torch.load(checkpoint, weights_only=True)["precision"]
    result = run_in_process("infer.py", "--checkpoint", checkpoint, "--image", sample, "--numerics", "evaluation")
    assert result.returncode == 0, result.stderr
    assert f"infer.py: precision: --precision {recorded} on a CPU" in result.stderr
    assert set(json.loads(result.stdout)["probabilities"]) and not result.stderr.count("\n") > 1
    result = run_in_process("infer.py", "--checkpoint", checkpoint, "--image", sample, "--precision", "fp32")
    assert_one_line_error(result, "--precision applies to --numerics evaluation")
