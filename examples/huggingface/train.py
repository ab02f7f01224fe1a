"""A tiny GPT-2 (built from a config, nothing downloaded) trained by Hugging Face's Trainer
with DeepSpeed ZeRO and the config's "sdp4bit" section, on a synthetic dataset; on CPU with
gloo when no GPU is there (DS_ACCELERATOR=cpu). sdp4bit's bytes and weight error reach the
Trainer's loggers through sdp4bit.huggingface's callback.

    torchrun --nproc-per-node 2 -m sdp4bit.deepspeed examples/huggingface/train.py \
        --deepspeed examples/huggingface/ds_config.json --output-dir OUT
    accelerate launch --config_file examples/huggingface/accelerate.yaml \
        examples/huggingface/train.py --install --output-dir OUT

``--install`` calls ``sdp4bit.deepspeed.install()`` (for launchers that run the script
directly, as ``accelerate launch``); ``--resume`` continues from the latest checkpoint in
OUT.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import sdp4bit.huggingface

SEQUENCE, VOCABULARY = 16, 64


class SyntheticText(torch.utils.data.Dataset):
    """`size` random token sequences (seeded), each its own label."""

    def __init__(self, size: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(VOCABULARY, (size, SEQUENCE), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def tiny_gpt2(seed: int) -> GPT2LMHeadModel:
    """Two layers of width 32, initialised from `seed`."""
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCABULARY, n_positions=SEQUENCE, n_embd=32, n_layer=2,
                        n_head=2)
    return GPT2LMHeadModel(config)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", required=True)
    p.add_argument("--deepspeed", help="DeepSpeed config (JSON); accelerate's config may "
                                       "name it instead")
    p.add_argument("--install", action="store_true",
                   help="call sdp4bit.deepspeed.install() before the Trainer is built")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=3)
    p.add_argument("--init-seed", type=int, default=1, help="the model's initial weights")
    p.add_argument("--data-seed", type=int, default=0, help="the order of the batches")
    p.add_argument("--resume", action="store_true",
                   help="resume from the latest checkpoint in --output-dir")
    return p.parse_args(argv)


def build_trainer(args: argparse.Namespace) -> Trainer:
    training = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.steps,
        per_device_train_batch_size=4, learning_rate=3e-3, lr_scheduler_type="constant",
        bf16=True, logging_steps=1, save_steps=args.save_steps, report_to="none",
        seed=0, data_seed=args.data_seed, dataloader_num_workers=0,
        use_cpu=not torch.cuda.is_available())
    trainer = Trainer(model=tiny_gpt2(args.init_seed), args=training,
                      train_dataset=SyntheticText(64))
    sdp4bit.huggingface.add_callback(trainer)
    return trainer


def main(argv=None) -> Trainer:
    args = parse_args(argv)
    if args.install:
        import sdp4bit.deepspeed

        sdp4bit.deepspeed.install()
    trainer = build_trainer(args)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    return trainer


if __name__ == "__main__":
    main()
