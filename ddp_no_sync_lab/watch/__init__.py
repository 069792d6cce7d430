"""The document's checklist on a training script the lab did not write, unmodified (docs/watch.md):

    torchrun --standalone --nproc-per-node=2 -m ddp_no_sync_lab.watch [--out DIR] my_train.py [ITS ARGS...]

Its modules, bottom up:

    observe    the audit's witnesses put on whatever the script makes (every DDP model, optimizer, cross-entropy,
               DistributedSampler), through the audit's face, and every rank's observations exchanged at its teardown
    report     the verdict as printed: the ten items' findings, what the loop was found to be, the last line
    verdict    the ten items judged from what happened: windows from the steps, syncs from DDP's hook, divisors
               from the losses
    __main__   the launcher: the script run as `python SCRIPT` runs it, its exit status passed through
"""
