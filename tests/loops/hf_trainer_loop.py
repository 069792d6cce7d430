"""A training loop in the HF Trainer's documented style, nothing of the lab in it: run under the watcher by
tests/test_watch_frameworks.py (`torchrun --nproc-per-node=2 -m ddp_no_sync_lab.watch hf_trainer_loop.py --case
CASE --output DIR`).

A tiny Llama built from its config (no download) on random token rows whose labels end in a random stretch of
ignored tokens (-100), Trainer(gradient_accumulation_steps=4) on CPU with its defaults (AdamW, gradient clipping
to norm 1, the loss normalized by the window's tokens over every rank), micro-batches of 4 rows, 2 epochs of 3
windows per rank. --case picks the loop:

    accumulate          the documented loop: the model's own loss, given num_items_in_batch
    ignores_num_items   a compute_loss override that returns the model's loss without passing num_items_in_batch
                        (transformers#37766's family): each micro-batch's mean, undivided
    gpt2                the documented loop on a GPT-2 (GPT2LMHeadModel): its loss type is not named ForCausalLM,
                        so the Trainer counts the window's tokens on the labels unshifted, one per row more than
                        its loss counts
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

ACCUM, BATCH, EPOCHS, WORLD_SIZE, LENGTH, VOCAB = 4, 4, 2, 2, 16, 64

parser = argparse.ArgumentParser()
parser.add_argument("--case", default="accumulate")
parser.add_argument("--output", required=True)
options = parser.parse_args()


class TokenRows(torch.utils.data.Dataset):
    def __init__(self, rows):
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, VOCAB, (rows, LENGTH), generator=generator)
        self.kept = torch.randint(LENGTH // 2, LENGTH + 1, (rows,), generator=generator)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        labels = self.tokens[index].clone()
        labels[self.kept[index] :] = -100
        return {"input_ids": self.tokens[index], "labels": labels}


class MeanLossTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        return (outputs.loss, outputs) if return_outputs else outputs.loss


torch.manual_seed(0)
if options.case == "gpt2":
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2))
else:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
arguments = TrainingArguments(
    output_dir=options.output,
    per_device_train_batch_size=BATCH,
    gradient_accumulation_steps=ACCUM,
    num_train_epochs=EPOCHS,
    learning_rate=1e-3,
    use_cpu=True,
    report_to="none",
    save_strategy="no",
    logging_strategy="epoch",
    disable_tqdm=True,
)
trainer_class = MeanLossTrainer if options.case == "ignores_num_items" else Trainer
trainer = trainer_class(model=model, args=arguments, train_dataset=TokenRows(WORLD_SIZE * 3 * ACCUM * BATCH))
trainer.train()
