"""The document's checklist on a training script the lab did not write, unmodified (docs/watch.md):

    torchrun --standalone --nproc-per-node=2 -m ddp_no_sync_lab.watch [--out DIR] my_train.py [ITS ARGS...]

Its modules, bottom up:

    witness    the watcher's witness on one model (the audit's, extended): DDP's sync flag, each loss's items, the
               inputs' fingerprint; a DDP model's counting slot, an FSDP2 root's view, the framework that made it
    observe    the witnesses put on whatever the script makes (every DDP model and FSDP2 root, optimizer,
               cross-entropy, GradScaler, DistributedSampler), through the audit's face, and every rank's
               observations exchanged at its teardown
    report     the verdict as printed: the ten items' findings, what the loop was found to be, the last line
    items      the ten items, each judged on its own from the ranks' loops: its mark, or the refusal that says
               where and what
    verdict    the ranks' loops read from what happened (windows from the steps, syncs from the hook, divisors
               from the losses), the items judged on them, the first refusal named
    __main__   the launcher: the script run as `python SCRIPT` runs it, its exit status passed through
"""
