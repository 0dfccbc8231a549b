"""
The building blocks both models are made of, as transformers computes them: RMSNorm, the SwiGLU
MLP, attention's weights, RoPE with HF's default, linear and YaRN scalings (the drafter in
model.py, the target in target.py: neither imports the other for them); two shared helpers.
"""
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

class RMSNorm(nn.Module):
    # plus_one: Qwen3.5's zero-centred norms (scale 1 + w); Qwen3 and the GDN gated norm: plain w
    def __init__(self, dim, eps, plus_one=False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        scale = self.weight.float() + 1.0 if self.plus_one else self.weight.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * scale).to(x.dtype)

ROPE_TYPES = ("default", "linear", "yarn")   # HF rope_type values rope_inv_freq computes

def rope_type(scaling):
    # of an HF rope_scaling / rope_parameters dict (transformers 4.x configs spell it "type")
    return "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))

def check_rope(scaling, fail):
    # fail(field, value, why) unless rope_inv_freq computes the HF rope dict `scaling` as HF does
    kind, factor = rope_type(scaling), (scaling or {}).get("factor")
    if kind == "dynamic":
        fail("rope_type", kind, "transformers recomputes dynamic NTK per batch length, vLLM fixes "
             "it at max_position_embeddings * factor: served features are ambiguous; use yarn")
    if kind not in ROPE_TYPES:
        fail("rope_type", kind, f"RoPE types computed here: {', '.join(ROPE_TYPES)}")
    if kind != "default" and not (isinstance(factor, (int, float)) and factor > 0):
        fail("factor", factor, f"rope_type {kind} needs a positive factor")

def rope_inv_freq(dim, theta, scaling=None, max_positions=None, device=None):
    """RoPE inverse frequencies [dim/2] over `dim` rotary dims (partial RoPE: HF's head_dim *
    partial_rotary_factor) and the factor cos and sin are multiplied by, exactly as transformers
    5.x modeling_rope_utils.py computes them for rope_type default, linear and yarn (YaRN: Peng et
    al., arXiv:2309.00071; the explicit factor wins over max_position_embeddings/original, as in
    v5). scaling: the HF dict without rope_theta; max_positions: YaRN's default original length."""
    s, kind = scaling or {}, rope_type(scaling)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    factor = s["factor"]
    if kind == "linear":
        return 1.0 / pos_freqs / factor, 1.0
    original = s.get("original_max_position_embeddings") or max_positions
    mscale = lambda m=1: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    scale = s.get("attention_factor")
    if scale is None:
        both = s.get("mscale") and s.get("mscale_all_dim")
        scale = mscale(s["mscale"]) / mscale(s["mscale_all_dim"]) if both else mscale()
    # pair i keeps its frequency below `low` rotations-wise (extrapolation), is divided by factor
    # above `high` (interpolation), and ramps linearly between
    corr = lambda rotations: (dim * math.log(original / (rotations * 2 * math.pi))
                              / (2 * math.log(theta)))
    low, high = corr(s.get("beta_fast") or 32), corr(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, device=device).float() - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolate) + 1.0 / pos_freqs * extrapolate
    return inv_freq, float(scale)

def rope_cos_sin(pos, dim, theta, scaling=None, max_positions=None):
    # NeoX-style cos, sin [T, dim] in fp32 at positions pos [T], both times YaRN's attention factor
    inv_freq, scale = rope_inv_freq(dim, theta, scaling, max_positions, pos.device)
    angles = (pos.float()[:, None] * inv_freq[None, :]).repeat(1, 2)
    return angles.cos() * scale, angles.sin() * scale

def apply_rope(x, cos, sin):
    # x [T, heads, head_dim]; rotates the first rot dims (partial RoPE), pairing i with i + rot/2
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot].float(), x[..., rot:]
    rotated = torch.cat([-x_rot[..., rot // 2:], x_rot[..., :rot // 2]], dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat([out.to(x.dtype), x_pass], dim=-1)

class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

class Attention(nn.Module):
    """Qwen3 attention's weights: q, k, v, o projections, per-head q and k RMSNorms. gated:
    Qwen3.5's (per head [query | gate] in q_proj, zero-centred norms). Forwards: each model's."""
    def __init__(self, c, gated=False):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (c.num_attention_heads,
                                                        c.num_key_value_heads, c.head_dim)
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(c.hidden_size, (2 if gated else 1) * q_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, kv_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(q_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, c.rms_norm_eps, plus_one=gated)
        self.k_norm = RMSNorm(self.head_dim, c.rms_norm_eps, plus_one=gated)

def upload(t, device):
    # a host tensor to `device` without a host sync: .to() from pageable memory waits for the
    # stream to drain; a copy from pinned memory is queued like a kernel
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)

def positions_from_cu(cu_seqlens):
    # -> positions [T] from 0 in each document (numpy: torch's repeat_interleave is a slow host op)
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    return torch.from_numpy(np.arange(cu[-1]) - np.repeat(cu[:-1], np.diff(cu)))
