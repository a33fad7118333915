"""LoRA adapters merged into the generation weights: W' = W + scale * B @ A, per adapted Linear.

The injected inference model (engine/inference) holds plain Hugging Face weights, so a peft LoRA
model reaches it merged: the training engine's `(name, tensor)` stream of
    <prefix>.base_layer.weight [out, in], <prefix>.base_layer.bias [out],
    <prefix>.lora_A.<adapter>.weight [r, in], <prefix>.lora_B.<adapter>.weight [out, r]
becomes `<prefix>.weight` = W + scale * B @ A (computed in fp32 from the tensors as streamed) and
`<prefix>.bias`. The training weights are never modified (no peft merge/unmerge round trip, whose
rounding would drift the base weights). Only what this formula describes is merged: one active
adapter per layer on an nn.Linear, no DoRA, no LoRA bias, no fan_in_fan_out, no embedding LoRA, no
modules_to_save copies; anything else is `None` from `lora_layers` (the engine then generates through
transformers, which applies the adapters at forward).

Detection is by duck typing on peft's LoraLayer attributes: the engine does not import peft.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from .parallelize import clean_name


@dataclass(frozen=True, slots=True)
class LoraLayer:
    adapter: str  # the one active adapter's name ("default")
    scale: float  # lora_alpha / r (or / sqrt(r) with rslora): peft's `scaling[adapter]`


def lora_layers(module: nn.Module) -> dict[str, LoraLayer] | None:
    """{clean module name: LoraLayer} for the LoRA layers of `module` (a peft model, possibly inside
    a ModuleView; {} for a model without adapters), or None when some adapter is not a plain
    mergeable LoRA (see the module docstring)."""
    layers: dict[str, LoraLayer] = {}
    for name, m in module.named_modules():
        if type(m).__name__ in ("ModulesToSaveWrapper", "TrainableTokensWrapper"):
            return None
        if not (hasattr(m, "lora_A") and hasattr(m, "lora_B") and hasattr(m, "base_layer")):
            continue
        active = list(getattr(m, "active_adapters", []))
        if (len(active) != 1 or set(m.lora_A) != set(active) or set(m.lora_B) != set(active)
                or not isinstance(m.base_layer, nn.Linear) or getattr(m, "disable_adapters", False)
                or getattr(m, "merged_adapters", []) or getattr(m, "fan_in_fan_out", False)
                or any(getattr(m, "use_dora", {}).values()) or any(getattr(m, "lora_bias", {}).values())
                or len(getattr(m, "lora_embedding_A", {}))):
            return None
        layers[clean_name(name)] = LoraLayer(active[0], float(m.scaling[active[0]]))
    is_peft = callable(getattr(module, "get_base_model", None)) or any(
        callable(getattr(m, "get_base_model", None)) for m in module.children())
    if is_peft and not layers:
        return None  # a peft model with adapters of another kind (prompt tuning, IA3, ...)
    return layers


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + scale * B @ A in fp32 ([out, in]), one `addmm`: the one formula both the merge and the weight
    check use, so a merged slot and its expected value agree bit for bit."""
    return torch.addmm(weight.float(), lora_b.float(), lora_a.float(), alpha=scale)


@dataclass(slots=True)
class MergedWeight:
    """A LoRA layer's merged weight, not yet computed: `write_into(slot)` puts W + scale * B @ A into
    the injected model's slot. An fp32 slot on the weight's device is computed in place (W copied in,
    then `addmm_` adds scale * B @ A: the same single addmm as `merged_weight`, bit for bit, and no
    [out, in] temporary); any other slot gets `merged_weight`'s fp32 result, cast once."""

    weight: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scale: float

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def value(self) -> torch.Tensor:
        return merged_weight(self.weight, self.lora_a, self.lora_b, self.scale)

    def write_into(self, slot: torch.Tensor) -> None:
        if slot.dtype == torch.float32 and slot.device == self.weight.device and slot.is_contiguous():
            slot.copy_(self.weight)
            slot.addmm_(self.lora_b.float(), self.lora_a.float(), alpha=self.scale)
        else:
            slot.copy_(self.value())


class LoraMerger:
    """Turns a stream of peft-named tensors into HF-named ones, one item at a time (`push`).

    NOTE: a LoRA layer's base weight is held until its lora_B arrives; the three are parameters of
    one module, hence of one FSDP unit, which `named_full_parameters` keeps gathered while it yields
    that unit's tensors."""

    def __init__(self, layers: dict[str, LoraLayer], lazy: bool = False):
        self.layers, self.lazy = layers, lazy  # lazy: a merged weight is a `MergedWeight`, computed by its consumer
        self._pending: dict[str, dict[str, torch.Tensor]] = {}

    def _split(self, name: str) -> tuple[str, str] | None:
        """(layer prefix, part) for a tensor of a LoRA layer: part W, bias, A or B; None otherwise."""
        for suffix, part in ((".base_layer.weight", "W"), (".base_layer.bias", "bias")):
            if name.endswith(suffix) and name[: -len(suffix)] in self.layers:
                return name[: -len(suffix)], part
        head, _, adapter_weight = name.rpartition(".lora_")  # <prefix>.lora_A.<adapter>.weight
        kind, _, rest = adapter_weight.partition(".")
        if head in self.layers and kind in ("A", "B") and rest == f"{self.layers[head].adapter}.weight":
            return head, kind
        return None

    def push(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        split = self._split(name)
        if split is None:
            return [(name, tensor)]
        prefix, part = split
        if part == "bias":
            return [(prefix + ".bias", tensor)]
        parts = self._pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) < 3:
            return []
        del self._pending[prefix]
        merged = MergedWeight(parts["W"], parts["A"], parts["B"], self.layers[prefix].scale)
        return [(prefix + ".weight", merged if self.lazy else merged.value())]

    def finish(self) -> None:
        if self._pending:
            prefix, parts = next(iter(self._pending.items()))
            raise ValueError(f"LoRA layer {prefix}: the stream ended with only {sorted(parts)} of its base weight "
                             "W, lora_A (A) and lora_B (B)")


def merge_lora(named: Iterable[tuple[str, torch.Tensor]], layers: dict[str, LoraLayer],
               lazy: bool = False) -> Iterator[tuple[str, "torch.Tensor | MergedWeight"]]:
    """`named` with every LoRA layer's tensors replaced by the merged weight (and its bias), HF-named;
    `lazy`: as a `MergedWeight` (for `InferenceModel.load_weights`, which writes it into its slot
    before taking the next item, while the FSDP unit holding W, A and B is still gathered)."""
    if not layers:
        yield from named
        return
    merger = LoraMerger(layers, lazy)
    for name, tensor in named:
        yield from merger.push(name, tensor)
    merger.finish()
