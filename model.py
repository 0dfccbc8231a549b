"""
The two models of a DFlash run, bottom-up:
1) the frozen target: the Qwen3.5 / Qwen3.6 hybrid text model (Gated DeltaNet + gated attention), read
   straight from Hugging Face safetensors; fla-core kernels on GPU, the same math in plain torch on CPU.
2) the DFlash drafter: Qwen3 layers over a 16-token block whose keys/values also see the target's fused
   hidden states; its anchor mask, its loss, and save/load in the z-lab format that SGLang/vLLM load.
Facts and sources: ../shared/reference/target.md (target) and dflash.md (drafter).
"""
import functools
import json
import os
import zlib
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# small shared pieces

def rms_norm(x, weight, eps, plus_one=False):
    # Qwen3.5 stores its norms zero-centred (scale = 1 + w); Qwen3 and the GDN gated norm use plain w
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + 1.0 if plus_one else weight.float()
    return (xf * w).to(x.dtype)

def rope_cos_sin(pos, rot_dim, theta):
    # NeoX-style rotary angles in fp32; pos [T] -> cos, sin [T, rot_dim]
    inv_freq = theta ** -(torch.arange(0, rot_dim, 2, device=pos.device, dtype=torch.float32) / rot_dim)
    ang = pos.float()[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    return ang.cos(), ang.sin()

def apply_rope(x, cos, sin):
    # x [T, heads, hd]; rotates the first cos.shape[-1] dims (partial RoPE), pairs (i, i + rot/2)
    r = cos.shape[-1]
    xr, xp = x[..., :r].float(), x[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rot = torch.cat([-x2, x1], dim=-1)
    out = xr * cos[:, None, :] + rot * sin[:, None, :]
    return torch.cat([out.to(x.dtype), xp], dim=-1)

def positions_from_cu(cu_seqlens):
    # cu_seqlens [n+1] (CPU) -> positions [T] restarting at 0 in every document
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1], lens)
    return torch.arange(int(cu_seqlens[-1])) - starts

class RMSNorm(nn.Module):
    def __init__(self, dim, eps, plus_one=False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self.plus_one)

@functools.lru_cache(maxsize=4)
def _doc_index(cu):
    # for boundaries cu (a tuple): source index [n_docs, L_max] of each padded slot, and which slots are real
    lens = torch.tensor(cu).diff()
    j = torch.arange(int(lens.max()))
    valid = j[None, :] < lens[:, None]
    return (torch.tensor(cu[:-1])[:, None] + j).masked_fill(~valid, 0), valid

def pad_docs(x, cu_list):
    # [T, ...] -> [n_docs, L_max, ...], every document zero-padded at its end (CPU: one batched call for all)
    idx, valid = _doc_index(tuple(cu_list))
    return x[idx] * valid.view(*valid.shape, *[1] * (x.dim() - 1)).to(x.dtype)

def unpad_docs(y, cu_list):
    return y[_doc_index(tuple(cu_list))[1]]

def seeded_init_(name, t, std):
    # every tensor gets its own generator seeded by its name, so a rank that builds only some tensors
    # (a drafter rank builds just embed_tokens + lm_head) gets exactly the weights the target rank has.
    # Small tensors are drawn on the CPU (a toy target is then the same on every device: the demo data was
    # made on the CPU); big ones on their own device (27B CPU normals would take minutes).
    dev = t.device if t.numel() >= 1 << 24 else torch.device("cpu")
    g = torch.Generator(dev).manual_seed(zlib.crc32(name.encode()))
    t.copy_(torch.empty(t.shape, device=dev).normal_(0.0, std, generator=g))   # fp32 draws: the same in any dtype

# -----------------------------------------------------------------------------
# Gated DeltaNet core in plain torch (CPU path and test reference for the fla kernel)

def torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk=None):
    """One document. q, k [T, HV, K] (already l2-normalised, q scaled, heads repeated to HV), v [T, HV, V],
    g (log decay <= 0) and beta [T, HV]. Returns o [T, HV, V] in fp32. Recurrence per v-head, state S [K, V]:
    S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t. Done chunkwise (WY form)."""
    T, HV, K = k.shape
    chunk = chunk or min(64, max(16, K))   # ~K balances the O(C^2) in-chunk work against the O(K V) state work
    pad = (-T) % chunk
    q, k, v, g, beta = [F.pad(t.float(), (0, 0) * (t.dim() - 1) + (0, pad)) for t in (q, k, v, g, beta)]
    n = (T + pad) // chunk
    # [T, HV, D] -> [HV, n, C, D]
    q, k, v = [t.view(n, chunk, HV, -1).permute(2, 0, 1, 3) for t in (q, k, v)]
    g, beta = [t.view(n, chunk, HV).permute(2, 0, 1) for t in (g, beta)]
    gc = g.cumsum(-1)                                                     # cumulative log decay in a chunk
    tri = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~tri, -float("inf")).exp()  # [HV,n,C,C]
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * decay).tril(-1)                      # strictly lower part
    eye = torch.eye(chunk, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False)  # (I + A)^-1
    u = Tinv @ (v * beta[..., None])                                      # pseudo-values
    w = Tinv @ (kb * gc[..., None].exp())                                 # decayed keys
    S = q.new_zeros(HV, K, v.shape[-1])
    out = []
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ S
        intra = (q[:, i] @ k[:, i].transpose(-1, -2) * decay[:, i]) @ v_new
        out.append((q[:, i] * gc[:, i, :, None].exp()) @ S + intra)
        last = gc[:, i, -1]
        S = S * last[:, None, None].exp() + (k[:, i] * (last[:, None] - gc[:, i]).exp()[..., None]).transpose(-1, -2) @ v_new
    o = torch.stack(out, 1).reshape(HV, n * chunk, -1).transpose(0, 1)  # [T_pad, HV, V]
    return o[:T]

def _fla():
    # imported lazily: CPU users and CI never need triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    return chunk_gated_delta_rule, causal_conv1d, rms_norm_gated

# -----------------------------------------------------------------------------
# target layers

@dataclass
class TargetConfig:
    vocab_size: int = 248320            # embedding / lm_head rows (padded vocab)
    hidden_size: int = 5120             # d_model
    intermediate_size: int = 17408      # SwiGLU width
    num_hidden_layers: int = 64         # decoder layers
    layer_types: list = None            # "linear_attention" (GDN) or "full_attention" per layer
    full_attention_interval: int = 4    # layer i is full attention iff (i+1) % interval == 0 (when no layer_types)
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
    partial_rotary_factor: float = 0.25 # RoPE on the first 25% of each attention head (64 of 256 dims)
    max_position_embeddings: int = 262144  # copied into the drafter config
    tie_word_embeddings: bool = False   # lm_head shares embed_tokens
    init_std: float = 0.02              # random init of presets (no checkpoint)

    def __post_init__(self):
        if self.layer_types is None:
            self.layer_types = ["full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
                                for i in range(self.num_hidden_layers)]
        bad = set(self.layer_types) - {"full_attention", "linear_attention"}
        assert not bad, f"unsupported layer_types {bad}: this target supports Qwen3.5/3.6 hybrid layers only"
        assert len(self.layer_types) == self.num_hidden_layers, "layer_types must have one entry per layer"

    @classmethod
    def from_hf(cls, path):
        """config.json of an HF checkpoint: the multimodal wrapper (text_config) or a text-only config."""
        f = os.path.join(path, "config.json") if os.path.isdir(path) else path
        with open(f) as fh:
            cfg = json.load(fh)
        arch = cfg.get("architectures", ["?"])[0]
        if cfg.get("model_type") not in ("qwen3_5", "qwen3_5_text"):
            raise ValueError(f"{f}: model_type {cfg.get('model_type')!r} ({arch}) is not supported; "
                             "this trainer's target is the Qwen3.5/Qwen3.6 hybrid (model_type qwen3_5)")
        t = cfg.get("text_config", cfg)
        rope = {**t, **(t.get("rope_parameters") or {})}   # some exports flatten rope_theta into text_config
        kw = {f.name: t[f.name] for f in fields(cls) if f.name in t}
        kw.update(rope_theta=rope.get("rope_theta", 1e7), partial_rotary_factor=rope.get("partial_rotary_factor", 0.25))
        kw.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        return cls(**kw)

    @classmethod
    def preset(cls, name):
        presets = {
            "qwen3.6-27b": dict(),   # the defaults above are the exact 27B geometry
            # a few-layer toy with the same structure, for CPU tests and the demo
            "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                         max_position_embeddings=4096, init_std=0.1),
        }
        if name not in presets:
            raise ValueError(f"unknown target preset {name!r}; choose one of {sorted(presets)} or pass a checkpoint dir")
        return cls(**presets[name])

class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class GatedAttention(nn.Module):
    """Qwen3.5 full-attention layer: causal GQA with q/k norm, partial RoPE and a sigmoid output gate."""
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv, self.hd, self.eps = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd * 2, bias=False)   # per head: [query | gate]
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, self.eps, plus_one=True)
        self.k_norm = RMSNorm(self.hd, self.eps, plus_one=True)

    def forward(self, x, rope, cu, cu_list):
        T = x.shape[0]
        q, gate = self.q_proj(x).view(T, self.nh, 2 * self.hd).chunk(2, dim=-1)     # [T, nh, hd] each
        q = apply_rope(self.q_norm(q), *rope)
        k = apply_rope(self.k_norm(self.k_proj(x).view(T, self.nkv, self.hd)), *rope)
        v = self.v_proj(x).view(T, self.nkv, self.hd)
        if x.is_cuda:
            # Document-causal attention as one varlen (flash) call over all documents, K/V repeated to the query
            # heads. Measured on H200, 8192 tokens in 4 documents, forward: varlen_attn 1.15 ms, compiled flex
            # with a document mask 1.24 ms, SDPA per document 20 ms (it leaves the flash kernel here).
            from torch.nn.attention.varlen import varlen_attn
            rep, cu32 = self.nh // self.nkv, cu.to(torch.int32)
            L = max(b - a for a, b in zip(cu_list[:-1], cu_list[1:]))
            o = varlen_attn(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), cu32, cu32, L, L, window_size=(-1, 0))
        else:
            # CPU: documents padded into one batch [n, heads, L, hd]; causal, so no query sees the padding
            q, k, v = (pad_docs(t, cu_list).transpose(1, 2) for t in (q, k, v))
            o = unpad_docs(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2), cu_list)
        o = o.reshape(T, self.nh * self.hd)
        return self.o_proj(o * torch.sigmoid(gate.reshape(T, -1)))

class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear-attention layer: causal conv -> gated delta rule -> gated RMSNorm (target.md section 4)."""
    def __init__(self, c):
        super().__init__()
        self.H, self.HV = c.linear_num_key_heads, c.linear_num_value_heads
        self.K, self.V, self.eps = c.linear_key_head_dim, c.linear_value_head_dim, c.rms_norm_eps
        kd, vd = self.H * self.K, self.HV * self.V
        self.in_proj_qkv = nn.Linear(c.hidden_size, 2 * kd + vd, bias=False)   # flat [q | k | v]
        self.in_proj_z = nn.Linear(c.hidden_size, vd, bias=False)
        self.in_proj_b = nn.Linear(c.hidden_size, self.HV, bias=False)
        self.in_proj_a = nn.Linear(c.hidden_size, self.HV, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(2 * kd + vd, 1, c.linear_conv_kernel_dim))
        self.dt_bias = nn.Parameter(torch.ones(self.HV))
        self.A_log = nn.Parameter(torch.zeros(self.HV))
        self.norm = RMSNorm(self.V, self.eps)              # plain weight, then * silu(z)
        self.out_proj = nn.Linear(vd, c.hidden_size, bias=False)

    def forward(self, x, rope, cu, cu_list):     # rope unused: GDN has no positions
        T, kd = x.shape[0], self.H * self.K
        qkv, z = self.in_proj_qkv(x), self.in_proj_z(x).view(T, self.HV, self.V)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float())  # log decay, fp32
        if x.is_cuda:
            chunk_gated_delta_rule, causal_conv1d, rms_norm_gated = _fla()
            y, _ = causal_conv1d(qkv[None], weight=self.conv1d.weight[:, 0], activation="silu", cu_seqlens=cu)
            q, k, v = y[0].split([kd, kd, self.HV * self.V], dim=-1)
            o, _ = chunk_gated_delta_rule(q.view(1, T, self.H, self.K), k.view(1, T, self.H, self.K),
                                          v.view(1, T, self.HV, self.V), g=g[None], beta=beta[None],
                                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
            o = rms_norm_gated(o[0], z, self.norm.weight, None, activation="swish", eps=self.eps)
        else:
            # causal depthwise conv that restarts at every document start: zero the taps from other documents
            W = self.conv1d.weight.shape[-1]
            doc = torch.repeat_interleave(torch.arange(len(cu_list) - 1), torch.tensor(cu_list).diff())
            win = F.pad(qkv, (0, 0, W - 1, 0)).unfold(0, W, 1)                    # [T, C, W]
            dwin = F.pad(doc, (W - 1, 0), value=-1).unfold(0, W, 1)                # [T, W]
            win = win * (dwin == doc[:, None])[:, None, :].to(win.dtype)
            y = F.silu((win * self.conv1d.weight[:, 0]).sum(-1))
            q, k, v = y.split([kd, kd, self.HV * self.V], dim=-1)
            # l2norm as HF/FLA do it: x / sqrt(|x|^2 + 1e-6) (F.normalize's x / max(|x|, eps) differs for small |x|)
            q, k = (t.view(T, self.H, self.K).float() for t in (q, k))
            q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * self.K ** -0.5
            k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
            q, k = (t.repeat_interleave(self.HV // self.H, dim=1) for t in (q, k))  # v-head j reads q/k head j // r
            v = v.view(T, self.HV, self.V)
            # every document restarts the state: pad them into one batch and fold the batch into the heads
            n, L = len(cu_list) - 1, max(b - a for a, b in zip(cu_list[:-1], cu_list[1:]))
            fold = lambda t: pad_docs(t, cu_list).transpose(0, 1).reshape(L, n * self.HV, *t.shape[2:])  # [L, n*HV, ..]
            o = torch_chunk_gated_delta_rule(*(fold(t) for t in (q, k, v, g, beta)))
            o = unpad_docs(o.view(L, n, self.HV, self.V).transpose(0, 1), cu_list).to(x.dtype)
            o = (self.norm(o).float() * F.silu(z.float())).to(x.dtype)
        return self.out_proj(o.reshape(T, -1))

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
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, h, rope, cu, cu_list):
        x = self.input_layernorm(h)
        h = h + (self.self_attn if self.kind == "full_attention" else self.linear_attn)(x, rope, cu, cu_list)
        return h + self.mlp(self.post_attention_layernorm(h))

class Target(nn.Module):
    """Frozen hybrid target. Builds only what the caller needs: layers [0, n_layers) (up to the last tapped
    one on a target rank; 0 on a drafter rank, which only borrows embed_tokens and lm_head) and lm_head
    when head=True (target ranks never need it)."""
    def __init__(self, config, n_layers=None, head=True):
        super().__init__()
        c = self.config = config
        self.n_layers = n_layers if n_layers is not None else c.num_hidden_layers
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([TargetLayer(c, c.layer_types[i]) for i in range(self.n_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, plus_one=True) if self.n_layers == c.num_hidden_layers else None
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if head else None
        self.requires_grad_(False)

    @classmethod
    def build(cls, config, device="cpu", dtype=torch.float32, n_layers=None, head=True):
        """Random weights (presets, tests): deterministic per tensor name, made tensor by tensor on the CPU."""
        with torch.device("meta"):
            model = cls(config, n_layers, head)
        sd = {}
        for name, p in model.named_parameters():
            t = torch.empty(p.shape, dtype=torch.float32 if name.endswith(("A_log", "dt_bias")) else dtype, device=device)
            if name.endswith("A_log"):
                t.copy_(torch.linspace(0.0, 2.7, p.numel()))            # decay rates exp(A) in [1, 15]
            elif name.endswith("dt_bias"):
                t.fill_(-2.0)
            elif name.endswith("linear_attn.norm.weight"):
                t.fill_(1.0)                                            # GDN gated norm: plain weight
            elif p.dim() == 1:
                t.zero_()                                               # zero-centred norms: scale 1 + 0
            else:   # embeddings N(0, 1) as nn.Embedding's default, so a random target's text is mostly a
                # function of the last tokens (learnable: the demo's teacher); GPT-2's residual scaling on outputs
                out = name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))
                std = 1.0 if name == "embed_tokens.weight" else config.init_std
                seeded_init_(name, t, std / (2 * config.num_hidden_layers) ** 0.5 if out else std)
            sd[name] = t
        if config.tie_word_embeddings and head:
            sd["lm_head.weight"] = sd["embed_tokens.weight"]
        model.load_state_dict(sd, assign=True)
        return model

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.bfloat16, n_layers=None, head=True):
        """Load an HF Qwen3.5/3.6 checkpoint dir (single model.safetensors or sharded with an index), reading
        only the tensors this rank needs, straight to `device` (the model is built on the meta device)."""
        from safetensors import safe_open
        config = TargetConfig.from_hf(path)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                where = json.load(f)["weight_map"]
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
                where = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
        # official multimodal layout: model.language_model.* + lm_head.weight; text-only layout: model.*
        prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in where) else "model."
        with torch.device("meta"):
            model = cls(config, n_layers, head)
        wanted = {}
        for name, p in model.named_parameters():
            key = "lm_head.weight" if name == "lm_head.weight" else prefix + name
            if key == "lm_head.weight" and config.tie_word_embeddings:
                key = prefix + "embed_tokens.weight"
            if key not in where:
                raise KeyError(f"{path}: tensor {key} (for {name}) is missing from the checkpoint index/file")
            wanted.setdefault(where[key], []).append((name, key, p))
        sd = {}
        for file, items in wanted.items():
            with safe_open(os.path.join(path, file), "pt", device=str(device)) as f:
                names = set(f.keys())
                for name, key, p in items:
                    if key not in names:
                        raise KeyError(f"{os.path.join(path, file)}: tensor {key} listed in the index is not in this file")
                    t = f.get_tensor(key)
                    if tuple(t.shape) != tuple(p.shape):
                        raise ValueError(f"{os.path.join(path, file)}: tensor {key} has shape {tuple(t.shape)}, "
                                         f"expected {tuple(p.shape)} from config.json")
                    sd[name] = t.to(torch.float32 if name.endswith(("A_log", "dt_bias")) else dtype)
        model.load_state_dict(sd, assign=True)
        return model

    def _run(self, ids, cu_seqlens, stop):
        # ids [T] long (device), cu_seqlens [n+1] long on the CPU: boundaries of the packed documents
        cu_list = cu_seqlens.tolist()
        pos = positions_from_cu(cu_seqlens).to(ids.device)
        rope = rope_cos_sin(pos, int(self.config.head_dim * self.config.partial_rotary_factor), self.config.rope_theta)
        cu = cu_seqlens.to(ids.device)
        h = self.embed_tokens(ids)
        for i in range(stop):
            h = self.layers[i](h, rope, cu, cu_list)
            yield i, h

    @torch.inference_mode()
    def features(self, ids, cu_seqlens, layer_ids):
        """Concatenated outputs of decoder layers `layer_ids` (HF hidden_states[i+1]) -> [T, len*H].
        Stops computing after the last requested layer."""
        assert max(layer_ids) < self.n_layers, f"tapped layer {max(layer_ids)} was not built (n_layers={self.n_layers})"
        hs = {i: h for i, h in self._run(ids, cu_seqlens, max(layer_ids) + 1) if i in layer_ids}
        return torch.cat([hs[i] for i in layer_ids], dim=-1)

    @torch.inference_mode()
    def logits(self, ids, cu_seqlens, at=None):
        """Next-token logits [T, V], or only at the positions `at` (generation needs just each document's last)."""
        assert self.norm is not None, "logits need every layer: build the target without n_layers"
        for _, h in self._run(ids, cu_seqlens, self.n_layers):
            pass
        return self.lm_head(self.norm(h if at is None else h[at])).float()

    def flops(self, cu_seqlens, n_layers):
        """Matmul FLOPs of a forward through layers [0, n_layers) over one packed row (for MFU)."""
        c, T = self.config, int(cu_seqlens[-1])
        lin = sum(p.numel() for n, p in self.layers[:n_layers].named_parameters() if p.dim() == 2)
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).double()
        n_full = sum(c.layer_types[i] == "full_attention" for i in range(n_layers))
        attn = n_full * 2 * 2 * c.num_attention_heads * c.head_dim * float((lens * (lens + 1) / 2).sum())  # causal QK^T, PV
        # GDN core, chunk form (64-token chunks): ~ (4 chunk-local + 6 state) K*V flops per token and v-head
        gdn = (n_layers - n_full) * T * c.linear_num_value_heads * c.linear_key_head_dim * (10 * c.linear_value_head_dim + 4 * 64)
        return 2 * lin * T + attn + gdn

# -----------------------------------------------------------------------------
# DFlash drafter (dflash.md sections 1-3)

def default_target_layer_ids(n_target_layers, n_feat):
    # z-lab/SpecForge/SGLang formula: evenly spaced from layer 1 to L-3, e.g. [1,16,31,46,61] for 64 layers
    if n_feat == 1:
        return [n_target_layers // 2]
    return [int(round(1 + i * (n_target_layers - 4) / (n_feat - 1))) for i in range(n_feat)]

@dataclass
class DrafterConfig:
    hidden_size: int = 5120             # must equal the target's hidden size (block embeddings are the target's)
    intermediate_size: int = 17408      # SwiGLU width (z-lab uses the target's)
    num_hidden_layers: int = 5          # drafter decoder layers
    num_attention_heads: int = 32       # Qwen3-style attention, independent of the target's
    num_key_value_heads: int = 8
    head_dim: int = 128
    target_layer_ids: list = field(default_factory=lambda: [1, 16, 31, 46, 61])  # tapped target layer outputs
    num_target_layers: int = 64         # engines range-check target_layer_ids against it
    block_size: int = 16                # anchor + 15 drafted tokens
    mask_token_id: int = 248070         # a row of the target's embedding used for the 15 masked slots
    vocab_size: int = 248320            # the target's (embedding and LM head are borrowed)
    rope_theta: float = 1e7             # the target's
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False   # copied from the target (informational)

    @classmethod
    def from_target(cls, t, n_feat=5, **overrides):
        toy = t.hidden_size < 1024   # shrink the attention of toy drafters (CPU demo) instead of 32 heads of 128
        known_mask = {248320: 248070, 151936: 151669}   # published z-lab mask ids for Qwen3.5/3.6 and Qwen3
        kw = dict(hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
                  num_attention_heads=4 if toy else 32, num_key_value_heads=2 if toy else 8, head_dim=16 if toy else 128,
                  target_layer_ids=default_target_layer_ids(t.num_hidden_layers, n_feat),
                  num_target_layers=t.num_hidden_layers, mask_token_id=known_mask.get(t.vocab_size, t.vocab_size - 1),
                  vocab_size=t.vocab_size, rope_theta=t.rope_theta, max_position_embeddings=t.max_position_embeddings,
                  rms_norm_eps=t.rms_norm_eps, tie_word_embeddings=t.tie_word_embeddings)
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

class DrafterAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context ; block] and whose queries are the block."""
    def __init__(self, c):
        super().__init__()
        self.nh, self.nkv, self.hd = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.hd, c.rms_norm_eps)
        self.k_norm = RMSNorm(self.hd, c.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, attend):
        Q, KV = x.shape[0], ctx.shape[0] + x.shape[0]
        kv_in = torch.cat([ctx, x])                                        # context keys first, then the block
        q = apply_rope(self.q_norm(self.q_proj(x).view(Q, self.nh, self.hd)), *rope_q)
        k = apply_rope(self.k_norm(self.k_proj(kv_in).view(KV, self.nkv, self.hd)), *rope_kv)
        v = self.v_proj(kv_in).view(KV, self.nkv, self.hd)
        o = attend(*(t.transpose(0, 1)[None] for t in (q, k, v)))          # [1, heads, Q, hd]
        return self.o_proj(o[0].transpose(0, 1).reshape(Q, self.nh * self.hd))

class DrafterLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DrafterAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    def forward(self, h, ctx, rope_q, rope_kv, attend):
        h = h + self.self_attn(self.input_layernorm(h), ctx, rope_q, rope_kv, attend)
        return h + self.mlp(self.post_attention_layernorm(h))

def anchor_mask_mod(anchors, keep, doc, S, B):
    """THE training mask (one definition for the flex BlockMask and the dense CPU mask). KV = [context (S) |
    block_0 .. block_{N-1}], Q = the blocks. A query of block j sees context kv < anchor_j (strictly: the
    anchor's own hidden state is not known at serving time) in the anchor's document, plus all B keys of its
    own block (bidirectional). Padded slots (keep False) see nothing. Indices are clamped because flex also
    evaluates padded tiles past Q_LEN/KV_LEN. Every per-step value is a device tensor: no recompiles."""
    N = anchors.shape[0]
    def mask_mod(b, h, q_idx, kv_idx):
        j = (q_idx // B).clamp(max=N - 1)
        a = anchors[j]
        ctx = (kv_idx < a) & (doc[kv_idx.clamp(max=S - 1)] == doc[a])
        blk = (kv_idx >= S) & ((kv_idx - S) // B == j)
        return (ctx | blk) & keep[j]
    return mask_mod

def sample_anchors(loss_mask, doc, n):
    """Up to n anchors per row, uniformly without replacement among positions whose next token is supervised
    and in the same document; sorted (sorted anchors keep flex tiles sparse). On device, no host sync.
    Returns anchors [n] long (0 in padded slots) and keep [n] bool."""
    valid = (loss_mask[1:] > 0) & (doc[1:] == doc[:-1])
    keys = torch.rand(valid.shape, device=valid.device).masked_fill(~valid, 2.0)
    picked = keys.topk(n, largest=False).indices                         # n random valid positions (if there are n)
    keep = keys[picked] < 2.0
    anchors = torch.where(keep, picked, valid.shape[0] + 1).sort().values  # padded slots sort last
    keep = anchors <= valid.shape[0]
    return torch.where(keep, anchors, 0), keep

def anchor_blocks(anchors, keep, doc, S, B, tile=128):
    """The BlockMask of anchor_mask_mod in closed form, eager and sort-free on the device: (kv_num, kv_idx,
    full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx), exactly what create_block_mask returns
    (test_smoke checks it). Why not create_block_mask inside the compiled step: on torch 2.11 its compiled
    argsort becomes a Triton sort whose cold compile took minutes at 512 anchors (pytorch#182060). Needs
    each document to be one contiguous run of `doc`, as the packer writes rows: then query row r of
    anchor j sees the interval [start of a_j's document, a_j) of context and its own B keys."""
    N, dev = anchors.shape[0], anchors.device
    Q, KV = N * B, S + N * B
    t = torch.arange(S, device=dev)
    new_doc = torch.ones(S, dtype=torch.bool, device=dev)
    new_doc[1:] = doc[1:] != doc[:-1]
    start = torch.where(new_doc, t, 0).cummax(0).values                  # first position of each token's document
    j = torch.arange(-(-Q // tile) * tile, device=dev) // B              # anchor of each (tile-padded) query row
    real = (j < N)[:, None]
    j = j.clamp(max=N - 1)
    a, kp = anchors[j][:, None], keep[j][:, None]
    lo, hi, blo = start[a], a, S + B * j[:, None]                        # context [lo, hi), own block [blo, blo+B)
    k0 = torch.arange(0, KV, tile, device=dev)[None, :]                  # first key of each kv tile
    k1 = k0 + tile
    hit = kp & real & ((lo.maximum(k0) < hi.minimum(k1)) | (blo.maximum(k0) < (blo + B).minimum(k1)))
    ce, bs = k1.clamp(max=S), k0.clamp(min=S)       # a tile is [k0, ce) of context then [bs, k1) of blocks
    full = kp & real & ((k0 >= ce) | ((lo <= k0) & (ce <= hi))) & ((bs >= k1) | ((blo <= bs) & (k1 <= blo + B)))
    R = hit.shape[0] // tile
    hit = hit.view(R, tile, -1).any(1)                                   # [q tiles, kv tiles]
    full = full.view(R, tile, -1).all(1)
    part = hit & ~full
    def ordered(dense):   # as flex's own: block count per row, indices of the set blocks first, ascending
        idx = torch.argsort(dense.to(torch.int32), dim=-1, descending=True, stable=True)
        # contiguous: argsort of the transpose keeps transposed strides, and the compiled flex backward (torch
        # 2.11, H200) read such q lists as if row-major: right loss, wrong dK/dV (grads 60% off)
        return dense.sum(-1).to(torch.int32)[None, None], idx.to(torch.int32).contiguous()[None, None]
    return (*ordered(part), *ordered(full), *ordered(part.t()), *ordered(full.t()))

class _WeightedCE(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, y_i) over the frozen LM head, in chunks of rows so the [N*B, vocab] logits
    never exist at once. The gradient wrt h is computed in the forward (W is frozen, so this is the only
    gradient), which saves re-running the 2*Q*V*H-FLOP logits GEMM in the backward."""
    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk):
        loss, pred, grads = h.new_zeros((), dtype=torch.float32), [], []
        for s in range(0, h.shape[0], chunk):
            logits = (h[s:s + chunk] @ weight.t()).float()
            lse = logits.logsumexp(-1)
            y = labels[s:s + chunk, None]
            ce = lse - logits.gather(1, y)[:, 0]
            loss = loss + (w[s:s + chunk] * ce.masked_fill(w[s:s + chunk] == 0, 0.0)).sum()  # no NaN*0
            pred.append(logits.argmax(-1))
            if ctx.needs_input_grad[0]:
                p = (logits - lse[:, None]).exp().scatter_add(1, y, -torch.ones_like(y, dtype=logits.dtype))
                grads.append((p * w[s:s + chunk, None]).to(weight.dtype) @ weight)
        pred = torch.cat(pred)
        ctx.mark_non_differentiable(pred)
        ctx.save_for_backward(torch.cat(grads) if grads else h.new_zeros(0))
        return loss, pred

    @staticmethod
    def backward(ctx, g_loss, g_pred):
        (dh,) = ctx.saved_tensors
        return (dh * g_loss).to(dh.dtype), None, None, None, None

class Drafter(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DrafterLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for name, p in self.named_parameters():      # Qwen3 init: normal(0.02) matrices, norms at 1
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def hidden(self, feats, ctx_pos, block_emb, block_pos, attend):
        """feats [S, n_feat*H] target features, block_emb [Q, H], positions for RoPE -> [Q, H] (final-normed)."""
        c = self.config
        ctx = self.hidden_norm(self.fc(feats))          # the same fused context feeds k/v of every layer
        rope_q = rope_cos_sin(block_pos, c.head_dim, c.rope_theta)
        rope_kv = rope_cos_sin(torch.cat([ctx_pos, block_pos]), c.head_dim, c.rope_theta)
        h = block_emb.to(ctx.dtype)
        for layer in self.layers:
            h = layer(h, ctx, rope_q, rope_kv, attend)
        return self.norm(h)

    def forward(self, feats, tokens, loss_mask, doc, pos, anchors, keep, embed, head, gamma=7.0, flex=None,
                blocks=None, ce_chunk=1024):
        """Masked training forward over one packed row. feats [S, n*H], tokens/loss_mask/doc/pos [S],
        anchors/keep [N] from sample_anchors, embed/head the target's frozen weights [V, H].
        flex: None -> dense boolean mask + SDPA (CPU); else a dict of flex_attention kernel options (GPU), with
        blocks = anchor_blocks(...) computed before the compiled graph (see anchor_blocks for why).
        Returns a dict of device tensors: loss and the sums behind acceptance / per-slot accuracy."""
        c, S, N, B = self.config, tokens.shape[0], anchors.shape[0], self.config.block_size
        k = torch.arange(B, device=tokens.device)
        idx = anchors[:, None] + k                                        # [N, B] absolute positions of the block
        inside = idx < S
        idx = idx.clamp(max=S - 1)
        block_ids = tokens[anchors][:, None].expand(N, B).masked_fill(~((k == 0) & keep[:, None]), c.mask_token_id)  # [anchor, mask x15]
        mask_mod = anchor_mask_mod(anchors, keep, doc, S, B)
        if flex is None:
            q_idx = torch.arange(N * B, device=tokens.device)[:, None]
            allowed = mask_mod(0, 0, q_idx, torch.arange(S + N * B, device=tokens.device)[None, :])  # [Q, KV]
            def attend(q, k_, v):
                o = F.scaled_dot_product_attention(q, k_, v, attn_mask=allowed, enable_gqa=True)
                return o.masked_fill(~allowed.any(-1)[:, None], 0.0)   # padded slots: zeros, as flex gives
        else:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention
            bm = BlockMask((N * B, S + N * B), *blocks, BLOCK_SIZE=(128, 128), mask_mod=mask_mod)
            def attend(q, k_, v):
                return flex_attention(q, k_, v, block_mask=bm, enable_gqa=True, kernel_options=flex or None)
        block_pos = (pos[anchors][:, None] + k).view(-1)                  # RoPE positions anchor..anchor+B-1 in its document
        h = self.hidden(feats, pos, F.embedding(block_ids.view(-1), embed), block_pos, attend)
        # labels: block slot k predicts the token AT anchor+k (no extra shift); slot 0 is the anchor itself
        decay = torch.exp(-(k - 1).clamp(min=0).float() / gamma)
        sup = keep[:, None] & (k > 0) & inside & (loss_mask[idx] > 0) & (doc[idx] == doc[anchors][:, None])
        w = sup.float() * decay                                           # [N, B]
        labels = tokens[idx]
        wce, pred = _WeightedCE.apply(h, head, labels.view(-1), w.view(-1), ce_chunk)
        correct = (pred.view(N, B) == labels) & sup
        accepted = 1 + correct[:, 1:].long().cumprod(1).sum(1)            # anchor + leading correct slots
        return dict(loss=wce / w.sum().clamp(min=1e-6), accept_sum=(accepted * keep).sum(), blocks=keep.sum(),
                    slot_correct=correct.sum(0), slot_count=sup.sum(0))

    @torch.no_grad()
    def propose(self, ctx_feats, ctx_pos, anchor_token, anchor_pos, embed, head):
        """What a serving engine runs: context = target features of the positions before the anchor, block =
        [anchor, mask x (B-1)] at positions anchor_pos.., no mask at all. Returns (B-1 tokens, their logits)."""
        c = self.config
        block = torch.full((c.block_size,), c.mask_token_id, dtype=torch.long, device=ctx_feats.device)
        block[0] = anchor_token
        bpos = anchor_pos + torch.arange(c.block_size, device=ctx_feats.device)
        attend = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        h = self.hidden(ctx_feats, ctx_pos, F.embedding(block, embed), bpos, attend)
        logits = (h[1:] @ head.t()).float()
        return logits.argmax(-1), logits

    def flops(self, S, N, visible=0):
        """Matmul FLOPs of one training step (fwd + bwd) at S context tokens and N anchors. visible: the (query,
        key) pairs the anchor mask lets through, for the attention FLOPs (data dependent; 0 leaves them out)."""
        c, Q = self.config, N * self.config.block_size
        per_layer_q = c.hidden_size * (2 * c.num_attention_heads * c.head_dim + 3 * c.intermediate_size)  # q, o, MLP
        kv = 2 * c.hidden_size * c.num_key_value_heads * c.head_dim
        fwd = 2 * c.num_hidden_layers * (Q * per_layer_q + (S + Q) * kv)
        attn = 4 * c.num_hidden_layers * c.num_attention_heads * c.head_dim * visible       # QK^T and PV
        fc = 2 * S * self.fc.in_features * c.hidden_size        # its input needs no gradient: fwd + dW only
        head = 2 * Q * c.vocab_size * c.hidden_size
        return 3 * (fwd + attn) + 2 * fc + 2 * head     # trainable GEMMs: fwd + 2x bwd; frozen head: logits + dh

    def save_pretrained(self, out_dir):
        """z-lab format: config.json + model.safetensors (bf16, keys without a `model.` prefix)."""
        from safetensors.torch import save_file
        c = self.config
        os.makedirs(out_dir, exist_ok=True)
        cfg = dict(architectures=["DFlashDraftModel"], model_type="qwen3", block_size=c.block_size,
                   dflash_config=dict(block_size=c.block_size, mask_token_id=c.mask_token_id,
                                      target_layer_ids=list(c.target_layer_ids)),
                   num_target_layers=c.num_target_layers, hidden_size=c.hidden_size,
                   intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                   num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                   head_dim=c.head_dim, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
                   rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta, rope_scaling=None,
                   max_position_embeddings=c.max_position_embeddings,
                   layer_types=["full_attention"] * c.num_hidden_layers, use_sliding_window=False, sliding_window=None,
                   max_window_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
                   tie_word_embeddings=c.tie_word_embeddings, initializer_range=0.02, dtype="bfloat16",
                   torch_dtype="bfloat16", use_cache=True)
        tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in self.state_dict().items()}
        tmp = os.path.join(out_dir, f".tmp-{os.getpid()}")
        save_file(tensors, tmp + ".safetensors", metadata={"format": "pt"})
        with open(tmp + ".json", "w") as f:
            json.dump(cfg, f, indent=2)
        os.replace(tmp + ".safetensors", os.path.join(out_dir, "model.safetensors"))   # atomic per file
        os.replace(tmp + ".json", os.path.join(out_dir, "config.json"))

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32):
        from safetensors.torch import load_file
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        d = cfg.get("dflash_config", {})
        names = {f.name for f in fields(DrafterConfig)}
        kw = {k: v for k, v in cfg.items() if k in names}
        kw.update(block_size=d.get("block_size", cfg.get("block_size", 16)), mask_token_id=d["mask_token_id"],
                  target_layer_ids=d["target_layer_ids"])
        model = cls(DrafterConfig(**kw))
        model.load_state_dict(load_file(os.path.join(path, "model.safetensors")))   # strict: exact key set
        return model.to(device=device, dtype=dtype)
