"""What a task decides: its data and split, its loaders, its model's loss and evaluation, its results. The image
task's model is model.py (the document's); everything else of both tasks is here.

    data        CIFAR-10's two layouts, the decode cache, the seeded split and the samplers
    loaders     the two loaders (tensor, PIL) over the split, and an epoch's batches from any batch on
    image       the image task (ImageTask): model.py's CNN, its loss and plan, its results drawn and written
    packed      the text task's corpus, split by document, packed rows, and the tokens of every window
    language    the text task (TextTask): its byte transformer, per-token loss, evaluation, continuation, report
    registry    the Task protocol train.py and its start-up use, and the tasks by name
"""
