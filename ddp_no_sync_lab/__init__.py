"""The lab's machinery beneath the document's scripts (train.py, verify.py, infer.py, check_env.py), by concern:
five shared modules, then one folder per concern, each with an __init__ that lists its modules. Listed bottom up:
a module imports only what is listed above it here or in its own folder's list (and model.py, which imports
nothing of the lab); tests/test_architecture.py checks it, docs/architecture.md draws what flows between them.

    cli           errors as one line that names the remedy, argparse with such lines, progress on stderr
    options       train.py's options as one frozen, typed object, completed once, then only read
    experiment    the documented configuration, the window plan, the exact counts a configuration implies
    precision     BF16 autocast or float32, chosen for the hardware
    files         the run folder's files: named, each written all or nothing, published whole, read back
    audit/        what a run did, observed as it happened: the instruments and the checklist's witnesses
    report/       the pictures, and the tables verify.py prints
    tasks/        what a task decides: CIFAR-10, its loaders and results; the text task's rows, transformer, results
    strategies/   the wrappers train_epoch drives and what the audit must know of each: DDP, FSDP2
    run/          a run's life: where it runs and the ranks' agreement, its rows and results, resume
    checks/       verify.py's judgement of a run folder: each checklist item, the strict audit, the run's facts
    watch/        the checklist on a script the lab did not write: its witnesses through the audit's face, its verdict

The audit observes beneath the strategies (they carry its instruments); verify.py's checks judge above them (they
recompute each strategy's counts), so the two sit in separate folders.
"""
