"""The text task (train.py --task text; docs/packed.md): packed rows of Python's own documentation, per-token loss
normalization, and the audit that reads the tokens a run's loss took.

The runs train on the real corpus cut to its documents' first 300 characters (tests/inject/sitecustomize.py's
LAB_TEST_TEXT_CHARACTERS; verify.py runs under it too, so that it packs the same corpus): 236 rows, 194 of them
train, 13 micro-batches of 8 rows per rank and epoch (the last of 1 row), 4 windows (the last of 1). The proof (tests/workers/text_equivalence.py)
uses real packed rows of the whole corpus.
"""

import dataclasses
import math
import shutil

import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

import train
from conftest import (
    REFUSED,
    assert_ok,
    assert_refused,
    injected,
    module_runs,
    module_start,
    read_json,
    run_in_process,
    subprocess_env,
    torchrun,
)
from ddp_no_sync_lab import experiment, files
from ddp_no_sync_lab.checks import certify
from ddp_no_sync_lab.cli import LabError
from ddp_no_sync_lab.options import TrainOptions
from ddp_no_sync_lab.tasks import packed

CHARACTERS = 300
TEXT_ENV = subprocess_env(LAB_TEST_TEXT_CHARACTERS=str(CHARACTERS))
TEXT_CORPUS = f"LAB_TEST_TEXT_CHARACTERS={CHARACTERS}"  # the same cut, as one run's own injection
FLOAT64_TOLERANCE = 1e-12  # relative L2 difference of gradients and parameters at every step
# BF16 autocast, first update (gradients, parameters): the two sides' BF16 products are the same bits only where
# oneDNN takes the same kernels for both (the EPYC: measured 5e-8); emulated BF16, and the Xeon's AMX, round some of
# them differently (measured 8.3e-5 and 7.9e-5 for the gradients, 4.9e-4 and 4.6e-4 for the parameters). So on
# every CPU the gradients within 1e-3 (a rank normalized by its own tokens is off by 2.8e-3) and the parameters
# within one BF16 rounding, 2^-8; float64 is the exact proof on every kind.
BFLOAT16_FIRST_STEP_TOLERANCES = (1e-3, 2**-8)


TEXT_RUN = ["--task", "text", "--device", "cpu", "--quiet"]
BROKEN_LOSSES = ("padding_in_mean", "one_token_too_many", "first_target_dropped")
# Pythons whose corpus train.py refuses at start-up (REFUSED runs of text_module_runs): none, or another
# on rank 1 (one document more).
TEXT_REFUSALS = {
    "no corpus": ["LAB_TEST_TEXT_NO_CORPUS=1"],
    "other corpus": [TEXT_CORPUS, "LAB_TEST_TEXT_OTHER_CORPUS_ON_RANK=1"],
}


def text_train(output, mode, *extra, env=TEXT_ENV, launcher=()):
    return torchrun("train.py", *TEXT_RUN, "--mode", mode, "--output", output, *extra, env=env, launcher=launcher)


def text_verify(artifacts, *extra):
    """verify.py in this process, on text runs: the corpus cut as the runs saw it."""
    with injected(LAB_TEST_TEXT_CHARACTERS=str(CHARACTERS)):
        return run_in_process("verify.py", "--artifacts", artifacts, *extra)


def small_corpus():
    """The corpus the runs see: each document's first CHARACTERS characters, packed by the lab."""
    source = packed.load_corpus()
    source.documents = [document.decode()[:CHARACTERS].encode() for document in source.documents]
    return source


@module_runs("text")
def text_module_runs(folder, image_data):
    """Every text run the module reads, in the session's module start, each with the corpus cut (TEXT_CORPUS): in
    documented/, both modes at the text task's documented configuration, per-token normalized, and the same pair
    at micro-batch normalization; in one-epoch/, a clean `every` run of one epoch, and (in broken/) the no_sync
    runs whose loss is broken beneath the loop (tests/inject); then the runs TEXT_REFUSALS refuses at start-up."""
    runs = [
        [TEXT_CORPUS, *TEXT_RUN, "--mode", mode, "--output", folder / "documented" / normalization / mode]
        + ["--loss-normalization", normalization]
        for normalization in experiment.LOSS_NORMALIZATIONS
        for mode in experiment.MODES
    ]
    one_epoch = folder / "one-epoch" / "artifacts"
    runs += [[TEXT_CORPUS, *TEXT_RUN, "--mode", "every", "--output", one_epoch / "every", "--epochs", "1"]]
    runs += [
        [TEXT_CORPUS, f"LAB_TEST_TEXT_LOSS={broken}", *TEXT_RUN, "--mode", "no_sync", "--epochs", "1"]
        + ["--output", one_epoch.parent / "broken" / broken / "no_sync"]
        for broken in BROKEN_LOSSES
    ]
    return runs + [
        [REFUSED, *injections, *TEXT_RUN, "--mode", "every", "--output", folder / "refused" / name]
        for name, injections in TEXT_REFUSALS.items()
    ]


@pytest.fixture(scope="module")
def text_runs(tmp_path_factory, image_data):
    """The documented runs' folder, the one-epoch run's, and each refusal's stderr by name."""
    folder, outputs = module_start(tmp_path_factory, image_data, "text")
    refused = {name: output.stderr for name, output in zip(TEXT_REFUSALS, outputs[-len(TEXT_REFUSALS) :])}
    return folder / "documented", folder / "one-epoch" / "artifacts", refused


@pytest.fixture(scope="module")
def documented(text_runs):
    return text_runs[0]


@pytest.fixture(scope="module")
def one_epoch(text_runs):
    """A clean `every` run of one epoch, with the broken no_sync runs in ../broken."""
    return text_runs[1]


def test_packing_keeps_every_document_whole_and_masks_boundaries_and_padding():
    documents = [b"abc", b"x" * 10, b"hello world"]
    rows = packed.pack(documents, row_length=8)
    inputs, targets = rows.inputs.tolist(), rows.targets.tolist()
    # "abc" + separator (4 tokens) fits a row of 9; "xxxxxxxxxx" + separator (11) fills rows of its own, each
    # starting on the last token of the one before; "hello world" + separator (12) the same.
    stream = [token for row in packed.pack([b"".join(documents)], row_length=1000).inputs.tolist() for token in row]
    assert stream[:24] == list(b"abcxxxxxxxxxxhello world")
    assert inputs[0] == [*b"abc", 0, 0, 0, 0, 0]  # padded after its separator
    assert targets[0] == [*b"bc", 0, -100, -100, -100, -100, -100]  # the end of the document is a target
    assert inputs[1] == list(b"xxxxxxxx") and targets[1] == list(b"xxxxxxx") + [ord("x")]
    assert inputs[2] == [ord("x"), ord("x"), 0, 0, 0, 0, 0, 0] and targets[2] == [ord("x"), 0, *[-100] * 6]
    assert inputs[3] == list(b"hello wo") and targets[3] == list(b"ello wor")
    assert inputs[4] == [*b"rld", 0, 0, 0, 0, 0] and targets[4] == [*b"ld", 0, *[-100] * 5]
    assert rows.tokens.tolist() == [3, 8, 2, 8, 3]
    # Attention stays within each document: a separator ends its document.
    mask = packed_mask([*b"ab", 0, *b"cd"])
    assert mask.tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ]


def packed_mask(tokens):
    from ddp_no_sync_lab.tasks.language import same_document

    return same_document(torch.tensor([tokens]))[0, 0].int()


def test_the_split_is_by_document_and_seeded():
    source = small_corpus()
    train, validation, test = packed.split_documents(len(source.documents), seed=47)
    assert sorted(train + validation + test) == list(range(79)) and len(validation) == len(test) == 7
    assert packed.split_documents(79, seed=47) == (train, validation, test)
    assert packed.split_documents(79, seed=48) != (train, validation, test)


@pytest.mark.torchrun
def test_every_and_no_sync_equal_one_process_over_the_windows_tokens(worker_results):
    """float64: every step within 1e-12 of the one-process reference (measured about 5e-15); micro-batch
    normalization and a per-rank token normalization are off by far more; BF16 autocast: the first update."""
    results = worker_results["text_equivalence.py"]
    assert min(results["row_tokens"]) < 10 and max(results["row_tokens"]) == packed.ROW_LENGTH
    exact = results["float64"]
    for mode, syncs in (("every", 5), ("no_sync", 2)):
        variant = exact[mode]
        assert variant["steps"] == variant["reference_steps"] == 2 and variant["ranks_agree"]
        assert variant["gradient_syncs"] == syncs
        assert max(variant["grad_relative"] + variant["param_relative"]) < FLOAT64_TOLERANCE
    for broken in ("micro_batch_normalization", "broken_per_rank_tokens"):
        assert exact[broken]["grad_relative"][0] > 1e-3, broken
    for mode in experiment.MODES:
        first = results["bfloat16_autocast"][mode]
        grad_bound, param_bound = BFLOAT16_FIRST_STEP_TOLERANCES
        assert first["grad_relative"][0] < grad_bound and first["param_relative"][0] < param_bound, first


def expected_window_tokens(config, epoch):
    """Each window's target tokens over both ranks, from torch's DistributedSampler over the packed rows."""
    row_tokens = packed.make_split(small_corpus(), config["seed"], 0, 2).parts["train"].tokens
    orders = []
    for rank in range(2):
        sampler = DistributedSampler(range(len(row_tokens)), 2, rank, shuffle=True, seed=config["seed"])
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    window_rows = config["batch_size"] * config["accum_steps"]
    per_rank = len(orders[0])
    return [
        sum(int(row_tokens[i]) for order in orders for i in order[start : start + window_rows])
        for start in range(0, per_rank, window_rows)
    ]


@pytest.mark.torchrun
def test_the_documented_text_pair_passes_the_strict_audit_with_exact_counts(documented):
    checked = assert_ok(text_verify(documented / "tokens"))
    assert "AUDIT PASSED: no_sync reduced gradient synchronizations by 3.25x" in checked.stdout
    assert "| every | 104 | 32 | 32 | 2 |" in checked.stdout  # collectives by kind, per rank over 8 epochs
    assert "| no_sync | 32 | 32 | 32 | 2 |" in checked.stdout
    # Each token weighed exactly its share: the divisor read at each loss is the window's tokens.
    assert "| every | 44-1024 | 172-6804 | 1.0000x-1.0000x |" in checked.stdout
    config = read_json(documented / "tokens" / "every" / files.RUN_RECORD_FILE)["config"]
    assert (config["task"], config["loss_normalization"], config["train_size"]) == ("text", "tokens", 194)
    for mode, syncs in (("every", 13), ("no_sync", 4)):
        history = read_json(documented / "tokens" / mode / files.HISTORY_FILE)
        assert len(history) == 8
        for epoch, row in enumerate(history):
            assert (row["gradient_syncs"], row["optimizer_steps"]) == (syncs, 4)
            window_tokens = expected_window_tokens(config, epoch)
            for rank in row["checklist"]["ranks"]:
                assert [v for v, n in rank["step_tokens"] for _ in range(n)] == window_tokens
                assert sum(v * n for v, n in rank["micro_batch_tokens"]) < sum(window_tokens)
        report = read_json(documented / "tokens" / mode / files.REPORT_FILE)
        assert report["model_test_perplexity"] == math.exp(report["model_test_loss"])
        assert report["model_test_loss"] < report["baseline_loss"] and report["continuation"]["greedy"]


@pytest.mark.torchrun
def test_strict_verify_refuses_micro_batch_normalization_naming_the_measured_bias(documented):
    refused = text_verify(documented / "micro-batch")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert "loss_normalization='micro-batch': the runs' tokens weighed " in line and "--expect-from-config" in line
    low, high = (
        float(value.rstrip("x")) for value in line.split(" weighed ")[1].split(" their share")[0].split(" to ")
    )
    assert low < 0.95 and high > 1.5  # a window's short rows: their tokens weigh far more than their share
    checked = assert_ok(text_verify(documented / "micro-batch", "--expect-from-config"))
    assert "AUDIT PASSED" in checked.stdout


@pytest.mark.torchrun
@pytest.mark.parametrize(
    "broken, item, seen",
    [
        ("padding_in_mean", 4, "target tokens over all ranks (tokens normalization expects"),
        ("one_token_too_many", 4, "target tokens over all ranks (tokens normalization expects"),
        ("first_target_dropped", 3, "target tokens over all ranks went into it, the packing gives"),
    ],
)
def test_a_loss_broken_beneath_the_loop_is_refused(one_epoch, tmp_path, broken, item, seen):
    artifacts = tmp_path / "artifacts"
    shutil.copytree(one_epoch, artifacts)
    shutil.copytree(one_epoch.parent / "broken" / broken / "no_sync", artifacts / "no_sync")
    refused = text_verify(artifacts, "--expect-from-config")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert seen in refused.stderr and f"[checklist item {item}:" in refused.stderr, refused.stderr


@pytest.mark.torchrun
def test_a_resumed_text_run_is_the_uninterrupted_one_bit_for_bit(one_epoch, tmp_path):
    output = tmp_path / "every"
    env = subprocess_env(LAB_TEST_TEXT_CHARACTERS=str(CHARACTERS), LAB_TEST_KILL_AT="saved:1")
    result = text_train(
        output, "every", "--epochs", "1", "--checkpoint-every-windows", "2", env=env, launcher=["--max-restarts=1"]
    )
    assert_ok(result)
    assert "train.py: resuming" in result.stderr and "epoch 1, micro-batch 8, from its saved state" in result.stderr
    resumed = torch.load(output / files.MODEL_FILE, weights_only=True)["model"]
    uninterrupted = torch.load(one_epoch / "every" / files.MODEL_FILE, weights_only=True)["model"]
    assert all(torch.equal(resumed[name], uninterrupted[name]) for name in uninterrupted)


def test_each_tasks_options_and_defaults(tmp_path):
    """train.py's parser (under torchrun every rank raises the same line; tests/test_e2e.py shows one printed)."""
    with pytest.raises(LabError, match="--loader: the text task has one loader"):
        train.parse_args(["--task", "text", "--mode", "every", "--output", str(tmp_path), "--loader", "pil"])
    args = train.parse_args(["--task", "text", "--mode", "every", "--output", str(tmp_path)])
    documented = {key: getattr(args, key) for key in ("epochs", "batch_size", "partial_window", "loss_normalization")}
    assert documented == {key: experiment.TEXT_DOCUMENTED[key] for key in documented}
    args = train.parse_args(["--mode", "every", "--output", str(tmp_path)])
    assert (args.epochs, args.batch_size, args.partial_window, args.loss_normalization) == (5, 50, "error", "tokens")
    # One frozen, typed object, its fields the parser's own, read by every module beneath train.py, never changed.
    assert type(args) is TrainOptions and args.output == tmp_path and args.profile_windows is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.epochs = 1


@pytest.mark.torchrun
def test_a_python_without_the_corpus_or_with_another_is_refused(text_runs):
    refused = text_runs[2]
    assert_refused(refused["no corpus"], "the text task reads pydoc_data.topics, which this Python does not have")
    line = assert_refused(refused["other corpus"], "[rank 1, node 0] its data in Python's pydoc_data.topics differ")
    assert "documents 80 vs 79" in line


@pytest.mark.parametrize(
    "broken, refusal",
    [
        ("misaligned", "the train rows' targets are not their next inputs"),
        ("last_target_lost", "the train rows' targets are not its documents' bytes"),
    ],
)
def test_verify_holds_the_packing_to_what_packing_must_keep(monkeypatch, broken, refusal):
    """verify.py packs the run's corpus again and checks it without ddp_no_sync_lab/tasks/packed.py's logic: a packing
    that shifts its targets, or loses a row's last target (a long document's rows not overlapping), is refused."""
    source = packed.load_corpus()
    sizes = packed.make_split(source, 47, 0, 2).sizes
    config = {
        "data_fingerprint": source.fingerprint,
        "torch": torch.__version__,
        "seed": 47,
        "world_size": 2,
        **{f"{name}_size": size for name, size in sizes.items()},
    }
    certify.recomputed_packing.cache_clear()
    assert certify.check_text_data("run.json", config, strict=True) is not None
    pack = packed.pack

    def broken_pack(documents, row_length=packed.ROW_LENGTH):
        rows = pack(documents, row_length)
        if broken == "misaligned":
            rows.targets = rows.targets.roll(1, dims=1)
        else:
            rows.targets[:, -1] = experiment.IGNORE_INDEX
        return rows

    monkeypatch.setattr(packed, "pack", broken_pack)
    certify.recomputed_packing.cache_clear()
    with pytest.raises(files.AuditError, match=refusal):
        certify.check_text_data("run.json", config, strict=True)
    certify.recomputed_packing.cache_clear()
