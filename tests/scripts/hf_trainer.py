"""The Hugging Face Trainer pattern: a tiny GPT-2 built from a config (nothing downloaded) on
random tokens, DDP over Gloo on CPU, with HF's own checkpoint on SIGTERM (`enable_jit_checkpoint`,
which installs a signal handler: it needs the main thread). Rank 0 prints each logged loss.

    torchrun --nproc_per_node 2 hf_trainer.py OUTPUT_DIR
"""

import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=64):
        self.ids = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and "loss" in (logs or {}):
            print(f"step {state.global_step} loss {logs['loss']:.6f}", flush=True)


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2))
arguments = TrainingArguments(output_dir=sys.argv[1], per_device_train_batch_size=4, max_steps=6, logging_steps=1,
                              learning_rate=1e-3, use_cpu=True, ddp_backend="gloo", save_strategy="no",
                              report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
                              enable_jit_checkpoint=True)
Trainer(model=model, args=arguments, train_dataset=Tokens(), callbacks=[PrintLoss()]).train()
