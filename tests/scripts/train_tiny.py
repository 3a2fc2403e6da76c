"""A plain Trainer script that never imports hf_muon: tiny Llama on this file's own bytes."""

import sys

import torch
from torch.utils.data import Dataset
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class Bytes(Dataset):
    def __init__(self, text: bytes, seq: int = 32):
        ids = torch.tensor(list(text), dtype=torch.long)
        self.blocks = ids[: len(ids) // seq * seq].view(-1, seq)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, i):
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def main() -> None:
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(args.seed)
    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    data = Bytes(open(__file__, "rb").read() * 4)
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # Accelerate wraps it
    print(f"OPTIMIZER={type(optimizer).__module__}.{type(optimizer).__name__}")
    print(f"EVAL_LOSS_BEFORE={before:.4f} EVAL_LOSS_AFTER={after:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
