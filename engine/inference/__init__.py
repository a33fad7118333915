"""Injected generation model for the hybrid engine: Llama family (llama, mistral, qwen2) and OPT.

    ok, reason = supports(hf_config)        # False -> the generic transformers `generate` path
    model = InferenceModel(hf_config, engine.named_full_parameters(), dtype=torch.bfloat16, device=dev)
    out = model.generate(prompt_ids, prompt_mask, max_new_tokens=256, eos_token_id=eos, pad_token_id=pad,
                         sampling=SamplingParams(temperature=1.0, top_p=0.9), return_logprobs=True)

Memory timeline of one generation phase (`with engine.generation():`), per rank:
    1. enter    FSDP units are gathered one at a time; each full tensor is copied into the model's
                fused slot (first phase: slots allocated once, ~Ψ × dtype bytes; later phases:
                `load_weights` into the same storage) and the unit is resharded: the gathered
                copy never exists for the whole model at once.
    2. cache    `setup_cache` / `generate` allocates k, v [L, B, Hkv, cache_slots(P + max_new), D] (zeros:
                the length rounded up to 32 slots) and reuses it while batch and length fit.
    3. graphs   CUDA only: the first decode step per (batch size, sampling) is captured; its private
                memory pool holds one step's activations and is shared by all graphs of the model, and
                all of them warm up and are captured on the model's one stream (cuBLAS keeps a workspace,
                32 MiB on Hopper, per stream it has run on).
    4. decode   no allocation per token besides the output columns; when finished rows are compacted away
                (`compact_finished`), one layer's moved cache rows as a temporary and the smaller batch's
                step state (CUDA: its graph, captured once per bucket size).
    5. leave    `release_cache()` frees the cache and the graphs (keeping weights resident makes the
                next refresh a plain copy); `release()` frees the weights too. Either way the caller
                then runs `torch.cuda.empty_cache()` if training needs the memory back from the
                allocator. After `release()`, `load_weights` re-allocates (new storage, new graphs).
"""
from .args import ModelArgs, supports
from .generate import DecodeState, GenerationOutput, Resume, cache_slots, decode_step, generate
from .model import InferenceModel, KVCache
from .sampling import SamplingParams, filter_logits, row_noise, sample, stream_seed

__all__ = [
    "DecodeState",
    "GenerationOutput",
    "InferenceModel",
    "KVCache",
    "ModelArgs",
    "Resume",
    "SamplingParams",
    "cache_slots",
    "decode_step",
    "filter_logits",
    "generate",
    "row_noise",
    "sample",
    "stream_seed",
    "supports",
]
