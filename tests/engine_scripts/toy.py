"""The tiny model, data and loss that the engine tests share (CPU, deterministic)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB, SEQ, ROWS = 64, 16, 64


def tiny_llama(seed: int = 0, lora: bool = False, tied: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(cfg)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
        )
        # peft zero-inits lora_B, which makes the first steps' lora_A gradients exactly 0; start from
        # small random B so every adapter weight moves.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    return model


def dataset(seed: int = 1234) -> dict[str, torch.Tensor]:
    """ROWS right-padded sequences of ragged length 4..SEQ: input_ids, attention_mask, labels (-100 on pad)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ROWS, SEQ), generator=g)
    lengths = torch.randint(4, SEQ + 1, (ROWS,), generator=g)
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = ids * mask  # pad id 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def rows(data: dict, start: int, stop: int) -> dict:
    return {k: v[start:stop] for k, v in data.items()}


def loss_fn(model, batch):
    """Token-sum next-token cross-entropy; weight = number of target tokens."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    logits, labels = logits[:, :-1], batch["labels"][:, 1:]  # (B, T-1, V), (B, T-1)
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum")
    valid = labels != -100
    weight = valid.sum()
    acc = ((logits.argmax(-1) == labels) & valid).sum() / weight.clamp(min=1)
    return loss_sum, weight, {"accuracy": acc}


class Block(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, h):
        return h + torch.tanh(self.proj(self.norm(h)))


class TinyNet(torch.nn.Module):
    """A transformers-free stand-in: embedding, a ModuleList of blocks (found by the fallback), head."""

    def __init__(self, vocab: int = 16, dim: int = 8, layers: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids):
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h)
        return self.head(h)


def tiny_loss_fn(model, batch):
    logits = model(batch["input_ids"]).float()
    loss_sum = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")
    weight = (batch["labels"] != -100).sum()
    return loss_sum, weight, {"tokens": weight.float()}
