"""
CPU tests, each module against an independent reference, seconds each: the target against transformers'
Qwen3.5 and a per-token delta-rule recurrence, checkpoint loading, the drafter's mask, loss and export
against brute force and hand-worked cases, data.py's format and packer, prepare.py and regenerate.py, the published
drafters' layouts (sliding windows, RoPE scaling, the z-lab config), generate.py's speculative decoding against greedy.
train.py and generate.py end to end: test_train.py.
Run: python -m pytest -q test_smoke.py test_train.py
Nothing here needs a GPU or the network; transformers/tokenizers are test-only dependencies.
"""
import asyncio
import collections
import copy
import dataclasses
import functools
import hashlib
import importlib
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from torch.nn.attention.flex_attention import create_block_mask
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

import data
import distill
import generate
import model
import prepare
import regenerate
from data import DataError, Packer, open_dataset, write_dataset
from model import (FULL, SLIDING, Drafter, DrafterConfig, anchor_blocks, anchor_mask_mod,
                   config_from_json, default_target_layer_ids, drafter_rope, row_attention,
                   sample_anchors)
import checks
import target
from checks import flex_matches_dense
from layers import positions_from_cu, rope_cos_sin, rope_inv_freq
from target import (MOE_FIELDS, Docs, MoE, Target, TargetConfig, _chunk_indices, dequantize_fp8,
                    expert_linear, torch_chunk_gated_delta_rule)

HERE = os.path.dirname(os.path.abspath(__file__))
LIN = "linear_attention"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny tensors: intra-op threads only add overhead, and OpenMP spin-waiting on 2 busy cores is
    # very slow. Module scope: the module-scoped fixtures (set up before function-scoped ones) use it.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_err(actual, expected):
    """Max abs error relative to the reference's largest magnitude (floored at 1e-6)."""
    actual, expected = actual.float(), expected.float()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    return (actual - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)


def cu_of(lens):
    """cu_seqlens [0, l0, l0 + l1, ...] of documents of these lengths."""
    return torch.tensor([0, *lens]).cumsum(0)


def doc_of(cu):
    """The document index of every position of a row with these cu_seqlens."""
    return torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())


def demo_data():
    """The demo dataset (data.make_demo's defaults) in data/demo, built once and reused."""
    return data.make_demo(os.path.join(HERE, "data", "demo"), log=lambda *a: None)


@functools.cache
def tiny_target():
    # built once (deterministic weights), read-only
    return Target.build(TargetConfig.preset("tiny"))


def randomize_(m, seed):
    """Random values for every tensor of a Qwen3.5 target (ours or HF's: same names), norms too:
    zero-centred 1-D norm weights get offsets, so a loader or forward mixing up w and 1+w shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2.5 - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(r)
            elif name.endswith("linear_attn.norm.weight"):   # the gated norm: a plain weight
                p.copy_(1.0 + 0.3 * r)
            elif p.dim() == 1:
                p.copy_(0.3 * r)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * r)
            else:
                p.copy_(r * p.shape[-1] ** -0.5)
    return m


def randomize_drafter_(d, seed):
    """Unit-scale random weights (the 0.02 init makes every block nearly the same) and norm weights
    != 1, so a norm that is skipped or applied to the wrong tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * r if p.dim() == 1 else r * p.shape[-1] ** -0.5)
    return d


# ==================================================================================================
# target.py: the frozen Qwen3.5/3.6 target

# -----------------------------------------------------------------------------
# the chunked torch gated delta rule == the per-token recurrence

def recurrent_delta_rule(q, k, v, g, beta):
    # fp64, per v-head: S <- exp(g_t) S; u = beta_t (v_t - S^T k_t); S <- S + k_t u^T; o_t = S^T q_t
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    T, HV, K = k.shape
    S = torch.zeros(HV, K, v.shape[-1], dtype=torch.float64)
    out = []
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
        S = S + k[t][:, :, None] * u[:, None, :]
        out.append(torch.einsum("hkv,hk->hv", S, q[t]))
    return torch.stack(out)


@pytest.mark.parametrize("T,chunk,g_max", [(150, 64, 2.3), (1, 64, 2.3), (64, 64, 2.3), (77, 16, 2.3),
                                           (100, 64, 30.0)])
def test_chunk_delta_rule_matches_recurrence(T, chunk, g_max):
    gen = torch.Generator().manual_seed(T)
    HV, K, V = 3, 16, 8
    q = F.normalize(torch.randn(T, HV, K, generator=gen), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(T, HV, K, generator=gen), dim=-1)
    v = torch.randn(T, HV, V, generator=gen)
    # per-step decays from ~1 (long memory: state crosses chunk boundaries) to exp(-g_max); g_max 30
    # makes the in-chunk cumulative decay underflow exp() in fp32: zeros, not inf/nan
    g = -torch.rand(T, HV, generator=gen) ** 3 * g_max
    beta = torch.rand(T, HV, generator=gen)
    o = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk=chunk)
    assert o.shape == (T, HV, V) and o.dtype == torch.float32
    ref = recurrent_delta_rule(q, k, v, g, beta)
    assert torch.isfinite(o).all()
    # with g_max 30 the in-chunk log-decay cumsum reaches ~-560, where fp32 keeps ~5e-5 relative
    # precision of the differences exp(gc_i - gc_j) (HF's torch_chunk_gated_delta_rule: same error)
    assert rel_err(o, ref) < (2e-5 if g_max < 10 else 2e-4), "chunk vs recurrent"
    if T > chunk and g_max < 10:   # the state carried into later chunks matters (a reset fails)
        reset = recurrent_delta_rule(q[chunk:], k[chunk:], v[chunk:], g[chunk:], beta[chunk:])
        assert (reset - ref[chunk:]).abs().max() > 1e-2


# -----------------------------------------------------------------------------
# packing: a row of three documents == the documents run alone

def test_positions_from_cu():
    assert positions_from_cu(cu_of([3, 1, 4])).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


def test_chunk_indices_by_hand():
    # the (document, chunk) list handed to fla: 64-token chunks, an empty document has none
    # (bench.py check compares it with fla's prepare_chunk_indices on a GPU)
    got = _chunk_indices((0, 130, 194, 194, 200), torch.device("cpu"))
    assert got.tolist() == [[0, 0], [0, 1], [0, 2], [1, 0], [3, 0]]


def test_packed_documents_equal_separate_runs():
    torch.manual_seed(0)
    cfg = TargetConfig.preset("tiny")
    target = Target.build(cfg, dtype=torch.float32)
    randomize_(target, 1)
    lens = [37, 70, 21]                 # the middle one spans two 64-token GDN chunks
    docs = [torch.randint(0, cfg.vocab_size, (n,)) for n in lens]
    ids, cu = torch.cat(docs), cu_of(lens)
    layers = list(range(cfg.num_hidden_layers))
    feats, logits = target.features(ids, cu, layers), target.logits(ids, cu)
    assert feats.shape == (sum(lens), len(layers) * cfg.hidden_size)
    assert logits.shape == (sum(lens), cfg.vocab_size)
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = torch.tensor([0, e - s])
        assert rel_err(feats[s:e], target.features(docs[d], one, layers)) < 3e-5, f"doc {d} features"
        assert rel_err(logits[s:e], target.logits(docs[d], one)) < 3e-5, f"doc {d} logits"
    # the check has teeth: without the boundaries the later documents come out different
    joined = target.features(ids, torch.tensor([0, sum(lens)]), layers)
    assert (joined[lens[0]:] - feats[lens[0]:]).abs().max() > 1e-2



# -----------------------------------------------------------------------------
# matches Hugging Face transformers' Qwen3.5 (its torch fallback path on CPU)

def hf_qwen3_5(name="transformers.models.qwen3_5.modeling_qwen3_5"):
    """transformers' Qwen3.5 modeling module, imported with fla and causal_conv1d hidden: it binds
    those kernels at import time when installed, and their Triton kernels can't run on CPU tensors."""
    if name not in sys.modules:
        saved = {m: sys.modules.get(m) for m in ("fla", "causal_conv1d")}
        try:
            sys.modules.update(dict.fromkeys(saved))          # None in sys.modules makes the import fail
            importlib.import_module(name)
        finally:
            for m, mod in saved.items():
                if mod is None:
                    sys.modules.pop(m, None)
                else:
                    sys.modules[m] = mod
    return sys.modules[name]


def hf_model(partial_rotary_factor, seed, rope=None, max_position_embeddings=1024):
    """transformers' Qwen3.5 text model, 4 layers (0-2 GDN, 3 attention), random weights (randomize_(seed)),
    RoPE theta 10000 with rope's fields (rope_type, factor, ...) over the default ones."""
    hf = hf_qwen3_5()
    Qwen3_5ForCausalLM, Qwen3_5TextConfig = hf.Qwen3_5ForCausalLM, hf.Qwen3_5TextConfig
    rot = int(32 * partial_rotary_factor) // 2
    base = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=partial_rotary_factor,
                mrope_section=[rot - 2 * (rot // 3), rot // 3, rot // 3], mrope_interleaved=True)
    cfg = Qwen3_5TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,   # layers 0-2 GDN, 3 attention
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={**base, **(rope or {})}, attn_implementation="eager")
    assert cfg.layer_types == [LIN, LIN, LIN, FULL]
    m = Qwen3_5ForCausalLM(cfg).eval()
    assert m.config._attn_implementation == "eager"
    return randomize_(m, seed)


def hf_run(m, ids):
    """HF forward of one document -> (outputs of every decoder layer, logits). hidden_states[i+1] is
    layer i's output except the last entry, which this transformers version returns after the final
    norm; forward hooks give every layer's raw output."""
    raw = []
    hook = lambda mod, args, out: raw.append(out[0] if isinstance(out, tuple) else out)
    hooks = [layer.register_forward_hook(hook) for layer in m.model.layers]
    try:
        with torch.no_grad():
            out = m(ids[None], output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    L = len(m.model.layers)
    assert len(raw) == L and len(out.hidden_states) == L + 1
    for i in range(L - 1):
        assert torch.equal(out.hidden_states[i + 1], raw[i])
    return [r[0] for r in raw], out.logits[0]


def save_hf(m, path):
    m.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == "qwen3_5_text"
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    keys = set()
    for file in files:
        with safe_open(os.path.join(path, file), "pt") as f:
            keys |= set(f.keys())
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in keys
    assert "model.layers.3.self_attn.q_norm.weight" in keys
    return Target.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module", params=[0.25, 0.5])
def hf_pair(request, tmp_path_factory):
    m = hf_model(request.param, seed=5)
    ours = save_hf(m, str(tmp_path_factory.mktemp("hf")))
    assert ours.config.partial_rotary_factor == request.param and ours.config.rope_theta == 10000.0
    return m, ours


def test_matches_hf_single_document(hf_pair):
    m, ours = hf_pair
    ids = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(6))   # > 2 GDN chunks
    cu = cu_of([150])
    hs, logits = hf_run(m, ids)
    for i in range(len(hs)):
        assert rel_err(ours.features(ids, cu, [i]), hs[i]) < 1e-4, f"layer {i}"
    assert rel_err(ours.features(ids, cu, [0, 1, 2, 3]), torch.cat(hs, -1)) < 1e-4, "all layers"
    assert rel_err(ours.logits(ids, cu), logits) < 1e-4, "logits"


def check_packed_against_hf(m, ours, lens, seed):
    # documents packed into one row == each run alone by transformers: no state, conv tap or attention
    # crosses a document boundary
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 300, (n,), generator=gen) for n in lens]
    ids, cu = torch.cat(docs), cu_of(lens)
    feats, logits = ours.features(ids, cu, [0, 1, 2, 3]), ours.logits(ids, cu)
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        hs, ref_logits = hf_run(m, docs[d])
        assert rel_err(feats[s:e], torch.cat(hs, -1)) < 1e-4, f"doc {d} hidden states"
        assert rel_err(logits[s:e], ref_logits) < 1e-4, f"doc {d} logits"


def test_matches_hf_packed_documents(hf_pair):
    m, ours = hf_pair
    check_packed_against_hf(m, ours, [45, 100, 30], seed=7)


def test_matches_hf_small_qk_norms(tmp_path):
    # GDN q/k vectors of tiny norm: HF and FLA l2-normalise as x / sqrt(|x|^2 + 1e-6), which is not
    # a unit vector there (F.normalize's x / max(|x|, eps) would be)
    m = hf_model(0.25, seed=8)
    with torch.no_grad():
        m.model.layers[1].linear_attn.in_proj_qkv.weight[:64] *= 1e-4     # q and k rows (2 * 2 heads * 16)
    ours = save_hf(m, str(tmp_path))
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(9))
    hs, logits = hf_run(m, ids)
    assert rel_err(ours.features(ids, cu_of([80]), [1]), hs[1]) < 1e-4, "layer 1"
    assert rel_err(ours.logits(ids, cu_of([80])), logits) < 1e-4, "logits"



# -----------------------------------------------------------------------------
# checkpoint layouts (official multimodal, sharded; text-only, single file), n_layers, head

SMALL = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
             layer_types=[LIN, FULL, LIN, LIN, FULL, LIN],       # not the interval-4 pattern: must be read
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             rms_norm_eps=1e-6, rope_theta=1000.0, partial_rotary_factor=0.5, max_position_embeddings=1024)


def text_config_json(cfg, flat_rope=False):
    t = {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                       "layer_types", "num_attention_heads", "num_key_value_heads", "head_dim",
                                       "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps",
                                       "max_position_embeddings", "tie_word_embeddings")}
    t.update(model_type="qwen3_5_text", hidden_act="silu", full_attention_interval=4, attn_output_gate=True,
             attention_bias=False, mtp_num_hidden_layers=1, mamba_ssm_dtype="float32", dtype="bfloat16")
    rot = int(cfg.head_dim * cfg.partial_rotary_factor) // 2
    rope = dict(rope_type="default", rope_theta=cfg.rope_theta, partial_rotary_factor=cfg.partial_rotary_factor,
                mrope_section=[rot - 2 * (rot // 3), rot // 3, rot // 3], mrope_interleaved=True)
    if flat_rope:   # some converted exports flatten the rope fields into the text config
        t.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                 mrope_section=rope["mrope_section"])
    else:
        t.update(rope_parameters=rope, partial_rotary_factor=cfg.partial_rotary_factor)
    return t


def write_official(path, cfg, sd, n_shards=3):
    """Qwen3_5ForConditionalGeneration layout: model.language_model.* + lm_head.weight, plus vision
    and MTP tensors the loader must skip, sharded with an index."""
    os.makedirs(path, exist_ok=True)
    tensors = {("lm_head.weight" if n == "lm_head.weight" else "model.language_model." + n): t.contiguous()
               for n, t in sd.items()}
    tensors.update({"model.visual.patch_embed.proj.weight": torch.randn(8, 3, 2, 4, 4),
                    "model.visual.blocks.0.attn.qkv.weight": torch.randn(24, 8),
                    "model.visual.merger.linear_fc2.weight": torch.randn(cfg.hidden_size, 16),
                    "mtp.fc.weight": torch.randn(cfg.hidden_size, 2 * cfg.hidden_size),
                    "mtp.layers.0.self_attn.q_proj.weight": torch.randn(7, 5),     # wrong shapes on purpose
                    "mtp.norm.weight": torch.randn(3)})
    names = sorted(tensors)   # lm_head.weight sorts first, model.language_model.embed_tokens elsewhere
    weight_map = {}
    for i in range(n_shards):
        file = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[i::n_shards]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    assert len(set(weight_map[n] for n in weight_map if n.startswith(("lm_head", "model.language_model")))) > 1
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(t.numel() * 4 for t in tensors.values())},
                   "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
                   "tie_word_embeddings": cfg.tie_word_embeddings, "image_token_id": 248056,
                   "text_config": text_config_json(cfg),
                   "vision_config": {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 8}}, f)


def write_text_only(path, cfg, sd, flat_rope=True):
    """Qwen3_5ForCausalLM layout: model.* + lm_head.weight in one model.safetensors."""
    os.makedirs(path, exist_ok=True)
    tensors = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): t.contiguous()
               for n, t in sd.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3_5ForCausalLM"], **text_config_json(cfg, flat_rope)}, f)


def edit_config(path, edit):
    """Rewrites path/config.json through edit(dict) (which changes it in place)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def small_ckpts(tmp_path_factory):
    cfg = TargetConfig(**SMALL)
    src = randomize_(Target.build(cfg, dtype=torch.float32), 2)
    sd = {n: p.detach().clone() for n, p in src.state_dict().items()}
    root = tmp_path_factory.mktemp("ckpt")
    write_official(str(root / "official"), cfg, sd)
    write_text_only(str(root / "text"), cfg, sd)
    ids = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(3))
    cu = cu_of([50, 40])
    return dict(cfg=cfg, src=src, sd=sd, root=root, ids=ids, cu=cu)


@pytest.mark.parametrize("layout", ["official", "text"])
def test_checkpoint_layouts_load(small_ckpts, layout):
    c = small_ckpts
    path = str(c["root"] / layout)
    cfg = TargetConfig.from_hf(path)
    assert cfg == c["cfg"], "config.json parsed into a different TargetConfig"
    t = Target.from_pretrained(path, dtype=torch.float32)
    got = t.state_dict()
    assert set(got) == set(c["sd"]), "loaded a different set of tensors (vision/MTP must be skipped)"
    for n, v in c["sd"].items():
        assert torch.equal(got[n], v), n
    layers = list(range(cfg.num_hidden_layers))
    ref_f, ref_l = c["src"].features(c["ids"], c["cu"], layers), c["src"].logits(c["ids"], c["cu"])
    torch.testing.assert_close(t.features(c["ids"], c["cu"], layers), ref_f, rtol=0, atol=1e-6)
    torch.testing.assert_close(t.logits(c["ids"], c["cu"]), ref_l, rtol=0, atol=1e-6)


def test_both_layouts_identical_and_dtypes(small_ckpts):
    c = small_ckpts
    a = Target.from_pretrained(str(c["root"] / "official"), dtype=torch.float32)
    b = Target.from_pretrained(str(c["root"] / "text"), dtype=torch.float32)
    layers = [4, 0, 2]                  # any order: features are concatenated in the order asked
    fa, fb = a.features(c["ids"], c["cu"], layers), b.features(c["ids"], c["cu"], layers)
    assert torch.equal(fa, fb)
    full = a.features(c["ids"], c["cu"], list(range(6)))
    H = c["cfg"].hidden_size
    assert torch.equal(fa, torch.cat([full[:, i * H:(i + 1) * H] for i in layers], -1))
    # bf16 load: everything bf16 except the fp32 GDN decay parameters
    h = Target.from_pretrained(str(c["root"] / "official"), dtype=torch.bfloat16)
    gdn = h.layers[0].linear_attn
    assert h.embed_tokens.weight.dtype == torch.bfloat16 and gdn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert gdn.A_log.dtype == torch.float32 and gdn.dt_bias.dtype == torch.float32
    assert torch.equal(gdn.A_log, c["sd"]["layers.0.linear_attn.A_log"])


@pytest.mark.parametrize("layout", ["official", "text"])
def test_partial_builds(small_ckpts, layout):
    c = small_ckpts
    path = str(c["root"] / layout)
    full = Target.from_pretrained(path, dtype=torch.float32)
    taps = [1, 3]
    # target rank: layers up to the last tapped one, no head
    part = Target.from_pretrained(path, dtype=torch.float32, n_layers=max(taps) + 1, head=False)
    assert len(part.layers) == max(taps) + 1 and part.lm_head is None and part.norm is None
    dropped = ("layers.4.", "layers.5.", "norm.", "lm_head.")
    assert all(not n.startswith(dropped) for n, _ in part.named_parameters())
    torch.testing.assert_close(part.features(c["ids"], c["cu"], taps), full.features(c["ids"], c["cu"], taps),
                               rtol=0, atol=0)
    with pytest.raises(AssertionError):
        part.features(c["ids"], c["cu"], [4])
    head = Target.from_pretrained(path, dtype=torch.float32, n_layers=0, head=True)
    # drafter rank: embed_tokens, the final norm (distillation) and lm_head only
    assert len(head.layers) == 0 and torch.equal(head.norm.weight, full.norm.weight)
    assert {n for n, _ in head.named_parameters()} == {"embed_tokens.weight", "norm.weight", "lm_head.weight"}
    assert torch.equal(head.embed_tokens.weight, full.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, full.lm_head.weight)
    assert not torch.equal(head.lm_head.weight, head.embed_tokens.weight)


def test_tied_embeddings_text_only(tmp_path):
    cfg = TargetConfig(**{**SMALL, "num_hidden_layers": 2, "layer_types": [LIN, FULL],
                          "tie_word_embeddings": True})
    src = randomize_(Target.build(cfg, dtype=torch.float32), 4)
    sd = {n: p.detach().clone() for n, p in src.state_dict().items() if n != "lm_head.weight"}
    write_text_only(str(tmp_path), cfg, sd, flat_rope=False)
    t = Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert torch.equal(t.lm_head.weight, sd["embed_tokens.weight"])
    assert t.lm_head.weight.data_ptr() == t.embed_tokens.weight.data_ptr()  # tied: one tensor
    ids, cu = torch.randint(0, cfg.vocab_size, (20,)), cu_of([20])
    ref = F.linear(src.norm(src.features(ids, cu, [1])), sd["embed_tokens.weight"])
    torch.testing.assert_close(t.logits(ids, cu), ref, rtol=0, atol=1e-5)


def test_config_layer_types_from_interval(tmp_path):
    cfg = TargetConfig(**SMALL)
    t = text_config_json(cfg)
    del t["layer_types"]
    t.update(num_hidden_layers=8, full_attention_interval=4)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                   "text_config": t}, f)
    got = TargetConfig.from_hf(str(tmp_path))
    assert got.layer_types == [LIN, LIN, LIN, FULL] * 2
    assert (got.rope_theta, got.partial_rotary_factor) == (1000.0, 0.5)


# -----------------------------------------------------------------------------
# bad checkpoints raise errors that name the file and tensor

def test_missing_tensor_in_index(small_ckpts, tmp_path):
    c = small_ckpts
    sd = dict(c["sd"])
    del sd["layers.2.linear_attn.in_proj_b.weight"]
    write_official(str(tmp_path), c["cfg"], sd)
    with pytest.raises(KeyError) as e:
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert "model.language_model.layers.2.linear_attn.in_proj_b.weight" in str(e.value)
    assert str(tmp_path) in str(e.value)
    # not needed by a rank that builds only layers 0-1: loads fine
    Target.from_pretrained(str(tmp_path), dtype=torch.float32, n_layers=2, head=False)


def test_missing_tensor_in_shard(small_ckpts, tmp_path):
    c = small_ckpts
    write_official(str(tmp_path), c["cfg"], c["sd"])
    with open(tmp_path / "model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    key = "model.language_model.layers.1.self_attn.k_norm.weight"
    file = wm[key]
    with open(tmp_path / "model.safetensors.index.json", "w") as f:   # index lists it in the wrong shard
        json.dump({"weight_map": {**wm, key: next(v for v in wm.values() if v != file)}}, f)
    with pytest.raises(KeyError) as e:
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert key in str(e.value) and str(tmp_path) in str(e.value) and ".safetensors" in str(e.value)


def test_missing_tensor_text_only(small_ckpts, tmp_path):
    c = small_ckpts
    write_text_only(str(tmp_path), c["cfg"], {n: v for n, v in c["sd"].items() if n != "lm_head.weight"})
    with pytest.raises(KeyError) as e:
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert "lm_head.weight" in str(e.value) and str(tmp_path) in str(e.value)


@pytest.mark.parametrize("layout", ["official", "text"])
def test_shape_mismatch(small_ckpts, tmp_path, layout):
    c = small_ckpts
    sd = {**c["sd"], "layers.1.self_attn.q_proj.weight": torch.zeros(128, 64)}   # gate half missing
    (write_official if layout == "official" else write_text_only)(str(tmp_path), c["cfg"], sd)
    with pytest.raises(ValueError) as e:
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    msg = str(e.value)
    assert "layers.1.self_attn.q_proj.weight" in msg and str(tmp_path) in msg and ".safetensors" in msg


@pytest.mark.parametrize("arch,model_type", [("Qwen3NextForCausalLM", "qwen3_next"), ("LlamaForCausalLM", "llama"),
                                             ("Qwen3MoeForCausalLM", "qwen3_moe")])
def test_unsupported_model_type(small_ckpts, tmp_path, arch, model_type):
    c = small_ckpts
    write_text_only(str(tmp_path), c["cfg"], c["sd"])
    edit_config(str(tmp_path), lambda j: j.update(architectures=[arch], model_type=model_type))
    with pytest.raises(ValueError, match="config.json"):
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    with pytest.raises(ValueError, match="config.json"):
        TargetConfig.from_hf(str(tmp_path))


def test_no_safetensors(small_ckpts, tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen3_5ForCausalLM"], **text_config_json(small_ckpts["cfg"])}, f)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError) as e:
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert str(tmp_path) in str(e.value)


# -----------------------------------------------------------------------------
# the 27B geometry and parameter count

def test_qwen36_27b_preset():
    c = TargetConfig.preset("qwen3.6-27b")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (64, 5120, 17408, 248320)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 4, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads) == (16, 48)
    assert (c.linear_key_head_dim, c.linear_value_head_dim) == (128, 128)
    assert c.linear_conv_kernel_dim == 4 and c.rms_norm_eps == 1e-6 and c.rope_theta == 1e7
    assert c.partial_rotary_factor == 0.25 and c.tie_word_embeddings is False
    assert [i for i, t in enumerate(c.layer_types) if t == FULL] == list(range(3, 64, 4))
    assert all(t == LIN for i, t in enumerate(c.layer_types) if i % 4 != 3)
    with torch.device("meta"):
        m = Target(c)
    assert sum(p.numel() for p in m.parameters()) == 26_895_998_464
    assert len(m.state_dict()) == 851       # 48*14 + 16*11 + embed, norm, lm_head
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["layers.0.linear_attn.in_proj_qkv.weight"] == (10240, 5120)
    assert shapes["layers.0.linear_attn.conv1d.weight"] == (10240, 1, 4)
    assert shapes["layers.0.linear_attn.A_log"] == (48,) and shapes["layers.0.linear_attn.norm.weight"] == (128,)
    assert shapes["layers.3.self_attn.q_proj.weight"] == (12288, 5120)
    assert shapes["layers.3.self_attn.k_proj.weight"] == (1024, 5120)
    assert shapes["layers.3.self_attn.o_proj.weight"] == (5120, 6144)
    assert shapes["lm_head.weight"] == (248320, 5120)


# ==================================================================================================
# model.py: the drafter (mask, BlockMask lists, train/serve equivalence, loss, acceptance, export)

# -----------------------------------------------------------------------------
# default target_layer_ids: z-lab/dflash's build_target_layer_ids, and published drafter configs

@pytest.mark.parametrize("L,n,ids", [
    (36, 5, [1, 9, 17, 25, 33]),
    (64, 5, [1, 16, 31, 46, 61]),
    (40, 5, [1, 10, 19, 28, 37]),
    (40, 8, [1, 6, 11, 16, 22, 27, 32, 37]),
    (32, 8, [1, 5, 9, 13, 17, 21, 25, 29]),
    (48, 8, [1, 7, 14, 20, 26, 32, 39, 45]),
    (64, 1, [32]), (36, 1, [18]), (8, 3, [1, 3, 5]),
])
def test_default_target_layer_ids(L, n, ids):
    out = default_target_layer_ids(L, n)
    assert out == ids and all(type(i) is int for i in out)


def test_features_tap_layer_outputs():
    """target.features(ids, cu, [i, ...]) is the OUTPUT of decoder layer i (HF hidden_states[i+1]),
    concatenated in the order asked, per packed document (layer i-1's output, hidden_states[i],
    fails)."""
    t = tiny_target()
    c = t.config
    cu = cu_of([9, 14, 7])
    ids = torch.randint(0, c.vocab_size, (int(cu[-1]),), generator=torch.Generator().manual_seed(0))
    rope = rope_cos_sin(positions_from_cu(cu), int(c.head_dim * c.partial_rotary_factor), c.rope_theta)
    h, outs = t.embed_tokens(ids), []
    with torch.no_grad():
        for layer in t.layers:
            h = layer(h, rope, Docs.of(cu, h.device))
            outs.append(h)
    for taps in ([0, 3, 5], [5, 1], [1, 3, 5]):
        f = t.features(ids, cu, taps)
        assert f.shape == (len(ids), len(taps) * c.hidden_size)
        assert rel_err(f, torch.cat([outs[i] for i in taps], -1)) < 1e-6, taps
    # and the neighbours really differ (so the check above pins the index)
    assert rel_err(outs[2], outs[3]) > 1e-2 and rel_err(t.embed_tokens(ids), outs[0]) > 1e-2


# -----------------------------------------------------------------------------
# the anchor mask: mask_mod == a loop over the spec (SpecForge's create_dflash_block_mask)

def brute_mask(anchors, keep, doc, pos, S, B, W=0):
    """Written from the spec with loops, per token: KV = [context (S) | block_0 .. block_{N-1}], Q = the
    blocks (SpecForge's create_dflash_block_mask; a window W > 0 as the engines' rule: SGLang window_left =
    W-1, vLLM flash-attn window (W-1, 0), SpecForge create_dflash_sdpa_mask). The query of kept block j slot
    k sits at position q = pos[a_j] + k. Context key t is seen iff t < a_j (strict), doc[t] == doc[a_j] and,
    in a sliding layer (W > 0), q - pos[t] < W. Block key i of its own block (at position pos[a_j] + i) is
    seen in a full layer (W = 0) always, in a sliding one iff i <= k and k - i < W; other blocks' keys never.
    A padded block (keep False) sees nothing."""
    N = len(anchors)
    out = torch.zeros(N * B, S + N * B, dtype=torch.bool)
    for j, a in enumerate(anchors):
        if not keep[j]:
            continue
        for k in range(B):
            q = pos[a] + k
            for t in range(S):
                out[j * B + k, t] = t < a and doc[t] == doc[a] and (W == 0 or q - pos[t] < W)
            for i in range(B):
                out[j * B + k, S + j * B + i] = W == 0 or (i <= k and k - i < W)
    return out


def random_row(rng, S, n_docs):
    """(document of each position, document starts) of S tokens cut at n_docs - 1 random places."""
    cu = torch.tensor([0, *sorted(rng.sample(range(1, S), n_docs - 1)), S])
    return doc_of(cu).tolist(), cu[:-1].tolist()


@pytest.mark.parametrize("B,N", [(4, 10), (16, 5)])
@pytest.mark.parametrize("seed", range(3))
def test_anchor_mask_matches_brute_force(B, N, seed):
    rng = random.Random(seed * 100 + B)
    S = rng.randint(40, 80)
    doc, starts = random_row(rng, S, rng.randint(2, 5))
    kept = set(rng.sample(range(S), rng.randint(2, N - 3)))
    kept.add(rng.choice(starts[1:]))                      # an anchor at a document start (empty context)
    kept.add(S - 1 if seed == 0 else S - rng.randint(2, B))  # and one whose block runs past the row end
    kept = sorted(kept)                                   # at most N - 1: at least one padded slot
    anchors = kept + [0] * (N - len(kept))                 # padded slots: anchor 0, keep False, last
    keep = [True] * len(kept) + [False] * (N - len(kept))
    a_t, k_t, d_t = torch.tensor(anchors), torch.tensor(keep), torch.tensor(doc)
    mm = anchor_mask_mod(a_t, k_t, d_t, S, B)
    q_idx, kv_idx = torch.arange(N * B)[:, None], torch.arange(S + N * B)[None, :]
    got = mm(0, 0, q_idx, kv_idx)
    ref = brute_mask(anchors, keep, doc, positions_from_cu(torch.tensor([*starts, S])).tolist(), S, B)
    assert got.shape == ref.shape and got.dtype == torch.bool
    assert torch.equal(got, ref), f"{(got != ref).sum().item()} cells differ"
    # flex also evaluates padded tiles past Q_LEN / KV_LEN: no out-of-range indexing there
    mm(0, 0, torch.arange(N * B + 2 * B)[:, None], torch.arange(S + N * B + 128)[None, :])


BLOCK_LISTS = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
               "full_q_num_blocks", "full_q_indices"]   # a BlockMask's 8 lists, in anchor_blocks' order


def check_blocks(anchors, keep, doc, S, B, W=0):
    """anchor_blocks (window W) == create_block_mask over the (windowed) mask_mod: all 8 lists, shape, dtype,
    stride and values. Returns anchor_blocks' lists."""
    N = len(anchors)
    got = anchor_blocks(anchors, keep, doc, S, B, W)
    ref = create_block_mask(anchor_mask_mod(anchors, keep, doc, S, B, W), None, None, N * B, S + N * B,
                            device="cpu")
    assert len(got) == len(BLOCK_LISTS)
    for name, g in zip(BLOCK_LISTS, got):
        r = getattr(ref, name)
        # strides too: the compiled flex backward reads the lists as laid out by create_block_mask
        assert g.shape == r.shape and g.dtype == r.dtype and g.stride() == r.stride(), name
        assert torch.equal(g, r), name
    return got


@pytest.mark.parametrize("S,N,B,docs,p", [(8192, 512, 16, 4, 0.7), (700, 40, 16, 3, 0.9), (300, 37, 5, 2, 0.5),
                                          (515, 64, 8, 5, 0.05), (129, 9, 16, 1, 1.0)])
def test_anchor_blocks_match_create_block_mask(S, N, B, docs, p):
    # the closed-form BlockMask the GPU step uses == flex's own create_block_mask over THE mask_mod:
    # all 8 block lists, partial and full (a tile wrongly called full would skip the mask), sizes
    # not multiples of 128
    g = torch.Generator().manual_seed(S)
    cuts = torch.randperm(S - 1, generator=g)[:docs - 1] + 1
    doc = doc_of(torch.tensor([0, *sorted(cuts.tolist()), S]))
    lm = (torch.rand(S, generator=g) < p).long()
    torch.manual_seed(N)
    anchors, keep, _ = sample_anchors(lm, doc, S, N)
    got = check_blocks(anchors, keep, doc, S, B)
    if S == 8192:   # the real shape has both kinds of tile, so both branches were exercised
        assert got[0].sum() > 0 and got[2].sum() > 0
    # by hand: contexts ending on a tile edge (anchor 128) or empty (anchor 256 starts a document)
    anchors, keep = torch.tensor([128] * 8 + [256] * 7 + [0]), torch.tensor([True] * 15 + [False])
    check_blocks(anchors, keep, doc_of(torch.tensor([0, 256, 400])), 400, 16)

# -----------------------------------------------------------------------------
# train/serve equivalence: the masked training forward == propose() with only the anchor's own past

def ref_propose_logits(d, ctx_feats, ctx_pos, anchor_token, anchor_pos, embed, head, hf_rope=False):
    """Independent fp32 reference of one drafting step (z-lab/dflash, dflash/model.py): c =
    hidden_norm(fc(feats)) feeds k/v of every layer unchanged; per layer a pre-norm Qwen3 block, q/k
    RMSNorm per head, NeoX RoPE (keys at [ctx_pos ; block_pos], queries at block_pos), GQA (head i
    reads kv head i // (nh/nkv)), SwiGLU; final norm; logits of block slots 1..B-1. A full layer sees
    every key; a sliding layer's query at position q sees key p iff q - (W-1) <= p <= q (loops, the
    engines' rule). RoPE by hand (plain), or with hf_rope from transformers' Qwen3RotaryEmbedding (the
    config's rope_scaling)."""
    c = d.config
    B, nh, nkv, hd, W = c.block_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w
    rotary = Qwen3RotaryEmbedding(hf_qwen3_config(c)) if hf_rope else None

    def rope(x, p):
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        if rotary is not None:
            cos, sin = rotary(x, p[None])
            return x * cos[0][:, None] + torch.cat([-x2, x1], -1) * sin[0][:, None]
        inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = (p.double()[:, None] * inv[None]).float()[:, None, :]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    bpos = anchor_pos + torch.arange(B)
    kpos = torch.cat([ctx_pos, bpos])
    sees = {FULL: torch.ones(B, len(kpos), dtype=torch.bool)}
    if SLIDING in c.layer_types:
        sees[SLIDING] = torch.tensor([[q - (W - 1) <= p <= q for p in kpos.tolist()] for q in bpos.tolist()])
    ctx = rms(ctx_feats @ d.fc.weight.T, d.hidden_norm.weight)
    h = embed[torch.tensor([anchor_token] + [c.mask_token_id] * (B - 1))]
    for L, kind in zip(d.layers, c.layer_types):
        a = L.self_attn
        x = rms(h, L.input_layernorm.weight)
        kvin = torch.cat([ctx, x])
        q = rope(rms((x @ a.q_proj.weight.T).view(B, nh, hd), a.q_norm.weight), bpos)
        k = rope(rms((kvin @ a.k_proj.weight.T).view(-1, nkv, hd), a.k_norm.weight), kpos)
        v = (kvin @ a.v_proj.weight.T).view(-1, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5
        p = s.masked_fill(~sees[kind], -float("inf")).softmax(-1)
        h = h + torch.einsum("hqk,khd->qhd", p, v).reshape(B, nh * hd) @ a.o_proj.weight.T
        y = rms(h, L.post_attention_layernorm.weight)
        h = h + (F.silu(y @ L.mlp.gate_proj.weight.T) * (y @ L.mlp.up_proj.weight.T)) @ L.mlp.down_proj.weight.T
    return rms(h, d.norm.weight)[1:] @ head.T


def forward(d, t, r, feats=None, **kw):
    """The drafter's training forward (loss, metrics) on row r, with the target's embedding and head."""
    feats = r["feats"] if feats is None else feats
    return d(feats, r["tokens"], r["loss_mask"], r["doc"], r["pos"], r["anchors"], r["keep"],
             t.embed_tokens.weight, t.lm_head.weight, **kw)


def propose_args(t, r, a):
    """propose()'s arguments for anchor a of row r: the context of its own document before it (features,
    positions), its token and position, the target's embedding and head."""
    s = max(x for x in r["cu"][:-1].tolist() if x <= a)       # the anchor's document start
    return (r["feats"][s:a], r["pos"][s:a], int(r["tokens"][a]), int(r["pos"][a]), t.embed_tokens.weight,
            t.lm_head.weight)


class Spy:
    """Wraps _WeightedCE.apply to record the forward's own (h, head, labels, w, chunk, ...)."""
    def __init__(self, monkeypatch, replace=None):
        self.calls, self.orig, self.replace = [], model._WeightedCE.apply, replace
        monkeypatch.setattr(model._WeightedCE, "apply", self)

    def __call__(self, h, head, labels, w, chunk, *rest):
        self.calls.append((h.detach().clone(), labels.clone(), w.clone()))
        if self.replace is not None:
            return self.replace(h, head, labels, w, chunk, *rest)
        return self.orig(h, head, labels, w, chunk, *rest)


@pytest.fixture(scope="module")
def drafter_rows():
    """The tiny target, a random 2-layer drafter on taps [1, 3, 5], 3 packed rows, sampled anchors."""
    t = tiny_target()
    cfg = DrafterConfig.from_target(t.config, n_feat=3, num_hidden_layers=2)
    assert cfg.target_layer_ids == [1, 3, 5] and cfg.block_size == 16
    d = randomize_drafter_(Drafter(cfg), 1)
    rows = []
    g = torch.Generator().manual_seed(3)
    for lens, full in (([14, 23, 19], True), ([30, 26], False), ([5, 40, 11], True)):
        cu = cu_of(lens)
        S = int(cu[-1])
        tokens = torch.randint(0, t.config.vocab_size - 1, (S,), generator=g)
        doc, pos = doc_of(cu), positions_from_cu(cu)
        loss_mask = (torch.rand(S, generator=g) < (0.35 if full else 0.7)).long()
        loss_mask[cu[:-1]] = loss_mask[cu[:-1] + 1] = 1   # every document start is a valid anchor
        n_valid = int(((loss_mask[1:] > 0) & (loss_mask[:-1] > 0) & (doc[1:] == doc[:-1])).sum())
        # full: n > #valid, so every valid anchor (document starts too) is kept, 3 slots are padding
        n = n_valid + 3 if full else 6
        torch.manual_seed(int(S))
        anchors, keep, _ = sample_anchors(loss_mask, doc, S, n)
        feats = t.features(tokens, cu, cfg.target_layer_ids).clone()
        rows.append(dict(cu=cu, S=S, tokens=tokens, doc=doc, pos=pos, loss_mask=loss_mask, anchors=anchors,
                         keep=keep, feats=feats, full=full))
    return t, d, rows


def train_h(monkeypatch, d, t, r, feats=None):
    """The final hidden states of the training forward, (N anchors, B, H)."""
    spy = Spy(monkeypatch)
    forward(d, t, r, feats)
    monkeypatch.undo()
    (h, _, _), = spy.calls
    return h.view(len(r["anchors"]), d.config.block_size, -1)


def test_train_serve_equivalence(drafter_rows, monkeypatch):
    t, d, rows = drafter_rows
    head = t.lm_head.weight
    n_start = 0
    for r in rows:
        h = train_h(monkeypatch, d, t, r)
        starts = r["cu"][:-1].tolist()
        assert r["keep"].any() and (not r["full"] or (~r["keep"]).sum() == 3)
        for j in range(len(r["anchors"])):
            if not r["keep"][j]:
                continue
            a = int(r["anchors"][j])
            s = max(x for x in starts if x <= a)             # the anchor's document start
            n_start += a == s
            train_logits = (h[j, 1:] @ head.T).float()
            tok, logits = d.propose(*propose_args(t, r, a))
            assert logits.shape == (d.config.block_size - 1, t.config.vocab_size)
            assert torch.equal(tok, logits.argmax(-1))
            assert rel_err(train_logits, logits) < 1e-4, (a, s)
    assert n_start >= 5   # anchors at document starts (empty context) were among those compared


def test_propose_matches_reference(drafter_rows):
    t, d, rows = drafter_rows
    r = rows[0]
    for a in (0, 14, 20, 40, 50):   # document starts (empty context) and mid-document anchors
        args = propose_args(t, r, a)
        _, logits = d.propose(*args)
        assert rel_err(logits, ref_propose_logits(d, *args)) < 1e-4, a


def test_training_context_is_strictly_before_anchor(drafter_rows, monkeypatch):
    t, d, rows = drafter_rows
    r = rows[0]
    starts = r["cu"][:-1].tolist()
    h = train_h(monkeypatch, d, t, r)
    g = torch.Generator().manual_seed(5)
    checked = 0
    for j in range(len(r["anchors"])):
        a = int(r["anchors"][j])
        s = max(x for x in starts if x <= a)
        if not r["keep"][j] or a == s or s == 0:
            continue                          # needs a-1 in the same document, and an earlier document
        ref = h[j]
        # features at and after the anchor, and of earlier documents: invisible to block j
        f = r["feats"].clone()
        f[a:] += torch.randn(f[a:].shape, generator=g)
        f[:s] += torch.randn(f[:s].shape, generator=g)
        assert rel_err(train_h(monkeypatch, d, t, r, f)[j], ref) < 1e-6, a
        # the feature right before the anchor (same document): visible
        f = r["feats"].clone()
        f[a - 1] += torch.randn(f[a - 1].shape, generator=g)
        assert rel_err(train_h(monkeypatch, d, t, r, f)[j], ref) > 1e-3, a
        checked += 1
        if checked == 3:
            break
    assert checked == 3


# -----------------------------------------------------------------------------
# loss weights, labels and the acceptance proxy on a hand-worked row (block size 5, gamma 2)

#                  0  1  2  3  4  5  6  7  8  9 10 11 12 13
HAND_DOC = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
HAND_LM = [0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]
HAND_ANCHORS = [0, 1, 4, 6, 9, 12, 0]
HAND_KEEP = [True] * 6 + [False]
# supervised slots, worked out by hand: slot k of anchor a is supervised iff keep, k >= 1, a+k < S,
# loss_mask[a+k] and doc[a+k] == doc[a]
HAND_SUP = [[0, 1, 1, 0, 1],    # a=0: pos 3 has loss_mask 0
            [0, 1, 0, 1, 1],    # a=1: pos 3 again
            [0, 1, 1, 1, 0],    # a=4: pos 8 is in the next document
            [0, 1, 0, 0, 0],    # a=6: pos 8, 9, 10 are in the next document
            [0, 1, 1, 1, 1],    # a=9: all of 10..13
            [0, 1, 0, 0, 0],    # a=12: pos 14.. are past the row end
            [0, 0, 0, 0, 0]]    # padded slot
GAMMA, HB = 2.0, 5


@pytest.fixture(scope="module")
def hand():
    t = tiny_target()
    cfg = DrafterConfig.from_target(t.config, n_feat=3, num_hidden_layers=1, block_size=HB)
    d = randomize_drafter_(Drafter(cfg), 2)
    S = len(HAND_DOC)
    tokens = torch.randint(0, 500, (S,), generator=torch.Generator().manual_seed(4))
    doc = torch.tensor(HAND_DOC)
    cu = torch.tensor([0, 8, 14])
    assert torch.equal(doc_of(cu), doc)
    r = dict(tokens=tokens, doc=doc, pos=positions_from_cu(cu), loss_mask=torch.tensor(HAND_LM),
             anchors=torch.tensor(HAND_ANCHORS), keep=torch.tensor(HAND_KEEP),
             feats=t.features(tokens, cu, cfg.target_layer_ids).clone())
    return t, d, r


def test_loss_weights_and_labels_by_hand(hand, monkeypatch):
    t, d, r = hand
    spy = Spy(monkeypatch)
    out = forward(d, t, r, gamma=GAMMA, ce_chunk=7)
    (h, labels, w), = spy.calls
    N = len(HAND_ANCHORS)
    exp_w = torch.zeros(N, HB)
    exp_lab = torch.full((N, HB), -1)
    for j, a in enumerate(HAND_ANCHORS):
        for k in range(HB):
            if HAND_SUP[j][k]:
                exp_w[j, k] = math.exp(-(k - 1) / GAMMA)     # w_1 = 1, w_2 = e^-1/2, ...
                exp_lab[j, k] = r["tokens"][a + k]           # slot k predicts the token AT a+k (no shift)
    assert torch.allclose(w.view(N, HB), exp_w, rtol=1e-6, atol=0), w.view(N, HB)
    sup = exp_w > 0
    assert torch.equal(labels.view(N, HB)[sup], exp_lab[sup])
    # reference loss from plain full logits
    ce_ref = F.cross_entropy(h.view(N, HB, -1)[sup] @ t.lm_head.weight.T, exp_lab[sup], reduction="none")
    ref = (exp_w[sup] * ce_ref).sum() / exp_w.sum()
    assert abs(out["loss"].item() - ref.item()) <= 1e-5 * ref.item()
    # per-slot counts: slot 0 never supervised
    assert out["slot_count"].tolist() == torch.tensor(HAND_SUP).sum(0).tolist() == [0, 6, 3, 3, 3]
    assert out["blocks"].item() == 6
    # gamma matters (the decay is applied) and the loss is differentiable wrt the drafter
    assert abs(forward(d, t, r, gamma=7.0)["loss"].item() - out["loss"].item()) > 1e-4
    d.zero_grad()
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in d.parameters()) and d.fc.weight.grad.abs().sum() > 0



def test_dpace_weights_by_hand():
    """model.dpace_weights on one block, q = 0.5, 0.2, 0.9: alpha 0.5 smooths to 0.75, 0.6, 0.95, prefix
    products 0.75, 0.45, 0.4275, suffix sums 1.6275, 0.8775, 0.4275; a masked middle slot is a no-op in the
    product and weighs 0; alpha 1 counts the valid slots left; alpha 0 uses q itself."""
    q = torch.tensor([[0.5, 0.2, 0.9]])
    every, middle = torch.tensor([[True, True, True]]), torch.tensor([[True, False, True]])
    assert torch.allclose(model.dpace_weights(q, every, 0.5), torch.tensor([[1.6275, 0.8775, 0.4275]]))
    assert torch.allclose(model.dpace_weights(q, middle, 0.5), torch.tensor([[1.4625, 0.0, 0.7125]]))
    assert torch.equal(model.dpace_weights(q, middle, 1.0), torch.tensor([[2.0, 0.0, 1.0]]))
    assert torch.allclose(model.dpace_weights(q, every, 0.0), torch.tensor([[0.5 + 0.1 + 0.09, 0.1 + 0.09, 0.09]]))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_dpace_loss_through_the_step(hand, monkeypatch, alpha):
    """Drafter.forward(dpace=alpha) on the hand-worked row (masked slots, blocks cut by the document end and
    the row end, a padded anchor), loss and every gradient, == a plain-torch D-PACE over full logits: weights
    from SpecForge's formula written as loops (detached), no decay, the sum over the row's 2 samples."""
    t, d, r = hand
    N, S = len(HAND_ANCHORS), len(HAND_DOC)
    d.zero_grad()
    out = forward(d, t, r, gamma=GAMMA, ce_chunk=7, dpace=alpha)
    out["loss"].backward()
    got = {n: p.grad.clone() for n, p in d.named_parameters()}
    captured, orig = [], model._WeightedCE.apply
    monkeypatch.setattr(model._WeightedCE, "apply", lambda h, *a: captured.append(h) or orig(h, *a))
    d.zero_grad()
    forward(d, t, r, gamma=GAMMA)                        # the same h, with its graph
    sup = torch.tensor(HAND_SUP).bool()
    labels = r["tokens"][(r["anchors"][:, None] + torch.arange(HB)).clamp(max=S - 1)]
    ce = F.cross_entropy(captured[0] @ t.lm_head.weight.T, labels.view(-1), reduction="none").view(N, HB)
    q = (-ce).exp().detach()
    w = torch.zeros(N, HB)
    for j in range(N):
        for k in range(HB):
            for m in range(k, HB):
                if sup[j, k] and sup[j, m]:
                    w[j, k] += math.prod(float((1 - alpha) * q[j, i] + alpha) for i in range(m + 1) if sup[j, i])
    ref = (w * ce * sup).sum() / 2
    ref.backward()
    assert abs(out["loss"].item() - ref.item()) <= 1e-5 * ref.item()
    for n, p in d.named_parameters():
        assert rel_err(got[n], p.grad) < 1e-4, n
    assert out["slot_count"].tolist() == [0, 6, 3, 3, 3]

def test_acceptance_proxy_by_hand(hand, monkeypatch):
    t, d, r = hand
    # pred == label at slots 1..4 ("raw", before the supervision mask), per block
    raw = [[1, 1, 1, 1],    # & sup -> 1 1 0 1: accept 1 + 2
           [1, 1, 1, 1],    # & sup -> 1 0 1 1: accept 1 + 1
           [1, 0, 1, 0],    # accept 1 + 1
           [0, 1, 1, 1],    # accept 1 + 0
           [1, 1, 1, 1],    # accept 1 + 4
           [1, 1, 1, 1],    # & sup -> 1 0 0 0: accept 1 + 1
           [1, 1, 1, 1]]    # padded: not counted
    V = t.config.vocab_size

    def fake(h, head, labels, w, chunk, *rest):
        ok = torch.tensor([[1] + row for row in raw]).view(-1).bool()
        pred = torch.where(ok, labels, (labels + 1) % V)
        return (h.sum() * 0.0).float(), pred, torch.ones(len(pred))

    Spy(monkeypatch, replace=fake)
    out = forward(d, t, r, gamma=GAMMA)
    assert out["accept_sum"].item() == 3 + 2 + 2 + 1 + 5 + 2
    assert out["blocks"].item() == 6
    sup = torch.tensor(HAND_SUP)[:, 1:].bool()
    corr = torch.tensor(raw).bool() & sup
    assert out["slot_correct"].tolist() == [0] + corr.sum(0).tolist() == [0, 5, 2, 3, 3]
    assert out["slot_count"].tolist() == [0, 6, 3, 3, 3]


@pytest.mark.parametrize("case", ["no_anchors", "zero_weights"])
def test_fully_masked_row(hand, case):
    t, d, r = hand
    r = dict(r)
    S = len(HAND_DOC)
    if case == "no_anchors":          # nothing supervised: sample_anchors keeps no slot
        r["loss_mask"] = torch.zeros(S, dtype=torch.long)
        r["anchors"], r["keep"], _ = sample_anchors(r["loss_mask"], r["doc"], 4, 4)
        assert not r["keep"].any() and (r["anchors"] == 0).all()
    else:                             # kept anchors, but every slot falls past the row end / unsupervised
        r["loss_mask"] = torch.tensor([1] * 12 + [0, 0])
        r["anchors"], r["keep"] = torch.tensor([11, 13]), torch.tensor([True, True])
    d.zero_grad()
    out = forward(d, t, r, gamma=GAMMA)
    assert out["loss"].item() == 0.0 and out["slot_count"].sum().item() == 0
    assert out["accept_sum"].item() == (0 if case == "no_anchors" else 2)
    assert out["blocks"].item() == r["keep"].sum()
    out["loss"].backward()
    for n, p in d.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad == 0).all(), n


# -----------------------------------------------------------------------------
# the chunked weighted CE == plain autograd over full logits; Drafter.flops == FlopCounterMode

@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 1024])
def test_weighted_ce_matches_autograd(chunk):
    g = torch.Generator().manual_seed(chunk)
    Q, H, V = 37, 16, 50
    h0 = torch.randn(Q, H, generator=g) * 2
    W = torch.randn(V, H, generator=g)
    y = torch.randint(0, V, (Q,), generator=g)
    w = torch.rand(Q, generator=g)
    w[torch.rand(Q, generator=g) < 0.3] = 0.0             # zero-weight rows
    w[:3] = 0.0
    h = h0.clone().requires_grad_()
    loss, pred, _ = model._WeightedCE.apply(h, W, y, w, chunk)
    (3.0 * loss).backward()                               # the upstream gradient is honoured
    hr = h0.clone().requires_grad_()
    logits = hr @ W.T
    ref = (w * F.cross_entropy(logits, y, reduction="none")).sum()
    (3.0 * ref).backward()
    assert loss.shape == () and abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
    assert rel_err(h.grad, hr.grad) < 1e-5
    assert (h.grad[w == 0] == 0).all()
    assert torch.equal(pred, logits.argmax(-1)) and not pred.requires_grad


@pytest.mark.parametrize("dpace,objective", [(None, None), (0.5, None), (0.5, "tv"), (None, "dspark"),
                                             (0.5, "accept")])
def test_plain_loss_equals_chunked(drafter_rows, dpace, objective):
    """Drafter.forward's reference loss (ce_chunk=0: model.plain_ce, plain autograd over full-vocab logits,
    train.py --plain-loss) == the chunked _WeightedCE it stands for: loss, metrics and every gradient, with
    the published loss and with D-PACE, CE or an objective against the target's distribution (its final
    hidden state after the taps), on rows with padded slots and masked labels."""
    t, d, rows = drafter_rows
    obj = objective and distill.Objective(objective, 0.8)
    for r in rows:
        outs, grads = [], []
        feats = t.features(r["tokens"], r["cu"], d.config.target_layer_ids, final=True).clone() if obj else None
        for chunk in (0, 7):
            d.zero_grad()
            out = forward(d, t, r, feats, ce_chunk=chunk, dpace=dpace, objective=obj)
            out["loss"].backward()
            outs.append(out)
            grads.append({n: p.grad.clone() for n, p in d.named_parameters()})
        assert outs[0]["loss"].item() == pytest.approx(outs[1]["loss"].item(), rel=1e-5)
        for k in ("accept_sum", "blocks", "slot_correct", "slot_count"):
            assert torch.equal(outs[0][k], outs[1][k]), k
        if obj:
            assert outs[0]["sampled_accept_sum"].item() == pytest.approx(outs[1]["sampled_accept_sum"].item())
        for n in grads[0]:
            assert rel_err(grads[0][n], grads[1][n]) < 1e-4, n


# -----------------------------------------------------------------------------
# objectives against the target's own distribution (distill.py)

OBJECTIVES = ("tv", "accept", "dspark")


@pytest.mark.parametrize("kind,T", [(kind, 1.0) for kind in OBJECTIVES] + [("tv", 2.0), ("accept", 2.0)])
def test_objectives_by_hand(kind, T):
    """One block of 3 slots over 3 tokens, W = I so that the logits are h and t_h themselves (times T: the
    distributions at T are q and p below); slot 0 the anchor (weight 0):
      slot 1: q = (.5, .3, .2), p = (.2, .5, .3): a = sum min = .7; b = [q < p] = (0, 1, 1), sum q b = .5,
              da/dz = q (b - .5) / T = (-.25, .15, .1) / T; label 1: CE = -log .3 (at T = 1)
      slot 2: q = (.6, .3, .1), p = (.7, .22, .08): a = .9; b = (1, 0, 0): da/dz = (.24, -.18, -.06) / T;
              label 0: CE = -log .6
    tv = 1 - a, accept = -log(a + eps), dspark = .1 CE + .9 tv (its CE's gradient q - onehot, at T = 1 only);
    summed with weight 1, and with D-PACE's (alpha .5, from a): smoothed (.85, .95), prefix (.85, .8075),
    weights (1.6575, .8075). The chunked pass (gradient by hand) and plain_ce (autograd) alike."""
    q = torch.tensor([[.2, .3, .5], [.5, .3, .2], [.6, .3, .1]], dtype=torch.float64)
    p = torch.tensor([[.3, .3, .4], [.2, .5, .3], [.7, .22, .08]], dtype=torch.float64)
    y, w, W = torch.tensor([2, 1, 0]), torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64), torch.eye(3).double()
    a = torch.tensor([.7, .9], dtype=torch.float64)
    da = torch.tensor([[-.25, .15, .1], [.24, -.18, -.06]], dtype=torch.float64) / T
    ce, dce = -torch.tensor([.3, .6]).double().log(), q[1:] - F.one_hot(y[1:], 3)
    value, grad = {"tv": (1 - a, -da), "accept": (-(a + distill.EPS).log(), -da / (a + distill.EPS)[:, None]),
                   "dspark": (.1 * ce + .9 * (1 - a), .1 * dce - .9 * da)}[kind]
    obj = distill.Objective(kind, T)
    for dpace, weights in ((None, torch.ones(2)), (0.5, torch.tensor([1.6575, .8075]))):
        for chunked in (True, False):
            h = (T * q.log()).requires_grad_()
            rest = (3, dpace, None, T * p.log(), obj)
            loss, pred, acc = (model._WeightedCE.apply(h, W, y, w, 3, *rest) if chunked
                               else model.plain_ce(h, W, y, w, *rest))
            loss.backward()
            assert loss.item() == pytest.approx((weights * value).sum().item(), rel=1e-6), (dpace, chunked)
            assert rel_err(h.grad[1:], weights[:, None] * grad) < 1e-6 and (h.grad[0] == 0).all()
            assert torch.allclose(acc[1:].double(), a) and pred.tolist() == [2, 0, 0]


@pytest.mark.parametrize("kind", OBJECTIVES)
@pytest.mark.parametrize("chunk,dpace,T", [(5, None, 1.0), (8, 0.5, 0.6), (1024, 0.5, 1.0), (1, None, 2.0)])
def test_objectives_match_autograd(kind, chunk, dpace, T):
    """_WeightedCE with an objective (distill.Objective.terms: the gradient by hand, chunk by chunk, the target's
    logits made in the same chunks) == plain_ce (autograd through torch.minimum over the full logits) on random
    rows, zero-weight rows among them: the loss, the acceptances, the gradient wrt h (1e-5)."""
    g = torch.Generator().manual_seed(chunk)
    Q, H, V, B = 40, 16, 50, 4
    h0, W, th = torch.randn(Q, H, generator=g) * 2, torch.randn(V, H, generator=g), torch.randn(Q, H, generator=g)
    y, w = torch.randint(0, V, (Q,), generator=g), torch.rand(Q, generator=g)
    w[torch.rand(Q, generator=g) < 0.3] = 0.0
    w = (w > 0).float() if dpace is not None else w                # D-PACE: w is the 0/1 supervision
    obj, outs = distill.Objective(kind, T), []
    for chunked in (True, False):
        h = h0.clone().requires_grad_()
        rest = (B, dpace, None, th, obj)
        loss, pred, acc = (model._WeightedCE.apply(h, W, y, w, chunk, *rest) if chunked
                           else model.plain_ce(h, W, y, w, *rest))
        (3.0 * loss).backward()
        outs.append((loss, pred, acc, h.grad))
    (loss, pred, acc, grad), (ref, pred_r, acc_r, grad_r) = outs
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel_err(grad, grad_r) < 1e-5 and (grad[w == 0] == 0).all() and grad.abs().sum() > 0
    assert rel_err(acc, acc_r) < 1e-6 and torch.equal(pred, pred_r)


def test_objective_reads_the_targets_next_token_distribution(drafter_rows, monkeypatch):
    """The objective's p at block slot k is the target's distribution after position anchor + k - 1 (its next
    token the label at anchor + k): Drafter.forward's sampled_accept_sum == per block 1 + sum_k prod_{i <= k}
    sum_x min(p_i, q_i) over the leading supervised slots, p from the target's own full forward
    (Target.logits), q from the drafter's final hidden states (seen by Spy) and the head, at T = 0.7."""
    t, d, rows = drafter_rows
    obj, T = distill.Objective("tv", 0.7), 0.7
    for r in rows:
        feats = t.features(r["tokens"], r["cu"], d.config.target_layer_ids, final=True)
        spy = Spy(monkeypatch)
        with torch.no_grad():
            out = forward(d, t, r, feats, objective=obj)
        monkeypatch.undo()
        (h, _, _), = spy.calls
        B, S = d.config.block_size, r["S"]
        q = (h @ t.lm_head.weight.T / T).softmax(-1).view(len(r["anchors"]), B, -1)
        p = (t.logits(r["tokens"], r["cu"]) / T).softmax(-1)        # [S, V]: after each position
        want = 0.0
        for j, (a, kept) in enumerate(zip(r["anchors"].tolist(), r["keep"].tolist())):
            run, total = 1.0, 1.0
            for k in range(1, B):
                x = a + k
                if not kept or x >= S or r["doc"][x] != r["doc"][a] or not r["loss_mask"][x]:
                    break
                run *= torch.minimum(p[x - 1], q[j, k]).sum().item()
                total += run
            want += total if kept else 0.0
        assert out["sampled_accept_sum"].item() == pytest.approx(want, rel=1e-5)


def test_drafter_flops_count_every_matmul(drafter_rows):
    # Drafter.flops, bench.py's MFU numerator, == the GEMM FLOPs torch's FlopCounterMode sees in a
    # real step (fwd + bwd). CPU SDPA is not among the counted ops: flops' visible (default None)
    # leaves attention out.
    t, d, rows = drafter_rows
    d, r = copy.deepcopy(d), rows[1]
    with FlopCounterMode(display=False) as fc:
        forward(d, t, r)["loss"].backward()
    assert fc.get_flop_counts()["Global"][torch.ops.aten.mm] == d.flops(r["S"], len(r["anchors"]))


def rss_peak():
    """GiB: this process's peak resident memory since the last reset_rss_peak()."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM")).split()[1]) / 2**20


def reset_rss_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def big_vocab_step(N, objective=None):
    """A 1-layer drafter's whole step (model.drafter_step) on a 1024-token row with N anchors, V = 131072, as
    (eager, CPU-compiled) functions of nothing -> the loss; one chunk of logits is 1024 x V fp32, 0.5 GiB."""
    torch.manual_seed(0)
    V, S = 131072, 1024
    tcfg = dataclasses.replace(TargetConfig.preset("tiny"), vocab_size=V)
    t = Target.build(tcfg, device="cpu", dtype=torch.float32, n_layers=0)
    d = Drafter(DrafterConfig.from_target(tcfg, num_hidden_layers=1))
    feats = torch.randn(S, (len(d.config.target_layer_ids) + bool(objective)) * tcfg.hidden_size)
    row = dict(tokens=torch.randint(0, V, (S,)), loss_mask=torch.ones(S, dtype=torch.long),
               doc=torch.zeros(S, dtype=torch.long), pos=torch.arange(S))
    eager = functools.partial(model.drafter_step, d, anchors_per_doc=N, row_anchors=N, embed=t.embed_tokens.weight,
                              head=t.lm_head.weight, objective=objective)

    def step(fn):
        torch.manual_seed(1)                      # the same anchors (train.py: inductor's fallback_random)
        with torch._inductor.config.patch(fallback_random=True):
            out, _ = fn(feats, row)
        out["loss"].backward()
        return out["loss"].item()
    return (functools.partial(step, fn) for fn in (eager, torch.compile(eager, fullgraph=True, dynamic=False)))


def test_compiled_step_holds_one_chunk_of_logits():
    """train.py's compiled drafter step (inductor, here on the CPU) peaks where the eager step does:
    _WeightedCE's chunks run one after another. Without its chunk-to-chunk dependency
    the compiler fuses them and holds every chunk's logits at once (here +2.0 GiB over eager; +0.4 with it)."""
    peaks, losses = {}, {}
    for name, step in zip(("eager", "compiled"), big_vocab_step(256)):   # 4 chunks
        step()                                        # compiles
        reset_rss_peak()
        before = rss_peak()
        losses[name] = step()
        peaks[name] = rss_peak() - before
    chunk = 1024 * 131072 * 4 / 2**30                 # one chunk's fp32 logits, GiB
    assert abs(losses["compiled"] - losses["eager"]) <= 1e-5 * losses["eager"]
    assert peaks["compiled"] <= peaks["eager"] + 2 * chunk, (peaks, chunk)


def test_objective_step_holds_no_rows_by_vocab_tensor():
    """With an objective (distill.py) the compiled step makes the target's logits chunk by chunk too: its peak
    does not grow with the rows (128 -> 256 anchors, 2048 -> 4096 rows: a [rows, V] fp32 tensor would add
    1 GiB; here +0.06 GiB; the target's logits made in one GEMM before the chunks: +1.06)."""
    peaks = {}
    for N in (128, 256):
        _, compiled = big_vocab_step(N, distill.Objective("tv"))
        loss = compiled()                             # compiles
        reset_rss_peak()
        before = rss_peak()
        assert compiled() == pytest.approx(loss, rel=1e-6)
        peaks[N] = rss_peak() - before
    assert peaks[256] - peaks[128] < 0.25, peaks


# -----------------------------------------------------------------------------
# anchor sampling

def eligible_by_doc(loss_mask, doc):
    # the recipe's rule, per position: anchor and next token supervised, one document
    S, out = len(loss_mask), {}
    for a in range(S - 1):
        if loss_mask[a] and loss_mask[a + 1] and doc[a] == doc[a + 1]:
            out.setdefault(int(doc[a]), []).append(a)
    return out


def check_anchors(loss_mask, doc, per_doc, cap, anchors, keep, wanted):
    """sample_anchors' output against a brute-force reference: eligibility, sorted and unique, padding last,
    and per document min(per_doc, eligible) anchors, cut to the capacity max-min fairly: with the level L the
    largest for which sum_d min(q_d, L) <= cap, every document gets min(q_d, L) or min(q_d, L + 1)."""
    eligible = eligible_by_doc(loss_mask, doc)
    q = {d: min(per_doc, len(v)) for d, v in eligible.items()}
    assert anchors.shape == keep.shape == (cap,) and anchors.dtype == torch.long and keep.dtype == torch.bool
    assert int(wanted) == sum(q.values())
    m = int(keep.sum())
    assert m == min(cap, sum(q.values()))
    assert keep[:m].all() and not keep[m:].any() and (anchors[m:] == 0).all()     # padded slots last
    kept = anchors[:m].tolist()
    assert kept == sorted(set(kept))                                               # sorted, unique
    got = {d: [a for a in kept if doc[a] == d] for d in eligible}
    assert sum(len(v) for v in got.values()) == m                                  # only eligible positions
    level = 0
    while level < cap and sum(min(n, level + 1) for n in q.values()) <= cap:
        level += 1
    for d, v in got.items():
        assert set(v) <= set(eligible[d])
        assert min(q[d], level) <= len(v) <= min(q[d], level + 1), (d, len(v), q[d], level)
    return got, eligible


def test_sample_anchors_invariants():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for it in range(40):
        S = int(torch.randint(30, 81, (), generator=g))
        cuts = torch.randperm(S - 1, generator=g)[: int(torch.randint(0, 5, (), generator=g))] + 1
        doc = doc_of(torch.tensor([0, *sorted(cuts.tolist()), S]))
        loss_mask = (torch.rand(S, generator=g) < [0.5, 0.1, 0.9, 0.0][it % 4]).long()
        for per_doc in (1, 3, S):
            for cap in (1, 8, S - 1):
                got, eligible = check_anchors(loss_mask, doc, per_doc, cap,
                                              *sample_anchors(loss_mask, doc, per_doc, cap))
                if per_doc == S and cap == S - 1:
                    assert got == eligible                 # no limit: every eligible position, exactly


def test_sample_anchors_cut_fairly_by_hand():
    # documents with 2, 9 and 5 eligible positions, 3 per document asked, capacity 7: the short document keeps
    # its 2, the other two share the 5 left (3 + 2 or 2 + 3); capacity 4: 2 + 1 + 1 (in some order)
    doc = torch.tensor([0] * 3 + [1] * 10 + [2] * 6)
    loss_mask = torch.ones(19, dtype=torch.long)
    for cap, total in ((7, 7), (4, 4), (20, 8)):
        for seed in range(20):
            torch.manual_seed(seed)
            anchors, keep, wanted = sample_anchors(loss_mask, doc, 3, cap)
            counts = sorted(int((doc[anchors[keep]] == d).sum()) for d in range(3))
            assert int(wanted) == 8 and sum(counts) == total
            assert counts == {7: [2, 2, 3], 4: [1, 1, 2], 20: [2, 3, 3]}[cap], (cap, counts)


def test_sample_anchors_uniform():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 0, 1])
    doc = torch.tensor([0] * 9 + [1] * 7 + [2] * 4)         # 15 -> 16 crosses a document boundary
    valid = {0: [1, 4, 5], 1: [9, 10, 13], 2: [16]}          # 2 -> 3, 6 -> 7, 14 -> 15: next not supervised
    per_doc, draws = 2, 3000
    torch.manual_seed(1)
    counts = torch.zeros(20)
    for _ in range(draws):
        anchors, keep, _ = sample_anchors(loss_mask, doc, per_doc, 8)
        assert keep.sum() == 5
        counts[anchors[keep]] += 1
    assert torch.nonzero(counts).view(-1).tolist() == sorted(a for v in valid.values() for a in v)
    for d, positions in valid.items():      # each position of a document with n eligible: min(2, n) / n
        expected = draws * min(per_doc, len(positions)) / len(positions)   # 2000 (sd ~26) or 3000
        assert ((counts[positions] - expected).abs() <= 0.06 * expected).all(), (d, counts[positions])


def test_sample_anchors_deterministic():
    # train.py seeds torch from (seed, step, pair) before drawing: the same seed gives the same anchors
    loss_mask = (torch.rand(300, generator=torch.Generator().manual_seed(0)) < 0.6).long()
    doc = doc_of(torch.tensor([0, 70, 200, 300]))
    draws = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        draws.append(sample_anchors(loss_mask, doc, 16, 40)[0])
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_packed_loss_is_weighted_mean_of_document_losses(drafter_rows):
    """The loss on a packed row, sum(w * CE) / sum(w), equals the mean of the losses a one-sample-per-row
    trainer computes on each document alone with the same anchors, weighted by each document's sum of
    weights W_d: L_row = sum_d W_d L_d / sum_d W_d. (An unweighted mean of L_d would over-weight short
    documents; per block, both trainers weigh every supervised slot alike.)"""
    t, d, rows = drafter_rows
    r = rows[0]
    out = forward(d, t, r)
    num = den = 0.0
    for s, e in zip(r["cu"][:-1].tolist(), r["cu"][1:].tolist()):
        sel = r["keep"] & (r["anchors"] >= s) & (r["anchors"] < e)
        if not sel.any():
            continue
        one = dict(feats=r["feats"][s:e], tokens=r["tokens"][s:e], loss_mask=r["loss_mask"][s:e],
                   doc=torch.zeros(e - s, dtype=torch.long), pos=r["pos"][s:e], anchors=r["anchors"][sel] - s,
                   keep=torch.ones(int(sel.sum()), dtype=torch.bool))
        o = forward(d, t, one)
        k = torch.arange(1, d.config.block_size)
        idx = one["anchors"][:, None] + k
        inside = idx < e - s
        sup = inside & (one["loss_mask"][idx.clamp(max=e - s - 1)] > 0)
        w_d = (sup.float() * torch.exp(-(k - 1).float() / 7.0)).sum().item()
        num, den = num + w_d * o["loss"].item(), den + w_d
    assert abs(out["loss"].item() - num / den) <= 1e-5 * out["loss"].item()


# -----------------------------------------------------------------------------
# save/load in the z-lab format (config.json, safetensors keys of z-lab/dflash's DFlashDraftModel)

def test_save_load_roundtrip_and_format(tmp_path, drafter_rows):
    t = tiny_target()
    tc = t.config
    cfg = DrafterConfig.from_target(tc, n_feat=3, num_hidden_layers=2, block_size=8, mask_token_id=500,
                                    rope_theta=12345.0, rms_norm_eps=1e-5)
    d = randomize_drafter_(Drafter(cfg), 7)
    d.save_pretrained(str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = Drafter.from_pretrained(str(tmp_path))
    assert loaded.config == cfg
    ref = copy.deepcopy(d)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert any(not torch.equal(p, q) for p, q in zip(d.parameters(), ref.parameters()))   # bf16 really rounds
    for name, p in loaded.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, ref.get_parameter(name)), name
    # identical logits: the serving step and the training loss
    _, _, rows = drafter_rows
    r = rows[0]
    args = propose_args(t, r, 20)
    assert torch.equal(args[0], r["feats"][14:20])          # its document starts at 14
    assert torch.equal(loaded.propose(*args)[1], ref.propose(*args)[1])
    assert torch.equal(forward(loaded, t, r)["loss"], forward(ref, t, r)["loss"])

    with open(tmp_path / "config.json") as f:
        j = json.load(f)
    L, H = cfg.num_hidden_layers, tc.hidden_size
    assert j["architectures"] == ["DFlashDraftModel"] and j["model_type"] == "qwen3"
    assert j["block_size"] == 8 and j["dflash_config"]["block_size"] == 8
    assert j["dflash_config"]["mask_token_id"] == 500
    assert j["dflash_config"]["target_layer_ids"] == [1, 3, 5]
    assert j["num_target_layers"] == tc.num_hidden_layers == 8
    assert j["layer_types"] == ["full_attention"] * L
    assert j["rope_theta"] == 12345.0 and j["max_position_embeddings"] == tc.max_position_embeddings
    assert j["vocab_size"] == tc.vocab_size and j["tie_word_embeddings"] == tc.tie_word_embeddings
    assert (j["hidden_size"], j["intermediate_size"], j["num_hidden_layers"]) == (H, tc.intermediate_size, L)
    assert (j["num_attention_heads"], j["num_key_value_heads"], j["head_dim"]) == (4, 2, 16)
    assert j["hidden_act"] == "silu" and j["rms_norm_eps"] == 1e-5
    for bad in ("eagle_aux_hidden_state_layer_ids", "auto_map", "is_causal"):
        assert bad not in j
    assert "causal" not in j["dflash_config"]

    nh, nkv, hd, I = 4, 2, 16, tc.intermediate_size
    shapes = {"fc.weight": (H, 3 * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(L):
        p = f"layers.{i}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (nh * hd, H), p + "self_attn.k_proj.weight": (nkv * hd, H),
                       p + "self_attn.v_proj.weight": (nkv * hd, H), p + "self_attn.o_proj.weight": (H, nh * hd),
                       p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
    assert len(shapes) == 3 + 11 * L
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert keys == set(shapes), keys ^ set(shapes)
        for k in keys:
            x = f.get_tensor(k)
            assert x.dtype == torch.bfloat16 and tuple(x.shape) == shapes[k], k


# -----------------------------------------------------------------------------
# the published Qwen3.6-27B drafter geometry (z-lab/Qwen3.6-27B-DFlash config.json)

def test_qwen36_27b_drafter_geometry():
    c = DrafterConfig.from_target(TargetConfig.preset("qwen3.6-27b"))
    assert (c.hidden_size, c.intermediate_size) == (5120, 17408)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (32, 8, 128)
    assert c.target_layer_ids == [1, 16, 31, 46, 61] and c.num_target_layers == 64
    assert c.num_hidden_layers == 5 and c.block_size == 16
    assert (c.mask_token_id, c.vocab_size) == (248070, 248320)
    assert c.rope_theta == 1e7 and c.max_position_embeddings == 262144
    with torch.device("meta"):
        d = Drafter(c)
    n = sum(p.numel() for p in d.parameters())
    layer = 2 * 4096 * 5120 + 2 * 1024 * 5120 + 3 * 5120 * 17408 + 2 * 128 + 2 * 5120
    assert n == 5 * 5120 * 5120 + 2 * 5120 + 5 * layer == 1_730_213_120   # ~1.73B
    assert sorted(d.state_dict()) == sorted(k for k, _ in d.named_parameters())   # no buffers to save



# ==================================================================================================
# data.py, prepare.py, regenerate.py: format, prepare, packer, bad input, flat memory, demo

COMMANDS = {"prepare": ["prepare.py"], "regenerate": ["regenerate.py"]}


def cli(cmd, *args):
    """The command `cmd` (prepare: python prepare.py ARGS, regenerate: python regenerate.py ARGS) in a fresh
    process."""
    script, *sub = COMMANDS[cmd]
    return subprocess.run([sys.executable, os.path.join(HERE, script), *sub, *map(str, args)],
                          capture_output=True, text=True)


def write_jsonl(path, objs):
    with open(path, "w") as f:
        for o in objs:
            f.write((o if isinstance(o, str) else json.dumps(o)) + "\n")


def random_samples(n, lo, hi, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(lo, hi + 1))
        out.append((rng.integers(0, vocab, L), (rng.random(L) < 0.7).astype(np.uint8)))
    return out


# -----------------------------------------------------------------------------
# round trips

def test_prepare_pretokenized_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    objs = []
    for i in range(50):
        L = int(rng.integers(1, 30))
        o = {"input_ids": rng.integers(0, 70000, L).tolist()}  # ids above 65535 must survive (uint32)
        if i % 3:
            o["loss_mask"] = [1] + rng.integers(0, 2, L - 1).tolist()
        objs.append(o)
    write_jsonl(tmp_path / "in.jsonl", objs)
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--val", 5)
    assert r.returncode == 0, r.stderr + r.stdout
    tr, va = open_dataset(tmp_path / "d"), open_dataset(tmp_path / "d" / "val")
    assert tr.path == os.path.join(tmp_path / "d", "train")  # the parent resolves to train/
    assert len(tr) == 45 and len(va) == 5
    # val lines are spread evenly (line i where floor(i*5/50) steps up); both splits keep file order
    val_lines = [i for i in range(50) if (i + 1) * 5 // 50 > i * 5 // 50]
    assert val_lines == [9, 19, 29, 39, 49]
    got = [tr.sample(k) for k in range(len(tr))]
    got_val = [va.sample(k) for k in range(len(va))]
    want = [o for i, o in enumerate(objs) if i not in val_lines]
    for (ids, mask), o in zip(got + got_val, want + [objs[i] for i in val_lines]):
        assert ids.dtype == np.uint32 and mask.dtype == np.uint8
        assert ids.tolist() == o["input_ids"]
        assert mask.tolist() == o.get("loss_mask", [1] * len(o["input_ids"]))
    all_ids = np.concatenate([o["input_ids"] for o in objs])
    assert tr.meta["n_tokens"] + va.meta["n_tokens"] == len(all_ids)
    assert tr.meta["n_supervised"] == int(sum(m.sum() for _, m in got))
    assert tr.vocab_size == int(max(i.max() for i, _ in got)) + 1
    assert tr.lengths.dtype == np.int64 and tr.lengths.tolist() == [len(o["input_ids"]) for o in want]
    # a declared vocab size is recorded as the bound
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d2", "--vocab-size", 80000)
    assert r.returncode == 0 and open_dataset(tmp_path / "d2").vocab_size == 80000
    assert not os.path.exists(tmp_path / "d2" / "val")


# -----------------------------------------------------------------------------
# chat lines: a checkpoint's own template against transformers' apply_chat_template

QWEN36 = os.path.join(HERE, "testdata", "qwen3.6-27b.chat_template.jinja")  # sources: testdata/README
QWEN3 = os.path.join(HERE, "testdata", "qwen3-8b.chat_template.jinja")
# Qwen2Tokenizer's pre-tokenizer (transformers/models/qwen2/tokenization_qwen2.py): transformers 5
# rebuilds a Qwen2Tokenizer with it, so tokenizer.json must use the same for the two to agree
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_ADDED = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
CORPUS_WORDS = ("the of and to in is you that it was for on are as with they at be this have from or one by "
                "word not what all we when your can said there an each which do how if will up other about "
                "many then them so some would make like into time has look two more write go see no way "
                "could people than first water call who its now find day get come made hello hi thanks "
                "weather Paris sunny degrees function tool answer think question let me check plus four "
                "greet back brief").split()


def chat_checkpoint(path, template=QWEN36, in_config=False):
    """A checkpoint directory as Qwen ships one, tiny: a byte-level BPE tokenizer.json trained here
    (vocab 512, the `tiny` target's, specials included), Qwen's special and added tokens,
    tokenizer_config.json that transformers' AutoTokenizer loads, generation_config.json's eos
    ids, and the chat template as chat_template.jinja (or in tokenizer_config.json). Returns the
    tokenizers.Tokenizer."""
    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(0)
    lines = [" ".join(rng.choice(CORPUS_WORDS) for _ in range(12)) + rng.choice(".?!\n{}\":,")
             for _ in range(2000)]
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=512 - len(QWEN_SPECIAL) - len(QWEN_ADDED), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIAL])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in QWEN_ADDED])
    assert tok.get_vocab_size(with_added_tokens=True) <= 512
    tok.save(os.path.join(path, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in QWEN_SPECIAL + QWEN_ADDED}
    cfg = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
           "pad_token": "<|endoftext|>", "unk_token": None, "errors": "replace", "add_prefix_space": False,
           "model_max_length": 262144, "split_special_tokens": False,
           "added_tokens_decoder": {str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": s in QWEN_SPECIAL}
                                    for s, i in ids.items()}}
    with open(template) as f:
        text = f.read()
    if in_config:
        cfg["chat_template"] = text
    else:
        with open(os.path.join(path, "chat_template.jinja"), "w") as f:
            f.write(text)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]]}, f)
    return tok


@pytest.fixture(scope="module")
def chat_dirs(tmp_path_factory):
    """{template: (checkpoint dir, transformers' tokenizer of it)}; Qwen3's template sits in
    tokenizer_config.json, as Qwen3-8B ships it."""
    from transformers import AutoTokenizer
    out = {}
    for tpl in (QWEN36, QWEN3):
        d = tmp_path_factory.mktemp("ckpt")
        chat_checkpoint(d, tpl, in_config=tpl == QWEN3)
        out[tpl] = str(d), AutoTokenizer.from_pretrained(d)
    return out


WEATHER_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
CONV_THINKING = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "reasoning_content": "greet back", "content": "hello"},
                 {"role": "user", "content": "what is two plus two?"},
                 {"role": "assistant", "content": "<think>\n2+2 is four\n</think>\n\nIt is four."}]
CONV_TOOLS = [{"role": "user", "content": "weather in Paris?"},
              {"role": "assistant", "reasoning": "call the tool", "content": "Let me check.",  # vLLM's name
               "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 2}"}}]},
              {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 degrees"},
              {"role": "tool", "tool_call_id": "c1", "content": "no rain"},
              {"role": "assistant", "thinking": "answer now", "content": "Sunny, 21 degrees.", "tool_calls": None}]
CONV_OFF = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "what is "}, {"type": "text", "text": "two plus two?"}]},
            {"role": "assistant", "content": "It is four."}]


def chat_cases(tpl):
    """(name, messages, tools, template kwargs, expected samples): each sample is
    (n: it is the rendering of messages[:n], [(i, the answer of message i as the template renders
    it, hand-written)]). Qwen3's generation prompt stops at "assistant\\n" (the model writes <think>
    itself); Qwen3.6's opens "<think>\\n" (thinking on) or writes an empty think block (off)."""
    q3 = tpl == QWEN3

    def ans(reasoning, content, calls=""):
        think = ("" if reasoning is None else f"<think>\n{reasoning}\n</think>\n\n" if q3
                 else f"{reasoning}\n</think>\n\n")
        return think + content + calls + "<|im_end|>"
    a2, a4 = ans("greet back", "hello"), ans("2+2 is four", "It is four.")
    # earlier thinking is dropped once a later user turn exists: turn 2 needs its own sample,
    # unless Qwen3.6's preserve_thinking keeps it
    yield "thinking", CONV_THINKING, None, {}, [(3, [(2, a2)]), (5, [(4, a4)])]
    yield ("preserve_thinking", CONV_THINKING, None, {"preserve_thinking": True},
           [(3, [(2, a2)]), (5, [(4, a4)])] if q3 else [(5, [(2, a2), (4, a4)])])
    calls = ('\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' if q3
             else "\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")
    yield ("tools", CONV_TOOLS, WEATHER_TOOLS, {},
           [(5, [(1, ans("call the tool", "Let me check.", calls)), (4, ans("answer now", "Sunny, 21 degrees."))])])
    # thinking off: the empty think block is the prompt's; history drops it, so each turn is its own
    yield ("thinking off", CONV_OFF, None, {"enable_thinking": False},
           [(2, [(1, ans(None, "hello"))]), (4, [(3, ans(None, "It is four."))])])


def hf_render(hf, msgs, tools, kw, gen=False):
    """transformers' rendering, with tool-call arguments parsed from JSON as the engines do first."""
    msgs = copy.deepcopy(msgs)
    for m in msgs:
        for c in m.get("tool_calls") or ():
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    return hf.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=gen, **kw)


def runs_of(mask):
    """[(start, end)] of the runs of 1s."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]]).astype(np.int8)))
    return list(zip(edges[::2], edges[1::2]))


@pytest.mark.parametrize("tpl", [QWEN36, QWEN3], ids=["qwen3.6", "qwen3"])
def test_chat_render_and_mask_match_transformers(chat_dirs, tpl):
    """Every sample's ids == transformers' tokenizer(apply_chat_template(messages[:n])) ids; every
    supervised run starts exactly where the tokens of apply_chat_template(messages[:i],
    add_generation_prompt=True) end and decodes to the hand-written answer; nothing else is
    supervised."""
    d, hf = chat_dirs[tpl]
    for name, msgs, tools, kw, want in chat_cases(tpl):
        chat = prepare.Chat(d, kw)
        got, n, notes = chat.samples({"messages": msgs, "tools": tools})
        assert len(got) == len(want) and not notes, name
        for (ids, mask), (end, turns) in zip(got, want):
            ref = hf(hf_render(hf, msgs[:end], tools, kw), add_special_tokens=False).input_ids
            assert ids.tolist() == ref, name
            assert len(runs_of(mask)) == len(turns), name
            for (a, b), (i, answer) in zip(runs_of(mask), turns):
                prompt = hf(hf_render(hf, msgs[:i], tools, kw, gen=True), add_special_tokens=False).input_ids
                assert ids[:a].tolist() == prompt, (name, i)
                assert hf.decode(ids[a:b].tolist()) == answer, (name, i)
        assert n["trained"] == n["assistant_turns"] == sum(len(t) for _, t in want) and n["straddle"] == 0
        assert n["own_sample"] == len(want) - 1 and n["not_as_served"] == n["not_intact"] == 0
    # --turns last: the whole conversation, its last answer supervised
    (ids, mask), = prepare.Chat(d).samples({"messages": CONV_THINKING}, turns="last")[0]
    assert ids.tolist() == hf(hf_render(hf, CONV_THINKING, None, {}), add_special_tokens=False).input_ids
    (a, b), = runs_of(mask)
    assert b == len(ids) - 1 and hf.decode(ids[a:b].tolist()).endswith("It is four.<|im_end|>")


def test_prepare_chat_roundtrip(chat_dirs, tmp_path):
    """prepare.py --tokenizer DIR: chat lines of every input form (messages, ShareGPT
    conversations) become the samples Chat makes (checked against transformers above), with
    --val, the vocab bound of the tokenizer, and the counts and template recorded in meta.json."""
    d, hf = chat_dirs[QWEN36]
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    lines = [{"messages": CONV_THINKING}, {"messages": CONV_TOOLS, "tools": WEATHER_TOOLS, "id": 7}, sharegpt,
             {"messages": CONV_THINKING[:3]}]
    write_jsonl(tmp_path / "chat.jsonl", lines)
    r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d", "--tokenizer", d, "--val", 1,
            "--workers", 2)
    assert r.returncode == 0, r.stderr + r.stdout
    tr, va = open_dataset(tmp_path / "d"), open_dataset(tmp_path / "d" / "val")
    chat = prepare.Chat(d)
    want = [s for o in lines for s in chat.samples(o)[0]]
    got = [tr.sample(k) for k in range(len(tr))] + [va.sample(k) for k in range(len(va))]
    assert len(got) == len(want) == 5 and len(va) == 1  # CONV_THINKING makes 2, the last line is val
    for (ids, mask), (wi, wm) in zip(got, want):
        assert ids.tolist() == wi.tolist() and mask.tolist() == wm.tolist()
    assert tr.vocab_size == hf.vocab_size + len(hf.added_tokens_decoder) == 512
    meta = tr.meta["chat"]
    assert meta["tokenizer"] == d and meta["template"] == os.path.join(d, "chat_template.jinja")
    assert meta["template_sha256"] == "e84f32a23fdda27689f868aa4a1a5621f41133e51a48d7f3efcbea2839574259"
    assert (meta["turns"], meta["trained"], meta["own_sample"]) == ("all", 5, 1)
    assert "6 of 6 assistant turns trained (1 in a sample of their own" in r.stdout


def test_chat_setup_errors(tmp_path):
    """Chat lines without --tokenizer, and a --tokenizer that is no checkpoint: one line naming what
    is missing, nothing written."""
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONV_THINKING}])
    r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d")
    assert r.returncode == 1 and "chat.jsonl:1" in r.stderr and "--tokenizer DIR" in r.stderr
    d = tmp_path / "ckpt"
    chat_checkpoint(d)
    for remove, msg in [("chat_template.jinja", "has no chat template: neither chat_template.jinja nor"),
                        ("tokenizer.json", "has no tokenizer.json")]:
        os.rename(d / remove, tmp_path / remove)
        r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d", "--tokenizer", d)
        assert r.returncode == 1 and msg in r.stderr and str(d) in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "d" / "train")
        os.rename(tmp_path / remove, d / remove)
    r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d", "--tokenizer", d / "tokenizer.json")
    assert r.returncode == 1 and "is not a directory" in r.stderr
    r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d", "--tokenizer", d,
            "--chat-template-kwargs", "[1]")
    assert r.returncode == 2 and "--chat-template-kwargs" in r.stderr
    for pkg in ("jinja2", "tokenizers"):  # not installed: one line saying how to install it
        code = (f"import sys; sys.modules[{pkg!r}] = None; sys.path.insert(0, {HERE!r}); import prepare; "
                f"prepare.main(['--input', {str(tmp_path / 'chat.jsonl')!r}, '--out', "
                f"{str(tmp_path / 'd')!r}, '--tokenizer', {str(d)!r}])")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 1 and r.stderr.strip() == (f"error: prepare.py --tokenizer needs the {pkg} "
                                                          f"package: pip install {pkg}"), r.stderr


def test_chat_bad_lines(tmp_path):
    """A template that raises, no assistant turn, an unknown role, malformed tool arguments, a turn
    the template does not render after its generation prompt: one line each naming the line,
    counted; the good lines all kept. Answers the template drops are counted as not intact."""
    d = tmp_path / "ckpt"
    chat_checkpoint(d)
    tools_bad = copy.deepcopy(CONV_TOOLS)
    tools_bad[1]["tool_calls"][0]["function"]["arguments"] = "{\"city\": Paris}"
    bad = {3: ({"messages": CONV_THINKING[1:2] + CONV_THINKING[:1] + CONV_THINKING[2:3]}, "template error",
               "TemplateError: System message must be at the beginning."),
           5: ({"messages": CONV_THINKING[:2]}, "no assistant turn", "nothing to train on"),
           7: ({"messages": [{"role": "robot", "content": "x"}] + CONV_THINKING}, "unknown role", "'robot'"),
           9: ({"messages": tools_bad, "tools": WEATHER_TOOLS}, "bad tool arguments", "message 1 tool call 0"),
           11: ({"prompt": "hi"}, "no assistant turn", "nothing to train on")}
    lines = [{"messages": CONV_THINKING[:3]}] * 12
    for k, (o, _, _) in bad.items():
        lines[k - 1] = o
    write_jsonl(tmp_path / "in.jsonl", lines)
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--tokenizer", d, "--max-bad", 0.5,
            "--workers", 2)
    assert r.returncode == 0, r.stderr + r.stdout
    for k, (_, kind, detail) in bad.items():
        line = next(l for l in r.stdout.splitlines() if l.startswith(f"{tmp_path / 'in.jsonl'}:{k}: "))
        assert kind in line and detail in line, line
    assert "skipped 5 of 12 lines" in r.stdout and len(open_dataset(tmp_path / "d")) == 7
    # thinking off, but answers carry reasoning: not what serving produces, so not trained (a line
    # with nothing left is bad); Qwen3's template renders an assistant's list content as nothing
    d3 = tmp_path / "qwen3"
    chat_checkpoint(d3, QWEN3, in_config=True)
    lost = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]
    partly = CONV_OFF[:3] + [{"role": "assistant", "reasoning_content": "2+2", "content": "four"}]
    write_jsonl(tmp_path / "off.jsonl", [{"messages": CONV_THINKING}, {"messages": CONV_OFF}, {"messages": lost},
                                         {"messages": partly}])
    r = cli("prepare", "--input", tmp_path / "off.jsonl", "--out", tmp_path / "e", "--tokenizer", d3,
            "--chat-template-kwargs", '{"enable_thinking": false}', "--max-bad", 0.5)
    assert r.returncode == 0, r.stderr + r.stdout
    assert "off.jsonl:1: not as served: turn 4: the generation prompt goes on '\\n</think>" in r.stdout
    assert "check --chat-template-kwargs" in r.stdout and "skipped 1 of 4 lines: 1 not as served" in r.stdout
    assert "off.jsonl:4: not as served: turn 3" in r.stdout
    assert "off.jsonl:3: not intact: turn 1: 'hello' is not in the supervised text" in r.stdout
    meta = open_dataset(tmp_path / "e").meta["chat"]
    assert (meta["not_as_served"], meta["not_intact"], meta["trained"]) == (1, 1, 4)
    assert meta["kwargs"] == {"enable_thinking": False} and meta["template"] == str(d3 / "tokenizer_config.json")


def test_chat_prepare_shows_sample(chat_dirs, tmp_path):
    """prepare.py --tokenizer ends with the sample lengths and the first training sample as written,
    printed back with the supervised spans between « and »."""
    d, _ = chat_dirs[QWEN36]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONV_TOOLS, "tools": WEATHER_TOOLS}, {"messages": CONV_OFF}])
    r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d", "--tokenizer", d)
    assert r.returncode == 0, r.stderr
    ds = open_dataset(tmp_path / "d")
    L = sorted(ds.lengths.tolist())  # p50, p99: the sorted lengths at floor((n - 1) * q)
    assert f"tokens per sample: p50 {L[(len(L) - 1) // 2]}, p99 {L[int(0.99 * (len(L) - 1))]}, max {L[-1]}" in r.stdout
    ids, mask = ds.sample(0)
    text = r.stdout.split("between « and »:\n", 1)[1]
    assert text.count("«") == len(runs_of(mask)) == 2
    assert "«call the tool\n</think>\n\nLet me check." in text and text.startswith("<|im_start|>system\n# Tools")


# -----------------------------------------------------------------------------
# packer

def ref_next_fit(lengths, order, budget):
    rows, cur, used = [], [], 0
    for i in order:
        l = min(lengths[i], budget)
        if used + l > budget:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += l
    return rows + [cur]


def check_row(row, ds, budget):
    assert all(len(a) == budget for a in (row.tokens, row.loss_mask, row.doc, row.pos))
    assert row.tokens.dtype == np.int64 and row.loss_mask.dtype == np.uint8
    assert row.doc.dtype == np.int32 and row.pos.dtype == np.int64 and row.cu_seqlens.dtype == np.int64
    p = 0
    for d, i in enumerate(row.samples):
        ids, mask = ds.sample(i)
        l = min(len(ids), budget)
        assert row.cu_seqlens[d] == p
        assert (row.tokens[p:p + l] == ids[:l]).all() and (row.loss_mask[p:p + l] == mask[:l]).all()
        assert (row.doc[p:p + l] == d).all() and (row.pos[p:p + l] == np.arange(l)).all()
        p += l
    n = len(row.samples)
    if p < budget:  # padding tail: its own document, id 0, never supervised
        assert row.cu_seqlens.tolist()[n:] == [p, budget]
        assert (row.doc[p:] == n).all() and (row.pos[p:] == np.arange(budget - p)).all()
        assert (row.tokens[p:] == 0).all() and (row.loss_mask[p:] == 0).all()
    else:
        assert row.cu_seqlens.tolist()[n:] == [budget]


@pytest.fixture
def ds(tmp_path):
    write_dataset(tmp_path / "ds", random_samples(157, 1, 40, seed=3))
    return open_dataset(tmp_path / "ds")


@pytest.mark.parametrize("n_shards", [1, 2, 3])
def test_packer_epoch_invariants(ds, n_shards):
    budget = 64
    packers = [Packer(ds, budget, n_shards, s, seed=7) for s in range(n_shards)]
    steps = {p.steps_per_epoch for p in packers}
    assert len(steps) == 1  # every shard does the same number of steps
    rows = [[p.next_row() for _ in range(p.steps_per_epoch)] for p in packers]
    order = np.random.default_rng((7, 0)).permutation(len(ds))
    ref = ref_next_fit(ds.lengths.tolist(), order.tolist(), budget)
    assert packers[0].steps_per_epoch == -(-len(ref) // n_shards)
    seen = []
    for s in range(n_shards):
        for k, row in enumerate(rows[s]):
            check_row(row, ds, budget)
            assert row.epoch == 0 and row.index == s + k * n_shards
            want = ref[row.index] if row.index < len(ref) else []  # filler row for a short shard
            assert row.samples.tolist() == want
            seen += want
    assert sorted(seen) == list(range(len(ds)))  # each sample exactly once per epoch, across shards
    nxt = packers[0].next_row()  # rolls over into epoch 1, with a new order
    assert nxt.epoch == 1 and packers[0].epoch == 1 and nxt.index == 0
    order = np.random.default_rng((7, 1)).permutation(len(ds))
    assert nxt.samples.tolist() == ref_next_fit(ds.lengths.tolist(), order.tolist(), budget)[0]


def test_packer_filler_row(tmp_path):
    # 5 samples of 10 tokens, budget 20: 3 rows (2+2+1); of 2 shards, shard 1 gets row 1 and a filler
    write_dataset(tmp_path / "d", [(np.arange(1, 11), np.ones(10)) for _ in range(5)])
    d = open_dataset(tmp_path / "d")
    p = Packer(d, 20, n_shards=2, shard=1, shuffle=False)
    assert p.steps_per_epoch == 2
    r1, r2 = p.next_row(), p.next_row()
    assert r1.samples.tolist() == [2, 3] and r1.index == 1
    assert r2.samples.tolist() == [] and r2.index == 3 and r2.cu_seqlens.tolist() == [0, 20]
    assert (r2.loss_mask == 0).all() and (r2.doc == 0).all() and (r2.pos == np.arange(20)).all()
    p0 = Packer(d, 20, n_shards=2, shard=0, shuffle=False)
    assert [p0.next_row().samples.tolist() for _ in range(2)] == [[0, 1], [4]]


def test_packer_seed_and_shuffle(ds):
    rows = lambda p, n: [p.next_row().samples.tolist() for _ in range(n)]
    a, b = rows(Packer(ds, 64, seed=1), 20), rows(Packer(ds, 64, seed=1), 20)
    c = rows(Packer(ds, 64, seed=2), 20)
    assert a == b and a != c
    p = Packer(ds, 64, shuffle=False)
    flat = sum(rows(p, p.steps_per_epoch), [])
    assert flat == list(range(len(ds)))  # eval mode: same packing, file order, every sample once


def test_packer_resume(ds):
    # train.py resumes with seek(step): the stream continues exactly, at and across epoch boundaries
    for n_shards, shard in [(1, 0), (3, 2)]:
        ref = Packer(ds, 64, n_shards, shard, seed=5)
        spe = ref.steps_per_epoch
        stream = [ref.next_row() for _ in range(3 * spe + 2)]
        for k in [0, 1, spe - 1, spe, spe + 1, 2 * spe + 3]:
            q = Packer(ds, 64, n_shards, shard, seed=5)
            q.next_row()                                   # seek is absolute, whatever was read before
            q.seek(k)
            for j in range(k, min(k + spe + 1, len(stream))):
                r, want = q.next_row(), stream[j]
                assert (r.epoch, r.index) == (want.epoch, want.index)
                for a, b in zip(r[:6], want[:6]):
                    assert np.array_equal(a, b)


def test_packer_truncation(tmp_path):
    lens = [100, 10, 64, 65, 3]
    write_dataset(tmp_path / "d", [(np.arange(L) + 1, np.ones(L, np.uint8)) for L in lens])
    d = open_dataset(tmp_path / "d")
    p = Packer(d, 64, shuffle=False)
    assert p.truncated == 2 and p.truncated_tokens == 36 + 1
    # supervised tokens lost: sample 0 supervised on 0..69 (6 of them past 64), sample 3 on all
    mask0 = (np.arange(100) < 70).astype(np.uint8)
    write_dataset(tmp_path / "m", [(np.arange(100) + 1, mask0)] + [(np.arange(L) + 1, np.ones(L, np.uint8))
                                                                    for L in lens[1:]])
    assert Packer(open_dataset(tmp_path / "m"), 64, shuffle=False).truncated_supervised() == 6 + 1
    rows = [p.next_row() for _ in range(p.steps_per_epoch)]
    assert [r.samples.tolist() for r in rows] == [[0], [1], [2], [3], [4]]
    for r in rows:
        check_row(r, d, 64)
    assert rows[0].tokens.tolist() == list(range(1, 65))


# -----------------------------------------------------------------------------
# bad input, bad files, atomic writes

def good(i):
    return {"input_ids": [1, 2, 3, i % 50 + 1], "loss_mask": [0, 1, 1, 1]}


def test_bad_lines_reported(tmp_path):
    lines = [good(i) for i in range(200)]
    bad = {3: "{not json", 10: {"text": "hello"}, 20: {"input_ids": [1, -4, 2]},
           30: {"input_ids": [1, 500, 2]}, 40: {"input_ids": [1, 2], "loss_mask": [1]},
           50: {"input_ids": [1, 2], "loss_mask": [0, 0]}, 60: {"input_ids": []}, 70: [1, 2, 3]}
    for i, b in bad.items():
        lines[i - 1] = b
    lines.insert(99, "   ")  # a blank line is ignored, not counted as bad; later line numbers shift by one
    write_jsonl(tmp_path / "in.jsonl", lines)
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--vocab-size", 100,
            "--max-bad", 0.05)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for line, kind in [(3, "malformed JSON"), (10, "neither input_ids nor messages"), (20, "token id out of range"),
                       (30, "token id out of range"), (40, "loss_mask length mismatch"), (50, "no supervised token"),
                       (60, "bad input_ids"), (70, "neither input_ids nor messages")]:
        assert f"in.jsonl:{line}: {kind}" in out, kind
    assert "id -4" in out and "id 500 not in [0, 100)" in out
    assert "skipped 8 of 200 lines" in out and "2 token id out of range" in out and "ignored 1 blank lines" in out
    assert len(open_dataset(tmp_path / "d")) == 192
    # the same file with the default --max-bad (1%) fails loudly and writes nothing
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "e", "--vocab-size", 100)
    assert r.returncode == 1 and "8 of 200 lines (4.0%) are bad" in r.stderr and "--max-bad" in r.stderr
    assert not os.path.exists(tmp_path / "e" / "train") and os.listdir(tmp_path / "e") == []


def test_bad_lines_first_ten_then_counts(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", ["{broken"] * 15 + [good(i) for i in range(5)])
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--max-bad", 0.9)
    assert r.returncode == 0
    assert "in.jsonl:10: malformed JSON" in r.stdout and "in.jsonl:11:" not in r.stdout
    assert "skipped 15 of 20 lines: 15 malformed JSON" in r.stdout


@pytest.mark.parametrize("content,msg", [("", "is empty"), ("\n\n", "is empty"),
                                         ("{bad\n[1]\n", "none of its 2 lines is a valid sample")])
def test_nothing_valid_fails(tmp_path, content, msg):
    (tmp_path / "in.jsonl").write_text(content)
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d")
    assert r.returncode == 1 and msg in r.stderr and "in.jsonl" in r.stderr
    assert not os.path.exists(tmp_path / "d" / "train")


def test_cli_errors(tmp_path):
    r = cli("prepare", "--input", tmp_path / "nope.jsonl", "--out", tmp_path / "d")
    assert r.returncode == 1 and "nope.jsonl not found" in r.stderr
    write_jsonl(tmp_path / "in.jsonl", [good(i) for i in range(10)])
    assert cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d").returncode == 0
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d")
    assert r.returncode == 1 and "already exists" in r.stderr and "--force" in r.stderr
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--force", "--val", 0.2)
    assert r.returncode == 0 and len(open_dataset(tmp_path / "d")) == 8
    assert len(open_dataset(tmp_path / "d" / "val")) == 2
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--force", "--val", 10)
    assert r.returncode == 1 and "fewer than all" in r.stderr
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--val", 1.5)
    assert r.returncode == 2 and r.stderr == "error: --val: 1.5: give a number of samples >= 1 or a fraction in (0, 1)\n"
    # the one held-out line (the last) is bad: nothing is written, not even train/
    write_jsonl(tmp_path / "v.jsonl", [good(i) for i in range(9)] + ["{bad"])
    r = cli("prepare", "--input", tmp_path / "v.jsonl", "--out", tmp_path / "e", "--val", 1, "--max-bad", 0.5)
    assert r.returncode == 1 and "every line of the val split is bad" in r.stderr and os.listdir(tmp_path / "e") == []
    assert sorted(os.listdir(tmp_path / "d")) == ["train", "val"]  # no temp directories left behind


def test_corrupt_dataset_named(tmp_path):
    write_dataset(tmp_path / "d", random_samples(20, 5, 10))
    open_dataset(tmp_path / "d")
    with open(tmp_path / "d" / "tokens.bin", "r+b") as f:
        f.truncate(40)
    with pytest.raises(DataError, match=r"tokens\.bin is 40 bytes.*python prepare\.py --input"):
        open_dataset(tmp_path / "d")
    os.remove(tmp_path / "d" / "meta.json")
    with pytest.raises(DataError, match=r"meta\.json not found.*python prepare\.py --input"):
        open_dataset(tmp_path / "d")
    write_dataset(tmp_path / "v", random_samples(3, 5, 10))
    meta = json.loads((tmp_path / "v" / "meta.json").read_text())
    (tmp_path / "v" / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(DataError, match="version 99"):
        open_dataset(tmp_path / "v")
    write_dataset(tmp_path / "o", random_samples(3, 5, 10))
    off = np.fromfile(tmp_path / "o" / "offsets.bin", "<i8")
    off[[1, 2]] = off[[2, 1]]
    off.tofile(tmp_path / "o" / "offsets.bin")
    with pytest.raises(DataError, match=r"offsets\.bin must .*increase"):
        open_dataset(tmp_path / "o")


def test_write_is_atomic(tmp_path):
    def crashing():
        yield from random_samples(10, 1, 5)
        raise RuntimeError("simulated crash")
    with pytest.raises(RuntimeError):
        write_dataset(tmp_path / "d", crashing())
    assert os.listdir(tmp_path) == []  # neither d nor d.tmp-<pid>
    write_dataset(tmp_path / "d", random_samples(4, 1, 5))
    with pytest.raises(DataError, match="already exists"):
        write_dataset(tmp_path / "d", random_samples(4, 1, 5))
    with pytest.raises(RuntimeError):  # a crash during --force leaves the old dataset intact
        write_dataset(tmp_path / "d", crashing(), force=True)
    assert len(open_dataset(tmp_path / "d")) == 4 and os.listdir(tmp_path) == ["d"]
    write_dataset(tmp_path / "d", random_samples(7, 1, 5), force=True)
    assert len(open_dataset(tmp_path / "d")) == 7 and os.listdir(tmp_path) == ["d"]
    with pytest.raises(DataError, match="ids must be integers in"):
        write_dataset(tmp_path / "e", [(np.array([1, 5]), np.array([1, 1]))], vocab_size=5)
    assert os.listdir(tmp_path) == ["d"]


# -----------------------------------------------------------------------------
# scale: a few million tokens in flat memory

def rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))


def child_peak_kib(code):
    """Peak RSS (VmHWM, KiB) of a fresh python that imports prepare.py (and data.py) and runs code."""
    script = (f"import sys; sys.path.insert(0, {HERE!r}); import prepare; {code}; "
              "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1])


def test_large_dataset_flat_memory(tmp_path):
    rng = np.random.default_rng(0)
    n_tok = 0
    with open(tmp_path / "big.jsonl", "w") as f:
        while n_tok < 4_000_000:
            L = int(rng.integers(200, 3000))
            f.write(json.dumps({"input_ids": rng.integers(0, 200_000, L).tolist()}) + "\n")
            n_tok += L
    token_bytes = 4 * n_tok
    # prepare in a child process, whose peak RSS we compare with a child that only imports the same
    # things (VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec: pytest's own size)
    base = child_peak_kib("pass")
    prep = child_peak_kib(f"prepare.main(['--input', {str(tmp_path / 'big.jsonl')!r}, "
                          f"'--out', {str(tmp_path / 'big')!r}, '--val', '0.01'])")
    # open and iterate a full epoch. Anonymous memory is what must stay flat: pages of the mapped
    # files count in VmRSS too, but they are the kernel's page cache, shared and evictable
    anon0, rss0, anon_peak, seen = rss_kb("RssAnon"), rss_kb("VmRSS"), 0, 0
    ds = open_dataset(tmp_path / "big")
    assert ds.meta["n_tokens"] + open_dataset(tmp_path / "big" / "val").meta["n_tokens"] == n_tok
    p = Packer(ds, 8192, n_shards=2, shard=0, seed=0)
    for _ in range(p.steps_per_epoch):
        row = p.next_row()
        seen += int((row.doc < len(row.samples)).sum())
        anon_peak = max(anon_peak, rss_kb("RssAnon"))
    rss1 = rss_kb("VmRSS")
    grow = anon_peak - anon0
    print(f"\n[memory] {n_tok / 1e6:.2f}M tokens = {token_bytes / 2**20:.1f} MiB of tokens.bin; "
          f"prepare peak RSS {prep} KiB vs {base} KiB for the bare imports (+{(prep - base) / 1024:.2f} MiB); "
          f"epoch of {p.steps_per_epoch} rows of 8192 on shard 0/2: anonymous RSS +{grow / 1024:.2f} MiB peak, "
          f"VmRSS +{(rss1 - rss0) / 1024:.1f} MiB (incl. mapped page cache)")
    assert seen > 0.4 * ds.meta["n_tokens"]  # shard 0 of 2 saw about half the tokens
    assert grow * 1024 < 0.25 * token_bytes
    assert (prep - base) * 1024 < 0.25 * token_bytes


# -----------------------------------------------------------------------------
# demo

def test_demo_is_the_targets_greedy_output(tmp_path):
    out = data.make_demo(tmp_path / "demo", samples=10, val_samples=3, new_tokens=20, seed=0, log=print)
    tr, va = open_dataset(out), open_dataset(os.path.join(out, "val"))
    assert len(tr) == 10 and len(va) == 3 and tr.vocab_size == TargetConfig.preset("tiny").vocab_size
    tiny = tiny_target()   # the same weights as make_demo's (seeded by tensor name)
    prompts = set()
    for d in (tr, va):
        for k in range(len(d)):
            ids, mask = (torch.from_numpy(a.astype(np.int64)) for a in d.sample(k))
            p = int((mask == 0).sum())
            assert 8 <= p <= 24 and len(ids) == p + 20 and mask[:p].sum() == 0 and mask[p:].all()
            prompts.add(tuple(ids[:p].tolist()))
            # independent of the cached lockstep decode (Target.greedy): one teacher-forced forward over
            # the sample alone; a causal model's argmax at each continuation position: the next token
            logits = tiny.logits(ids, torch.tensor([0, len(ids)]))
            assert torch.equal(logits[p - 1:-1].argmax(-1), ids[p:])
    assert len(prompts) == 13
    mtime = os.path.getmtime(os.path.join(out, "train", "meta.json"))
    assert data.make_demo(tmp_path / "demo", samples=10, val_samples=3, new_tokens=20, seed=0) == out  # reused
    assert os.path.getmtime(os.path.join(out, "train", "meta.json")) == mtime
    # another demo (other settings, or another target.py's tiny preset) is made anew, and says so
    lines = []
    data.make_demo(tmp_path / "demo", samples=11, val_samples=3, new_tokens=20, seed=0, log=lines.append)
    assert "was made by another target.py or other settings: making it anew" in lines[0] and len(open_dataset(out)) == 11
    # a dataset that is not a demo is never overwritten
    write_dataset(str(tmp_path / "mine" / "train"), [(np.arange(1, 9), np.ones(8, np.uint8))], vocab_size=512)
    with pytest.raises(DataError, match="already exists"):
        data.make_demo(tmp_path / "mine", samples=10, val_samples=3, new_tokens=20, seed=0)


# -----------------------------------------------------------------------------
# regenerate, against a real OpenAI-compatible HTTP server

def fake_answer(user, earlier):
    """The test server's answer: a function of the request's last user message and the assistant
    answers before it, so a stored answer shows which exact request it came from."""
    h = hashlib.sha1(json.dumps([user, earlier]).encode()).hexdigest()[:10]
    return f"thought {h} about {user}", f"answer {h} to {user}"


class FakeOpenAI:
    """/v1/models and /v1/chat/completions on 127.0.0.1 ports (asyncio, HTTP/1.1 keep-alive, in a
    daemon thread), replies shaped like SGLang's / vLLM's. Knobs, settable any time: reasoning (the
    field: 'reasoning_content', 'reasoning', 'inline' for <think> in the content, or None), delay
    (s), fail_every (every n-th chat request answers 500), answer (messages -> (reasoning, content);
    default fake_answer) and faults: user prompts FAIL (500), BAD (400), HANG (no reply), HTML (a 200
    that is not JSON), EMPTY (a 200 without choices)."""

    def __init__(self, ports=1, model="tiny", **knobs):
        self.model, self.requests, self.hits = model, [], collections.Counter()
        self.inflight = self.max_inflight = 0
        self.reasoning, self.delay, self.fail_every, self.faults = "reasoning_content", 0, 0, False
        self.answer = lambda msgs: fake_answer([m for m in msgs if m["role"] == "user"][-1]["content"],
                                               [m.get("content") for m in msgs if m["role"] == "assistant"])
        self.__dict__.update(knobs)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def start():
            return [await asyncio.start_server(self.serve, "127.0.0.1", 0) for _ in range(ports)]
        self.servers = asyncio.run_coroutine_threadsafe(start(), self.loop).result()
        self.urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in self.servers]

    def close(self):
        async def stop():  # connections too (a HANG reply still waits), so nothing is left pending
            for s in self.servers:
                s.close()
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)

    def asked(self, user):
        """The requests whose last user message is `user`."""
        return [r for r in self.requests if [m for m in r["messages"] if m["role"] == "user"][-1]["content"] == user]

    async def serve(self, reader, writer):
        try:
            while line := await reader.readline():
                path, size = line.split()[1], 0
                while (h := await reader.readline()) not in (b"\r\n", b""):
                    k, _, v = h.partition(b":")
                    size = int(v) if k.lower() == b"content-length" else size
                status, kind, body = await self.reply(path, await reader.readexactly(size))
                self.hits[writer.get_extra_info("sockname")[1]] += path != b"/v1/models"
                writer.write(b"HTTP/1.1 %d -\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                             % (status, kind, len(body), body))
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def reply(self, path, body):
        if path == b"/v1/models":
            return 200, b"application/json", json.dumps({"object": "list", "data": [{"id": self.model}]}).encode()
        req = json.loads(body)
        self.requests.append(req)
        k, msgs = len(self.requests), req["messages"]
        user = [m for m in msgs if m["role"] == "user"][-1]["content"]
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        await asyncio.sleep(self.delay)
        self.inflight -= 1
        fault = self.faults and user in ("FAIL", "BAD", "HANG", "HTML", "EMPTY") and user
        if fault == "FAIL" or (self.fail_every and k % self.fail_every == 0):
            return 500, b"application/json", b'{"object": "error", "message": "boom"}'
        if fault == "BAD":
            return 400, b"application/json", b'{"object": "error", "message": "prompt too long"}'
        if fault == "HANG":
            await asyncio.sleep(3600)
        if fault in ("HTML", "EMPTY"):
            return (200, b"text/html", b"<html>502 Bad Gateway</html>") if fault == "HTML" else \
                (200, b"application/json", b'{"object": "error", "message": "no choices"}')
        reasoning, content = self.answer(msgs)
        msg, finish = {"role": "assistant", "content": content}, "length" if user.startswith("LONG") else "stop"
        if self.reasoning == "inline":
            msg["content"] = f"<think>\n{reasoning}\n</think>\n\n{content}"
        elif self.reasoning:
            msg[self.reasoning] = reasoning
        if req.get("tools"):
            msg["tool_calls"] = [{"id": "call_1", "type": "function",
                                  "function": {"name": "lookup", "arguments": json.dumps({"q": user})}}]
            finish = "tool_calls"
        usage = {"prompt_tokens": len(json.dumps(msgs).split()), "completion_tokens": len(content.split()),
                 "total_tokens": 0}
        return 200, b"application/json", json.dumps({
            "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": self.model,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish}], "usage": usage}).encode()


@pytest.fixture
def fake_server():
    servers = []
    yield lambda **kw: servers.append(FakeOpenAI(**kw)) or servers[-1]
    for s in servers:
        s.close()


def regen(inp, out, server, *args, concurrency=4):
    return cli("regenerate", "--input", inp, "--out", out, *[a for u in server.urls for a in ("--server", u)],
               "--model", server.model, "--concurrency", concurrency, "--backoff", 0.01, *args)


def expected(msgs, tools_or_last=False):
    """What regenerate must write for these input messages, from fake_answer alone: every assistant turn
    (or, with tool messages, the final one) answered again, each request holding the earlier answers.
    An answer is a tuple (reasoning, content)."""
    def answer(history):
        return fake_answer([m for m in history if isinstance(m, dict) and m["role"] == "user"][-1]["content"],
                           [m[1] if isinstance(m, tuple) else m.get("content") for m in history
                            if isinstance(m, tuple) or m["role"] == "assistant"])
    if tools_or_last:
        head = msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs
        return head + [answer(head)]
    out = []
    for m in msgs:
        out.append(answer(out) if m["role"] == "assistant" else m)
    return out if msgs[-1]["role"] == "assistant" else out + [answer(out)]


def check_answers(got, want):
    """The stored messages == the expected ones; answers (tuples) as the server sent them."""
    assert len(got) == len(want), (got, want)
    for g, w in zip(got, want):
        if isinstance(w, tuple):
            assert g["role"] == "assistant" and (g["reasoning_content"], g["content"]) == w, (g, w)
            assert g["finish_reason"] in ("stop", "length", "tool_calls")
            assert g["usage"]["completion_tokens"] == len(w[1].split()) and g["usage"]["prompt_tokens"] > 0
        else:
            assert g == w


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def by_line(path):
    rows = read_jsonl(path)
    assert len({r["input_line"] for r in rows}) == len(rows), "a prompt written twice"
    return {r["input_line"]: r for r in rows}


CHATS = [
    {"id": "a", "source": "mix", "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "old answer 1", "reasoning_content": "old thought"},
        {"role": "user", "content": "u2"}, {"role": "assistant", "content": "old answer 2"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "old"},
                                  {"from": "human", "value": "and then?"}]},
    {"id": "c", "prompt": "LONG story"},
    {"id": "d", "tools": [{"type": "function", "function": {"name": "lookup", "parameters": {}}}], "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "t0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t0", "content": "sunny"},
        {"role": "assistant", "content": "old final"}]},
    "{broken",
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "assistant", "content": "an answer to nothing"}]},
]


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning", "inline"])
def test_regenerate_answers_every_turn(tmp_path, fake_server, field):
    srv = fake_server(reasoning=field)
    write_jsonl(tmp_path / "in.jsonl", CHATS)
    kwargs = '{"enable_thinking": true}'
    r = regen(tmp_path / "in.jsonl", tmp_path / "out.jsonl", srv, "--chat-template-kwargs", kwargs)
    assert r.returncode == 0, r.stderr
    rows = by_line(tmp_path / "out.jsonl")
    assert sorted(rows) == [1, 2, 3, 4]
    for i, chat in enumerate(CHATS[:4], 1):
        row = rows[i]
        assert {k: v for k, v in row.items() if k not in ("input_line", "messages")} == \
            {k: v for k, v in chat.items() if k not in ("messages", "conversations", "prompt")}
        check_answers(row["messages"], expected(prepare.conversation(chat), tools_or_last=chat["id"] == "d"))
    assert rows[3]["messages"][-1]["finish_reason"] == "length"
    assert rows[4]["messages"][-1]["tool_calls"][0]["function"]["arguments"] == '{"q": "weather?"}'
    assert rows[1]["messages"][-1]["usage"]["prompt_tokens"] == len(json.dumps(srv.asked("u2")[0]["messages"]).split())
    # turn 2's request holds the target's answer 1 (reasoning under both names), not the data's
    (req,) = srv.asked("u2")
    thought, answer = fake_answer("u1", [])
    assert req["messages"][2] == {"role": "assistant", "content": answer, "reasoning_content": thought,
                                  "reasoning": thought}
    assert srv.asked("weather?")[0]["tools"] == CHATS[3]["tools"]
    assert srv.asked("weather?")[0]["messages"] == CHATS[3]["messages"][:3]
    for q in srv.requests:  # SpecForge's defaults; the template kwargs reach the server
        assert q["temperature"] == 0.7 and q["max_tokens"] == 4096 and "top_p" not in q and "top_k" not in q
        assert q["chat_template_kwargs"] == {"enable_thinking": True}
    assert len(srv.requests) == 6
    # bad input lines: reported by number, listed in the failures file, not fatal
    for line, kind in [(5, "malformed JSON"), (6, "unknown role"), (7, "no user turn")]:
        assert f"in.jsonl:{line}: {kind}" in r.stdout
    assert [f["input_line"] for f in read_jsonl(tmp_path / "out.failed.jsonl")] == [5, 6, 7]
    assert "wrote 4 lines" in r.stdout and "6 answers, 1 cut at --max-tokens" in r.stdout
    assert "3 bad input lines" in r.stdout
    # --turns last: only the final answer, the earlier turns as the data has them
    n_before = len(srv.requests)
    r = regen(tmp_path / "in.jsonl", tmp_path / "last.jsonl", srv, "--turns", "last", "--limit", 2,
              "--top-p", 0.95, "--top-k", 20, "--temperature", 0.6, "--max-tokens", 99)
    assert r.returncode == 0, r.stderr
    assert [(q["top_p"], q["top_k"], q["temperature"], q["max_tokens"], "chat_template_kwargs" in q)
            for q in srv.requests[n_before:]] == [(0.95, 20, 0.6, 99, False)] * 2
    rows = by_line(tmp_path / "last.jsonl")
    assert sorted(rows) == [1, 2]
    for i in (1, 2):
        check_answers(rows[i]["messages"], expected(prepare.conversation(CHATS[i - 1]), tools_or_last=True))


def test_regenerate_resume_after_kill(tmp_path, fake_server):
    srv = fake_server(delay=0.2)
    prompts = [{"id": i, "prompt": f"q{i}"} for i in range(40)]
    write_jsonl(tmp_path / "in.jsonl", prompts)
    out = tmp_path / "out.jsonl"
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "regenerate.py"), "--input", tmp_path / "in.jsonl",
                          "--out", out, "--server", srv.urls[0], "--model", "tiny", "--concurrency", "2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.time()
    while not (out.exists() and out.read_text().count("\n") >= 5) and time.time() - t0 < 30:
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    first = by_line(out)
    assert 5 <= len(first) < 40
    with open(out, "a") as f:  # what a kill in the middle of a write leaves
        f.write('{"input_line": 39, "id": 38, "messa')
    r = regen(tmp_path / "in.jsonl", out, srv)
    assert r.returncode == 1 and "already exists; pass --resume" in r.stderr
    n_before, srv.delay = len(srv.requests), 0
    r = regen(tmp_path / "in.jsonl", out, srv, "--resume")
    assert r.returncode == 0, r.stderr
    assert f"resuming: {len(first)} lines already in" in r.stdout and "dropped a half-written last line" in r.stdout
    rows = by_line(out)
    assert sorted(rows) == list(range(1, 41))
    for i, row in rows.items():
        assert row["id"] == i - 1
        check_answers(row["messages"], expected([{"role": "user", "content": f"q{i - 1}"}]))
    # what was written before the kill is not asked again
    assert not {m["messages"][0]["content"] for m in srv.requests[n_before:]} & {f"q{i - 1}" for i in first}


def test_regenerate_flaky_server_loses_nothing(tmp_path, fake_server):
    srv = fake_server(ports=2, fail_every=5)
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"q{i}"} for i in range(60)])
    r = regen(tmp_path / "in.jsonl", tmp_path / "out.jsonl", srv, "--retries", 8)
    assert r.returncode == 0, r.stderr
    rows = by_line(tmp_path / "out.jsonl")
    assert sorted(rows) == list(range(1, 61))
    for i, row in rows.items():
        check_answers(row["messages"], expected([{"role": "user", "content": f"q{i - 1}"}]))
    n_retries = int(re.search(r"(\d+) retries", r.stdout)[1])
    assert n_retries == len(srv.requests) - 60 == len(srv.requests) // 5  # every 5th failed, was asked again
    assert read_jsonl(tmp_path / "out.failed.jsonl") == []
    assert len(srv.hits) == 2 and min(srv.hits.values()) > 10  # both servers took their share


def test_regenerate_server_faults(tmp_path, fake_server):
    srv = fake_server(faults=True)
    lines = [{"prompt": f"q{i}"} for i in range(5)] + [{"prompt": p} for p in ("FAIL", "BAD", "HANG", "HTML", "EMPTY")]
    write_jsonl(tmp_path / "in.jsonl", lines)
    r = regen(tmp_path / "in.jsonl", tmp_path / "out.jsonl", srv, "--timeout", 0.5, "--retries", 1)
    assert r.returncode == 1 and "5 lines failed on the server" in r.stderr and "--resume" in r.stderr
    url = srv.urls[0] + "/v1"
    for line, why in [(6, "HTTP 500"), (7, "HTTP 400"), (8, "no reply within --timeout 0.5s"),
                      (9, "non-JSON reply '<html>502 Bad Gateway</html>'"), (10, "reply without choices")]:
        assert f"in.jsonl:{line}: {url}: {why}" in r.stdout, why
    assert sorted(f["input_line"] for f in read_jsonl(tmp_path / "out.failed.jsonl")) == [6, 7, 8, 9, 10]
    assert sorted(by_line(tmp_path / "out.jsonl")) == [1, 2, 3, 4, 5]
    assert "5 failed" in r.stdout and "4 retries" in r.stdout
    assert [len(srv.asked(p)) for p in ("FAIL", "BAD", "HANG", "HTML", "EMPTY")] == [2, 1, 2, 2, 2]  # 400: no retry
    srv.faults = False  # the server is fixed: --resume asks for exactly the failed lines
    r = regen(tmp_path / "in.jsonl", tmp_path / "out.jsonl", srv, "--resume")
    assert r.returncode == 0, r.stderr
    rows = by_line(tmp_path / "out.jsonl")
    assert sorted(rows) == list(range(1, 11)) and len(srv.requests) == 5 + 9 + 5
    for i, row in rows.items():
        check_answers(row["messages"], expected([{"role": "user", "content": lines[i - 1]["prompt"]}]))
    assert read_jsonl(tmp_path / "out.failed.jsonl") == []
    # a server failing everything stops the run after 2 x --concurrency lines in a row, not asked for every line
    srv.fail_every, n_before = 1, len(srv.requests)
    write_jsonl(tmp_path / "more.jsonl", [{"prompt": f"q{i}"} for i in range(40)])
    r = regen(tmp_path / "more.jsonl", tmp_path / "more.out.jsonl", srv, "--retries", 0)
    assert r.returncode == 1 and f"{url} fails every request: the last 8 lines all failed (last: HTTP 500" in r.stderr
    assert "rerun with --resume" in r.stderr
    # 8, plus what the other 3 workers had in flight; the rest is never asked
    assert 8 <= len(read_jsonl(tmp_path / "more.out.failed.jsonl")) <= len(srv.requests) - n_before < 8 + 4


def test_regenerate_stops_without_reasoning(tmp_path, fake_server):
    srv = fake_server(reasoning=None)
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"q{i}"} for i in range(30)])
    r = regen(tmp_path / "in.jsonl", tmp_path / "out.jsonl", srv)
    (err,) = [line for line in r.stderr.splitlines() if "error" in line]
    assert r.returncode == 1 and srv.urls[0] in err and "--reasoning-parser qwen3" in err
    assert "enable_thinking" in err and os.path.getsize(tmp_path / "out.jsonl") == 0  # nothing written
    assert len(srv.requests) < 30   # stopped early
    r = regen(tmp_path / "in.jsonl", tmp_path / "out.jsonl", srv, "--resume",
              "--chat-template-kwargs", '{"enable_thinking": false}')
    assert r.returncode == 0, r.stderr
    rows = by_line(tmp_path / "out.jsonl")
    assert sorted(rows) == list(range(1, 31)) and not any("reasoning_content" in m for row in rows.values()
                                                             for m in row["messages"])


def test_regenerate_overhead(tmp_path, fake_server):
    """The client must never be what limits a real engine: exactly --concurrency requests in flight, and its own
    cost per request against a server that answers at once. The README's figure:
    python -m pytest -q -s test_smoke.py -k regenerate_overhead"""
    srv = fake_server(delay=1.5)  # long enough for a busy CPU to send all 256 before the first reply
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": f"q{i}"} for i in range(512)])
    r = regen(tmp_path / "in.jsonl", tmp_path / "out.jsonl", srv, concurrency=256)
    assert r.returncode == 0, r.stderr
    assert srv.max_inflight == 256 and len(by_line(tmp_path / "out.jsonl")) == 512
    srv.delay = 0
    write_jsonl(tmp_path / "fast.jsonl", [{"prompt": f"question {i}: " + "word " * 200} for i in range(2000)])
    r = regen(tmp_path / "fast.jsonl", tmp_path / "fast.out.jsonl", srv, concurrency=256)
    assert r.returncode == 0, r.stderr
    summary = r"([\d.]+) requests/s.*used (\d+)% of a CPU core, ([\d.]+) ms a request"
    rate, core, ms = re.search(summary, r.stdout).groups()
    print(f"\n[regenerate] 2000 requests, concurrency 256, instant server: {rate} requests/s, client at {core}% "
          f"of a core, {ms} ms of client CPU a request = {1e3 / float(ms):.0f} requests/s per core")
    assert float(ms) < 10  # a regression to per-request setup (a client, a TLS context) costs 100+ ms


def test_regenerate_setup_errors(tmp_path, fake_server, monkeypatch):
    srv = fake_server()
    write_jsonl(tmp_path / "in.jsonl", [{"prompt": "q"}])
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = cli("regenerate", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "o.jsonl", "--model", "tiny",
            "--server", srv.urls[0], "--server", f"127.0.0.1:{port}")
    assert r.returncode == 1 and f"server http://127.0.0.1:{port}/v1 is unreachable" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("regenerate", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "o.jsonl", "--model", "big",
            "--server", srv.urls[0])
    assert r.returncode == 1 and "does not serve --model big; it serves tiny" in r.stderr
    r = cli("regenerate", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "o.jsonl", "--model", "tiny",
            "--server", srv.urls[0], "--chat-template-kwargs", "enable_thinking")
    assert r.returncode == 2 and "not JSON" in r.stderr
    monkeypatch.setitem(sys.modules, "openai", None)  # as if not installed
    with pytest.raises(SystemExit) as e:
        regenerate.main(["--input", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "o.jsonl"),
                         "--model", "tiny", "--server", srv.urls[0]])
    assert e.value.code == "error: regenerate.py needs the openai package: pip install openai"



# ==================================================================================================
# drafter layouts of the published drafters: sliding-window layers, RoPE scaling, the z-lab config

# -----------------------------------------------------------------------------
# the sliding mask == a per-token definition written from the serving engines' rule

@pytest.mark.parametrize("W", [1, 3, 9, 16, 25, 1000])
@pytest.mark.parametrize("B", [4, 16])
def test_sliding_mask_matches_per_token_definition(W, B):
    rng = random.Random(W * 31 + B)
    lens = [rng.randint(5, 40) for _ in range(3)]
    cu = cu_of(lens)
    doc, pos = doc_of(cu), positions_from_cu(cu)
    S = int(cu[-1])
    starts = cu[:-1].tolist()
    anchors = sorted(set(rng.sample(range(S), 8)) | set(starts) | {S - 1})   # document starts, the row's end
    N = len(anchors) + 2
    anchors, keep = anchors + [0, 0], [True] * (N - 2) + [False, False]         # padded slots last
    mm = anchor_mask_mod(torch.tensor(anchors), torch.tensor(keep), doc, S, B, W)
    got = mm(0, 0, torch.arange(N * B)[:, None], torch.arange(S + N * B)[None, :])
    ref = brute_mask(anchors, keep, doc.tolist(), pos.tolist(), S, B, W)
    assert torch.equal(got, ref), f"{(got != ref).sum().item()} cells differ"
    # the window binds (shorter than some context) or not (longer than every context), as parametrized
    full = brute_mask(anchors, keep, doc.tolist(), pos.tolist(), S, B)
    assert (ref & ~full).sum() == 0
    assert (ref != full).any()                             # block causality at least
    if W < max(lens) - B:
        assert (ref[:, :S] != full[:, :S]).any()           # and the window cut some context
    if W >= max(lens) + B:
        assert torch.equal(ref[:, :S], full[:, :S])
    # flex also evaluates padded tiles past Q_LEN / KV_LEN: no out-of-range indexing there
    mm(0, 0, torch.arange(N * B + 2 * B)[:, None], torch.arange(S + N * B + 128)[None, :])


@pytest.mark.parametrize("S,N,B,docs,W", [(8192, 512, 16, 4, 2048), (8192, 512, 16, 4, 300), (700, 40, 16, 3, 1),
                                          (700, 40, 16, 3, 127), (700, 40, 16, 3, 129), (300, 37, 5, 2, 64),
                                          (515, 64, 8, 5, 10000), (129, 9, 16, 1, 8)])
def test_sliding_anchor_blocks_match_create_block_mask(S, N, B, docs, W):
    g = torch.Generator().manual_seed(S + W)
    cuts = torch.randperm(S - 1, generator=g)[:docs - 1] + 1
    starts = [0] + sorted(cuts.tolist())
    doc = doc_of(torch.tensor([*starts, S]))
    picked = torch.randperm(S, generator=g)[:N - 4].tolist() + starts[:2]       # some at document starts
    anchors = torch.tensor(sorted(picked) + [0] * (N - len(picked)))
    keep = torch.arange(N) < len(picked)
    got = check_blocks(anchors, keep, doc, S, B, W)
    if S == 8192:   # the real shape has both kinds of tile, so both branches were exercised
        assert got[0].sum() > 0 and got[2].sum() > 0
    # by hand: a window starting exactly on a tile edge (anchor 300, W - 1 = 172 -> 128) and one past a document start
    anchors, keep = torch.tensor([300] * 8 + [258] * 7 + [0]), torch.tensor([True] * 15 + [False])
    check_blocks(anchors, keep, doc_of(torch.tensor([0, 256, 400])), 400, 16, 173)


# -----------------------------------------------------------------------------
# RoPE: default, linear and YaRN == transformers' own rope functions and rotary embedding

ROPES = [None, {"rope_type": "linear", "factor": 2.5}, {"type": "linear", "factor": 4.0},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
         {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16,
          "beta_slow": 2, "truncate": False},
         {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192, "mscale": 0.707,
          "mscale_all_dim": 1.0},
         {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3},
         {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096}]


def hf_qwen3_config(c):
    """transformers' Qwen3Config of a drafter config's attention and RoPE fields."""
    rope = dict(c.rope_scaling or {"rope_type": "default"})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                       max_position_embeddings=c.max_position_embeddings,
                       rope_parameters={**rope, "rope_theta": c.rope_theta})


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("head_dim,theta", [(128, 1e7), (16, 1e4)])
def test_rope_matches_transformers(rope, head_dim, theta):
    c = DrafterConfig(hidden_size=256, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=head_dim, rope_theta=theta, max_position_embeddings=32768,
                      rope_scaling=rope)
    hf = hf_qwen3_config(c)
    kind = hf.rope_parameters["rope_type"]
    ref_inv, ref_scale = ROPE_INIT_FUNCTIONS[kind](hf, "cpu") if kind != "default" else (None, 1.0)
    inv, scale = rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)
    if ref_inv is not None:
        assert torch.allclose(inv, ref_inv, rtol=1e-6, atol=0) and scale == pytest.approx(ref_scale, rel=1e-12)
    # the whole table: HF's rotary embedding multiplies cos and sin by the attention factor
    pos = torch.tensor([0, 1, 7, 100, 2047, 4096, 30000])
    cos, sin = Qwen3RotaryEmbedding(hf)(torch.zeros(1, 1, dtype=torch.float32), pos[None])
    ours = drafter_rope(pos, c)
    assert rel_err(ours[0], cos[0]) < 1e-5 and rel_err(ours[1], sin[0]) < 1e-5
    if rope and "factor" in rope and rope["factor"] > 1:      # scaling really changes something
        plain = drafter_rope(pos, DrafterConfig(head_dim=head_dim, rope_theta=theta))
        assert rel_err(ours[1], plain[1]) > 1e-3


# -----------------------------------------------------------------------------
# a mixed layout with YaRN: training forward == propose == an independent reference

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def mixed():
    """The tiny target, two random 3-layer drafters [sliding, full, sliding] with YaRN (windows 5 and 20),
    and one packed row of three documents."""
    t = tiny_target()
    out = []
    for W in (5, 20):          # shorter than the block (the window also cuts block keys) and longer
        base = DrafterConfig.from_target(t.config, n_feat=3, num_hidden_layers=3)
        cfg = DrafterConfig(**{**vars(base), "layer_types": [SLIDING, FULL, SLIDING], "sliding_window": W,
                               "use_sliding_window": True, "rope_scaling": YARN})
        out.append(randomize_drafter_(Drafter(cfg), W))
    cu = cu_of([14, 37, 9])
    tokens = torch.randint(0, 511, (int(cu[-1]),), generator=torch.Generator().manual_seed(0))
    feats = t.features(tokens, cu, out[0].config.target_layer_ids).clone()
    return t, out, dict(cu=cu, doc=doc_of(cu), pos=positions_from_cu(cu), tokens=tokens, feats=feats)


def test_mixed_layout_train_serve_equivalence(mixed, monkeypatch):
    t, drafters, r = mixed
    S = len(r["tokens"])
    anchors = torch.tensor(list(range(S)) + [0, 0])             # every position (document starts too), 2 padded
    keep = torch.arange(S + 2) < S
    row = dict(r, loss_mask=torch.ones(S, dtype=torch.long), anchors=anchors, keep=keep)
    head = t.lm_head.weight
    for d in drafters:
        h = train_h(monkeypatch, d, t, row)
        for a in range(S):
            _, logits = d.propose(*propose_args(t, r, a))
            assert rel_err((h[a, 1:] @ head.T).float(), logits) < 1e-4, (d.config.sliding_window, a)


def test_mixed_layout_propose_matches_reference(mixed):
    t, drafters, r = mixed
    for d in drafters:
        for a in (14, 20, 40, 50, 51):       # a document start (empty context) and contexts past the window
            args = propose_args(t, r, a)
            logits = d.propose(*args)[1]
            assert rel_err(logits, ref_propose_logits(d, *args, hf_rope=True)) < 1e-4, (d.config.sliding_window, a)
    # the layout matters: the same weights as all full layers, or with plain RoPE, give other logits
    d = drafters[0]
    args = propose_args(t, r, 45)            # context 14..44: past the window
    for other in (dict(layer_types=[FULL] * 3), dict(rope_scaling=None)):
        e = Drafter(DrafterConfig(**{**vars(d.config), **other}))
        e.load_state_dict(d.state_dict())
        assert rel_err(e.propose(*args)[1], d.propose(*args)[1]) > 1e-2, other


# -----------------------------------------------------------------------------
# layouts: defaults, the published config read (in and out through train.py: test_train.py), errors

# SpecForge configs/qwen3.6-27b-dflash.json (b9c2860c), the public copy of z-lab/Qwen3.6-27B-DFlash's config
PUBLISHED = {
    "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 16, "bos_token_id": None,
    "dflash_config": {"mask_token_id": 248070, "target_layer_ids": [1, 16, 31, 46, 61]},
    "dtype": "bfloat16", "eos_token_id": 248044, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120,
    "initializer_range": 0.02, "intermediate_size": 17408,
    "layer_types": [SLIDING, SLIDING, SLIDING, SLIDING, FULL],
    "max_position_embeddings": 262144, "max_window_layers": 5, "model_type": "qwen3", "num_attention_heads": 32,
    "num_hidden_layers": 5, "num_key_value_heads": 8, "num_target_layers": 64, "pad_token_id": 248044,
    "rms_norm_eps": 1e-06, "sliding_window": 2048, "tie_word_embeddings": False, "transformers_version": "5.5.3",
    "use_cache": True, "use_sliding_window": True, "vocab_size": 248320, "rope_theta": 10000000, "rope_scaling": None}


def test_default_layouts():
    c = DrafterConfig.from_target(TargetConfig.preset("qwen3.6-27b"))
    assert c == config_from_json(PUBLISHED)                  # the published drafter, field for field
    assert DrafterConfig.from_target(TargetConfig.preset("qwen3.6-27b"), sliding_window=0).layer_types == [FULL] * 5
    assert DrafterConfig.from_target(TargetConfig.preset("tiny")).layer_types == [FULL] * 5
    tiny = DrafterConfig.from_target(TargetConfig.preset("tiny"), sliding_window=64, num_hidden_layers=3)
    assert (tiny.layer_types, tiny.sliding_window, tiny.use_sliding_window) == ([SLIDING, SLIDING, FULL], 64, True)
    assert c.windows() == {FULL: 0, SLIDING: 2048} and tiny.windows() == {FULL: 0, SLIDING: 64}


def write_published_tiny(path, rope_scaling):
    """The published config's schema and key set with the tiny target's dimensions, and random weights."""
    t = TargetConfig.preset("tiny")
    cfg = dict(PUBLISHED, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_target_layers=t.num_hidden_layers, vocab_size=t.vocab_size,
               dflash_config={"mask_token_id": 511, "target_layer_ids": [1, 3, 5]}, sliding_window=48,
               max_position_embeddings=t.max_position_embeddings, rope_scaling=rope_scaling)
    d = Drafter(config_from_json(cfg))
    d.save_pretrained(str(path))                        # the weights, in the format z-lab ships
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f)                                # and the published config file itself
    return cfg


def test_rope_parameters_spelling_reads_the_same():
    t = TargetConfig.preset("tiny")
    base = dict(PUBLISHED, hidden_size=t.hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    del base["rope_theta"], base["rope_scaling"]
    v4 = config_from_json({**base, "rope_theta": 5e5, "rope_scaling": YARN})
    v5 = config_from_json({**base, "rope_parameters": {"rope_theta": 5e5, **YARN}})
    plain = config_from_json({**base, "rope_parameters": {"rope_theta": 5e5, "rope_type": "default"}})
    assert v4 == v5 and v4.rope_scaling == YARN and v4.rope_theta == 5e5
    assert plain.rope_scaling is None and plain.rope_theta == 5e5


def test_layer_types_absent_follow_qwen3config():
    # old-style configs derive layer_types from use_sliding_window / max_window_layers, as HF Qwen3Config does
    base = {k: v for k, v in PUBLISHED.items() if k != "layer_types"}
    for use, first in ((True, 2), (False, 2), (True, 0), (True, 5)):
        cfg = dict(base, use_sliding_window=use, max_window_layers=first, sliding_window=64)
        hf = Qwen3Config(num_hidden_layers=5, use_sliding_window=use, max_window_layers=first, sliding_window=64)
        c = config_from_json(cfg)
        assert c.layer_types == hf.layer_types, (use, first)


BAD_LAYOUTS = [
    (dict(layer_types=[SLIDING, "chunked_attention", SLIDING, SLIDING, FULL]), "layer_types: 'chunked_attention'"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_type 'dynamic' is not supported"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope_type 'longrope' is not supported"),
    (dict(rope_scaling={"rope_type": "yarn"}), "yarn needs a positive factor"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias true"),
    (dict(use_sliding_window=False), "use_sliding_window is false"),
    (dict(sliding_window=None), "sliding_window None"),
    (dict(is_causal=False), "is_causal / dflash_config.causal False"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
]


@pytest.mark.parametrize("fields,msg", BAD_LAYOUTS, ids=[m.split()[0] for _, m in BAD_LAYOUTS])
def test_unsupported_field_is_an_error(tmp_path, fields, msg):
    path = tmp_path / "d"
    write_published_tiny(path, None)
    edit_config(path, lambda j: j.update(fields))
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        Drafter.from_pretrained(str(path))


# -----------------------------------------------------------------------------
# the start-up self-check: its dense half and comparison on CPU (flex itself only runs on GPU)

def probe_config(**kw):
    return DrafterConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, layer_types=[SLIDING, SLIDING, FULL],
                         sliding_window=2048, rope_scaling=YARN, **kw)


def test_rank_caches_precedence(tmp_path, monkeypatch):
    """--cache-dir puts this rank's Triton and Inductor caches under it, whatever the environment says (a
    parent that compiled sets TORCHINDUCTOR_CACHE_DIR: quality.py's runs inherit it); without it the
    environment's choice stands."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inherited"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    _, dirs = checks.rank_caches(str(tmp_path / "c"), 3)
    assert dirs == [str(tmp_path / "c" / "rank3" / "triton"), str(tmp_path / "c" / "rank3" / "inductor")]
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inherited"))
    assert checks.rank_caches(None, 0)[1][1] == str(tmp_path / "inherited")


def test_self_check_plumbing():
    out_err, grad_err, seconds = flex_matches_dense(probe_config(), "cpu", candidate=row_attention)
    assert out_err == 0.0 and grad_err == 0.0 and seconds > 0
    rng = torch.get_rng_state()
    # attention that gets the window wrong by one token, or ignores it, fails the check
    def wrong(delta):
        def run(c, *row):
            kw = ({"layer_types": [FULL] * 2} if delta is None else
                  {"sliding_window": c.sliding_window + delta})
            attend = row_attention(DrafterConfig(**{**vars(c), **kw}), *row)
            return {SLIDING: attend[FULL if delta is None else SLIDING], FULL: attend[FULL]}
        return run
    for delta in (1, None):
        out_err, grad_err, _ = flex_matches_dense(probe_config(), "cpu", candidate=wrong(delta))
        assert out_err > 1e-3 and grad_err > 1e-3, (delta, out_err, grad_err)
    assert torch.equal(torch.get_rng_state(), rng)                  # the caller's random stream is untouched


def flex_emulated(c, anchors, keep, doc, S):
    """flex_attention's block-sparse semantics in dense SDPA: every key of a full tile visible, mask_mod
    evaluated in partial tiles only, the other tiles hidden; the tiles from anchor_blocks, as the step
    builds them. The check's CPU stand-in for compiled flex."""
    B, attend = c.block_size, {}
    Q, KV = len(anchors) * B, S + len(anchors) * B
    q, kv = torch.arange(Q)[:, None], torch.arange(KV)[None, :]
    for kind, w in c.windows().items():
        kv_num, kv_idx, full_num, full_idx = (x[0, 0] for x in anchor_blocks(anchors, keep, doc, S, B, w)[:4])
        tiles = torch.zeros(kv_num.shape[0], -(-KV // model.TILE), dtype=torch.long)   # 1 partial, 2 full
        for r in range(kv_num.shape[0]):
            tiles[r, kv_idx[r, :kv_num[r]]], tiles[r, full_idx[r, :full_num[r]]] = 1, 2
        t = tiles[q // model.TILE, kv // model.TILE]
        mask = model.anchor_mask_mod(anchors, keep, doc, S, B, w)(0, 0, q, kv)
        attend[kind] = model._dense_attention((t == 2) | ((t == 1) & mask))
    return attend


def test_self_check_catches_a_one_sided_mask_edit(monkeypatch):
    """The self-check's row has fully visible tiles for every layer kind, so an edit of anchor_mask_mod not
    mirrored in anchor_blocks (here: context keys 64..69 hidden) fails the check, as compiled flex skips
    mask_mod on full tiles: shown with flex's semantics emulated densely (the GPU run: RESULTS.md)."""
    c = probe_config()
    S, doc, anchors, keep = checks.check_row(c.block_size, "cpu")
    short = DrafterConfig(**{**vars(c), "sliding_window": 300})      # the check cuts the window to 300
    for kind, w in short.windows().items():
        assert anchor_blocks(anchors, keep, doc, S, c.block_size, w)[2].sum() > 0, kind   # full tiles
    assert max(flex_matches_dense(c, "cpu", candidate=flex_emulated)[:2]) < 1e-5
    real = model.anchor_mask_mod

    def edited(anchors, keep, doc, S, B, window=0):
        mask_mod = real(anchors, keep, doc, S, B, window)
        return lambda b, h, q_idx, kv_idx: mask_mod(b, h, q_idx, kv_idx) & ~((kv_idx >= 64) & (kv_idx < 70))
    monkeypatch.setattr(model, "anchor_mask_mod", edited)
    out_err, grad_err, _ = flex_matches_dense(c, "cpu", candidate=flex_emulated)
    assert out_err > 1e-3 and grad_err > 1e-3, (out_err, grad_err)


# ==================================================================================================
# generate.py: greedy speculative decoding with the tiny target and a drafter trained here on the demo
# prompts (its command line: test_train.py)

MAX_NEW = 32


class GenerateRun:
    """The tiny target, 8 demo held-out prompts and, per prompt, the target's greedy continuation of
    MAX_NEW + B - 1 tokens (so every slot of every block of the speculative run has a label)."""
    def __init__(self, tmp):
        self.demo = demo_data()
        self.t = tiny_target()
        self.prompts = generate.dataset_prompts(self.demo, 8)
        self.B = 16
        self.cont = [generate.greedy(self.t, p, MAX_NEW + self.B - 1) for p in self.prompts]
        self.drafter_dir = os.path.join(tmp, "drafter")
        train_drafter(self, self.drafter_dir)
        self.drafter = Drafter.from_pretrained(self.drafter_dir)      # the export, as a user loads it


def train_drafter(run, out, steps=90):
    """A 2-layer drafter trained with Drafter.forward on the prompts' greedy continuations (the DFlash recipe at
    toy scale, overfit to these prompts so a short run reaches tau well above 1), then exported."""
    t, seqs = run.t, [torch.cat([p, torch.tensor(c)]) for p, c in zip(run.prompts, run.cont)]
    cu = cu_of([len(s) for s in seqs])
    tokens, pos, doc = torch.cat(seqs), positions_from_cu(cu), doc_of(cu)
    loss_mask = torch.cat([(torch.arange(len(s)) >= len(p)).long() for s, p in zip(seqs, run.prompts)])
    cfg = DrafterConfig.from_target(t.config, n_feat=3, num_hidden_layers=2, block_size=run.B)
    feats = t.features(tokens, cu, cfg.target_layer_ids).clone()
    torch.manual_seed(0)
    d = Drafter(cfg)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for _ in range(steps):
        anchors, keep, _ = sample_anchors(loss_mask, doc, 48, 96)
        out_ = d(feats, tokens, loss_mask, doc, pos, anchors, keep, t.embed_tokens.weight, t.lm_head.weight)
        out_["loss"].backward()
        opt.step()
        opt.zero_grad()
    d.save_pretrained(out)


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    return GenerateRun(str(tmp_path_factory.mktemp("gen")))


def proxy_at(d, t, prompt, cont, anchor):
    """The training-time acceptance proxy (Drafter.forward's accept_sum) at one anchor of the row
    [prompt ; the target's greedy continuation], loss mask on the continuation."""
    tokens = torch.cat([prompt, torch.tensor(cont)])
    S = len(tokens)
    feats = t.features(tokens, torch.tensor([0, S]), d.config.target_layer_ids)
    loss_mask = (torch.arange(S) >= len(prompt)).long()
    with torch.no_grad():
        out = d(feats, tokens, loss_mask, torch.zeros(S, dtype=torch.long), torch.arange(S),
                torch.tensor([anchor]), torch.tensor([True]), t.embed_tokens.weight, t.lm_head.weight)
    return int(out["accept_sum"])


class Scripted:
    """A stand-in drafter with a fixed rule for its proposals (it has the real drafter's config)."""
    def __init__(self, config, rule):
        self.config, self.rule = config, rule

    def propose(self, ctx_feats, ctx_pos, anchor_token, anchor_pos, embed, head):
        assert ctx_feats.shape[0] == len(ctx_pos) == anchor_pos       # context: exactly the positions before
        return torch.tensor(self.rule(anchor_pos)), None


def test_features_and_logits_is_features_plus_logits():
    t = tiny_target()
    ids, cu = torch.randint(0, 512, (37,)), torch.tensor([0, 20, 37])
    at = torch.tensor([5, 19, 36])
    feats, logits = t.features_and_logits(ids, cu, [1, 3, 5], at=at)
    assert torch.equal(feats, t.features(ids, cu, [1, 3, 5]))
    assert torch.equal(logits, t.logits(ids, cu, at=at))
    # final=True (train.py --objective): the taps, then the final hidden state the LM head reads
    both = t.features(ids, cu, [1, 3, 5], final=True)
    assert torch.equal(both[:, :3 * 64], feats)
    assert rel_err(t.lm_head(both[at, 3 * 64:]), logits) < 1e-6


def test_prompts_are_the_unsupervised_prefix(gen):
    ds = data.open_dataset(os.path.join(gen.demo, "val"))
    for i, p in enumerate(gen.prompts):
        tokens, mask = ds.sample(i)
        assert torch.equal(p, torch.from_numpy(tokens[:len(p)].astype("int64")))
        assert mask[:len(p)].sum() == 0 and mask[len(p)] == 1
        # the demo is the target's greedy continuation: the greedy decode must reproduce the sample exactly
        n = min(len(gen.cont[i]), len(tokens) - len(p))
        assert n >= MAX_NEW and gen.cont[i][:n] == tokens[len(p):len(p) + n].tolist()


def test_speculative_equals_greedy_and_tau_is_the_proxy(gen):
    """Exact correspondence: let x = prompt + the target's greedy continuation (long enough that every block has
    labels), a_1 = len(prompt) (the prefill's token), a_{k+1} = a_k + tau_k. Then tau_k (accepted + 1 of cycle
    k) == the teacher-forced proxy of Drafter.forward at anchor a_k on row x: the drafter sees the same inputs
    (features of x[:a_k], the token x[a_k] at position a_k) and, as long as its proposals match, the target's
    verifying argmax at slot i is x[a_k + i + 1]. Equality is exact here (fp32; no argmax near-ties)."""
    d = gen.drafter
    all_cycles = []
    for p, cont in zip(gen.prompts, gen.cont):
        spec, cycles, forwards = generate.speculative(gen.t, d, p, MAX_NEW)
        assert spec == cont[:MAX_NEW] and forwards == 1 + len(cycles)
        anchors = [len(p) + sum(cycles[:k]) for k in range(len(cycles))]
        assert [proxy_at(d, gen.t, p, cont, a) for a in anchors] == cycles
        assert sum(cycles[:-1]) < MAX_NEW - 1 <= sum(cycles)        # stopped right after max_new was reached
        all_cycles += cycles
    tau = sum(all_cycles) / len(all_cycles)
    print(f"trained drafter: tau {tau:.2f} over {len(all_cycles)} cycles, values {sorted(set(all_cycles))}")
    assert tau > 2 and len(set(all_cycles)) >= 4        # a nontrivial mix of cycle lengths


def test_oracle_drafter_fills_every_block(gen):
    """A drafter that proposes the target's own greedy tokens: every cycle accepts all B-1 plus the bonus."""
    B, t = gen.B, gen.t
    for p, cont in list(zip(gen.prompts, gen.cont))[:3]:
        oracle = Scripted(gen.drafter.config, lambda a: cont[a - len(p) + 1:a - len(p) + B])
        spec, cycles, forwards = generate.speculative(t, oracle, p, MAX_NEW)
        assert spec == cont[:MAX_NEW] and cycles == [B] * -(-(MAX_NEW - 1) // B) and forwards == 1 + len(cycles)


def test_mask_token_drafter_gives_tau_1(gen):
    """A drafter that always proposes the mask token (as an untrained or mis-wired one can): nothing is ever
    accepted, so every target forward commits exactly one token, and the output is still the greedy one."""
    c = gen.drafter.config
    lazy = Scripted(c, lambda a: [c.mask_token_id] * (c.block_size - 1))
    for p, cont in list(zip(gen.prompts, gen.cont))[:3]:
        assert c.mask_token_id not in cont          # else accepting it would be right
        spec, cycles, forwards = generate.speculative(gen.t, lazy, p, MAX_NEW)
        assert spec == cont[:MAX_NEW] and cycles == [1] * (MAX_NEW - 1) and forwards == MAX_NEW


def test_wrong_mask_token_in_export_is_visibly_worse(gen, tmp_path):
    """The most common serving complaint: a config.json with the wrong mask_token_id loads fine and silently
    drafts badly. generate.py shows it: tau collapses towards 1 (the output stays the greedy one: lossless)."""
    broken = tmp_path / "broken"
    shutil.copytree(gen.drafter_dir, broken)
    edit_config(broken, lambda j: j["dflash_config"].update(mask_token_id=7))
    logs = []
    good = generate.evaluate(gen.t, gen.drafter, gen.prompts, MAX_NEW, log=logs.append)
    bad = generate.evaluate(gen.t, Drafter.from_pretrained(str(broken)), gen.prompts, MAX_NEW, log=logs.append)
    print(f"tau: exported {good['tau']:.2f}, mask_token_id 511 -> 7 in config.json {bad['tau']:.2f}")
    assert bad["tau"] - 1 < 0.5 * (good["tau"] - 1)
    assert good["identical"] == bad["identical"] == len(gen.prompts)
    assert good["spec_forwards"] < good["greedy_forwards"] and good["hist"][0] < sum(good["hist"])
    assert good["tau"] == pytest.approx(sum((k + 1) * c for k, c in enumerate(good["hist"])) / sum(good["hist"]))


def test_eos_stops_both_decodes(gen):
    p, cont = gen.prompts[0], gen.cont[0]
    eos = cont[6]
    stop = cont.index(eos)                     # its first occurrence
    spec, _, _ = generate.speculative(gen.t, gen.drafter, p, MAX_NEW, eos={eos})
    assert spec == generate.greedy(gen.t, p, MAX_NEW, eos={eos}) == cont[:stop + 1]



def test_replay_equals_the_speculative_loop(gen):
    """generate.replay gives speculative()'s accepted lengths cycle by cycle, from one greedy decode and one
    target forward (the demo's trained drafter; then with an end-of-sequence token that stops some prompts
    early, after a cycle that may accept past it); and tau_summary's tau is evaluate()'s."""
    B = gen.B
    seqs = [torch.cat([p, torch.tensor(c)]) for p, c in zip(gen.prompts, gen.cont)]
    lens = [len(p) for p in gen.prompts]
    for eos in (set(), {gen.cont[0][6], gen.cont[3][20]}):
        want = [generate.speculative(gen.t, gen.drafter, p, MAX_NEW, eos)[1] for p in gen.prompts]
        got, differ = generate.replay(gen.t, gen.drafter, seqs, lens, MAX_NEW, eos, batch=3)
        assert got == want and differ == 0
        if eos:
            assert len(want[0]) < 4 and any(len(w) > 4 for w in want)      # some stop early, some do not
    res = generate.evaluate(gen.t, gen.drafter, gen.prompts, MAX_NEW, log=lambda *a: None)
    summary = generate.tau_summary(want if not eos else got, B)
    nothing = generate.tau_summary(generate.replay(gen.t, gen.drafter, seqs, lens, MAX_NEW)[0], B)
    assert nothing["tau"] == pytest.approx(res["tau"]) and nothing["hist"] == res["hist"][:B]
    assert summary["cycles"] == sum(map(len, got))
    with pytest.raises(AssertionError, match="needs prompt"):     # too short to replay the last cycle
        generate.replay(gen.t, gen.drafter, [s[:-1] for s in seqs], lens, MAX_NEW)


def test_tau_summary_hand_worked():
    """Prompts with accepted+1 per cycle [1, 3], [2, 2, 2], [1]: tokens y = 4, 6, 1 in x = 2, 3, 1 cycles.
    tau = 11/6; residuals y - tau x = 1/3, 1/2, -5/6, squares summing to 19/18, so the ratio CI is
    1.96 sqrt(19/18 / (3 * 2)) / 2 = 0.41105; per-prompt taus 2, 2, 1: mean 5/3, sd 1/sqrt(3), CI
    1.96 (1/sqrt 3) / sqrt 3 = 0.65333."""
    r = generate.tau_summary([[1, 3], [2, 2, 2], [1], []], 4)
    assert r["tau"] == pytest.approx(11 / 6) and r["tau_ci"] == pytest.approx(1.96 * (19 / 18 / 6) ** 0.5 / 2)
    assert r["tau_mean"] == pytest.approx(5 / 3) and r["tau_mean_ci"] == pytest.approx(1.96 / 3)
    assert r["prompts"] == 3 and r["cycles"] == 6 and r["hist"] == [2, 3, 1, 0]


def test_sampled_decode_follows_the_target():
    """Target.greedy(temperature=T): near T = 0 exactly the greedy decode; at T = 1 the first sampled token of
    2000 copies of one prompt follows softmax(logits) of the target's forward (chi-square over the 8 likeliest
    tokens and the rest, 8 degrees of freedom: 26.1 is its 0.999 quantile)."""
    t = tiny_target()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g) for n in (5, 9, 3)]
    assert torch.equal(t.greedy(prompts, 12, temperature=1e-4, generator=g), t.greedy(prompts, 12))
    p = prompts[0]
    probs = t.logits(p, torch.tensor([0, len(p)]), at=torch.tensor([len(p) - 1]))[0].softmax(-1).double()
    draws = t.greedy([p] * 2000, 1, temperature=1.0, generator=g)[:, len(p)]
    top = probs.topk(8).indices
    counts = torch.stack([(draws == i).sum() for i in top] + [(~torch.isin(draws, top)).sum()]).double()
    expect = 2000 * torch.cat([probs[top], (1 - probs[top].sum()).view(1)])
    assert expect.min() > 5                                         # the chi-square approximation holds
    assert float(((counts - expect) ** 2 / expect).sum()) < 26.1


def test_target_interface_is_the_only_seam():
    """What the product files import from target.py is the written Target interface (Target, TargetConfig),
    plus the two Qwen-only names its docstring gives for the commands made for that target; model.py
    (the drafter) and every other module import nothing of it."""
    import ast
    allowed = {"Target", "TargetConfig"}
    extra = {"quality.py": {"Docs"}, "bench.py": {"per_expert_linear"}}
    doc = " ".join(target.__doc__.split())
    assert all(f"{f} ({n}" in doc for f, names in extra.items() for n in names), doc
    seen = {}
    for f in sorted(os.listdir(HERE)):
        if not f.endswith(".py") or f.startswith("test_") or f == "target.py":
            continue
        for node in ast.walk(ast.parse(open(os.path.join(HERE, f)).read())):
            if isinstance(node, ast.Import):
                assert "target" not in [a.name for a in node.names], f"{f}: import target"
            elif isinstance(node, ast.ImportFrom) and node.module == "target":
                seen.setdefault(f, set()).update(a.name for a in node.names)
    assert "model.py" not in seen and "checks.py" not in seen and "speedups.py" not in seen, seen
    for f, names in seen.items():
        assert names <= allowed | extra.get(f, set()), (f, names - allowed)
    assert set(seen) >= {"train.py", "generate.py", "quality.py", "bench.py"}, seen


def test_quality_target_is_a_checkpoint(tmp_path):
    """quality.py's builder: a Qwen3.5 target trained with target.py's layers (the plain-torch path), written
    as an HF checkpoint in shards, reads back in Target.from_pretrained as exactly the trained module (its
    weights rounded to bf16, as saved) and in transformers' Qwen3_5ForCausalLM with the same logits; the
    tokenizer has the end-of-text and mask ids train.py and generate.py expect."""
    import quality
    from transformers import AutoModelForCausalLM
    b = quality.Build(vocab=300, hidden=64, layers=4, intermediate=96, seq=32, batch=4, steps=3, max_files=120)
    tok, enc = quality.tokenized(b)
    assert tok.get_vocab_size() == 300 and tok.token_to_id(quality.EOT) == 0
    assert tok.token_to_id(quality.MASK) == 299 and all(299 not in e for e in enc["train"])
    cfg = quality.hf_config(b)
    m, train_loss, dev_loss = quality.train_target(b, cfg, np.concatenate(enc["train"]),
                                                   np.concatenate(enc["dev"]), torch.device("cpu"))
    assert train_loss < math.log(300) and dev_loss < math.log(300)
    out = tmp_path / "ckpt"
    quality.save_hf(m, cfg, tok, str(out), shard_bytes=40_000)
    assert len(list(out.glob("model-*.safetensors"))) > 2
    loaded = Target.from_pretrained(str(out), dtype=torch.float32)
    for k, v in m.state_dict().items():
        want = v if k.endswith(("A_log", "dt_bias")) else v.to(torch.bfloat16).float()
        assert torch.equal(loaded.state_dict()[k], want), k
    ids = torch.from_numpy(enc["test"][0][:40].astype(np.int64))
    ours = loaded.logits(ids, torch.tensor([0, len(ids)]))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids[None]).logits[0]
    assert (ours - theirs).abs().max() < 1e-3 * theirs.abs().max()
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 0
    assert DrafterConfig.from_target(loaded.config).mask_token_id == 299


def test_quality_command_end_to_end(tmp_path, capsys, monkeypatch):
    """python quality.py at toy scale: builds the target and its data once (a second run reuses them), trains
    with train.py (flags after --), and prints the replayed tau that generate.replay_dataset gives for the
    exported drafter, with its histogram. A finished run is reused for another split and temperature;
    --compare trains each configuration (the finished one reused) and prints one table row each."""
    import quality
    small = ["--work", str(tmp_path), "--target-vocab", "300", "--target-hidden", "64", "--target-layers", "6",
             "--target-intermediate", "96", "--target-seq", "32", "--target-batch", "4", "--target-steps", "3",
             "--target-max-files", "120", "--target-train-prompts", "12", "--target-eval-prompts", "4",
             "--target-new-tokens", "24"]
    quality.main(small + ["--build-only"])
    assert "built " in capsys.readouterr().out
    flags = ["--budget", "256", "--anchors", "8", "--row-anchors", "0", "--max-steps", "3", "--eval-rows", "2",
             "--no-compile"]
    quality.main(small + ["--", *flags])           # greedy, T = 1 and as served (the defaults)
    out = capsys.readouterr().out
    assert "reusing the target and data" in out and out.count("train: ") == 1
    assert re.search(r"^anchors: up to 8 per document, \d+ slots per row", out, re.M), out   # train.py banner
    tau = float(re.search(r"tau test greedy: ([\d.]+) \+- ", out).group(1))
    hist = dict(map(int, kv.split(":")) for kv in out.split("count of cycles: ")[1].split("\n")[0].split())
    (build,) = tmp_path.glob("build-*")
    (run,) = (p.parent for p in tmp_path.glob("run-*/log.jsonl"))          # train.py's --out
    res = generate.replay_dataset(str(build / "target"), str(run / "drafter"),
                                  str(build / "data" / "test-greedy"), 24)
    assert res["tau"] == pytest.approx(tau, abs=5e-4) and sum(hist.values()) == res["cycles"]
    assert sum(k * n for k, n in hist.items()) / res["cycles"] == pytest.approx(res["tau"])
    # generate.py on the built checkpoint: speculative decoding equals greedy
    r = generate.main(["--target", str(build / "target"), "--drafter", str(run / "drafter"), "--data",
                       str(build / "data"), "--num-prompts", "2", "--max-new-tokens", "16"])
    out_gen = capsys.readouterr().out
    assert r["identical"] == 2 and "speculative == greedy on 2/2 prompts" in out_gen, out_gen[-1500:]
    # T = 1, and T 0.6 top-p 0.95 top-k 20: speculative sampling from the same prompts, seeded by the build's seed
    sampled = float(re.search(r"tau test T 1: ([\d.]+) \+- ", out).group(1))
    served = float(re.search(r"tau test T 0.6 p 0.95 k 20: ([\d.]+) \+- ", out).group(1))
    for kw, printed in ((dict(temperature=1.0), sampled), (dict(temperature=0.6, top_p=0.95, top_k=20), served)):
        res = generate.replay_dataset(str(build / "target"), str(run / "drafter"),
                                      str(build / "data" / "test-greedy"), 24, seed=0, **kw)
        assert res["tau"] == pytest.approx(printed, abs=5e-4) and res["prompts"] == 4 and res["cycles"] >= 4 * 24 / 16
    # the finished run is reused for another split and temperature: nothing trains again
    ((_, _, (greedy, at_half, _)),) = quality.main(small + ["--tau-temperature", "0.5", "--", *flags])
    out = capsys.readouterr().out
    assert "train: " not in out and f"reusing the finished run {run}" in out
    assert greedy["tau"] == pytest.approx(tau, abs=5e-4) and at_half["prompts"] == 4
    ((_, _, taus),) = quality.main(small + ["--split", "dev", "--tau-temperature", "0", "--tau-served", "",
                                            "--", *flags])
    assert "train: " not in capsys.readouterr().out and len(taus) == 1 and taus[0]["prompts"] == 4
    # --compare: one child quality.py per configuration, side by side (the finished one reused), one table
    other = flags + ["--lr", "1e-3"]
    rows = quality.main(small + ["--compare", " ".join(flags), " ".join(other)])
    out = capsys.readouterr().out
    assert [r[0] for r in rows] == [" ".join(flags), " ".join(other)]
    table = out.split("+- 95% CI over prompts\n")[1].splitlines()
    assert [c.strip() for c in table[0].split(" | ")] == ["configuration", "greedy", "T 1", "T 0.6 p 0.95 k 20",
                                                          "per-prompt", "proxy", "train s"]
    assert len(table) == 3 and table[1].startswith(" ".join(flags)) and f"{tau:.3f} +- " in table[1], out
    assert f"{sampled:.3f} +- " in table[1] and f"{served:.3f} +- " in table[1]
    assert table[2].startswith(" ".join(other))
    runs = [p.parent for p in tmp_path.glob("run-*/log.jsonl")]
    assert len(runs) == 2 and "reusing the finished run" in (run.parent / f"{run.name}.quality.log").read_text()
    (new,) = set(runs) - {run}
    assert "train: " in (new.parent / f"{new.name}.quality.log").read_text()
    # a build that changes only the data (here the drafter's prompts) reuses the target, trains none
    quality.main(small + ["--target-train-prompts", "8", "--build-only"])
    assert f"reusing the target of {build}" in capsys.readouterr().out
    (other,) = set(tmp_path.glob("build-*")) - {build}
    assert data.open_dataset(str(other / "data" / "train")).meta["n_samples"] == 8
    for f in (build / "target").iterdir():
        assert f.read_bytes() == (other / "target" / f.name).read_bytes(), f.name
    # a changed train.py default is a new run (its --help is in the key): it trains again
    fork = tmp_path / "fork"
    fork.mkdir()
    for f in os.listdir(HERE):
        if f.endswith(".py"):
            shutil.copy(os.path.join(HERE, f), fork / f)
    src = (fork / "train.py").read_text()
    (fork / "train.py").write_text(src.replace("default=6e-4", "default=7e-4"))
    monkeypatch.setattr(quality, "HERE", str(fork))
    quality.main(small + ["--tau-temperature", "0", "--", *flags])
    assert "train: " in capsys.readouterr().out


def test_quality_builds_side_by_side(tmp_path):
    """Three `python quality.py --build-only` processes started at once on one cold --work (two
    with the same settings, one differing in its data only) all finish: one target is trained
    and shared by both builds, each build is made once (its twin waits and reuses it), and no
    tmp dir is left behind. CPU, three real processes."""
    small = ["--work", str(tmp_path), "--build-only", "--target-vocab", "300", "--target-hidden",
             "64", "--target-layers", "4", "--target-intermediate", "96", "--target-seq", "32",
             "--target-batch", "4", "--target-steps", "3", "--target-max-files", "120",
             "--target-train-prompts", "12", "--target-eval-prompts", "4",
             "--target-new-tokens", "24"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "quality.py"), *small, *more],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for more in ([], [], ["--target-train-prompts", "8"])]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    log = "".join(outs)
    assert log.count("target step 0/3") == 1 and log.count("reusing the target of ") == 1, log
    assert len(re.findall("^built ", log, re.M)) == 2, log
    assert log.count("reusing the target and data in ") == 1, log
    # the twins print one build: its dir, build time and target losses
    same = [re.search(r"build-\w+ \(build time .*", out).group(0) for out in outs[:2]]
    assert same[0] == same[1], same
    assert not list(tmp_path.glob("*.tmp-*")), os.listdir(tmp_path)
    builds = sorted(p for p in tmp_path.glob("build-*") if p.is_dir())
    assert len(builds) == 2, os.listdir(tmp_path)
    for f in (builds[0] / "target").iterdir():
        assert f.read_bytes() == (builds[1] / "target" / f.name).read_bytes(), f.name


def _make_once_unlocked(path, barrier, results):
    # a child of test_quality_once_without_locks: flock fails as on a filesystem without locks
    import quality

    def make(tmp):
        os.makedirs(tmp)
        with open(os.path.join(tmp, "who"), "w") as f:
            f.write(str(os.getpid()))
        barrier.wait(timeout=60)    # both peers are making the dir at once

    def no_locks(*args):
        raise OSError(37, "No locks available")
    quality.fcntl.flock = no_locks
    results.put((os.getpid(), quality.once(path, make)))


def test_quality_once_without_locks(tmp_path):
    """quality.once where flock fails: two processes make one dir at once, each in a tmp dir of its
    own; the first rename publishes, the second keeps that copy and drops its own, so path holds
    one whole copy and no tmp dir is left. CPU, two forked processes."""
    import multiprocessing
    mp = multiprocessing.get_context("fork")
    barrier, results, path = mp.Barrier(2), mp.Queue(), str(tmp_path / "thing")
    procs = [mp.Process(target=_make_once_unlocked, args=(path, barrier, results))
             for _ in range(2)]
    for p in procs:
        p.start()
    made = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sorted(made.values()) == [False, True], made
    winner = next(pid for pid, m in made.items() if m)
    assert (tmp_path / "thing" / "who").read_text() == str(winner)
    assert sorted(os.listdir(tmp_path)) == ["thing", "thing.lock"]


def chi_square(draws, probs):
    """Pearson's statistic of integer draws against probabilities, bins with < 5 expected pooled; and
    its degrees of freedom."""
    expect = len(draws) * probs
    counts = torch.bincount(draws, minlength=len(probs)).double()
    small = expect < 5
    counts = torch.cat([counts[~small], counts[small].sum().view(1)])
    expect = torch.cat([expect[~small], expect[small].sum().view(1)])
    keep = expect > 0
    return float(((counts - expect)[keep] ** 2 / expect[keep]).sum()), int(keep.sum()) - 1


def test_sampling_probs_by_hand():
    """generate.sampling_probs as z-lab's _sampling_probs (and the engines) filter: p = (.5, .25, .15, .1) as
    logits log p. top-k 3: (.5, .25, .15) / .9; then top-p .7: sorted, the mass before each (0, .556, .833)
    under .7 keeps two, renormalised (2/3, 1/3); T = 2: softmax(log p / 2) ~ sqrt(p); T = 0: one-hot."""
    logits = torch.tensor([[.5, .25, .15, .1]]).log()
    sp = generate.sampling_probs
    assert torch.allclose(sp(logits, 1.0, 1.0, 3), torch.tensor([[.5, .25, .15, 0]]) / .9)
    assert torch.allclose(sp(logits, 1.0, 0.7, 3), torch.tensor([[2 / 3, 1 / 3, 0, 0]]))
    assert torch.allclose(sp(logits, 1.0, 0.7), torch.tensor([[2 / 3, 1 / 3, 0, 0]]))   # .5, .75: two
    assert torch.allclose(sp(logits, 1.0, 0.76), torch.tensor([[.5, .25, .15, 0]]) / .9)
    root = torch.tensor([[.5, .25, .15, .1]]).sqrt()
    assert torch.allclose(sp(logits, 2.0), root / root.sum()) and torch.equal(sp(logits, 0.0), torch.eye(4)[:1])


def target_marginals(t, prompt, depth, T, top_p=1.0, top_k=0, V=8):
    """The target's own sampling distribution after prompt (generate.sampling_probs at T, top-p, top-k) for
    every prefix of up to depth - 1 tokens: [p(x1), p(x2 | x1) [V, V], p(x3 | x1, x2) [V, V, V], ...]."""
    out = []
    for n in range(depth):
        prefixes = [list(x) for x in itertools.product(range(V), repeat=n)]
        seqs = [torch.cat([prompt, torch.tensor(x, dtype=torch.long)]) for x in prefixes]
        cu = torch.tensor([0] + np.cumsum([len(s) for s in seqs]).tolist())
        p = generate.sampling_probs(t.logits(torch.cat(seqs), cu, at=cu[1:] - 1), T, top_p, top_k).double()
        out.append(p.view(*[V] * (n + 1)))
    return out


def check_first_cycle(news, cycles, P, q):
    """Speculative sampling's output against the exact distributions (chi-square below its 0.999 quantile):
    the 2nd and 3rd emitted tokens (the accept/reject path of the first cycle) follow the target's own
    marginals from P (target_marginals); with the drafts' fixed distributions q [3, V] (independent of the
    prefix), the first cycle's accepted count does too: P(acc >= k) = sum over x1 (the prefill's token) and
    drafts x2..x(k+1) of p(x1) prod_i min(q_i, p)(x(i+1) | x<=i) (Leviathan et al.'s acceptance)."""
    quantile = {7: 24.32, 6: 22.46, 5: 20.52, 4: 18.47, 3: 16.27, 2: 13.82, 1: 10.83}
    p12 = P[0][:, None] * P[1]
    for k, probs in ((1, p12.sum(0)), (2, (p12[..., None] * P[2]).sum((0, 1)))):
        stat, dof = chi_square(torch.tensor([new[k] for new in news]), probs)
        assert stat < quantile[dof], (k, stat, dof)
    if q is None:
        return
    path, ge = P[0], []                          # mass of the paths accepted so far, [x1, ..., x(k+1)]
    for i in range(3):
        path = path[..., None] * torch.minimum(q[i].double(), P[i + 1])
        ge.append(path.sum())
    probs = torch.stack([1 - ge[0], ge[0] - ge[1], ge[1] - ge[2], ge[2]]).float()
    stat, dof = chi_square(torch.tensor([c[0] - 1 for c in cycles]), probs)
    assert stat < quantile[dof], ("accepted", stat, dof, probs)


@pytest.mark.parametrize("T,top_p,top_k", [(1.5, 1.0, 0), (1.2, 0.8, 5)])
def test_speculative_sampling_keeps_the_target_distribution(T, top_p, top_k):
    """generate.speculative_sampling on a target of 8 tokens, blocks of 4, 2000 copies of one prompt in one call,
    as served: T, then top-k and top-p on both distributions: with proposals from a fixed distribution unlike the
    target's (filtered alike), the emitted tokens follow the target's own filtered sampling marginals and the
    first cycle's accepted count its exact distribution (check_first_cycle); proposals drawn from the target
    itself are always accepted."""
    cfg = dataclasses.replace(TargetConfig.preset("tiny"), vocab_size=8)
    t, B, taps = Target.build(cfg), 4, [1]
    prompt = torch.tensor([3, 1, 4, 1, 5])
    g = torch.Generator().manual_seed(0)
    q_fixed = generate.sampling_probs(torch.randn(B - 1, 8, generator=g) * 2, T, top_p, top_k)

    def fixed(feats, tokens, doc, pos, anchors):
        q = q_fixed.expand(len(anchors), B - 1, 8)
        return torch.multinomial(q.flatten(0, 1), 1, generator=g)[:, 0].view(-1, B - 1), q

    def the_target(feats, tokens, doc, pos, anchors):
        xs, qs = [], []
        for a in anchors.tolist():
            seq, x, q = tokens[(doc == doc[a]).nonzero()[0, 0]:a + 1], [], []
            for _ in range(B - 1):
                ids = torch.cat([seq, torch.tensor(x, dtype=torch.long)])
                p = generate.sampling_probs(t.logits(ids, torch.tensor([0, len(ids)]), at=torch.tensor(
                    [len(ids) - 1]))[0], T, top_p, top_k)
                x.append(int(torch.multinomial(p, 1, generator=g)))
                q.append(p)
            xs.append(torch.tensor(x))
            qs.append(torch.stack(q))
        return torch.stack(xs), torch.stack(qs)
    news, cycles = generate.speculative_sampling(t, fixed, [prompt] * 2000, 3, T, g, B, taps, (), top_p, top_k)
    assert all(len(new) == 3 for new in news) and any(c[0] < B for c in cycles) and any(c[0] > 1 for c in cycles)
    check_first_cycle(news, cycles, target_marginals(t, prompt, 4, T, top_p, top_k), q_fixed)
    # prompts of different lengths in one call, each to its own end: proposals from the target itself
    news, cycles = generate.speculative_sampling(t, the_target, [prompt, prompt[:2], prompt[1:]] * 4, 9, T, g,
                                                 B, taps, (), top_p, top_k)
    assert all(c == [B] * len(c) for c in cycles) and all(len(new) == 9 for new in news)
    assert all(len(c) == 2 for c in cycles)     # 1 + 4 + 4 tokens: the prefill's, then two whole blocks


def test_divergence_is_reported(gen, monkeypatch):
    """A greedy decode that differs (here: forced, at new token 5) is named, with the target's top-2 gap there;
    a large gap is called a bug, not bf16 rounding."""
    real = generate.greedy
    monkeypatch.setattr(generate, "greedy", lambda *a, **k: [x if i != 5 else (x + 1) % 512
                                                             for i, x in enumerate(real(*a, **k))])
    logs = []
    res = generate.evaluate(gen.t, gen.drafter, gen.prompts[:1], 12, log=logs.append)
    assert res["identical"] == 0
    assert "DIVERGES at new token 5" in logs[0] and "NOT a near-tie: a bug" in logs[0], logs[0]


@pytest.mark.parametrize("tpl", [QWEN36, QWEN3], ids=["qwen3.6", "qwen3"])
def test_chat_prompts_are_what_the_engine_renders(chat_dirs, tpl, tmp_path):
    """generate.py --prompts: ids == transformers' apply_chat_template(..., add_generation_prompt=True)
    ids with the same kwargs, a final reference answer dropped; and for a one-turn chat, exactly
    the tokens `prepare.py` writes before the first supervised one."""
    d, hf = chat_dirs[tpl]
    objs = [{"messages": CONV_THINKING}, {"messages": CONV_TOOLS[:3], "tools": WEATHER_TOOLS},
            {"conversations": [{"from": "human", "value": "hi there"}]}, {"prompt": "what is two plus two?"}]
    with open(tmp_path / "p.jsonl", "w") as f:
        f.write("\n\n".join(json.dumps(o) for o in objs) + "\n")
    for kw in ({}, {"enable_thinking": False}):
        prompts = generate.chat_prompts(tmp_path / "p.jsonl", d, 8, kw)
        want = [CONV_THINKING[:4], CONV_TOOLS[:3], [{"role": "user", "content": "hi there"}],
                [{"role": "user", "content": "what is two plus two?"}]]
        assert len(prompts) == 4
        for p, msgs, o in zip(prompts, want, objs):
            text = hf_render(hf, msgs, o.get("tools"), kw, gen=True)
            assert p.tolist() == hf(text, add_special_tokens=False).input_ids
        ids, mask = prepare.Chat(d, kw).samples({"messages": CONV_OFF[:2]})[0][0]
        first = int(mask.argmax())
        with open(tmp_path / "one.jsonl", "w") as f:
            f.write(json.dumps({"messages": CONV_OFF[:2]}) + "\n")
        p, = generate.chat_prompts(tmp_path / "one.jsonl", d, 8, kw)
        assert p.tolist() == ids[:first].tolist()
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.write('{"prompt": "hi"}\n{"messages": [{"role": "robot", "content": "x"}]}\n')
    with pytest.raises(DataError, match="bad.jsonl:2: unknown role"):
        generate.chat_prompts(tmp_path / "bad.jsonl", d, 8)
    with pytest.raises(DataError, match="has no chat template"):
        generate.chat_prompts(tmp_path / "bad.jsonl", tmp_path, 8)


# target checkpoints as users have them: RoPE scaling (yarn, linear) in both config spellings,
# block-FP8 weights (Qwen's -FP8 releases), HF defaults, and one clear error per field we cannot honour

# -----------------------------------------------------------------------------
# RoPE scaling == transformers' Qwen3.5 (rotary over head_dim * partial_rotary_factor, cos/sin * factor)

ROPE_CASES = [   # (HF rope dict without rope_theta, partial_rotary_factor, config.json spelling)
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 0.25, "rope_parameters"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 0.5, "rope_scaling"),
    ({"rope_type": "yarn", "factor": 8.0, "beta_fast": 16, "beta_slow": 2, "truncate": False,
      "attention_factor": 1.3}, 0.5, "rope_parameters"),          # original = max_position_embeddings
    ({"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32, "mscale": 0.707,
      "mscale_all_dim": 1.0}, 0.5, "rope_scaling"),
    ({"rope_type": "linear", "factor": 2.5}, 0.5, "rope_parameters"),
    ({"rope_type": "linear", "factor": 3.0}, 0.25, "rope_scaling"),
]


@pytest.mark.parametrize("rope,partial,spelling", ROPE_CASES)
def test_rope_scaling_matches_hf(tmp_path, rope, partial, spelling):
    hf = hf_qwen3_5()
    m = hf_model(partial, 11, rope=rope, max_position_embeddings=256)
    m.save_pretrained(str(tmp_path))
    if spelling == "rope_scaling":   # transformers 4.x: rope_scaling ("type") + top-level theta and factor
        def legacy(c):
            del c["rope_parameters"]
            c.update(rope_scaling={"type" if k == "rope_type" else k: v for k, v in rope.items()},
                     rope_theta=1e4, partial_rotary_factor=partial)
        edit_config(str(tmp_path), legacy)
        # transformers reads that spelling as the very rope_parameters the model was built with
        again = hf.Qwen3_5TextConfig.from_pretrained(str(tmp_path)).rope_parameters
        built = m.config.rope_parameters
        assert all(again[k] == v for k, v in built.items() if not k.startswith("mrope")), again
    with open(tmp_path / "config.json") as f:
        assert spelling in json.load(f)
    ours = Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert ours.config.rope_scaling["factor"] == rope["factor"] and ours.config.rope_theta == 1e4
    assert ours.config.partial_rotary_factor == partial
    ids = torch.randint(0, 300, (200,), generator=torch.Generator().manual_seed(12))   # past original 64
    cu = cu_of([200])
    hs, logits = hf_run(m, ids)
    assert rel_err(ours.features(ids, cu, [0, 1, 2, 3]), torch.cat(hs, -1)) < 1e-4, "features"
    assert rel_err(ours.logits(ids, cu), logits) < 1e-4, "logits"
    # the scaling matters here: the same weights with plain RoPE are far off after the attention layer
    plain = copy.deepcopy(ours)
    plain.config = dataclasses.replace(ours.config, rope_scaling=None)
    assert rel_err(plain.features(ids, cu, [3]), hs[3]) > 1e-3


def test_rope_spellings_parse_alike(small_ckpts, tmp_path):
    c = small_ckpts
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}
    write_text_only(str(tmp_path / "new"), c["cfg"], c["sd"], flat_rope=False)
    edit_config(str(tmp_path / "new"), lambda j: j["rope_parameters"].update(yarn))
    write_text_only(str(tmp_path / "old"), c["cfg"], c["sd"], flat_rope=True)
    edit_config(str(tmp_path / "old"), lambda j: j.update(rope_scaling={**yarn, "type": "yarn"}))
    new, old = TargetConfig.from_hf(str(tmp_path / "new")), TargetConfig.from_hf(str(tmp_path / "old"))
    assert new.rope_scaling == yarn and old.rope_scaling == {**yarn, "type": "yarn"}
    assert (new.rope_theta, new.partial_rotary_factor) == (old.rope_theta, old.partial_rotary_factor) == (1e3, 0.5)
    pos = torch.arange(2000)
    rot = int(new.head_dim * new.partial_rotary_factor)
    a = rope_cos_sin(pos, rot, new.rope_theta, new.rope_scaling, new.max_position_embeddings)
    b = rope_cos_sin(pos, rot, old.rope_theta, old.rope_scaling, old.max_position_embeddings)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# -----------------------------------------------------------------------------
# defaults follow transformers: absent fields, rope_theta 10000, the tie flag of the multimodal wrapper

@pytest.mark.parametrize("moe", [False, True])
def test_config_defaults_follow_hf(tmp_path, moe):
    hf = hf_qwen3_5()
    from transformers import Qwen3_5MoeTextConfig
    ref = Qwen3_5MoeTextConfig() if moe else hf.Qwen3_5TextConfig()
    # a qwen3_5_moe config must give its MoE geometry (here transformers' defaults)
    given = {k: getattr(ref, k) for k in MOE_FIELDS} if moe else {}
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text", **given}, f)
    ours = TargetConfig.from_hf(str(tmp_path))
    for field in dataclasses.fields(TargetConfig):
        if hasattr(ref, field.name) and field.name not in ("rope_theta", "partial_rotary_factor", "rope_scaling"):
            assert getattr(ours, field.name) == getattr(ref, field.name), field.name
    assert ours.rope_theta == ref.rope_parameters["rope_theta"] == 10000.0
    assert ours.partial_rotary_factor == ref.rope_parameters["partial_rotary_factor"] == 0.25
    assert ours.rope_scaling is None and ours.fp8_block is None
    # rope_parameters without rope_theta: also 10000 (not the 27B's 1e7)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "qwen3_5_text", "rope_parameters": {"rope_type": "default"}}, f)
    assert TargetConfig.from_hf(str(tmp_path)).rope_theta == 10000.0


@pytest.mark.parametrize("top,text", [(True, False), (False, True), (None, True), (True, None)])
def test_tie_flag_read_like_hf_multimodal(tmp_path, top, text):
    hf = hf_qwen3_5()
    from transformers import Qwen3_5Config
    tc = dict(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=1,
              linear_key_head_dim=8, linear_value_head_dim=8)
    if text is not None:
        tc["tie_word_embeddings"] = text
    vc = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    m = hf.Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=tc, vision_config=vc, **({} if top is None else {"tie_word_embeddings": top})))
    tied = m.lm_head.weight is m.model.language_model.embed_tokens.weight
    cfg = {"model_type": "qwen3_5", "text_config": {**tc, "model_type": "qwen3_5_text"}}
    if top is not None:
        cfg["tie_word_embeddings"] = top
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
    assert TargetConfig.from_hf(str(tmp_path)).tie_word_embeddings == tied == bool(top)


# -----------------------------------------------------------------------------
# block-FP8 checkpoints (e4m3 weights, weight_scale_inv per block, partial edge blocks)

def quantize_fp8_by_hand(w, block, gen):
    """Per block: scale = amax / 448 times a random u in [1, 4] (so scales differ a lot between blocks and a
    misplaced one shows), q = w / scale in e4m3. Returns q [rows, cols], scale_inv [ceil, ceil] fp32."""
    (rows, cols), (b0, b1) = w.shape, block
    n0, n1 = -(-rows // b0), -(-cols // b1)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scale = torch.empty(n0, n1)
    for i in range(n0):
        for j in range(n1):
            blk = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1]
            scale[i, j] = blk.abs().max().clamp(min=1e-8) / 448 * (1 + 3 * torch.rand((), generator=gen))
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (blk / scale[i, j]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_by_hand(q, scale, block):
    (rows, cols), (b0, b1) = q.shape, block
    w = torch.empty(rows, cols)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            r, k = slice(i * b0, (i + 1) * b0), slice(j * b1, (j + 1) * b1)
            w[r, k] = q[r, k].float() * scale[i, j]
    return w


FP8_SKIP = ("in_proj_a.weight", "in_proj_b.weight")   # as in Qwen's -FP8 configs' modules_to_not_convert


@pytest.fixture(scope="module")
def fp8_source():
    # the init of the presets at the tiny preset's scale: each layer changes the features by ~20-35%, and
    # they react to weight errors smoothly (randomize_'s unit-scale weights amplify e4m3 rounding chaotically)
    cfg = TargetConfig(**SMALL, init_std=0.1)
    src = Target.build(cfg, dtype=torch.float32)
    sd = {n: p.detach().clone() for n, p in src.state_dict().items()}
    ids = torch.randint(0, cfg.vocab_size, (90,), generator=torch.Generator().manual_seed(3))
    return dict(cfg=cfg, src=src, sd=sd, ids=ids, cu=cu_of([50, 40]))


def fp8_checkpoint(path, c, layout, block, scale_dtype):
    """The small checkpoint with every decoder Linear weight but in_proj_a/b in block FP8 (the rest as is,
    fp32), config.json with Qwen's quantization_config. Returns {name: (hand-dequantized fp32 weight,
    the scale of each element)}."""
    gen = torch.Generator().manual_seed(13)
    sd, deq = {}, {}
    for n, t in c["sd"].items():
        if n.startswith("layers.") and t.dim() == 2 and not n.endswith(FP8_SKIP):
            q, scale = quantize_fp8_by_hand(t, block, gen)
            sd[n], sd[n + "_scale_inv"] = q, scale.to(scale_dtype)
            scale = scale.to(scale_dtype).float()
            each = scale.repeat_interleave(block[0], 0)[:t.shape[0]].repeat_interleave(block[1], 1)[:, :t.shape[1]]
            deq[n] = dequantize_by_hand(q, scale, block), each
        else:
            sd[n] = t
    (write_official if layout == "official" else write_text_only)(str(path), c["cfg"], sd)
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": block,
             "modules_to_not_convert": ["lm_head", "embed_tokens", "in_proj_a", "in_proj_b"]}
    edit_config(str(path), lambda j: j.update(quantization_config=quant))
    return deq


# official: sharded (a weight and its scales land in different shards), bf16 scales, blocks that leave a
# partial last block in every dim; text-only: one file, fp32 scales, blocks that divide every dim
FP8_CASES = [("official", [24, 40], torch.bfloat16), ("text", [16, 32], torch.float32)]


@pytest.mark.parametrize("layout,block,scale_dtype", FP8_CASES)
def test_fp8_checkpoint_loads_dequantized(fp8_source, tmp_path, layout, block, scale_dtype):
    c = fp8_source
    deq = fp8_checkpoint(tmp_path, c, layout, block, scale_dtype)
    assert len(deq) == 4 * 3 + 2 * 4 + 6 * 3   # GDN qkv, z, out; attention q, k, v, o; MLPs
    partial = any(w.shape[0] % block[0] or w.shape[1] % block[1] for w, _ in deq.values())
    assert partial == (layout == "official")
    if layout == "official":   # at least one weight's scales live in another shard than the weight
        with open(tmp_path / "model.safetensors.index.json") as f:
            wm = json.load(f)["weight_map"]
        k = "model.language_model.layers.0.mlp.up_proj.weight"
        assert wm[k] != wm[k + "_scale_inv"]
    assert TargetConfig.from_hf(str(tmp_path)).fp8_block == block
    t = Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    got = t.state_dict()
    assert set(got) == set(c["sd"]), "scales must not become parameters"
    for n, v in c["sd"].items():
        if n not in deq:
            assert torch.equal(got[n], v), n
            continue
        w, scale = deq[n]
        assert torch.equal(got[n], w), f"{n}: not the hand dequantization"
        # e4m3 rounding: 2^-4 relative (3 mantissa bits), 2^-10 * scale absolute below the normal range,
        # plus the scale's own rounding when stored in bf16
        err = (got[n] - v).abs()
        assert (err <= v.abs() * (2 ** -4 + 2 ** -8) + scale * 2 ** -10).all(), n
        assert err.max() > 0
    # the features of the weights it was made from, up to FP8 rounding (the same weights with one scale per
    # tensor instead of the right block's are off by ~40% here)
    layers = list(range(c["cfg"].num_hidden_layers))
    f8, ref = t.features(c["ids"], c["cu"], layers), c["src"].features(c["ids"], c["cu"], layers)
    assert 1e-4 < rel_err(f8, ref) < 0.05
    assert rel_err(t.logits(c["ids"], c["cu"]), c["src"].logits(c["ids"], c["cu"])) < 0.05
    # bf16 runs: the fp32 product rounded once; a partial build reads only its layers' weights and scales
    h = Target.from_pretrained(str(tmp_path), dtype=torch.bfloat16, n_layers=2, head=False)
    for n, p in h.state_dict().items():
        fp32 = n.endswith(("A_log", "dt_bias"))
        want = deq[n][0] if n in deq else c["sd"][n]
        assert torch.equal(p, want.to(torch.float32 if fp32 else torch.bfloat16)), n


def test_dequantize_fp8_partial_blocks():
    gen = torch.Generator().manual_seed(14)
    for rows, cols, block in [(37, 53, [16, 16]), (5, 7, [16, 16]), (48, 20, [16, 5]), (300, 260, [128, 128])]:
        w = torch.randn(rows, cols, generator=gen)
        q, scale = quantize_fp8_by_hand(w, block, gen)
        got = dequantize_fp8(q, scale, block, torch.float32)
        assert torch.equal(got, dequantize_by_hand(q, scale, block)), (rows, cols, block)
        assert rel_err(got, w) < 0.07                                   # e4m3 rounding, scales up to 4x off amax
        with pytest.raises(ValueError, match=r"expected \(%d, %d\)" % scale.shape):
            dequantize_fp8(q, scale[:, :-1], block, torch.float32)


@pytest.mark.parametrize("case", ["no_scale", "bad_scale_shape", "no_quant_config", "scale_on_bf16"])
def test_fp8_checkpoint_errors(fp8_source, tmp_path, case):
    c = fp8_source
    fp8_checkpoint(tmp_path, c, "text", [16, 32], torch.float32)
    key = "model.layers.1.self_attn.k_proj.weight"
    file = tmp_path / "model.safetensors"
    with safe_open(str(file), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if case == "no_scale":
        del tensors[key + "_scale_inv"]
    elif case == "bad_scale_shape":
        tensors[key + "_scale_inv"] = tensors[key + "_scale_inv"][:, :1].contiguous()
    elif case == "no_quant_config":
        edit_config(str(tmp_path), lambda j: j.pop("quantization_config"))
    else:   # a scale next to a weight that is not FP8
        tensors[key] = tensors[key].to(torch.bfloat16)
    save_file(tensors, str(file))
    with pytest.raises(ValueError) as e:
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    msg = str(e.value)
    assert "\n" not in msg and str(file) in msg and (key in msg or case == "no_quant_config"), msg
    if case == "no_quant_config":
        assert "quantization_config" in msg


# -----------------------------------------------------------------------------
# every config field that changes the math and that the target does not implement: one line naming it

def _set_rope(j, **kw):
    j["text_config"]["rope_parameters"].update(kw)


BAD_CONFIGS = [
    (lambda j: j["text_config"].update(attention_bias=True), "attention_bias = True"),
    (lambda j: j["text_config"].update(hidden_act="gelu"), "hidden_act = 'gelu'"),
    (lambda j: _set_rope(j, rope_type="dynamic", factor=2.0), "rope_parameters.rope_type = 'dynamic'"),
    (lambda j: _set_rope(j, rope_type="longrope", factor=2.0), "rope_parameters.rope_type = 'longrope'"),
    (lambda j: _set_rope(j, rope_type="yarn"), "rope_parameters.factor = None"),
    (lambda j: j["text_config"].update(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope_scaling = {"),
    (lambda j: (_set_rope(j, rope_type="yarn", factor=2.0),
                j["text_config"].update(original_max_position_embeddings=64)),
     "original_max_position_embeddings = 64"),
    (lambda j: j["text_config"]["layer_types"].__setitem__(2, "sliding_attention"),
     "layer_types = 'sliding_attention'"),
    (lambda j: j["text_config"]["layer_types"].pop(), "layer_types = '5 entries'"),
    (lambda j: j["text_config"].update(num_experts=8, num_experts_per_tok=2),
     "text_config.num_experts = 8"),
    (lambda j: j.update(quantization_config={"quant_method": "gptq", "bits": 4}),
     "quantization_config.quant_method = 'gptq'"),
    (lambda j: j.update(quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"}),
     "quantization_config.weight_block_size = None"),
    (lambda j: j.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                             "activation_scheme": "static"}),
     "quantization_config.activation_scheme = 'static'"),
    (lambda j: j.update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128],
                                             "fmt": "e5m2"}), "quantization_config.fmt = 'e5m2'"),
]


@pytest.mark.parametrize("edit,expected", BAD_CONFIGS, ids=[e for _, e in BAD_CONFIGS])
def test_unsupported_config_fields(small_ckpts, tmp_path, edit, expected):
    write_official(str(tmp_path), small_ckpts["cfg"], small_ckpts["sd"])
    edit_config(str(tmp_path), edit)
    for load in (TargetConfig.from_hf, lambda p: Target.from_pretrained(p, dtype=torch.float32)):
        with pytest.raises(ValueError) as e:
            load(str(tmp_path))
        msg = str(e.value)
        assert msg.startswith(f"{tmp_path / 'config.json'}: {expected}") and "is not supported" in msg, msg
        assert "\n" not in msg

# target.py: the MoE target (qwen3_5_moe: Qwen3.5-35B-A3B, Qwen3.6-35B-A3B)

MOE_HF = "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe"


def hf_moe_model(seed, experts=7, top_k=3):
    """transformers' Qwen3_5MoeForCausalLM at odd sizes (no dimension a multiple of 8: the per-expert path)."""
    hf = hf_qwen3_5(MOE_HF)
    cfg = hf.Qwen3_5MoeTextConfig(
        vocab_size=300, hidden_size=36, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
        linear_value_head_dim=10, linear_conv_kernel_dim=4, moe_intermediate_size=20,
        shared_expert_intermediate_size=28, num_experts=experts, num_experts_per_tok=top_k,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                             mrope_section=[1, 1, 1], mrope_interleaved=True),
        attn_implementation="eager")
    assert cfg.layer_types == [LIN, LIN, LIN, FULL]
    m = hf.Qwen3_5MoeForCausalLM(cfg).eval()
    return randomize_(m, seed)


def moe_routing(m, ids):
    """Per layer, HF's top-k expert ids [T, k] and the shared-expert gate [T] on one document."""
    seen = []
    def hook(mod, args, out):
        x = args[0].reshape(-1, args[0].shape[-1])
        seen.append((mod.gate(x)[2], torch.sigmoid(mod.shared_expert_gate(x))[:, 0]))
    hooks = [layer.mlp.register_forward_hook(hook) for layer in m.model.layers]
    try:
        hf_run(m, ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    m = hf_moe_model(seed=11)
    path = str(tmp_path_factory.mktemp("hf_moe"))
    m.save_pretrained(path)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    # transformers 5.24 writes one tensor per expert; the official checkpoints have them fused (tested below)
    assert "model.layers.0.mlp.experts.6.up_proj.weight" in keys
    assert not any(k.endswith("experts.gate_up_proj") for k in keys)
    ours = Target.from_pretrained(path, dtype=torch.float32)
    return m, ours, path


def test_moe_config_from_hf(moe_pair):
    m, ours, _ = moe_pair
    c = ours.config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.shared_expert_intermediate_size) == \
        (7, 3, 20, 28)
    assert type(ours.layers[0].mlp).__name__ == "MoE" and c.intermediate_size == 0
    for i, layer in enumerate(ours.layers):      # the stacked per-expert tensors == HF's fused parameters
        assert torch.equal(layer.mlp.experts.gate_up_proj, m.model.layers[i].mlp.experts.gate_up_proj)
        assert torch.equal(layer.mlp.experts.down_proj, m.model.layers[i].mlp.experts.down_proj)


def test_moe_matches_hf_single_document(moe_pair):
    m, ours, _ = moe_pair
    ids = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(12))
    cu = cu_of([150])
    # the test exercises routing: every expert is used, tokens disagree, the shared expert's gate is neither 0 nor 1
    for idx, shared in moe_routing(m, ids):
        assert idx.shape == (150, 3) and len(idx.unique()) == 7
        assert len({tuple(r) for r in idx.sort(-1)[0].tolist()}) > 10        # many different expert sets
        assert 0.02 < shared.min() and shared.max() < 0.98 and shared.std() > 0.05
    hs, logits = hf_run(m, ids)
    feats = ours.features(ids, cu, [0, 1, 2, 3])
    for i in range(4):
        assert rel_err(feats[:, i * 36:(i + 1) * 36], hs[i]) < 1e-4, f"layer {i}"
    assert rel_err(ours.logits(ids, cu), logits) < 1e-4, "logits"


def test_moe_matches_hf_packed_documents(moe_pair):
    m, ours, _ = moe_pair
    check_packed_against_hf(m, ours, [45, 100, 31], seed=13)


def moe_official_config(text):
    """The official Qwen3_5MoeForConditionalGeneration config.json: MoE fields in text_config, no SwiGLU width."""
    text = {k: v for k, v in text.items() if k != "intermediate_size"}
    text.update(model_type="qwen3_5_moe_text", num_experts=7, num_experts_per_tok=3, moe_intermediate_size=20,
                shared_expert_intermediate_size=28, router_aux_loss_coef=0.001, output_router_logits=False)
    return text


def test_moe_official_fused_layout(moe_pair, tmp_path):
    # official layout: model.language_model.layers.N.mlp.experts.{gate_up_proj [E, 2I, H], down_proj [E, H, I]}
    # (no .weight), vision + MTP tensors skipped, sharded; loads to exactly the tensors of the per-expert layout
    _, ours, _ = moe_pair
    sd = {n: p.detach().clone() for n, p in ours.state_dict().items()}
    write_official(str(tmp_path), ours.config, sd)
    def official(j):
        j.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe",
                 text_config=moe_official_config(j["text_config"]))
    edit_config(str(tmp_path), official)
    with open(tmp_path / "model.safetensors.index.json") as f:
        wm = json.load(f)["weight_map"]
    assert wm["model.language_model.layers.3.mlp.experts.gate_up_proj"]
    assert not any(".experts.0." in k for k in wm)
    t = Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert TargetConfig.from_hf(str(tmp_path)).num_experts == 7
    got = t.state_dict()
    assert set(got) == set(sd)
    for n, v in sd.items():
        assert torch.equal(got[n], v), n
    ids, cu = torch.randint(0, 300, (60,), generator=torch.Generator().manual_seed(14)), cu_of([25, 35])
    assert torch.equal(t.logits(ids, cu), ours.logits(ids, cu))
    # bf16 load, partial build (a target rank)
    h = Target.from_pretrained(str(tmp_path), dtype=torch.bfloat16, n_layers=2, head=False)
    assert h.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16 and len(h.layers) == 2


def test_moe_missing_expert_tensor(moe_pair, tmp_path):
    _, _, path = moe_pair
    from safetensors.torch import load_file
    sd = load_file(os.path.join(path, "model.safetensors"))
    del sd["model.layers.2.mlp.experts.4.up_proj.weight"]
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f, open(tmp_path / "config.json", "w") as g:
        g.write(f.read())
    with pytest.raises(KeyError) as e:
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    msg = str(e.value)
    assert "model.layers.2.mlp.experts.4.up_proj.weight" in msg and "experts.gate_up_proj" in msg
    assert str(tmp_path) in msg


@pytest.mark.parametrize("edit,field", [
    (dict(num_experts=8), "text_config.num_experts"),                         # MoE field in a dense config
    (dict(norm_topk_prob=True), "text_config.norm_topk_prob"),
    ("moe:-moe_intermediate_size", "text_config.moe_intermediate_size"),     # MoE config missing a field
    ("moe:norm_topk_prob=false", "text_config.norm_topk_prob"),
    ("moe:mlp_only_layers=[0]", "mlp_only_layers"),
    ("moe:decoder_sparse_step=2", "decoder_sparse_step"),
    ("moe:num_experts_per_tok=9", "num_experts_per_tok"),
    ("moe:num_experts=0", "text_config.num_experts"),                         # a MoE model without experts
])
def test_moe_config_errors(tmp_path, edit, field):
    text = text_config_json(TargetConfig(**SMALL))
    model_type = "qwen3_5"
    if isinstance(edit, dict):
        text.update(edit)
    else:
        model_type, text = "qwen3_5_moe", moe_official_config(text)
        change = edit.split(":")[1]
        if change.startswith("-"):
            del text[change[1:]]
        else:
            k, v = change.split("=")
            text[k] = json.loads(v)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": model_type, "architectures": ["X"], "text_config": text}, f)
    with pytest.raises(ValueError) as e:
        TargetConfig.from_hf(str(tmp_path))
    msg = str(e.value)
    assert field in msg and str(tmp_path) in msg and len(msg.splitlines()) == 1


def moe_block(dtype, E=6, k=3, H=32, I=16, Is=24, seed=15):
    """Our MoE block alone with random weights (aligned sizes: rows of 16 bytes in bf16 and fp32)."""
    c = TargetConfig(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                     shared_expert_intermediate_size=Is)
    block = MoE(c)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return block.to(dtype)


def test_moe_grouped_mm_path(monkeypatch):
    # bf16 with aligned sizes takes torch._grouped_mm (one grouped GEMM, on-device offsets); it must equal one
    # matmul per expert, also when an expert gets no token (the GPU fast path is checked by bench.py check)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(16)
    w = torch.randn(5, 24, 16, generator=g).bfloat16()
    counts = torch.tensor([3, 0, 7, 1, 4])
    x = torch.randn(15, 16, generator=g).bfloat16()
    got = expert_linear(x, w, counts.cumsum(0))
    assert len(calls) == 1
    ref = torch.cat([F.linear(xe.float(), we.float()) for xe, we in zip(x.split(counts.tolist()), w)])
    assert rel_err(got, ref) < 1e-2
    # the whole block in bf16 (grouped) against fp32 (per expert)
    calls.clear()
    x = torch.randn(200, 32, generator=g)
    ref = moe_block(torch.float32)(x)
    assert not calls
    got = moe_block(torch.bfloat16)(x.bfloat16())
    assert len(calls) == 2 and rel_err(got, ref) < 3e-2


def test_moe_flops_count_active_parameters():
    # Target.flops' MLP part == the matmul FLOPs a forward of every MoE block really runs (top-k of the experts)
    cfg = dict(vocab_size=300, hidden_size=36, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=12,
               linear_value_head_dim=10, moe_intermediate_size=20, shared_expert_intermediate_size=28,
               num_experts=7, num_experts_per_tok=3)
    t = randomize_(Target.build(TargetConfig(**cfg)), 17)
    twin = Target.build(TargetConfig(**{**cfg, "num_experts": 0, "intermediate_size": 0}))   # no MLP at all
    T = 90
    x = torch.randn(T, 36, generator=torch.Generator().manual_seed(18))
    with FlopCounterMode(display=False) as fc:
        for layer in t.layers:
            layer.mlp(x)
    counts = {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}
    combine = counts.pop("aten.bmm")            # the weighted sum of the k expert outputs: no parameters
    assert combine == 4 * 2 * T * 3 * 36
    cu = cu_of([40, 50])
    assert t.flops(cu, 4) - twin.flops(cu, 4) == sum(counts.values())
    assert sum(counts.values()) == 4 * 2 * T * (7 * 36 + 36 + 3 * 36 * 28 + 3 * 3 * 36 * 20)


def test_moe_35b_a3b_preset():
    # Qwen3.5-35B-A3B / Qwen3.6-35B-A3B text model: 40 layers (10 x (3 GDN + 1 attention)), hidden 2048,
    # 16 q / 2 kv heads of 256, GDN 16 qk / 32 v heads of 128, 256 experts (top 8) of width 512 + shared 512
    a, b = TargetConfig.preset("qwen3.5-35b-a3b"), TargetConfig.preset("qwen3.6-35b-a3b")
    assert a == b
    assert (a.num_hidden_layers, a.hidden_size, a.vocab_size, a.head_dim) == (40, 2048, 248320, 256)
    assert (a.num_attention_heads, a.num_key_value_heads, a.linear_num_key_heads, a.linear_num_value_heads) == \
        (16, 2, 16, 32)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.shared_expert_intermediate_size) == \
        (256, 8, 512, 512)
    assert [i for i, t in enumerate(a.layer_types) if t == FULL] == list(range(3, 40, 4))
    with torch.device("meta"):
        m = Target(a)
    assert len(m.state_dict()) == 693       # 30*18 + 10*15 + embed, norm, lm_head: the official index's text keys
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["layers.0.mlp.experts.gate_up_proj"] == (256, 1024, 2048)
    assert shapes["layers.39.mlp.experts.down_proj"] == (256, 2048, 512)
    assert shapes["layers.0.mlp.gate.weight"] == (256, 2048)
    assert shapes["layers.0.mlp.shared_expert_gate.weight"] == (1, 2048)
    assert shapes["layers.0.linear_attn.in_proj_qkv.weight"] == (8192, 2048)
    assert shapes["layers.3.self_attn.q_proj.weight"] == (8192, 2048)
    total = sum(p.numel() for p in m.parameters())
    assert total == 34_660_610_688          # + vision tower and MTP head: the "35B"
    experts = sum(p.numel() for n, p in m.named_parameters() if ".experts." in n)
    assert experts == 40 * 256 * 3 * 512 * 2048
    # active per token, the "A3B": embed + head 1,017,118,720, GDN 30 x 33,718,464, attention 10 x 27,263,488,
    # router + shared expert 40 x 3,672,064, norms 165,888, and 8 of 256 experts 1,006,632,960
    assert total - experts + experts * 8 // 256 == 3_454_988_928
    # FLOPs of a forward through the 38 layers the drafter taps: the MLP part counts the active parameters
    # (router, shared expert and its gate, 8 of 256 experts), twice per token
    twin = TargetConfig(**{**vars(a), "num_experts": 0, "intermediate_size": 0})
    with torch.device("meta"):
        dense = Target(twin, n_layers=38, head=False)
    cu = cu_of([3000, 5192])
    per_token = 256 * 2048 + 3 * 512 * 2048 + 2048 + 8 * 3 * 512 * 2048
    assert m.flops(cu, 38) - dense.flops(cu, 38) == 2 * 8192 * 38 * per_token


def test_moe_35b_a3b_drafter_defaults():
    # z-lab/Qwen3.5-35B-A3B-DFlash and z-lab/Qwen3.6-35B-A3B-DFlash (nested-dflash_config revision, June 2026)
    published = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 2048, "num_hidden_layers": 6,
        "intermediate_size": 6144, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "rms_norm_eps": 1e-6, "vocab_size": 248320, "max_position_embeddings": 262144, "tie_word_embeddings": False,
        "num_target_layers": 40, "sliding_window": 4096, "use_sliding_window": True, "max_window_layers": 6,
        "layer_types": [SLIDING] * 5 + [FULL],
        "dflash_config": {"block_size": 16, "mask_token_id": 248077,
                          "target_layer_ids": [1, 6, 11, 16, 22, 27, 32, 37]},
        "rope_parameters": {"rope_theta": 10_000_000.0, "rope_type": "default"}}
    c = DrafterConfig.from_target(TargetConfig.preset("qwen3.6-35b-a3b"))
    assert c == config_from_json(published)
    assert DrafterConfig.from_target(TargetConfig.preset("qwen3.5-35b-a3b"), sliding_window=0, n_feat=5,
                                     num_hidden_layers=8).target_layer_ids == [1, 10, 19, 28, 37]   # the legacy one
    with torch.device("meta"):
        d = Drafter(c)
    assert d.fc.weight.shape == (2048, 8 * 2048)


# ==================================================================================================
# DFlash2 (dflash2.py): block-local convolutions and the candidate selector

import dflash2  # noqa: E402  (only DFlash2's tests need it)

D2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)   # tiny DFlash2


def dflash2_config(**kw):
    """The tiny target's DFlash2 drafter: 2 layers, taps [1, 3, 5], hidden 64 (4 groups of 16)."""
    return DrafterConfig.from_target(tiny_target().config, n_feat=3, num_hidden_layers=2, **{**D2, **kw})


def ref_conv(x, u, W, base, side, K, G, B):
    """out[i, c] = sum_t (base[side, t, c] + delta[i, t, c // G]) * x[i - t, c], x[i - t] = 0 across a block
    start; delta[i, t, g] = row side*K*N + t*N + g of W (N = H/G groups) dotted with u[i], the sublayer's
    normed input (both sides' kernels come from it): loops over rows, taps and channels."""
    (Q, H), N, W = x.shape, x.shape[1] // G, W.detach()
    out = torch.zeros(Q, H, dtype=torch.float64)
    for i in range(Q):
        for t in range(K):
            if i % B - t < 0:              # before its block's slot 0
                continue
            for c in range(H):
                delta = sum(float(W[side * K * N + t * N + c // G, h]) * float(u[i, h]) for h in range(H))
                out[i, c] += (float(base[side, t, c]) + delta) * float(x[i - t, c])
    return out


@pytest.mark.parametrize("K", [2, 3])
def test_dflash2_conv_matches_loops(K):
    """Conv's two sides (z-lab's prepare / finish) on a packed row of 3 blocks of 4 slots (random, non-identity weights) == the
    loops, fp32 precision; slot 0 of the 2nd and 3rd blocks reads nothing of the block before (a conv over
    the whole row, ignoring blocks, differs exactly there)."""
    c = dflash2_config(conv_kernel_size=K, block_size=4)
    conv = dflash2.Conv(c)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        conv.base_kernel.copy_(torch.randn(conv.base_kernel.shape, generator=g))
        conv.kernel_projection.weight.copy_(torch.randn(conv.kernel_projection.weight.shape, generator=g) * 0.1)
    H, G, B = 64, 16, 4
    assert conv.kernel_projection.weight.shape == (2 * K * H // G, H)
    u, y = torch.randn(3 * B, H, generator=g), torch.randn(3 * B, H, generator=g)
    seen = []                                             # the sublayer's input: u convolved
    with torch.no_grad():
        out = conv(u, lambda x: seen.append(x) or y)
    x = seen[0]
    W, base = conv.kernel_projection.weight, conv.base_kernel.detach()
    assert rel_err(x, ref_conv(u, u, W, base, 0, K, G, B)) < 1e-6
    assert rel_err(out, ref_conv(y, u, W, base, 1, K, G, B)) < 1e-6
    whole = ref_conv(u, u, W, base, 0, K, G, 3 * B)      # as one block: taps cross the block boundaries
    crossed = (whole.float() - x).abs().amax(-1) > 1e-3
    assert crossed[[B, 2 * B]].all() and not crossed[:B].any()


def test_dflash2_identity_start(drafter_rows, monkeypatch, tmp_path):
    """A DFlash drafter's export made DFlash2 (conv at identity, selector at init; train.py's --init-drafter
    path: checks.init_drafter) computes exactly the DFlash drafter's final hidden states, logits, backbone
    loss and acceptance on packed rows, and proposes from the same logits."""
    t, d, rows = drafter_rows
    d.save_pretrained(str(tmp_path))
    loaded = Drafter.from_pretrained(str(tmp_path))
    args = types.SimpleNamespace(init_drafter=str(tmp_path), block_size=16, mask_token_id=None, drafter_layers=None,
                                 sliding_window=None, arch="dflash2")
    d2 = checks.init_drafter(args, loaded, dataclasses.replace(loaded.config, **D2), t.config)
    assert d2.config.conv_kernel_size == 2 and loaded.config.conv_kernel_size == 0
    with pytest.raises(SystemExit, match="--arch dflash: --init-drafter .* is DFlash2; drop it"):   # no downgrade
        checks.init_drafter(types.SimpleNamespace(**{**vars(args), "arch": "dflash"}), d2, d2.config, t.config)
    assert set(d2.state_dict()) - set(loaded.state_dict()) == {
        k for k in d2.state_dict() if "_conv." in k or k.startswith("candidate_selector.")}
    for r in rows[:2]:
        h1, h2 = train_h(monkeypatch, loaded, t, r), train_h(monkeypatch, d2, t, r)
        assert torch.equal(h1, h2)
        o1, o2 = forward(loaded, t, r), forward(d2, t, r, selector_alpha=0.0)
        for k in ("loss", "accept_sum", "slot_correct", "slot_count"):
            assert torch.equal(o1[k], o2[k]), k
    args_ = propose_args(t, rows[0], 20)
    assert torch.equal(loaded.propose(*args_)[1], d2.propose(*args_)[1])


def ref_walk(sel, h, anchor, logits, k, T=0.0, u=None):
    """The candidate selector's walk by plain loops: per block and slot, the k largest logits (sorted), scores
    unary + sum_r A[prev, r] (P h)[r] B[cand, r], the best (greedy) or the inverse CDF of softmax(score / T)
    at u; the choice the next predecessor."""
    A, Bc, P = sel.predecessor_codebook, sel.successor_codebook, sel.hidden_projection.weight
    n, J, _ = h.shape
    paths, qs = [], []
    for i in range(n):
        prev, path, qrow = int(anchor[i]), [], []
        for j in range(J):
            cand = sorted(range(logits.shape[-1]), key=lambda v: -float(logits[i, j, v]))[:k]
            z = [sum(float(P[r, x]) * float(h[i, j, x]) for x in range(h.shape[-1])) for r in range(P.shape[0])]
            s = [float(logits[i, j, cc]) + sum(float(A[prev, r]) * z[r] * float(Bc[cc, r]) for r in range(len(z)))
                 for cc in cand]
            if T:
                e = [math.exp((v - max(s)) / T) for v in s]
                q = [v / sum(e) for v in e]
                cdf, pick = 0.0, k - 1
                for m, v in enumerate(q):
                    cdf += v
                    if cdf > float(u[i, j]):
                        pick = m
                        break
                qrow.append(q)
            else:
                pick = max(range(k), key=lambda m: s[m])
            prev = cand[pick]
            path.append(prev)
        paths.append(path)
        qs.append(qrow)
    return torch.tensor(paths), torch.tensor(qs, dtype=torch.float64) if T else None


def test_dflash2_walk_matches_loops():
    """Selector.walk (random codebooks, successor non-zero) == the loops: greedy, and sampled at T = 1 and 0.7
    from the same uniforms (the draws agree, q to fp32 precision)."""
    c = dflash2_config(vocab_size=40, selector_rank=6, selector_top_k=5)
    sel = dflash2.Selector(c)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in sel.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    n, J = 3, 7
    h, logits = torch.randn(n, J, 64, generator=g) * 0.3, torch.randn(n, J, 40, generator=g) * 2
    anchor = torch.tensor([3, 17, 39])
    with torch.no_grad():
        path, cand, q = sel.walk(h, anchor, logits)
        assert q is None and torch.equal(path, ref_walk(sel, h, anchor, logits, 5)[0])
        assert torch.equal(cand, logits.topk(5, dim=-1).indices)
        for T in (1.0, 0.7):
            u = torch.rand(n, J, generator=g)
            path, _, q = sel.walk(h, anchor, logits, T, u)
            ref_path, ref_q = ref_walk(sel, h, anchor, logits, 5, T, u)
            assert torch.equal(path, ref_path) and rel_err(q, ref_q) < 1e-5
    assert len(set(path.view(-1).tolist())) > 5    # the draws are not all one token


@pytest.mark.parametrize("V", [20000, 16384 + 100])
def test_dflash2_candidates_equal_topk(V):
    """Selector.candidates (the max of each 256 logits, the top 16 groups, a top-16 over their 4,096 and the
    tail) == torch.topk over the whole vocabulary: fp32 values and ids exactly; bf16 logits (ties at the 16th
    value) the same values, ids whose logits are those values. The top 16 planted in 16 distinct groups, in
    one group, and in the V % 256 tail, where a wrong grouping would miss them; eager and compiled."""
    sel = dflash2.Selector(dflash2_config(vocab_size=V, selector_top_k=16))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, V, generator=g)
    x[1, torch.arange(16) * 997 % V] += 10          # 16 groups
    x[2, 512:528] += 10                              # one group
    x[3, V - 16:] += 10                              # the tail when V % 256 > 0
    x[4, :] = x[4, :].sort().values                  # the 16 best in the last group(s)
    compiled = torch.compile(sel.candidates, fullgraph=True, dynamic=False)
    for fn in (sel.candidates, compiled):
        v, i = fn(x)
        ref = x.topk(16, dim=-1)
        assert torch.equal(v, ref.values) and torch.equal(i, ref.indices)
        xb = x.bfloat16()
        v, i = fn(xb)
        assert v.dtype == torch.float32 and torch.equal(v, xb.topk(16, dim=-1).values.float())
        assert torch.equal(xb.gather(1, i).float(), v)
    assert (xb.topk(17, dim=-1).values[:, 15:].diff(dim=-1) == 0).any()   # ties happened in bf16

def test_dflash2_selector_loss_by_hand():
    """Selector.terms on one block of 3 slots (anchor token 0, labels 3 and 1), top-2 candidates, P = I, A[0]
    = (1, 1), A[3] = (2, 2), other A rows 0 (a wrong predecessor shows), h_1 = (1, 0), h_2 = (0, 1):
      slot 1 (predecessor: the anchor 0): candidates [3, 2], unary [2, 1]; B[3] = (.5, 0), B[2] = (-1, -1):
        scores [2.5, 0]; gold 3 in the top-2 (index 0): CE = log(1 + e^-2.5)
      slot 2 (predecessor: the gold 3, not the drafted token): candidates [4, 2], unary [1.5, .5], gold 1
        missing (unary .25) is appended: B[4] = (0, 1), B[1] = (0, .5): z * A[3] = (0, 2), scores
        [3.5, -1.5, 1.25]: CE = logsumexp - 1.25
    loss = backbone + alpha x the mean; metrics: gold in top-K at 1 slot, the selector right at slot 1 only
    (it picks 4 at slot 2), walk accepted 1 + 1 = 2."""
    c = DrafterConfig(hidden_size=2, vocab_size=5, selector_rank=2, selector_top_k=2, conv_kernel_size=2,
                      block_size=3)
    sel = dflash2.Selector(c)
    with torch.no_grad():
        sel.hidden_projection.weight.copy_(torch.eye(2))
        sel.predecessor_codebook.zero_()[0] = 1.0
        sel.predecessor_codebook[3] = 2.0
        sel.successor_codebook.zero_()
        sel.successor_codebook[3] = torch.tensor([0.5, 0.0])
        sel.successor_codebook[2] = torch.tensor([-1.0, -1.0])
        sel.successor_codebook[4] = torch.tensor([0.0, 1.0])
        sel.successor_codebook[1] = torch.tensor([0.0, 0.5])
    h = torch.tensor([[0.3, 0.3], [1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    labels, supervised = torch.tensor([[0, 3, 1]]), torch.tensor([[False, True, True]])
    vals = torch.tensor([[9.0, 8.0, 0.0], [2.0, 1.0, 2.0], [1.5, 0.5, 0.25]])
    cand = torch.tensor([[1, 2], [3, 2], [4, 2]])
    head = torch.randn(5, 2)
    out = sel.terms(dict(loss=torch.tensor(1.0)), h, head, labels, supervised, torch.tensor([True]),
                    (vals, cand), 0.5)
    ce1 = math.log(1 + math.exp(-2.5))
    ce2 = math.log(math.exp(3.5) + math.exp(-1.5) + math.exp(1.25)) - 1.25
    assert out["selector_loss"].item() == pytest.approx((ce1 + ce2) / 2, rel=1e-6)
    assert out["loss"].item() == pytest.approx(1 + 0.5 * (ce1 + ce2) / 2, rel=1e-6)
    assert (out["topk_recall_hits"], out["selector_acc_hits"], out["walk_accept_sum"]) == (1, 1, 2)
    # an objective (distill.py): on the walk's q over the strict top-2, as served, p the target's at the ids:
    #   slot 1: q = softmax(2.5, 0) = (1 - e1, e1), p (.5, .3): a1 = .5 + e1; slot 2: q = softmax(3.5, -1.5),
    #   p (.1, .6): a2 = .1 + e2; tv = 1 - a; dspark .1 CE + .9 tv; the walk's expected accepted 1 + a1 + a1 a2
    e1, e2 = 1 / (1 + math.exp(2.5)), 1 / (1 + math.exp(5.0))
    a1, a2 = .5 + e1, .1 + e2
    p_at = torch.tensor([[.4, .4], [.5, .3], [.1, .6]])
    for kind, want in (("tv", (2 - a1 - a2) / 2), ("dspark", .1 * (ce1 + ce2) / 2 + .9 * (2 - a1 - a2) / 2)):
        o = sel.terms(dict(loss=torch.tensor(1.0)), h, head, labels, supervised, torch.tensor([True]),
                      (vals, cand, p_at), 0.5, distill.Objective(kind))
        assert o["selector_loss"].item() == pytest.approx(want, rel=1e-6), kind
        assert o["walk_sampled_accept_sum"].item() == pytest.approx(1 + a1 + a1 * a2, rel=1e-6)
    out["loss"].backward()
    assert h.grad[0].abs().sum() == 0 and h.grad[1:].abs().sum() > 0     # the anchor's slot: no loss
    # _Unary's gradient into h == plain autograd through the full logits h @ head^T at the ids
    grad, h.grad = h.grad.clone(), None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dflash2._Unary, "apply", lambda v, h, head, ids: v + (x := (h @ head.T).gather(1, ids)) - x.detach())
        sel.terms(dict(loss=torch.tensor(1.0)), h, head, labels, supervised, torch.tensor([True]), (vals, cand),
                  0.5)["loss"].backward()
    assert rel_err(grad, h.grad) < 1e-6


def test_dflash2_export_keys_and_reload(tmp_path, drafter_rows):
    """The DFlash2 export: DFlash2DraftModel, dflash_config with its 4 fields (the unary transforms off: output
    multiplier 1, no softcap), every DFlash tensor plus exactly the contract's (z-lab/dflash DFlash2DraftModel)
    with its shapes, bf16; the reload's config is the same and it proposes the same tokens as the bf16-rounded
    drafter. A DFlash export has none of the 4 fields."""
    t, _, rows = drafter_rows
    cfg = dflash2_config(block_size=8, mask_token_id=500)
    d = randomize_drafter_(Drafter(cfg), 7)
    d.save_pretrained(str(tmp_path / "d2"))
    loaded = Drafter.from_pretrained(str(tmp_path / "d2"))
    assert loaded.config == cfg
    j = json.load(open(tmp_path / "d2" / "config.json"))
    assert j["architectures"] == ["DFlash2DraftModel"]
    assert {k: j["dflash_config"][k] for k in (*D2, "output_multiplier", "final_logit_softcapping")} == dict(
        D2, output_multiplier=1.0, final_logit_softcapping=0.0)
    assert not set(D2) & set(j)
    H, V, L, r, K, G = 64, tiny_target().config.vocab_size, 2, 8, 2, 16
    new = {"candidate_selector.hidden_projection.weight": (r, H), "candidate_selector.predecessor_codebook": (V, r),
           "candidate_selector.successor_codebook": (V, r)}
    for i in range(L):
        for conv in ("attention_conv", "mlp_conv"):
            new[f"layers.{i}.{conv}.base_kernel"] = (2, K, H)
            new[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * K * H // G, H)
    plain = set(Drafter(dataclasses.replace(cfg, conv_kernel_size=0)).state_dict())
    with safe_open(str(tmp_path / "d2" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == plain | set(new)
        for k, shape in new.items():
            x = f.get_tensor(k)
            assert x.dtype == torch.bfloat16 and tuple(x.shape) == shape, k
    ref = copy.deepcopy(d)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    for a in (0, 20, 40):
        args = propose_args(t, rows[0], a)
        assert torch.equal(loaded.propose(*args)[0], ref.propose(*args)[0])
    Drafter(dataclasses.replace(cfg, conv_kernel_size=0)).save_pretrained(str(tmp_path / "d1"))
    j = json.load(open(tmp_path / "d1" / "config.json"))
    assert j["architectures"] == ["DFlashDraftModel"] and not set(D2) & (set(j) | set(j["dflash_config"]))


def test_dflash2_speculative_equals_greedy_and_replay(gen):
    """The trained demo drafter made DFlash2 with a random selector (its walk is not the argmax): speculative
    decoding == greedy decoding, and replay gives the loop's accepted lengths cycle by cycle."""
    d = dflash2.upgrade(gen.drafter, **D2)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in d.candidate_selector.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    prompts, conts = gen.prompts[:4], gen.cont[:4]
    want = []
    for p, cont in zip(prompts, conts):
        spec, cycles, _ = generate.speculative(gen.t, d, p, MAX_NEW)
        assert spec == cont[:MAX_NEW]
        want.append(cycles)
    seqs = [torch.cat([p, torch.tensor(c)]) for p, c in zip(prompts, conts)]
    got, differ = generate.replay(gen.t, d, seqs, [len(p) for p in prompts], MAX_NEW, batch=3)
    assert got == want and differ == 0
    p = prompts[0]
    feats = gen.t.features(p, torch.tensor([0, len(p)]), d.config.target_layer_ids)
    walked, logits = d.propose(feats[:-1], torch.arange(len(p) - 1), int(p[-1]), len(p) - 1,
                               gen.t.embed_tokens.weight, gen.t.lm_head.weight)
    assert not torch.equal(walked, logits.argmax(-1))


@pytest.mark.parametrize("T,top_p,top_k", [(1.0, 1.0, 0), (0.8, 0.9, 6)])
def test_dflash2_speculative_sampling_keeps_the_target_distribution(T, top_p, top_k):
    """As test_speculative_sampling_keeps_the_target_distribution, the proposals DFlash2's sampled walk
    (generate.propose_at) over the top-3 of 8 tokens, q zero outside them (z-lab's walk filters nothing; the
    target's p is filtered as served): the 2nd and 3rd emitted tokens follow the target's own sampling
    marginals (chi-square below its 0.999 quantile)."""
    cfg = dataclasses.replace(TargetConfig.preset("tiny"), vocab_size=8)
    t, B = Target.build(cfg), 4
    dc = DrafterConfig.from_target(cfg, n_feat=1, num_hidden_layers=1, block_size=B, **dict(D2, selector_top_k=3))
    d = randomize_drafter_(Drafter(dc), 5)
    prompt, g = torch.tensor([3, 1, 4, 1, 5]), torch.Generator().manual_seed(0)

    def draft(feats, tokens, doc, pos, anchors):
        x, q = generate.propose_at(d, t, d.context(feats), tokens, doc, pos, anchors, T, g, top_p, top_k)
        assert ((q > 0).sum(-1) == 3).all() and torch.allclose(q.sum(-1), torch.ones(()))
        return x, q
    with torch.no_grad():
        news, cycles = generate.speculative_sampling(t, draft, [prompt] * 2000, 3, T, g, B, dc.target_layer_ids,
                                                     (), top_p, top_k)
    assert all(len(new) == 3 for new in news) and any(c[0] < B for c in cycles) and any(c[0] > 1 for c in cycles)
    check_first_cycle(news, cycles, target_marginals(t, prompt, 3, T, top_p, top_k), None)


@pytest.mark.parametrize("objective", [None, "dspark"])
def test_dflash2_compiled_step_equals_eager(objective):
    """train.py's whole drafter step (model.drafter_step) for a DFlash2 drafter compiles with fullgraph=True on
    the CPU (no graph break, no data-dependent branch) and gives the eager step's loss, metrics, gradients;
    with CE and with an objective against the target's distribution (distill.py: the Objective's code inlined)."""
    t = tiny_target()
    d = randomize_drafter_(Drafter(dflash2_config()), 2)
    S, g = 160, torch.Generator().manual_seed(4)
    feats = torch.randn(S, (3 + bool(objective)) * 64, generator=g)
    row = dict(tokens=torch.randint(0, 512, (S,), generator=g), loss_mask=torch.ones(S, dtype=torch.long),
               doc=(torch.arange(S) >= 90).long(), pos=torch.arange(S) % 90)
    eager = functools.partial(model.drafter_step, d, anchors_per_doc=8, row_anchors=16, embed=t.embed_tokens.weight,
                              head=t.lm_head.weight, selector_alpha=0.3,
                              objective=objective and distill.Objective(objective, 0.6))
    outs, grads = [], []
    for fn in (eager, torch.compile(eager, fullgraph=True, dynamic=False)):
        torch.manual_seed(1)
        with torch._inductor.config.patch(fallback_random=True):
            out, _ = fn(feats, row)
        out["loss"].backward()
        outs.append(out)
        grads.append({k: p.grad.clone() for k, p in d.named_parameters()})
        d.zero_grad(set_to_none=True)
    for k in ("accept_sum", "topk_recall_hits", "selector_acc_hits", "walk_accept_sum"):
        assert torch.equal(outs[0][k], outs[1][k]), k
    for k in ["loss"] + ["sampled_accept_sum", "walk_sampled_accept_sum"] * bool(objective):
        assert rel_err(outs[1][k], outs[0][k]) < 1e-5, k
    for k in grads[0]:
        assert rel_err(grads[1][k], grads[0][k]) < 1e-4, k
