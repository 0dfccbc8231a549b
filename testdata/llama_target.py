"""
A plain dense Llama-style target written only against the Target interface at the top of
target.py: a fork copies it over target.py and every command but quality.py runs on it
(test_train.py: test_target_interface, test_fork_runs_every_command; on a GPU, the run in
RESULTS.md). Its layers are the shared building blocks of layers.py, nothing of the Qwen target.
transformers' LlamaForCausalLM is its reference.
"""
import json
import os
import zlib
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers import MLP, RMSNorm, apply_rope, positions_from_cu, rope_cos_sin, upload

@dataclass
class TargetConfig:
    vocab_size: int = 512
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    num_experts: int = 0

    @classmethod
    def preset(cls, name):   # the defaults: the tiny CPU target (train.py's default, the demo's)
        if name != "tiny":
            raise ValueError(f"unknown target preset {name!r}; choose tiny or a checkpoint dir")
        return cls()

    @classmethod
    def from_hf(cls, path):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        theta = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
        return cls(**{**{f.name: cfg[f.name] for f in fields(cls) if f.name in cfg},
                      "rope_theta": theta})

class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c, a = c, nn.Module()
        for name, n_in, n_out in (("q_proj", c.hidden_size, c.num_attention_heads * c.head_dim),
                                  ("k_proj", c.hidden_size, c.num_key_value_heads * c.head_dim),
                                  ("v_proj", c.hidden_size, c.num_key_value_heads * c.head_dim),
                                  ("o_proj", c.num_attention_heads * c.head_dim, c.hidden_size)):
            setattr(a, name, nn.Linear(n_in, n_out, bias=False))
        self.self_attn, self.mlp = a, MLP(c.hidden_size, c.intermediate_size)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, h, rope, mask, cache=None):
        # h [T, H]: a packed row, mask [T, T]; or a decoding step (greedy): one token of each of T
        # sequences, mask None, its keys and values appended to `cache`, the sequence's past
        T, a, x = h.shape[0], self.self_attn, self.input_layernorm(h)
        q, k, v = (p(x).view(T, -1, self.c.head_dim) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:     # sequences as the batch: q [T, 1, heads, d], k, v [T, t, ...]
            cache.append((k, v))
            q, k, v = q[:, None], *(torch.stack(kv, 1) for kv in zip(*cache))
        o = F.scaled_dot_product_attention(*(t.transpose(-3, -2) for t in (q, k, v)),
                                           attn_mask=mask, enable_gqa=True)
        h = h + a.o_proj(o.transpose(-3, -2).reshape(T, -1))
        return h + self.mlp(self.post_attention_layernorm(h))

class Target(nn.Module):
    def __init__(self, config, n_layers=None, head=True):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        n = c.num_hidden_layers if n_layers is None else n_layers
        self.layers = nn.ModuleList([Layer(c) for _ in range(n)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps) if head or n == c.num_hidden_layers else None
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False) if head else None
        self.requires_grad_(False)

    @classmethod
    def build(cls, config, device="cpu", dtype=torch.float32, n_layers=None, head=True):
        model = cls(config, n_layers, head)
        for name, p in model.named_parameters():     # seeded by name: every rank the same
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.1) if p.dim() > 1 else p.fill_(1.0)
        return model.to(device, dtype)

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.bfloat16, n_layers=None, head=True):
        from safetensors.torch import load_file
        model = cls(TargetConfig.from_hf(path), n_layers, head)
        state = {k.removeprefix("model."): v for k, v in
                 load_file(os.path.join(path, "model.safetensors")).items()}
        model.load_state_dict({k: state[k] for k in model.state_dict()})
        return model.to(device, dtype)

    def _run(self, ids, cu_seqlens, layer_ids, stop, pos=None, caches=None):
        # layers [0, stop) -> (layer_ids' outputs concatenated or None, the last layer's): over
        # packed documents (cu_seqlens on the CPU), or a decoding step at positions pos with caches
        c, h, taps, mask = self.config, self.embed_tokens(ids), {}, None
        if caches is None:
            pos = upload(positions_from_cu(cu_seqlens), h.device)
            doc = torch.repeat_interleave(torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff())
            doc = doc.to(h.device)
            mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])  # per document
        rope = rope_cos_sin(pos, c.head_dim, c.rope_theta, None, c.max_position_embeddings)
        for i in range(stop):
            h = taps[i] = self.layers[i](h, rope, mask, caches[i] if caches else None)
        return torch.cat([taps[i] for i in layer_ids], dim=-1) if layer_ids else None, h

    @torch.inference_mode()
    def features(self, ids, cu_seqlens, layer_ids, final=False):
        # final (train.py --objective): + the last layer's output final-normed
        feats, h = self._run(ids, cu_seqlens, layer_ids, len(self.layers) if final else max(layer_ids) + 1)
        return torch.cat([feats, self.norm(h)], -1) if final else feats

    def _head(self, h):
        assert self.norm is not None and len(self.layers) == self.config.num_hidden_layers, (
            "logits need every layer and the head: build the target without n_layers")
        return self.lm_head(self.norm(h)).float()

    @torch.inference_mode()
    def features_and_logits(self, ids, cu_seqlens, layer_ids, at=None):
        feats, h = self._run(ids, cu_seqlens, layer_ids, len(self.layers))
        return feats, self._head(h if at is None else h[at])

    def logits(self, ids, cu_seqlens, at=None):
        return self.features_and_logits(ids, cu_seqlens, (), at)[1]

    @torch.inference_mode()
    def greedy(self, prompts, new_tokens):
        # in lockstep with KV caches: sequence j reads its prompt while it lasts, then its argmax
        dev, n = self.embed_tokens.weight.device, len(prompts)
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        seq = F.pad(nn.utils.rnn.pad_sequence(prompts, True), (0, new_tokens)).to(dev, torch.long)
        caches = [[] for _ in self.layers]
        for t in range(seq.shape[1] - 1):     # every sequence is at position t
            h = self._run(seq[:, t], None, (), len(self.layers), torch.full((n,), t, device=dev),
                          caches)[1]
            seq[:, t + 1] = torch.where(lens > t + 1, seq[:, t + 1], self._head(h).argmax(-1))
        return seq

    def flops(self, cu_seqlens, n_layers):
        # matmul FLOPs of layers [0, n_layers) over one packed row (bench.py's MFU)
        c, lens = self.config, cu_seqlens.diff().double()
        linear = sum(p.numel() for p in self.layers[:n_layers].parameters() if p.dim() > 1)
        pairs = float((lens * (lens + 1) / 2).sum())
        attn = n_layers * 2 * 2 * c.num_attention_heads * c.head_dim * pairs   # QK^T and PV
        return 2 * linear * int(cu_seqlens[-1]) + attn
