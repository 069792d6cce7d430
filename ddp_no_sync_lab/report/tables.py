"""What verify.py prints and draws once every check has held: the document's table, the communication and
memory tables, the profiler's witness beside the audit, and the pictures (curves, communication, timeline)
next to the run folders (or in the folder verify.py --pictures names).
"""

import json

from ddp_no_sync_lab.audit.scale import token_weights
from ddp_no_sync_lab.experiment import from_runs
from ddp_no_sync_lab.files import png_bytes, write_atomic
from ddp_no_sync_lab.report import pictures

# Pictures verify.py draws from both runs, next to the run folders.
CURVES_FILE = "curves.png"
COMMUNICATION_FILE = "communication.png"
TIMELINE_FILE = "timeline.png"


def per_epoch(history, key):
    """The value if every epoch has the same one, else the values joined by '/'."""
    values = [row[key] for row in history]
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def total(history, key):
    return sum(row[key] for row in history)


def ratio(numerator, denominator):
    return f"{numerator / denominator:.2f}x" if denominator else "n/a"


def print_tables(runs, config):
    every_history, every_report, _ = runs["every"]
    no_sync_history, no_sync_report, _ = runs["no_sync"]
    print("| mod | pași optimizer/epocă | sincronizări/epocă | test accuracy |")
    print("|---|---:|---:|---:|")
    for mode, (history, report, _) in runs.items():
        print(
            f"| {mode} | {per_epoch(history, 'optimizer_steps')} | {per_epoch(history, 'gradient_syncs')} | "
            f"{report['model_test_accuracy']:.4f} |"
        )
    print()
    epochs = len(every_history)
    print(
        f"Communication per rank, totals over {epochs} epochs (comm s and train s, the epochs' training: means over "
        "ranks; the rate: all ranks together):"
    )
    print(
        "| mode | gradient syncs | hook calls | all-reduce MB | buffer-broadcast collectives | broadcast KB "
        f"| bucket-rebuild collectives | comm s | train s | {'tokens' if config.get('task') == 'text' else 'images'}/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, (history, _, _) in runs.items():
        print(
            f"| {mode} | {total(history, 'gradient_syncs')} | {total(history, 'sync_bucket_calls')} | "
            f"{total(history, 'allreduce_bytes') / 1e6:.1f} | {total(history, 'buffer_broadcast_collectives')} | "
            f"{total(history, 'broadcast_bytes') / 1e3:.1f} | {total(history, 'rebuild_broadcast_collectives')} | "
            f"{total(history, 'comm_seconds'):.2f} | "
            f"{total(history, 'epoch_seconds'):.1f} | "
            f"{sum(r['train_images_per_second'] for r in history) / epochs:.0f} |"
        )
    print(
        "| every / no_sync | "
        + " | ".join(
            ratio(total(every_history, key), total(no_sync_history, key))
            for key in (
                "gradient_syncs",
                "sync_bucket_calls",
                "allreduce_bytes",
                "buffer_broadcast_collectives",
                "broadcast_bytes",
                "rebuild_broadcast_collectives",
                "comm_seconds",
                "epoch_seconds",
            )
        )
        + " | |"
    )
    print()
    if config.get("strategy") == "fsdp":
        print_fsdp_table(runs, epochs)
    checkpointing = "on" if config.get("activation_checkpointing") else "off"
    print("Memory per micro-batch (rank 0; activations held from the forward for the backward, saved_tensors_hooks):")
    print(
        "| mode | activation checkpointing | saved activations MB | gradients held MB | parameters held MB "
        "| peak allocated MB (CUDA, per epoch) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for mode, (history, _, _) in runs.items():
        peaks = [row["peak_allocated_bytes"] for row in history]
        peak = "/".join(f"{value / 1e6:.1f}" for value in peaks) if peaks[0] is not None else "n/a (CPU)"
        held = history[0]["held_bytes"]
        print(
            f"| {mode} | {checkpointing} | {history[0]['saved_activation_bytes'] / 1e6:.2f} | "
            f"{held['gradients'] / 1e6:.2f} | {held['parameters'] / 1e6:.2f} | {peak} |"
        )
    print()
    if config.get("task") == "text":
        print_text_tables(runs, config)
    elif config.get("task") is None:  # the document's task (a task of your own prints nothing of its own here)
        print("baseline:", no_sync_report["baseline_class"], f"{no_sync_report['baseline_accuracy']:.4f}")
        print("top confusions (no_sync, test set):")
        print("| true | predicted | count |")
        print("|---|---|---:|")
        for confusion in no_sync_report["top_confusions"]:
            print(f"| {confusion['true']} | {confusion['predicted']} | {confusion['count']} |")


def print_fsdp_table(runs, epochs):
    """FSDP's collectives (strategies/fsdp.py): the all-gathers both modes share, the reduce-scatters no_sync saves."""
    print(f"FSDP's collectives per rank, totals over {epochs} epochs (training and validation):")
    print("| mode | all-gathers | all-gathered MB | reduce-scatters | reduce-scattered MB |")
    print("|---|---:|---:|---:|---:|")
    keys = ("all_gathers", "all_gather_bytes", "reduce_scatters", "reduce_scatter_bytes")
    for mode, (history, _, _) in runs.items():
        values = [total(history, key) for key in keys]
        print(f"| {mode} | {values[0]} | {values[1] / 1e6:.1f} | {values[2]} | {values[3] / 1e6:.1f} |")
    every, no_sync = runs["every"][0], runs["no_sync"][0]
    print("| every / no_sync | " + " | ".join(ratio(total(every, key), total(no_sync, key)) for key in keys) + " |")
    print()


def print_text_tables(runs, config):
    """The text task: tokens per micro-batch and window, how the tokens weighed, the collectives by kind, the
    test in loss per token, perplexity and bits per byte, and the greedy continuation."""
    print(f"Target tokens ({config['loss_normalization']} normalization; min-max over the epochs and ranks):")
    print("| mode | per micro-batch | per window, all ranks | token weight vs its share (read at each loss) |")
    print("|---|---:|---:|---:|")
    for mode, (history, _, _) in runs.items():
        ranks = [rank for row in history for rank in row["checklist"]["ranks"]]
        micro = [value for rank in ranks for value in from_runs(rank["micro_batch_tokens"])]
        window = [value for rank in ranks for value in from_runs(rank["step_tokens"])]
        weights = [weight for row in history for weight in token_weights(row, config)]
        print(
            f"| {mode} | {min(micro)}-{max(micro)} | {min(window)}-{max(window)} | "
            f"{min(weights):.4f}x-{max(weights):.4f}x |"
        )
    print()
    print(
        "Collectives per rank by kind, totals (the audit's counts; no collective counts the window's tokens: every "
        "rank takes them from the packing):"
    )
    print(
        "| mode | gradient all-reduces (hook calls) | rank-agreement all-reduces | average-witness all-reduces "
        "| broadcasts |"
    )
    print("|---|---:|---:|---:|---:|")
    for mode, (history, _, _) in runs.items():
        broadcasts = total(history, "buffer_broadcast_collectives") + total(history, "rebuild_broadcast_collectives")
        print(
            f"| {mode} | {total(history, 'sync_bucket_calls')} | {total(history, 'steps_with_ranks_agreed')} | "
            f"{total(history, 'witness_allreduces')} | {broadcasts} |"
        )
    print()
    print("| mode | test loss per token | perplexity | bits per byte | next-byte accuracy | unigram baseline loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, (_, report, _) in runs.items():
        print(
            f"| {mode} | {report['model_test_loss']:.4f} | {report['model_test_perplexity']:.2f} | "
            f"{report['model_test_bits_per_byte']:.3f} | {report['model_test_accuracy']:.4f} | "
            f"{report['baseline_loss']:.4f} |"
        )
    for mode, (_, report, _) in runs.items():
        continuation = report["continuation"]
        print(f"{mode}: {continuation['prompt']!r} -> {continuation['greedy']!r}")


def print_witness(runs):
    profiled = {mode: profile for mode, (_, _, profile) in runs.items() if profile}
    if not profiled:
        return
    print()
    print("The profiler as witness, epoch 1's recorded micro-batches, per rank (seconds: the profiler's executions")
    print(
        "of the gradient all-reduces, broadcasts and reduce-scatters, the audit's comm_seconds for the same micro-batches):"
    )
    print(
        "| mode | micro-batches | rank | c10d::allreduce_ (profiler) | hook calls + 2 x steps (audit) | c10d::broadcast_ "
        "(profiler) | broadcast collectives (audit) | FSDP's all-gathers, reduce-scatters (profiler) | (audit) "
        "| collective s (profiler) | comm s (audit) | compute s per micro-batch |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, profile in profiled.items():
        first, stop = profile["micro_batches"]
        steps = profile["windows"]
        for summary in profile["ranks"]:
            audit, calls, seconds = summary["audit"], summary["calls"], summary["collective_seconds"]
            print(
                f"| {mode} | {first}-{stop - 1} | {summary['rank']} | {calls['c10d::allreduce_']} | "
                f"{audit['sync_bucket_calls']} + 2 x {steps} | {calls['c10d::broadcast_']} | "
                f"{audit['buffer_broadcast_collectives'] + audit['rebuild_broadcast_collectives']} | "
                f"{calls['c10d::_allgather_base_']}, {calls['c10d::_reduce_scatter_base_']} | "
                f"{audit['all_gathers']}, {audit['reduce_scatters']} | "
                f"{seconds['gradient all-reduce'] + seconds['broadcast'] + seconds['reduce-scatter']:.4f} | "
                f"{audit['comm_seconds']:.4f} | "
                f"{summary['compute_seconds_per_micro_batch']:.4f} |"
            )


def first_window(profile, accum_steps):
    """The first recorded window of each rank: its micro-batches and the collectives that start in it."""
    first = profile["micro_batches"][0]
    lanes = []
    for summary in profile["ranks"]:
        spans = [span for span in summary["micro_batches"] if first <= span[0] < first + accum_steps]
        window_end = max(stop for _, _, stop in spans)
        collectives = [collective for collective in summary["collectives"] if collective[1] <= window_end]
        lanes.append({"label": f"rank {summary['rank']}", "micro_batches": spans, "collectives": collectives})
    return lanes


def draw_timeline(folder, runs, records, text):
    path = folder / TIMELINE_FILE
    unprofiled = [mode for mode, (_, _, profile) in runs.items() if profile is None]
    if unprofiled:
        if len(unprofiled) < len(runs):
            print(
                f"note: {TIMELINE_FILE} needs both runs profiled (train.py --profile-windows K); {', '.join(unprofiled)} was not"
            )
        path.unlink(missing_ok=True)  # a timeline of earlier runs would not show these
        return None
    accum_steps = records["every"]["config"]["accum_steps"]
    panels = []
    for mode, (_, _, profile) in runs.items():
        first = profile["micro_batches"][0]
        title = (
            f"{mode}: window {first // accum_steps + 1} of epoch 1 (micro-batches {first}-{first + accum_steps - 1})"
        )
        panels.append({"title": title, "lanes": first_window(profile, accum_steps)})
    caption = (
        f"The PyTorch profiler's record (train.py --profile-windows): one accumulation window of {accum_steps} "
        f"micro-batches per mode; collectives as executed ({records['every']['config']['backend']})."
    )
    image, data = pictures.timeline_image("One accumulation window: every vs no_sync", panels, caption)
    write_atomic(path, png_bytes(image, {**text, "data": json.dumps(data)}))
    return path


def draw_pictures(folder, runs, records):
    text = {"run_ids": json.dumps({mode: record["run_id"] for mode, record in records.items()})}
    curves = []
    for metric, label in (("loss", "cross-entropy loss"), ("accuracy", "accuracy")):
        series = [
            {
                "label": f"{mode} {split}",
                "mode": mode,
                "dashed": split == "validation",
                "values": [row[f"{split}_{metric}"] for row in history],
            }
            for mode, (history, _, _) in runs.items()
            for split in ("train", "validation")
        ]
        curves.append({"title": f"{metric} per epoch", "y_label": label, "series": series})
    image, data = pictures.line_panels("Training curves: every vs no_sync (validation dashed)", curves)
    write_atomic(folder / CURVES_FILE, png_bytes(image, {**text, "data": json.dumps(data)}))

    panels = [
        ("gradient_syncs", "gradient syncs per epoch", "syncs", 1),
        ("allreduce_bytes", "all-reduced gradients per epoch", "MB per rank", 1e6),
        ("buffer_broadcast_collectives", "buffer-broadcast collectives per epoch", "collectives", 1),
        ("comm_seconds", "time in collectives per epoch", "seconds (mean over ranks)", 1),
    ]
    bars = [
        {
            "title": title,
            "y_label": unit,
            "bars": {mode: [row[key] / scale for row in history] for mode, (history, _, _) in runs.items()},
        }
        for key, title, unit, scale in panels
    ]
    image, data = pictures.bar_panels("Communication: every vs no_sync", bars)
    write_atomic(folder / COMMUNICATION_FILE, png_bytes(image, {**text, "data": json.dumps(data)}))
    return draw_timeline(folder, runs, records, text)
