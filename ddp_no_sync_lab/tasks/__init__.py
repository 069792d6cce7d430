"""What a task decides: its data and split, its loaders, its model's loss and evaluation, its report. The image
task's model is model.py and its results run/records.py; the text task's are here.

    data        CIFAR-10's two layouts, the decode cache, the seeded split and the samplers
    loaders     the two loaders (tensor, PIL) over the split, and an epoch's batches from any batch on
    packed      the text task's corpus, split by document, packed rows, and the tokens of every window
    language    the text task's byte transformer, its per-token loss, evaluation, continuation and report
"""
