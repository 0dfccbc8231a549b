"""
The frozen target: the Qwen3.5 / Qwen3.6 hybrid text model (Gated DeltaNet + gated attention),
read straight from Hugging Face safetensors. fla-core kernels on GPU; the same math in plain torch
on CPU, so every test runs without a GPU. The reference is transformers'
models/qwen3_5/modeling_qwen3_5.py (test_smoke.py compares against it).

The Target interface: what the rest of the trainer calls, so another target (a Llama, say) is
this file rewritten against it, and train.py, generate.py, bench.py and the demo data run on it:
  TargetConfig.preset(name) / .from_hf(dir)   ValueError (OSError) naming the field or file; a
      dataclass (vars() goes into checkpoints) with vocab_size, hidden_size, num_hidden_layers,
      intermediate_size, num_experts (0: dense), rope_theta, max_position_embeddings,
      rms_norm_eps, tie_word_embeddings: what train.py and DrafterConfig.from_target read;
      preset("tiny"): a few layers small enough for the CPU, the commands' default target and
      the demo data's (data.make_demo)
  Target.build(config, device, dtype, n_layers, head) (random weights) / .from_pretrained(dir,
      device, dtype, n_layers, head) (ValueError, KeyError, FileNotFoundError): layers
      [0, n_layers) only; head=False: no lm_head, and the final norm only with every layer
  .embed_tokens.weight, .lm_head.weight [vocab, H] (the drafter borrows them)
  .features(ids [T], cu_seqlens [n+1] on the CPU, layer_ids, final=False) -> [T, len(layer_ids)
      * H]: the outputs of decoder layers layer_ids (HF hidden_states[i+1]), each packed document
      alone; final: + the last layer's output final-normed, [T, H] more (train.py --objective)
  .greedy(prompts, new_tokens) -> [n, longest prompt + new_tokens]: the demo data, generate.py
  .features_and_logits(ids, cu_seqlens, layer_ids, at), .logits(ids, cu_seqlens, at) -> fp32
      [T or len(at), vocab] next-token logits: generate.py
  .flops(cu_seqlens, n_layers): matmul FLOPs of the forward, bench.py's MFU
  optional, used on a GPU where present: .graphed_features(layer_ids, log, final) -> features(ids,
      cu_seqlens, train) replaying CUDA graphs, or None
Nothing else of it is imported elsewhere (test_smoke.py checks) but by quality.py (Docs: it is
Qwen-only, trains a Qwen3.5 target, samples with greedy's temperature) and bench.py
(per_expert_linear: the MoE GEMM check's reference; where it is missing, `bench.py check` says so).
Its layers are layers.py's, shared with the drafter; testdata/llama_target.py is a second target.
"""
import functools
import json
import os
import zlib
from dataclasses import dataclass, fields
from typing import NamedTuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from layers import MLP, Attention, RMSNorm, apply_rope, check_rope, positions_from_cu
from layers import rope_cos_sin, rope_type, upload

# -----------------------------------------------------------------------------
# packed documents on the CPU path: [T, ...] <-> [n_docs, longest, ...]

def pad_docs(x, docs):   # [T, ...] -> [n_docs, longest, ...], every document zero-padded at its end
    idx, valid = docs.pad[:2]
    return x[idx] * valid.view(*valid.shape, *[1] * (x.dim() - 1)).to(x.dtype)

def unpad_docs(y, docs):
    # [n_docs, longest, ...] -> [T, ...]: a gather, not a boolean mask (no data-dependent shape)
    return y.flatten(0, 1)[docs.pad[3]]

# -----------------------------------------------------------------------------
# Gated DeltaNet core in plain torch (the CPU path, and the reference for the fla kernel)

def torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk=None):
    """One document. q, k [T, heads, dk] (l2-normalised, q scaled, q/k heads repeated to the v
    heads), v [T, heads, dv], g (log decay <= 0) and beta [T, heads]. Returns o [T, heads, dv] in
    fp32. Recurrence per head with state M [dk, dv]:
        M <- exp(g_t) M;  M <- M + k_t (beta_t (v_t - M^T k_t))^T;  o_t = M^T q_t
    computed chunkwise in the WY form (Yang et al., Gated Delta Networks, arXiv:2412.06464)."""
    T, heads, dk = k.shape
    chunk = chunk or min(64, max(16, dk))   # ~dk: O(C^2) in-chunk work vs O(dk dv) state work
    pad = (-T) % chunk
    q, k, v, g, beta = [F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad))
                        for t in (q, k, v, g, beta)]
    n = (T + pad) // chunk
    # q, k, v [heads, n, C, d]; g, beta [heads, n, C]
    q, k, v = [t.view(n, chunk, heads, -1).permute(2, 0, 1, 3) for t in (q, k, v)]
    g, beta = [t.view(n, chunk, heads).permute(2, 0, 1) for t in (g, beta)]
    gc = g.cumsum(-1)                                          # cumulative log decay in a chunk
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # [heads, n, C, C]
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~tri, -float("inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * decay).tril(-1)            # strictly lower part
    eye = torch.eye(chunk, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)  # (I + A)^-1
    u = Tinv @ (v * beta[..., None])                           # pseudo-values
    w = Tinv @ (kb * gc[..., None].exp())                      # decayed keys
    state = q.new_zeros(heads, dk, v.shape[-1])
    out = []
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state
        intra = (q[:, i] @ k[:, i].transpose(-1, -2) * decay[:, i]) @ v_new
        out.append((q[:, i] * gc[:, i, :, None].exp()) @ state + intra)
        last = gc[:, i, -1]
        k_decayed = k[:, i] * (last[:, None] - gc[:, i]).exp()[..., None]
        state = state * last[:, None, None].exp() + k_decayed.transpose(-1, -2) @ v_new
    o = torch.stack(out, 1).reshape(heads, n * chunk, -1).transpose(0, 1)  # [T_padded, heads, dv]
    return o[:T]

def _chunk_list(cu):
    # fla's work list, (document, chunk within it) of each 64-token chunk [n_chunks, 2], from the
    # host's boundaries (fla.ops.utils.prepare_chunk_indices syncs on the device's every forward)
    counts = (np.diff(cu) + 63) // 64                                  # numpy: positions_from_cu
    doc = np.repeat(np.arange(len(counts)), counts)
    first = np.cumsum(counts) - counts
    return np.stack([doc, np.arange(len(doc)) - first[doc]], 1)

@functools.lru_cache(maxsize=4)
def _chunk_indices(cu, device):   # cu: a tuple
    return upload(torch.from_numpy(_chunk_list(cu)), device)

class Docs(NamedTuple):
    """A packed row's document boundaries as every layer reads them, made on the host (a compiled
    layer never syncs): cu [n+1] long on the row's device and as a host list; fla's chunk list and
    the longest document (fla, flash attention); pad (plain torch): pad_docs' index [n_docs,
    longest], which of it is real, each token's document and unpad_docs' index."""
    cu: torch.Tensor
    bounds: list
    chunks: torch.Tensor | None
    longest: int
    pad: tuple | None = None

    @staticmethod
    def of(cu_seqlens, device, kernels=True):
        # cu_seqlens [n+1] long on the CPU. kernels=False on a GPU: the plain-torch layers (they
        # have a backward; quality.py trains a target with them)
        bounds = cu_seqlens.tolist()
        cu, lens = np.asarray(bounds), np.diff(bounds)
        docs = Docs(upload(cu_seqlens, device), bounds, None, int(lens.max()))
        if device.type == "cuda" and kernels:
            return docs._replace(chunks=_chunk_indices(tuple(bounds), device))
        j = np.arange(lens.max())
        valid = j[None, :] < lens[:, None]
        pad = (np.where(valid, cu[:-1, None] + j, 0), valid, np.repeat(np.arange(len(lens)), lens),
               np.flatnonzero(valid))
        return docs._replace(pad=tuple(upload(torch.from_numpy(a), device) for a in pad))

@functools.cache
def _fla():   # imported lazily: CPU users and CI never need triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    return chunk_gated_delta_rule, causal_conv1d, rms_norm_gated

# -----------------------------------------------------------------------------
# target config and layers

FP32_PARAMS = ("A_log", "dt_bias")   # GDN decay parameters: fp32 whatever the model dtype

# transformers' Qwen3_5TextConfig and Qwen3_5MoeTextConfig defaults where they differ from the 27B
# values below (a config.json without the field gets these, as in transformers)
HF_TEXT_DEFAULTS = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                        num_attention_heads=16, linear_num_value_heads=32,
                        max_position_embeddings=32768)
# intermediate_size 0: no dense SwiGLU (Qwen3_5MoeTextConfig has no such field)
HF_MOE_TEXT_DEFAULTS = dict(hidden_size=2048, intermediate_size=0, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2,
                            linear_num_value_heads=32, max_position_embeddings=32768)
# Qwen3.5 MoE fields (transformers Qwen3_5MoeTextConfig): none may be set in a dense config
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
              "shared_expert_intermediate_size")

@dataclass
class TargetConfig:
    vocab_size: int = 248320            # embedding / lm_head rows (padded vocab)
    hidden_size: int = 5120             # d_model
    intermediate_size: int = 17408      # SwiGLU width (dense targets; an MoE target has none)
    num_hidden_layers: int = 64         # decoder layers
    layer_types: list = None            # "linear_attention" (GDN) or "full_attention" per layer
    full_attention_interval: int = 4    # no layer_types: layer i is full iff (i+1) % 4 == 0
    num_attention_heads: int = 24       # gated attention query heads
    num_key_value_heads: int = 4        # gated attention kv heads (GQA)
    head_dim: int = 256                 # gated attention head size (not hidden/heads)
    linear_num_key_heads: int = 16      # GDN q/k heads
    linear_num_value_heads: int = 48    # GDN v heads; v-head j reads q/k head j // (48/16)
    linear_key_head_dim: int = 128      # GDN q/k head size
    linear_value_head_dim: int = 128    # GDN v head size
    linear_conv_kernel_dim: int = 4     # causal depthwise conv width
    rms_norm_eps: float = 1e-6          # every norm, the GDN gated norm included
    rope_theta: float = 1e7             # RoPE base
    partial_rotary_factor: float = 0.25 # RoPE on the first 25% of each head (64 of 256 dims)
    rope_scaling: dict = None           # None, or HF's linear/yarn rope dict (no rope_theta)
    max_position_embeddings: int = 262144  # copied into the drafter; YaRN's default original
    tie_word_embeddings: bool = False   # lm_head shares embed_tokens
    fp8_block: list = None              # block-FP8 checkpoint: [rows, cols] of a scale block
    num_experts: int = 0                # routed experts per layer (qwen3_5_moe); 0: dense MLP
    num_experts_per_tok: int = 8        # experts each token is routed to (top-k)
    moe_intermediate_size: int = 512    # SwiGLU width of each routed expert
    shared_expert_intermediate_size: int = 512  # SwiGLU width of the always-on shared expert
    init_std: float = 0.02              # random init of presets (no checkpoint)

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0
                                else "linear_attention" for i in range(self.num_hidden_layers)]
        # messages as from_hf's: "field = value is not supported: why" (it prefixes the file)
        bad = [t for t in self.layer_types if t not in ("full_attention", "linear_attention")]
        if bad:
            raise ValueError(f"layer_types = {bad[0]!r} is not supported: Qwen3.5/3.6 layers are "
                             "full_attention or linear_attention")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types = '{len(self.layer_types)} entries' is not supported: "
                             f"num_hidden_layers is {self.num_hidden_layers}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok = {self.num_experts_per_tok} is not supported: "
                             f"must be 1..num_experts ({self.num_experts})")

    @classmethod
    def from_hf(cls, path):
        """config.json of an HF checkpoint (multimodal, text_config, or text-only); absent fields
        take transformers' defaults, but a qwen3_5_moe config must give MOE_FIELDS. A field that
        changes the math and that this target lacks: a one-line ValueError naming it."""
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(file) as f:
            cfg = json.load(f)
        arch = cfg.get("architectures", ["?"])[0]
        if str(cfg.get("model_type")).removesuffix("_text") not in ("qwen3_5", "qwen3_5_moe"):
            raise ValueError(f"{file}: model_type {cfg.get('model_type')!r} ({arch}) is not "
                             "supported; this trainer's target is the Qwen3.5/Qwen3.6 hybrid "
                             "(model_type qwen3_5 or qwen3_5_moe)")
        text = cfg.get("text_config", cfg)
        def fail(field, value, why):
            raise ValueError(f"{file}: {field} = {value!r} is not supported: {why}")
        moe = cfg["model_type"].startswith("qwen3_5_moe")
        given = {f.name: text[f.name] for f in fields(cls) if f.name in text}
        kw = {**(HF_MOE_TEXT_DEFAULTS if moe else HF_TEXT_DEFAULTS), **given}
        # the multimodal model ties lm_head by the wrapper's flag, not text_config's (transformers
        # 5.x Qwen3_5ForConditionalGeneration); a text-only config reads its own (default False)
        kw["tie_word_embeddings"] = cfg.get("tie_word_embeddings", False)
        # transformers' qwen3_5_moe: every layer is MoE and the top-k weights always sum to 1
        every = "every layer of a qwen3_5_moe model is MoE"
        moe_checks = [
            *[(k, k in text, f"a qwen3_5_moe config needs {', '.join(MOE_FIELDS)}")
              for k in MOE_FIELDS],
            # (0 would make TargetConfig a dense model without its MLP)
            ("num_experts", text.get("num_experts", 1) > 0,
             "a qwen3_5_moe model routes every token to experts"),
            ("norm_topk_prob", text.get("norm_topk_prob", True) is True,
             "qwen3_5_moe renormalises the top-k weights"),
            ("mlp_only_layers", not text.get("mlp_only_layers"), every),
            ("decoder_sparse_step", text.get("decoder_sparse_step", 1) == 1, every),
        ] if moe else [(k, not text.get(k), f"an MoE field in a dense {cfg['model_type']} config; "
                        "use model_type qwen3_5_moe or remove it") for k in
                       MOE_FIELDS + ("norm_topk_prob", "mlp_only_layers", "decoder_sparse_step")]
        where = "text_config." if "text_config" in cfg else ""
        for field, ok, why in [
                ("hidden_act", text.get("hidden_act", "silu") == "silu",
                 "the MLP and the GDN conv use SiLU"),
                ("attention_bias", not text.get("attention_bias", False),
                 "the projections have no biases"),
                *[(where + field, ok, why) for field, ok, why in moe_checks]]:
            if not ok:
                fail(field, text.get(field.split(".")[-1]), why)
        # RoPE as transformers 5.x reads it (modeling_rope_utils.py convert_rope_params_to_dict,
        # standardize_rope_params): a legacy rope_scaling replaces rope_parameters, rope_theta and
        # partial_rotary_factor in it beat top-level ones (else 10000, 0.25: Qwen3_5TextConfig)
        if text.get("rope_scaling") and text.get("rope_parameters"):
            fail("rope_scaling", text["rope_scaling"],
                 "rope_parameters is also set, and transformers would ignore it (its rope_theta "
                 "too): move the scaling keys into rope_parameters")
        where = "rope_scaling" if text.get("rope_scaling") else "rope_parameters"
        rope = dict(text.get(where) or {})
        kw["rope_theta"] = rope.pop("rope_theta", text.get("rope_theta", 10000.0))
        kw["partial_rotary_factor"] = rope.pop("partial_rotary_factor",
                                               text.get("partial_rotary_factor", 0.25))
        # M-RoPE: text positions are equal in all three (t, h, w) rows, so any section layout is
        # 1-D RoPE (modeling_qwen3_5.py Qwen3_5TextRotaryEmbedding.recomposition_frequencies)
        for k in ("mrope_section", "mrope_interleaved"):
            rope.pop(k, None)
        check_rope(rope, lambda field, value, why: fail(f"{where}.{field}", value, why))
        if rope_type(rope) == "yarn" and "original_max_position_embeddings" in text:
            fail("original_max_position_embeddings", text["original_max_position_embeddings"],
                 f"Qwen3_5TextConfig ignores it at the top level: put it in {where}")
        kw["rope_scaling"] = rope if rope_type(rope) != "default" else None
        # the one quantized form read: block FP8 as Qwen's -FP8 checkpoints ship it (transformers
        # utils/quantization_config.py FineGrainedFP8Config): e4m3 weights, float weight_scale_inv
        # per block; FP8 weights are known by their scales, so modules_to_not_convert is not read
        q = cfg.get("quantization_config") or text.get("quantization_config") or {}
        block = q.get("weight_block_size")
        for field, ok, why in [
                ("quant_method", q.get("quant_method") == "fp8",
                 "only block-FP8 (quant_method fp8) checkpoints are read; use the bf16 checkpoint"),
                ("weight_block_size", isinstance(block, list) and len(block) == 2
                 and all(type(b) is int and b > 0 for b in block),
                 "need [rows, cols] of a scale block (per-tensor FP8 is not read)"),
                ("fmt", q.get("fmt", "e4m3") == "e4m3", "FP8 weights must be float8_e4m3fn"),
                ("activation_scheme", q.get("activation_scheme", "dynamic") == "dynamic",
                 "only dynamic"),
                ("scale_fmt", q.get("scale_fmt", "float") == "float", "scales must be floats")]:
            if q and not ok:
                fail(f"quantization_config.{field}", q.get(field), why)
        kw["fp8_block"] = list(block) if q else None
        try:   # layer_types and num_experts_per_tok: checked by __post_init__
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{file}: {e}") from None

    @classmethod
    def preset(cls, name):
        presets = {
            "qwen3.6-27b": dict(),   # the defaults above are the exact 27B geometry
            # Qwen3.5-35B-A3B and Qwen3.6-35B-A3B (one geometry): transformers' defaults, 262144
            # positions and 256 experts (top-8 of 512 wide + a shared expert of 512: our defaults)
            **dict.fromkeys(["qwen3.5-35b-a3b", "qwen3.6-35b-a3b"], dict(
                HF_MOE_TEXT_DEFAULTS, max_position_embeddings=262144, num_experts=256)),
            # a few-layer toy with the same structure, for CPU tests and the demo
            "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, max_position_embeddings=4096, init_std=0.1),
        }
        if name not in presets:
            raise ValueError(f"unknown target preset {name!r}; "
                             f"choose one of {sorted(presets)} or pass a checkpoint dir")
        return cls(**presets[name])

class GatedAttention(Attention):
    """Qwen3.5 full attention: causal GQA with q/k norm, partial RoPE and a sigmoid output gate."""
    def __init__(self, c):
        super().__init__(c, gated=True)

    def forward(self, x, rope, docs, cache=None):
        T, hd = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(T, self.n_heads, 2 * hd).chunk(2, dim=-1)  # [T, heads, hd]
        q = apply_rope(self.q_norm(q), *rope)
        k = apply_rope(self.k_norm(self.k_proj(x).view(T, self.n_kv_heads, hd)), *rope)
        v = self.v_proj(x).view(T, self.n_kv_heads, hd)
        if cache is not None:
            # decoding (Target.greedy): x is the newest token of T sequences, all at position n;
            # their keys and values [T, kv_heads, size, hd] fill up one position per step
            if "k" not in cache:
                cache.update(n=0, k=k.new_zeros(T, self.n_kv_heads, cache["size"], hd),
                             v=v.new_zeros(T, self.n_kv_heads, cache["size"], hd))
            n = cache["n"]
            cache["k"][:, :, n], cache["v"][:, :, n], cache["n"] = k, v, n + 1
            o = F.scaled_dot_product_attention(q[:, :, None], cache["k"][:, :, :n + 1],
                                               cache["v"][:, :, :n + 1], enable_gqa=True)[:, :, 0]
        elif docs.chunks is not None:
            # document-causal attention over all documents in one varlen (flash) call, K/V repeated
            # to the query heads (the fastest of the kernels bench.py target compares)
            from torch.nn.attention.varlen import varlen_attn
            rep, cu32 = self.n_heads // self.n_kv_heads, docs.cu.to(torch.int32)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            o = varlen_attn(q, k, v, cu32, cu32, docs.longest, docs.longest, window_size=(-1, 0))
        else:
            # documents padded to [n_docs, heads, longest, hd]: causal, so no query sees the padding
            q, k, v = (pad_docs(t, docs).transpose(1, 2) for t in (q, k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o = unpad_docs(o.transpose(1, 2), docs)                   # [T, heads, hd]
        return self.o_proj(o.reshape(T, -1) * torch.sigmoid(gate.reshape(T, -1)))

class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear-attention layer: causal conv -> gated delta rule -> gated RMSNorm."""
    def __init__(self, c):
        super().__init__()
        self.n_qk, self.n_v = c.linear_num_key_heads, c.linear_num_value_heads
        self.dk, self.dv, self.eps = c.linear_key_head_dim, c.linear_value_head_dim, c.rms_norm_eps
        key_dim, value_dim = self.n_qk * self.dk, self.n_v * self.dv
        qkv_dim = 2 * key_dim + value_dim                   # flat [q | k | v]
        self.in_proj_qkv = nn.Linear(c.hidden_size, qkv_dim, bias=False)
        self.in_proj_z = nn.Linear(c.hidden_size, value_dim, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.n_v, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.n_v, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(qkv_dim, 1, c.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.n_v))
        self.A_log = nn.Parameter(torch.zeros(self.n_v))
        self.norm = RMSNorm(self.dv, self.eps)              # plain weight, then * silu(z)
        self.out_proj = nn.Linear(value_dim, c.hidden_size, bias=False)

    def forward(self, x, rope, docs, cache=None):     # rope unused: GDN has no positions
        T, key_dim = x.shape[0], self.n_qk * self.dk
        qkv = self.in_proj_qkv(x)
        z = self.in_proj_z(x).view(T, self.n_v, self.dv)
        beta = torch.sigmoid(self.in_proj_b(x))
        # log decay per step and v-head, in fp32
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())
        split = [key_dim, key_dim, self.n_v * self.dv]
        if cache is None and docs.chunks is not None:
            chunk_gated_delta_rule, causal_conv1d, rms_norm_gated = _fla()
            y, _ = causal_conv1d(qkv[None], weight=self.conv1d.weight[:, 0], activation="silu",
                                 cu_seqlens=docs.cu, chunk_indices=docs.chunks)
            q, k, v = y[0].split(split, dim=-1)
            q, k = q.view(1, T, self.n_qk, self.dk), k.view(1, T, self.n_qk, self.dk)
            o, _ = chunk_gated_delta_rule(q, k, v.view(1, T, self.n_v, self.dv), g=g[None],
                                          beta=beta[None], use_qk_l2norm_in_kernel=True,
                                          cu_seqlens=docs.cu, chunk_indices=docs.chunks)
            o = rms_norm_gated(o[0], z, self.norm.weight, None, activation="swish", eps=self.eps)
        else:
            width = self.conv1d.weight.shape[-1]
            if cache is not None:
                # decoding (greedy): each of the T sequences' last width-1 conv inputs are cached
                past = cache.get("conv", qkv.new_zeros(T, qkv.shape[1], width - 1))
                windows = torch.cat([past, qkv[:, :, None]], 2)           # [T, channels, width]
                cache["conv"] = windows[:, :, 1:]
            else:
                # a causal conv restarting at every document: taps from other documents zeroed
                doc = docs.pad[2]
                windows = F.pad(qkv, (0, 0, width - 1, 0)).unfold(0, width, 1)  # [T, channels, w]
                window_doc = F.pad(doc, (width - 1, 0), value=-1).unfold(0, width, 1)  # [T, width]
                windows = windows * (window_doc == doc[:, None])[:, None, :].to(windows.dtype)
            y = F.silu((windows * self.conv1d.weight[:, 0]).sum(-1))
            q, k, v = y.split(split, dim=-1)
            # l2norm as HF/FLA do it: x / sqrt(|x|^2 + 1e-6) (not F.normalize's x / max(|x|, eps))
            q, k = (t.view(T, self.n_qk, self.dk).float() for t in (q, k))
            q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * self.dk ** -0.5
            k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
            rep = self.n_v // self.n_qk                      # v-head j reads q/k head j // rep
            q, k = (t.repeat_interleave(rep, dim=1) for t in (q, k))
            v = v.view(T, self.n_v, self.dv)
            if cache is not None:
                # one step of the recurrence (torch_chunk_gated_delta_rule), M [T, heads, dk, dv]
                M = cache.get("state", q.new_zeros(T, self.n_v, self.dk, self.dv))
                M = M * g.exp()[..., None, None]
                delta = beta[..., None].float() * (v.float() - (M * k[..., None]).sum(-2))
                cache["state"] = M = M + k[..., None] * delta[..., None, :]
                o = (M * q[..., None]).sum(-2).to(x.dtype)                   # [T, heads, dv]
            else:
                # every document restarts the state: pad them into a batch folded into the heads
                n_docs, longest = len(docs.bounds) - 1, docs.longest
                def fold(t):   # [T, heads, ...] -> [longest, n_docs * heads, ...]
                    return pad_docs(t, docs).transpose(0, 1).reshape(
                        longest, n_docs * self.n_v, *t.shape[2:])
                o = torch_chunk_gated_delta_rule(*(fold(t) for t in (q, k, v, g, beta)))
                # [n_docs, longest, heads, dv]
                o = o.view(longest, n_docs, self.n_v, self.dv).transpose(0, 1)
                o = unpad_docs(o, docs).to(x.dtype)
            o = (self.norm(o).float() * F.silu(z.float())).to(x.dtype)
        return self.out_proj(o.reshape(T, -1))

def expert_linear(x, w, ends):
    """x [P, in], rows grouped by expert (e's end at row ends[e]); w [E, out, in] -> [P, out]"""
    if x.dtype == torch.bfloat16 and w.shape[1] % 8 == 0 and w.shape[2] % 8 == 0:
        # one grouped GEMM (CUTLASS on sm90+), its offsets on the device: no host sync
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    return per_expert_linear(x, w, ends)    # rows not 16-byte aligned (toy sizes) or fp32

def per_expert_linear(x, w, ends):
    # expert_linear as one matmul per expert on its contiguous slice (host sync for the split
    # sizes); bench.py times and checks the grouped GEMM against it
    sizes = ends.diff(prepend=ends.new_zeros(1)).tolist()
    return torch.cat([F.linear(xe, we) for xe, we in zip(x.split(sizes), w)])

class MoE(nn.Module):
    """Qwen3.5/3.6 sparse MoE MLP (transformers' Qwen3_5MoeSparseMoeBlock): softmax router over all
    experts in fp32, top-k renormalised to sum to 1; SwiGLU experts fused in 3-D tensors (as the
    official checkpoints store them); a shared SwiGLU expert times sigmoid(shared_expert_gate)."""
    def __init__(self, c):
        super().__init__()
        E, H, I = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.top_k = c.num_experts_per_tok
        self.gate = nn.Linear(H, E, bias=False)                              # the router
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))   # [gate | up] rows
        self.experts.down_proj = nn.Parameter(torch.empty(E, H, I))
        self.shared_expert = MLP(H, c.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def forward(self, x):
        T, k, E = x.shape[0], self.top_k, self.gate.out_features
        probs = self.gate(x).float().softmax(-1)   # logits in the model dtype, softmax in fp32
        w, idx = probs.topk(k, dim=-1)             # [T, k]
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        # the T*k (token, slot) pairs sorted by expert: every expert's rows are one contiguous slice
        expert, order = idx.flatten().sort(stable=True)          # [T*k]
        ends = torch.searchsorted(expert, torch.arange(1, E + 1, device=x.device))  # [E] (no sync)
        gate, up = expert_linear(x[order // k], self.experts.gate_up_proj, ends).chunk(2, dim=-1)
        out = expert_linear(F.silu(gate) * up, self.experts.down_proj, ends)  # [T*k, H], sorted
        out = torch.empty_like(out).index_copy_(0, order, out).view(T, k, -1)   # token order
        routed = torch.bmm(w[:, None, :], out)[:, 0]     # sum over the k slots, fp32 accumulate
        return routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)

class TargetLayer(nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        self.kind = kind
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, plus_one=True)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, plus_one=True)
        if kind == "full_attention":
            self.self_attn = GatedAttention(c)
        else:
            self.linear_attn = GatedDeltaNet(c)
        self.mlp = MoE(c) if c.num_experts else MLP(c.hidden_size, c.intermediate_size)

    def forward(self, h, rope, docs, cache=None):
        mixer = self.self_attn if self.kind == "full_attention" else self.linear_attn
        h = h + mixer(self.input_layernorm(h), rope, docs, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

# -----------------------------------------------------------------------------
# the target model: random or an HF checkpoint; features for the drafter, logits for generation

def dequantize_fp8(w, scale_inv, block, dtype, what="weight_scale_inv"):
    """A block-FP8 weight w [rows, cols] (float8_e4m3fn) times its scales scale_inv
    [ceil(rows/b0), ceil(cols/b1)]: W[i, j] = w[i, j] * scale_inv[i // b0, j // b1], the last block
    of a row or column partial (transformers integrations/finegrained_fp8.py FP8Linear allocates
    the scales so). In fp32, rounded once to dtype; the scales are never expanded to w's size."""
    (rows, cols), (b0, b1) = w.shape, block
    grid = (-(-rows // b0), -(-cols // b1))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"{what} has shape {tuple(scale_inv.shape)}, expected {grid} for a weight "
                         f"[{rows}, {cols}] in blocks of {list(block)} "
                         "(quantization_config.weight_block_size)")
    s = scale_inv.float().repeat_interleave(b0, dim=0)[:rows]      # [rows, cols in blocks]
    W = w.float()
    full = cols // b1
    W[:, :full * b1].view(rows, full, b1).mul_(s[:, :full, None])  # whole column blocks
    W[:, full * b1:].mul_(s[:, full:])                             # the partial one (if any)
    return W.to(dtype)

class Target(nn.Module):
    """Frozen hybrid target. Builds only what the caller needs: layers [0, n_layers) (up to the
    last tapped one on a target rank; none on a drafter rank, which borrows embed_tokens and
    lm_head), and the final norm and lm_head when head=True. Names are the checkpoint's."""
    def __init__(self, config, n_layers=None, head=True):
        super().__init__()
        c = self.config = config
        self.n_layers = n_layers if n_layers is not None else c.num_hidden_layers
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(c, kind) for kind in c.layer_types[:self.n_layers])
        # the final norm: with the head, or where every layer is (features' final)
        self.norm = (RMSNorm(c.hidden_size, c.rms_norm_eps, plus_one=True)
                     if head or self.n_layers == c.num_hidden_layers else None)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if head else None
        self.requires_grad_(False)

    @classmethod
    def build(cls, config, device="cpu", dtype=torch.float32, n_layers=None, head=True):
        """Random weights (presets, tests): deterministic per tensor name, made tensor by tensor."""
        with torch.device("meta"):
            model = cls(config, n_layers, head)
        state = {}
        for name, p in model.named_parameters():
            fp32 = name.endswith(FP32_PARAMS)
            t = torch.empty(p.shape, dtype=torch.float32 if fp32 else dtype, device=device)
            if name.endswith("A_log"):
                t.copy_(torch.linspace(0.0, 2.7, p.numel()))  # decay rates exp(A) in [1, 15]
            elif p.dim() == 1:   # dt_bias; the GDN gated norm's plain weight; zero-centred norms
                t.fill_(-2.0 if name.endswith("dt_bias") else
                        1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
            else:
                # embeddings N(0, 1) as nn.Embedding's, so a random target's text mostly follows
                # the last tokens (learnable: the demo's teacher); GPT-2's scaled residual outputs
                out = name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight",
                                     "down_proj"))
                std = 1.0 if name == "embed_tokens.weight" else config.init_std
                std = std / (2 * config.num_hidden_layers) ** 0.5 if out else std
                # a generator per tensor, seeded by its name: a rank that builds only some tensors
                # (a drafter rank: embed_tokens + lm_head) gets exactly the target rank's weights.
                # Small ones drawn on the CPU (a toy target is then the same on every device: the
                # demo data was made there); big ones on their device (27B of CPU normals: minutes)
                dev = t.device if t.numel() >= 1 << 24 else torch.device("cpu")
                gen = torch.Generator(dev).manual_seed(zlib.crc32(name.encode()))
                # fp32 draws: any dtype alike
                t.copy_(torch.empty(t.shape, device=dev).normal_(0.0, std, generator=gen))
            state[name] = t
        return model._assign(state)

    def _assign(self, state):
        # the module's tensors become those of state {name: tensor} (no copies)
        if self.config.tie_word_embeddings and self.lm_head is not None:
            state["lm_head.weight"] = state["embed_tokens.weight"]
        self.load_state_dict(state, assign=True)
        return self

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.bfloat16, n_layers=None, head=True):
        """An HF Qwen3.5/3.6 checkpoint dir (one model.safetensors, or shards with an index): only
        the tensors this rank needs, read straight to `device` into a model built on the meta
        device; block-FP8 ones (Qwen's -FP8 releases) dequantized to `dtype` one by one there."""
        from safetensors import safe_open
        config = TargetConfig.from_hf(path)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
                where = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        # official multimodal layout: model.language_model.* + lm_head.weight; text-only: model.*
        multimodal = any(k.startswith("model.language_model.") for k in where)
        prefix = "model.language_model." if multimodal else "model."
        with torch.device("meta"):
            model = cls(config, n_layers, head)
        # a tied lm_head is embed_tokens' tensor (_assign): read and dequantized once
        params = {name: p for name, p in model.named_parameters()
                  if not (config.tie_word_embeddings and name == "lm_head.weight")}
        wanted = {}   # shard file -> [(checkpoint key, expected shape, dtype)]
        keys_of = {}  # our name -> its checkpoint keys (several: experts stored one per expert)
        for name, p in params.items():
            key = name if name == "lm_head.weight" else prefix + name
            keys, shape = [key], tuple(p.shape)
            if key not in where and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # official checkpoints store each layer's experts fused, as ours ([E, 2I, H] and
                # [E, H, I]); transformers' save_pretrained one by one: experts.{e}.{proj}.weight
                projs = (("gate_proj", "up_proj") if name.endswith("gate_up_proj")
                         else ("down_proj",))
                keys = [f"{key.rsplit('.', 1)[0]}.{e}.{proj}.weight"
                        for e in range(p.shape[0]) for proj in projs]
                shape = (p.shape[1] // len(projs), p.shape[2])
            for k in keys:
                if k not in where:
                    also = f" (nor {key})" if k != key else ""
                    raise KeyError(f"{path}: tensor {k}{also} (for {name}) is missing from the "
                                   "checkpoint index/file")
                out = torch.float32 if name.endswith(FP32_PARAMS) else dtype
                wanted.setdefault(where[k], []).append((k, shape, out))
            keys_of[name] = keys
        tensors = {}
        # one shard open at a time: host memory stays near one shard
        for file, items in wanted.items():
            file = os.path.join(path, file)
            with safe_open(file, "pt", device=str(device)) as f:
                present = set(f.keys())
                for key, shape, out in items:
                    if key not in present:
                        raise KeyError(f"{file}: tensor {key}, listed in the index, is not in it")
                    t = f.get_tensor(key)
                    if tuple(t.shape) != shape:
                        raise ValueError(f"{file}: tensor {key} has shape {tuple(t.shape)}, "
                                         f"expected {shape} from config.json")
                    scale_key = key + "_scale_inv"   # FP8 tensors come with their block scales
                    if scale_key in where or (t.is_floating_point() and t.element_size() == 1):
                        if scale_key not in where or t.dtype != torch.float8_e4m3fn or t.dim() != 2:
                            raise ValueError(
                                f"{file}: tensor {key} ({t.dtype}, {t.dim()}-D) with {scale_key} "
                                f"{'present' if scale_key in where else 'absent'}: block-FP8 "
                                "weights are 2-D float8_e4m3fn with their scales")
                        if config.fp8_block is None:
                            raise ValueError(f"{file}: tensor {key} is block-FP8, but config.json "
                                             "has no quantization_config (quant_method fp8, "
                                             "weight_block_size)")
                        # (the index may put a weight and its scales in different shards)
                        scale_file = os.path.join(path, where[scale_key])
                        with safe_open(scale_file, "pt", device=str(device)) as g:
                            scale = g.get_tensor(scale_key)
                        t = dequantize_fp8(t, scale, config.fp8_block, out,
                                           f"{scale_file}: {scale_key}")
                    tensors[key] = t.to(out)
        # per-expert tensors, freed once stacked: [E (x2 gate, up), rows, cols] -> the parameter's
        return model._assign({name: tensors[keys[0]] if len(keys) == 1 else
                              torch.stack([tensors.pop(k) for k in keys]).view(params[name].shape)
                              for name, keys in keys_of.items()})

    def _run(self, ids, cu_seqlens, layer_ids, stop, prepared=None, caches=None):
        # layers [0, stop) over ids [T] -> (layer_ids' outputs concatenated or None, the last
        # layer's). Documents: cu_seqlens [n+1] on the CPU, or prepared = (Docs, positions [T])
        # (FeatureGraphs' buffers); a decoding step (greedy): (None, positions [T]) and caches
        c, h, taps = self.config, self.embed_tokens(ids), {}
        docs, pos = prepared or (Docs.of(cu_seqlens, h.device),
                                 upload(positions_from_cu(cu_seqlens), h.device))
        rope = rope_cos_sin(pos, int(c.head_dim * c.partial_rotary_factor), c.rope_theta,
                            c.rope_scaling, c.max_position_embeddings)
        for i in range(stop):
            h = self.layers[i](h, rope, docs, caches[i] if caches else None)
            if i in layer_ids:
                taps[i] = h
        return torch.cat([taps[i] for i in layer_ids], dim=-1) if layer_ids else None, h

    @torch.inference_mode()
    def features(self, ids, cu_seqlens, layer_ids, prepared=None, final=False):
        """Concatenated outputs of decoder layers `layer_ids` (HF hidden_states[i+1]) ->
        [T, len * hidden]; final: then the last layer's output, final-normed (what the LM head
        reads) -> [T, (len + 1) * hidden]. Stops computing after the last layer it needs."""
        stop = self.config.num_hidden_layers if final else max(layer_ids) + 1
        assert stop <= self.n_layers, f"layer {stop - 1} was not built"
        feats, h = self._run(ids, cu_seqlens, layer_ids, stop, prepared)
        return torch.cat([feats, self.norm(h)], -1) if final else feats

    def logits(self, ids, cu_seqlens, at=None):
        """Next-token logits [T, vocab], or only at the positions `at` ([len(at), vocab])."""
        return self.features_and_logits(ids, cu_seqlens, (), at)[1]

    @torch.inference_mode()
    def features_and_logits(self, ids, cu_seqlens, layer_ids, at=None):
        """One forward through every layer giving `features` (None without layer_ids) and `logits`:
        speculative decoding's verification forward also gives the next drafts' context."""
        assert self.n_layers == self.config.num_hidden_layers and self.norm is not None, (
            "logits need every layer and the head: build the target without n_layers")
        feats, h = self._run(ids, cu_seqlens, layer_ids, self.n_layers)
        return feats, self.lm_head(self.norm(h if at is None else h[at])).float()

    @torch.inference_mode()
    def greedy(self, prompts, new_tokens, temperature=0.0, generator=None):
        """Continuations of `prompts` (1-D id tensors), new_tokens each, decoded in lockstep with
        per-layer caches (attention keys/values, the GDN conv inputs and state), on the plain-torch
        path: sequence j reads its prompt while it lasts, then its own argmax (temperature > 0: a
        draw from softmax(logits / temperature) with `generator`, as a serving engine samples).
        Returns ids [n, longest prompt + new_tokens], row j = prompt j, then its continuation."""
        assert self.n_layers == self.config.num_hidden_layers and self.norm is not None, (
            "greedy needs every layer and the head: build the target without n_layers")
        dev, n = self.embed_tokens.weight.device, len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        seq = F.pad(nn.utils.rnn.pad_sequence(prompts, True), (0, new_tokens)).to(dev, torch.long)
        caches = [dict(size=seq.shape[1]) for _ in self.layers]
        for t in range(seq.shape[1] - 1):     # every sequence is at position t
            _, h = self._run(seq[:, t], None, (), self.n_layers,
                             (None, torch.full((n,), t, device=dev)), caches)
            logits = self.lm_head(self.norm(h)).float()
            nxt = (logits.argmax(-1) if not temperature else torch.multinomial(
                (logits / temperature).softmax(-1), 1, generator=generator)[:, 0])
            seq[:, t + 1] = torch.where(lens > t + 1, seq[:, t + 1], nxt)
        return seq

    def graphed_features(self, layer_ids, log=print, final=False):
        return None if self.config.num_experts else FeatureGraphs(self, layer_ids, log, final)

    def flops(self, cu_seqlens, n_layers):
        """Matmul FLOPs of a forward through layers [0, n_layers) over one packed row (for MFU)."""
        c, T, layers = self.config, int(cu_seqlens[-1]), self.layers[:n_layers]
        # the weights a token multiplies by: its 2-D ones, of each MoE's routed experts top_k of E
        linear = sum(p.numel() for p in layers.parameters() if p.dim() == 2)
        for moe in (m for m in layers.modules() if isinstance(m, MoE)):
            routed = moe.experts.gate_up_proj.numel() + moe.experts.down_proj.numel()
            linear += routed * moe.top_k // moe.gate.out_features
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
        n_full = sum(c.layer_types[i] == "full_attention" for i in range(n_layers))
        causal_pairs = float((lens * (lens + 1) / 2).sum())
        attn = n_full * 2 * 2 * c.num_attention_heads * c.head_dim * causal_pairs   # QK^T and PV
        # GDN core in 64-token chunks: ~ (4 chunk-local + 6 state) dk*dv FLOPs per token and v-head
        dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
        gdn = (n_layers - n_full) * T * c.linear_num_value_heads * dk * (10 * dv + 4 * 64)
        return 2 * linear * T + attn + gdn

# -----------------------------------------------------------------------------
# Target.graphed_features, a GPU hook train.py calls: the features replayed from CUDA graphs

class FeatureGraphs:
    """target.features(ids, cu_seqlens, layer_ids) from CUDA graphs. Kernel grids depend on a
    row only through its document count and fla's 64-token chunk count: one graph per such shape,
    captured its second time (fla's autotuner must have tuned), the row's values copied in before a
    replay. Flash attention gets the row length as the longest document: a bigger grid, the same
    result. One shared memory pool: outputs are copied out. Dense targets only (MoE syncs)."""
    def __init__(self, target, layer_ids, log=print, final=False):
        self.features, self.log = functools.partial(target.features, layer_ids=layer_ids,
                                                    final=final), log
        self.graphs, self.seen, self.pool, self.train_rows, self.bound = {}, set(), None, 0, None

    def __call__(self, ids, cu_seqlens, train=True):
        # the first train row autotunes fla's kernels, the second is timed: replays if bound
        if not self.bound:
            self.train_rows += train
            if self.train_rows != 2 or self.bound is not None:
                return self.features(ids, cu_seqlens)
            from speedups import launch_bound
            out, self.bound = launch_bound("target forward", self.features, ids, cu_seqlens,
                                           log=self.log)
            return out
        bounds = cu_seqlens.numpy()
        chunks = _chunk_list(bounds)
        key, dev, T = (len(bounds), len(chunks)), ids.device, ids.shape[0]
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self.features(ids, cu_seqlens)
            # fresh buffers: fla caches what it derives from cu_seqlens by tensor identity
            new = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
            docs = Docs(new(len(bounds)), None, new(len(chunks), 2), T)
            inputs, graph = (new(T), docs, new(T)), torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.features(inputs[0], None, prepared=(docs, inputs[2]))
            self.pool, self.graphs[key] = graph.pool(), (graph, inputs, out)
        graph, (ids_in, docs, pos), out = self.graphs[key]
        # one upload: boundaries, positions, chunk list
        host = np.concatenate([bounds, positions_from_cu(cu_seqlens).numpy(), chunks.ravel()])
        host = upload(torch.from_numpy(host), dev).split([len(bounds), T, chunks.size])
        ids_in.copy_(ids), docs.cu.copy_(host[0]), pos.copy_(host[1])
        docs.chunks.view(-1).copy_(host[2])
        graph.replay()
        return out.clone()
