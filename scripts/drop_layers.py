"""A smaller model from a larger one by keeping some of its decoder layers (the embeddings, final norm
and head kept as they are): the start of a smaller student for on-policy distillation
(docs/results-log.md, "Distillation, measured"; DistilBERT initialises its student the same way).

    python scripts/drop_layers.py outputs/sft --keep 0 2 --out outputs/student_init

Then train it with the SFT stage before distilling (a model cut so is far from its source until it has
learnt again: measured gold 0-18 right after the cut):

    python -m rlhf.sft model.name_or_path=outputs/student_init train.max_steps=580 output_dir=outputs/student_sft

`SRC`: a stage's output_dir (its model/ is read) or a Hugging Face model directory, a Llama-style causal
LM whose decoder layers are `model.model.layers`. `--keep`: the indices of the layers to keep, in
order. The output is `OUT/model/` (weights, config with the new `num_hidden_layers`, and the source's
tokenizer, chat template and generation config copied), so a stage reads it as it reads a stage's
output. Exit 2 with the reason on a bad index or a model without `model.model.layers`.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch
from transformers import AutoModelForCausalLM

WEIGHTS = ("model.safetensors", "pytorch_model.bin", "config.json")


def model_dir(path: str) -> str:
    """A stage's output_dir holds its model in model/; a plain HF directory is the model itself."""
    inner = os.path.join(path, "model")
    return inner if os.path.isfile(os.path.join(inner, "config.json")) else path


def drop_layers(src: str, keep: list[int], out: str) -> torch.nn.Module:
    """Load `src`, keep its decoder layers `keep` (in that order), save to `out`/model; returns the model."""
    src = model_dir(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"{src}: no decoder layers at model.model.layers (a Llama-style causal LM is needed)")
    n = len(layers)
    if not keep or any(i < 0 or i >= n for i in keep) or len(set(keep)) != len(keep):
        raise ValueError(f"--keep must name distinct layer indices in [0, {n - 1}], got {keep}")
    model.model.layers = torch.nn.ModuleList(layers[i] for i in keep)
    for new_idx, layer in enumerate(model.model.layers):  # the KV cache is indexed by layer
        if hasattr(getattr(layer, "self_attn", None), "layer_idx"):
            layer.self_attn.layer_idx = new_idx
    model.config.num_hidden_layers = len(keep)
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = [model.config.layer_types[i] for i in keep]
    dst = os.path.join(out, "model")
    os.makedirs(dst, exist_ok=True)
    model.save_pretrained(dst)
    for name in os.listdir(src):  # tokenizer, chat template, generation config
        if name not in WEIGHTS and os.path.isfile(os.path.join(src, name)):
            shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="a stage's output_dir or a HF model directory")
    ap.add_argument("--keep", type=int, nargs="+", required=True, help="indices of the decoder layers to keep, in order")
    ap.add_argument("--out", required=True, help="output directory (the model goes to OUT/model)")
    args = ap.parse_args(argv)
    try:
        model = drop_layers(args.src, args.keep, args.out)
    except (ValueError, OSError) as e:
        print(f"drop_layers.py: {e}", file=sys.stderr)
        return 2
    n = sum(p.numel() for p in model.parameters())
    print(f"{args.out}/model: layers {args.keep} of {args.src}, {model.config.num_hidden_layers} layers, {n:,} params")
    return 0


if __name__ == "__main__":
    sys.exit(main())
