"""`InferenceModel`: fused weights + a static KV cache + `forward(tokens, input_pos, ...)`, gpt-fast style.

Weights arrive as `(name, tensor)` pairs with the Hugging Face state-dict names of
LlamaForCausalLM / MistralForCausalLM / Qwen2ForCausalLM / OPTForCausalLM, one tensor at a time
(how the training engine hands over gathered FSDP units). Each is copied into a slot preallocated in
fused form: q, k, v rows of one `wqkv` matrix, gate and up rows of one `w1`; the tied LM head *is*
the embedding. So the model never holds a second full copy, and `load_weights` refreshes the same
storage, which keeps captured CUDA graphs valid.

KV cache: k, v [L, B, Hkv, T, D] plus `valid` [B, T] (slot holds a real token). A forward writes its
tokens' k/v at cache slots `input_pos` and attends over slots [0, kv_len) with the boolean mask
    keep[b, s, t] = t <= input_pos[s]  and  (valid[b, t] or t == input_pos[s])   (and the window)
Left-padded prompts put pads in slots that are never attended; the `t == input_pos[s]` term only lets
a pad query see itself, so pad rows stay finite. Positions (rotary / OPT's learned table) are per
row: the number of real tokens before the token, as transformers derives them from the attention
mask in `generate`. Batches smaller than the cache use its leading rows.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from .args import ModelArgs, rope_inv_freq
from .ops import activation, apply_rotary, attention, layer_norm, rms_norm, rotary_cos_sin, swiglu

PEFT_PREFIX = "base_model.model."  # what a peft wrapper puts before the HF names
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")  # recomputed, never loaded


@dataclass(slots=True)
class LayerWeights:
    """One block, fused. Norm biases only for OPT (LayerNorm); other biases per config."""

    attn_norm: torch.Tensor | None
    attn_norm_b: torch.Tensor | None
    wqkv: torch.Tensor  # [(H + 2 Hkv) D, dim]: q rows, then k, then v
    bqkv: torch.Tensor | None
    wo: torch.Tensor  # [dim, H D]
    bo: torch.Tensor | None
    mlp_norm: torch.Tensor | None
    mlp_norm_b: torch.Tensor | None
    w1: torch.Tensor  # llama: [gate; up] [2F, dim]; OPT: fc1 [F, dim]
    b1: torch.Tensor | None
    w2: torch.Tensor  # down / fc2 [dim, F]
    b2: torch.Tensor | None


@dataclass(slots=True)
class KVCache:
    k: torch.Tensor  # [L, B, Hkv, T, D]
    v: torch.Tensor
    valid: torch.Tensor  # [B, T] bool: the slot holds a real (non-pad) token
    slots: torch.Tensor  # [T] arange, for the masks
    # After a `generate` call that compacted its batch: rows[i] = the cache row holding the call's row i
    # (None: row i). What a `Resume` of that call reads (generate.keep_rows).
    rows: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[3]


class InferenceModel:
    """Generation-mode model for one supported architecture (see `supports`).

    model = InferenceModel(hf_config, named_tensors, dtype=torch.bfloat16, device="cuda")
    model.setup_cache(batch_size, max_seq_len)           # or let generate() size it
    logits = model.forward(tokens, input_pos, position_ids, valid)
    model.load_weights(named_tensors)                     # refresh in place
    model.release()                                       # free cache, graphs and weights
    """

    def __init__(
        self,
        config,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        use_cuda_graphs: bool = True,
    ):
        self.args = ModelArgs.from_hf_config(config)
        self.dtype = dtype  # None: the first tensor's
        self.device = torch.device(device) if device is not None else None
        self.use_cuda_graphs = use_cuda_graphs  # only ever used when device.type == "cuda"
        self.cache: KVCache | None = None
        # Decode CUDA graphs (generate.py), keyed by batch size and sampling settings; they hold
        # pointers into the weights and cache, so they are dropped whenever either is reallocated.
        self.graphs: dict = {}
        self.graph_pool = None
        # the one side stream every graph of this model warms up and is captured on: cuBLAS keeps a workspace per
        # (handle, stream) for the process's life (32 MiB on Hopper), so a stream per graph cost one each
        self.graph_stream = None
        self._slots: dict[str, torch.Tensor] | None = None
        # What the switches to generation cost, for the engine's log and the tests: `allocations`
        # counts every allocation of the fused weights or of the KV cache (a switch after the first
        # adds none while the batch fits the cache), `allocated_bytes` their total; `refreshes`
        # counts `load_weights` calls, `last_refresh` the last one's tensors, bytes written and seconds.
        self.allocations = 0
        self.allocated_bytes = 0
        self.refreshes = 0
        self.last_refresh: dict[str, float] = {"tensors": 0, "bytes": 0, "seconds": 0.0}
        self.load_weights(named_tensors)

    # ------------------------------------------------------------ weights

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = True) -> int:
        """Copy HF-named tensors into the fused slots (allocating them on first use or after
        `release`). Same storage on every refresh. strict: every weight must arrive. Returns the count.

        A value may also be an object with `shape` and `write_into(slot)` (a LoRA merge,
        engine/lora.py `MergedWeight`), which computes itself into the slot without a full-size
        temporary where it can."""
        start = time.perf_counter()
        it = iter(named_tensors)
        if self._slots is None:
            first = next(it, None)
            if first is None:
                raise ValueError("no weights given")
            self.dtype = self.dtype or first[1].dtype
            self.device = self.device or first[1].device
            self._allocate()
            it = itertools.chain([first], it)
        seen, written = set(), 0
        with torch.no_grad():
            for name, tensor in it:
                name = name.removeprefix(PEFT_PREFIX)
                slot = self._slots.get(name)
                if slot is None:
                    if name.endswith(IGNORED_SUFFIXES):
                        continue
                    raise KeyError(f"{name!r} is not a weight of the injected {self.args.model_type} model")
                if tuple(slot.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: got shape {tuple(tensor.shape)}, expected {tuple(slot.shape)}")
                if isinstance(tensor, torch.Tensor):
                    slot.copy_(tensor)  # casts to the model's dtype / device
                else:
                    tensor.write_into(slot)
                seen.add(name)
                written += slot.numel() * slot.element_size()
        missing = self._required - seen
        if strict and missing:
            raise ValueError(f"{len(missing)} weights not given, e.g. {sorted(missing)[:4]}")
        self.refreshes += 1
        self.last_refresh = {"tensors": len(seen), "bytes": written, "seconds": time.perf_counter() - start}
        return len(seen)

    def _allocate(self) -> None:
        """Empty fused tensors, and `_slots`: HF name -> the view of a fused tensor it fills."""
        a, kw = self.args, {"dtype": self.dtype, "device": self.device}
        q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        ffn_rows = 2 * a.ffn_dim if a.arch == "llama" else a.ffn_dim

        def empty(*shape, when=True):
            return torch.empty(*shape, **kw) if when else None

        has_ln_params = a.arch == "llama" or a.norm_affine
        self.layers = [
            LayerWeights(
                attn_norm=empty(a.dim, when=has_ln_params),
                attn_norm_b=empty(a.dim, when=a.arch == "opt" and a.norm_affine),
                wqkv=empty(q + 2 * kv, a.dim),
                bqkv=empty(q + 2 * kv, when=a.qkv_bias),
                wo=empty(a.dim, q),
                bo=empty(a.dim, when=a.o_bias),
                mlp_norm=empty(a.dim, when=has_ln_params),
                mlp_norm_b=empty(a.dim, when=a.arch == "opt" and a.norm_affine),
                w1=empty(ffn_rows, a.dim),
                b1=empty(ffn_rows, when=a.mlp_bias),
                w2=empty(a.dim, a.ffn_dim),
                b2=empty(a.dim, when=a.mlp_bias),
            )
            for _ in range(a.n_layers)
        ]
        self.embed = empty(a.vocab_size, a.embed_dim)
        self.lm_head = self.embed if a.tie_embeddings else empty(a.vocab_size, a.embed_dim)
        opt, proj = a.arch == "opt", a.embed_dim != a.dim
        self.norm = empty(a.dim, when=a.arch == "llama" or (a.final_norm and a.norm_affine))
        self.norm_b = empty(a.dim, when=opt and a.final_norm and a.norm_affine)
        self.pos_embed = empty(a.max_positions + 2, a.dim, when=opt)  # OPT's offset of 2
        self.project_in = empty(a.dim, a.embed_dim, when=opt and proj)
        self.project_out = empty(a.embed_dim, a.dim, when=opt and proj)
        self.inv_freq = rope_inv_freq(a.rope, a.head_dim, self.device) if a.rope else None

        slots = self._opt_slots(q, kv) if opt else self._llama_slots(q, kv)
        self._slots = {k: v for k, v in slots.items() if v is not None}
        self._required = set(self._slots) - ({"lm_head.weight"} if a.tie_embeddings else set())
        self.graphs.clear()
        self.allocations += 1
        self.allocated_bytes += self.memory_bytes()["weights"]

    def _llama_slots(self, q: int, kv: int) -> dict:
        f = self.args.ffn_dim
        s = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm, "lm_head.weight": self.lm_head}
        for i, lw in enumerate(self.layers):
            p = f"model.layers.{i}."
            s[p + "input_layernorm.weight"] = lw.attn_norm
            s[p + "post_attention_layernorm.weight"] = lw.mlp_norm
            for part, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
                s[f"{p}self_attn.{part}_proj.weight"] = lw.wqkv[rows]
                s[f"{p}self_attn.{part}_proj.bias"] = _rows(lw.bqkv, rows)
            s[p + "self_attn.o_proj.weight"], s[p + "self_attn.o_proj.bias"] = lw.wo, lw.bo
            s[p + "mlp.gate_proj.weight"], s[p + "mlp.gate_proj.bias"] = lw.w1[:f], _rows(lw.b1, slice(0, f))
            s[p + "mlp.up_proj.weight"], s[p + "mlp.up_proj.bias"] = lw.w1[f:], _rows(lw.b1, slice(f, 2 * f))
            s[p + "mlp.down_proj.weight"], s[p + "mlp.down_proj.bias"] = lw.w2, lw.b2
        return s

    def _opt_slots(self, q: int, kv: int) -> dict:
        d = "model.decoder."
        s = {
            d + "embed_tokens.weight": self.embed,
            d + "embed_positions.weight": self.pos_embed,
            d + "project_in.weight": self.project_in,
            d + "project_out.weight": self.project_out,
            d + "final_layer_norm.weight": self.norm,
            d + "final_layer_norm.bias": self.norm_b,
            "lm_head.weight": self.lm_head,
        }
        for i, lw in enumerate(self.layers):
            p = f"{d}layers.{i}."
            s[p + "self_attn_layer_norm.weight"], s[p + "self_attn_layer_norm.bias"] = lw.attn_norm, lw.attn_norm_b
            s[p + "final_layer_norm.weight"], s[p + "final_layer_norm.bias"] = lw.mlp_norm, lw.mlp_norm_b
            for part, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
                s[f"{p}self_attn.{part}_proj.weight"] = lw.wqkv[rows]
                s[f"{p}self_attn.{part}_proj.bias"] = _rows(lw.bqkv, rows)
            s[p + "self_attn.out_proj.weight"], s[p + "self_attn.out_proj.bias"] = lw.wo, lw.bo
            s[p + "fc1.weight"], s[p + "fc1.bias"] = lw.w1, lw.b1
            s[p + "fc2.weight"], s[p + "fc2.bias"] = lw.w2, lw.b2
        return s

    def named_slots(self) -> tuple[dict[str, torch.Tensor], frozenset[str]]:
        """({HF name: the view of a fused tensor it fills}, the names `load_weights` requires): what
        the weight check (engine/weight_check.py) compares with the training parameters."""
        if self._slots is None:
            return {}, frozenset()
        return dict(self._slots), frozenset(self._required)

    def weight_tensors(self) -> list[torch.Tensor]:
        """The distinct fused tensors (for memory accounting and the storage-stability test)."""
        if self._slots is None:
            return []
        out = {id(t): t for lw in self.layers for f in fields(lw) if (t := getattr(lw, f.name)) is not None}
        for t in (self.embed, self.lm_head, self.norm, self.norm_b, self.pos_embed, self.project_in, self.project_out):
            if t is not None:
                out[id(t)] = t
        return list(out.values())

    def memory_bytes(self) -> dict[str, int]:
        cache = 0 if self.cache is None else sum(t.numel() * t.element_size() for t in (self.cache.k, self.cache.v))
        return {"weights": sum(t.numel() * t.element_size() for t in self.weight_tensors()), "kv_cache": cache}

    # ------------------------------------------------------------ cache and release

    def setup_cache(self, batch_size: int, max_seq_len: int) -> bool:
        """Make the cache hold at least `batch_size` rows of `max_seq_len` slots (prompt + new tokens).
        Reuses the current one when it is big enough (so captured graphs stay valid); otherwise frees
        it, drops the graphs and allocates max(old, new) in each dimension. Returns True if allocated."""
        if self._slots is None:
            raise RuntimeError("the model was released; load_weights() first")
        c = self.cache
        if c is not None and batch_size <= c.batch_size and max_seq_len <= c.max_seq_len:
            return False
        if c is not None:
            batch_size, max_seq_len = max(batch_size, c.batch_size), max(max_seq_len, c.max_seq_len)
        self.release_cache()  # free before allocating: never two caches at once
        a = self.args
        shape = (a.n_layers, batch_size, a.n_kv_heads, max_seq_len, a.head_dim)
        self.cache = KVCache(
            k=torch.zeros(shape, dtype=self.dtype, device=self.device),
            v=torch.zeros(shape, dtype=self.dtype, device=self.device),
            valid=torch.zeros(batch_size, max_seq_len, dtype=torch.bool, device=self.device),
            slots=torch.arange(max_seq_len, device=self.device),
        )
        self.allocations += 1
        self.allocated_bytes += self.memory_bytes()["kv_cache"]
        return True

    def release_cache(self) -> None:
        """Free the KV cache and the decode graphs (their memory pool holds step activations)."""
        self.graphs.clear()
        self.graph_pool = None
        self.cache = None

    def release(self) -> None:
        """Free everything (leaving generation mode). `load_weights` brings the model back."""
        self.release_cache()
        self._slots = None
        self.layers = []
        self.embed = self.lm_head = self.norm = self.norm_b = None
        self.pos_embed = self.project_in = self.project_out = self.inv_freq = None

    # ------------------------------------------------------------ forward

    @torch.no_grad()
    def forward(
        self,
        tokens: torch.Tensor,
        input_pos: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        valid: torch.Tensor | None = None,
        kv_len: int | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [B, S, V] (or [B, 1, V] with last_only) for tokens [B, S] written at cache slots
        input_pos [S] (the same for every row: prompts are left-padded to a common length).

        position_ids [B, S]: per-row positions (default: input_pos); valid [B, S] bool: False marks a
        pad (never attended; default all real); kv_len: attend over slots [0, kv_len), a host int the
        caller knows (prefill: S, eager decode: slot + 1); None = the whole cache, the static shape a
        CUDA graph needs (later slots are masked). No host syncs.
        """
        a, c = self.args, self.cache
        if c is None:
            raise RuntimeError("no KV cache: call setup_cache(batch_size, max_seq_len) first")
        B, S = tokens.shape
        if position_ids is None:
            position_ids = input_pos.expand(B, S)
        if valid is None:
            c.valid[:B].index_fill_(1, input_pos, True)
        else:
            c.valid[:B, input_pos] = valid
        T = c.max_seq_len if kv_len is None else kv_len
        masks = self._masks(input_pos, B, T)

        # NOTE: each block returns the residual stream x and its last branch's output `delta`, not
        # their sum: the next norm adds them in its kernel (the add that precedes every norm).
        x, delta = F.embedding(tokens, self.embed), None
        if a.arch == "llama":
            cos, sin = rotary_cos_sin(position_ids, self.inv_freq, x.dtype)
            for i, lw in enumerate(self.layers):
                x, delta = self._llama_block(i, lw, x, delta, input_pos, masks[a.sliding_windows[i]], T, cos, sin)
            x = _add_norm(lambda t, r=None: rms_norm(t, self.norm, a.norm_eps, r), x, delta)[0]
        else:
            if self.project_in is not None:
                x = F.linear(x, self.project_in)
            x = x + F.embedding(position_ids + 2, self.pos_embed)
            for i, lw in enumerate(self.layers):
                x, delta = self._opt_block(i, lw, x, delta, input_pos, masks[None], T)
            if a.final_norm:
                x = _add_norm(lambda t, r=None: layer_norm(t, self.norm, self.norm_b, a.norm_eps, r), x, delta)[0]
            elif delta is not None:
                x = x + delta
            if self.project_out is not None:
                x = F.linear(x, self.project_out)
        if last_only:
            x = x[:, -1:]
        return F.linear(x, self.lm_head)

    __call__ = forward

    def _masks(self, input_pos: torch.Tensor, B: int, T: int) -> dict[int | None, torch.Tensor]:
        """Boolean keep-masks [B, 1, S, T] for full attention (key None) and each sliding window,
        which (as transformers does) counts cache slots: key slot t is seen from slot s if t > s - w."""
        c = self.cache
        slots, q_pos = c.slots[:T], input_pos[:, None]  # [T], [S, 1]
        keep = (slots <= q_pos) & (c.valid[:B, None, :T] | (slots == q_pos))  # [B, S, T]
        masks = {None: keep[:, None]}
        for w in set(self.args.sliding_windows) - {None}:
            masks[w] = (keep & (slots > q_pos - w))[:, None]
        return masks

    def _attention(self, i, lw, h, input_pos, mask, T, cos=None, sin=None) -> torch.Tensor:
        a = self.args
        B, S, _ = h.shape
        qkv = F.linear(h, lw.wqkv, lw.bqkv)
        q, k, v = qkv.split((a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim), -1)
        q = q.view(B, S, a.n_heads, a.head_dim)
        k = k.view(B, S, a.n_kv_heads, a.head_dim)
        v = v.view(B, S, a.n_kv_heads, a.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, S, D]
        if cos is not None:
            q, k = apply_rotary(q, k, cos, sin)
        k_cache, v_cache = self.cache.k[i, :B], self.cache.v[i, :B]  # [B, Hkv, Tmax, D] views
        k_cache.index_copy_(2, input_pos, k)
        v_cache.index_copy_(2, input_pos, v)
        y = attention(q, k_cache[:, :, :T], v_cache[:, :, :T], mask)  # [B, H, S, D]
        return F.linear(y.transpose(1, 2).reshape(B, S, -1), lw.wo, lw.bo)

    def _llama_block(self, i, lw, x, delta, input_pos, mask, T, cos, sin):
        """(x, delta) -> (x + delta + attn, mlp): the residual stream and the MLP's output, still apart."""
        eps = self.args.norm_eps
        h, x = _add_norm(lambda t, r=None: rms_norm(t, lw.attn_norm, eps, r), x, delta)
        h, x = rms_norm(self._attention(i, lw, h, input_pos, mask, T, cos, sin), lw.mlp_norm, eps, x)
        return x, F.linear(swiglu(F.linear(h, lw.w1, lw.b1)), lw.w2, lw.b2)

    def _opt_block(self, i, lw, x, delta, input_pos, mask, T):
        a = self.args

        def ln1(t, r=None):
            return layer_norm(t, lw.attn_norm, lw.attn_norm_b, a.norm_eps, r)

        def ln2(t, r=None):
            return layer_norm(t, lw.mlp_norm, lw.mlp_norm_b, a.norm_eps, r)

        def mlp(h):
            return F.linear(activation(F.linear(h, lw.w1, lw.b1), a.activation), lw.w2, lw.b2)

        if a.norm_before:  # pre-LN (most OPT sizes): x + f(ln(x)), as Llama
            h, x = _add_norm(ln1, x, delta)
            h, x = ln2(self._attention(i, lw, h, input_pos, mask, T), x)
            return x, mlp(h)
        # post-LN (opt-350m): ln(x + f(x)); nothing left pending
        x = ln1(self._attention(i, lw, x, input_pos, mask, T), x)[0]
        return ln2(mlp(x), x)[0], None


def _add_norm(norm, x: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + delta), x + delta) through the norm's fused residual add; (norm(x), x) without delta."""
    return (norm(x), x) if delta is None else norm(delta, x)


def _rows(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]
