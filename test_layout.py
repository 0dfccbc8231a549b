"""
CPU tests of the drafter layouts of the published drafters (issue 13): sliding-window layers (the mask against a
per-token definition, its BlockMask lists against create_block_mask, train == serve, an independent propose
reference), RoPE scaling against transformers' own rope functions, the z-lab config in and out through train.py,
one-line errors for fields the drafter cannot honour, and the start-up self-check's plumbing.
Run: python -m pytest -q test_layout.py
"""
import contextlib
import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import model
from model import (FULL, SLIDING, Drafter, DrafterConfig, anchor_blocks, anchor_mask_mod, block_lists,
                   config_from_json, drafter_rope, flex_matches_dense)
from target import Target, TargetConfig, positions_from_cu, rope_inv_freq

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(autouse=True)
def one_thread():
    # tiny tensors on a shared 2-core box: intra-op threads only add overhead
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_err(a, b):
    a, b = a.float(), b.float()
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)


def randomize_drafter_(d, seed):
    # unit-scale weights and norm weights != 1: every path through the layers shows in the output
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in d.parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * r if p.dim() == 1 else r * p.shape[-1] ** -0.5)
    return d


def packed_row(lens):
    cu = torch.tensor([0] + list(lens)).cumsum(0)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    return cu, doc, positions_from_cu(cu)


# -----------------------------------------------------------------------------
# 1. the sliding mask == a per-token definition written from the serving engines' rule

def brute_mask(anchors, keep, doc, pos, S, B, W):
    """Per token, from the engines' rule (SGLang window_left = W-1, vLLM flash-attn window (W-1, 0), SpecForge
    create_dflash_sdpa_mask): the query of block j slot k sits at position q = pos[a_j] + k. Context key t is
    seen iff t is before the anchor in its document and, in a sliding layer (W > 0), q - pos[t] < W. Block key
    i (at position pos[a_j] + i) is seen in a full layer always, in a sliding one iff i <= k and k - i < W.
    Padded slots (keep False) see nothing."""
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


@pytest.mark.parametrize("W", [1, 3, 9, 16, 25, 1000])
@pytest.mark.parametrize("B", [4, 16])
def test_sliding_mask_matches_per_token_definition(W, B):
    rng = random.Random(W * 31 + B)
    lens = [rng.randint(5, 40) for _ in range(3)]
    cu, doc, pos = packed_row(lens)
    S = int(cu[-1])
    starts = cu[:-1].tolist()
    anchors = sorted(set(rng.sample(range(S), 8)) | set(starts) | {S - 1})   # document starts, the row's end
    N = len(anchors) + 2
    anchors, keep = anchors + [0, 0], [True] * (N - 2) + [False, False]         # padded slots last
    got = anchor_mask_mod(torch.tensor(anchors), torch.tensor(keep), doc, S, B, W)(
        0, 0, torch.arange(N * B)[:, None], torch.arange(S + N * B)[None, :])
    ref = brute_mask(anchors, keep, doc.tolist(), pos.tolist(), S, B, W)
    assert torch.equal(got, ref), f"{(got != ref).sum().item()} cells differ"
    # the window binds (shorter than some context) or not (longer than every context), as parametrized
    full = brute_mask(anchors, keep, doc.tolist(), pos.tolist(), S, B, 0)
    assert (ref & ~full).sum() == 0
    assert (ref != full).any()                             # block causality at least
    if W < max(lens) - B:
        assert (ref[:, :S] != full[:, :S]).any()           # and the window cut some context
    if W >= max(lens) + B:
        assert torch.equal(ref[:, :S], full[:, :S])
    # flex also evaluates padded tiles past Q_LEN / KV_LEN: no out-of-range indexing there
    anchor_mask_mod(torch.tensor(anchors), torch.tensor(keep), doc, S, B, W)(
        0, 0, torch.arange(N * B + 2 * B)[:, None], torch.arange(S + N * B + 128)[None, :])


NAMES = ["kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
         "full_q_num_blocks", "full_q_indices"]


def check_blocks(anchors, keep, doc, S, B, W):
    from torch.nn.attention.flex_attention import create_block_mask
    N = len(anchors)
    got = anchor_blocks(anchors, keep, doc, S, B, W)
    ref = create_block_mask(anchor_mask_mod(anchors, keep, doc, S, B, W), None, None, N * B, S + N * B,
                            device="cpu")
    for name, g in zip(NAMES, got):
        r = getattr(ref, name)
        # strides too: the compiled flex backward reads the lists as laid out by create_block_mask
        assert g.shape == r.shape and g.dtype == r.dtype and g.stride() == r.stride() and torch.equal(g, r), name
    return got


@pytest.mark.parametrize("S,N,B,docs,W", [(8192, 512, 16, 4, 2048), (8192, 512, 16, 4, 300), (700, 40, 16, 3, 1),
                                          (700, 40, 16, 3, 127), (700, 40, 16, 3, 129), (300, 37, 5, 2, 64),
                                          (515, 64, 8, 5, 10000), (129, 9, 16, 1, 8)])
def test_sliding_anchor_blocks_match_create_block_mask(S, N, B, docs, W):
    g = torch.Generator().manual_seed(S + W)
    cuts = torch.randperm(S - 1, generator=g)[:docs - 1] + 1
    doc = (torch.arange(S)[:, None] >= cuts[None, :]).sum(1)
    starts = [0] + sorted(cuts.tolist())
    picked = torch.randperm(S, generator=g)[:N - 4].tolist() + starts[:2]       # some at document starts
    anchors = torch.tensor(sorted(picked) + [0] * (N - len(picked)))
    keep = torch.arange(N) < len(picked)
    got = check_blocks(anchors, keep, doc, S, B, W)
    if S == 8192:   # the real shape has both kinds of tile, so both branches were exercised
        assert got[0].sum() > 0 and got[2].sum() > 0
    # by hand: a window starting exactly on a tile edge (anchor 300, W - 1 = 172 -> 128) and one past a document start
    doc = (torch.arange(400) >= 256).long()
    anchors, keep = torch.tensor([300] * 8 + [258] * 7 + [0]), torch.tensor([True] * 15 + [False])
    check_blocks(anchors, keep, doc, 400, 16, 173)


# -----------------------------------------------------------------------------
# 2. RoPE: default, linear and YaRN == transformers' own rope functions and rotary embedding

ROPES = [None, {"rope_type": "linear", "factor": 2.5}, {"type": "linear", "factor": 4.0},
         {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
         {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16,
          "beta_slow": 2, "truncate": False},
         {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 8192, "mscale": 0.707,
          "mscale_all_dim": 1.0},
         {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.3},
         {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 4096}]


def hf_qwen3_config(c):
    from transformers import Qwen3Config
    rope = dict(c.rope_scaling or {"rope_type": "default"})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=c.num_attention_heads, head_dim=c.head_dim,
                       max_position_embeddings=c.max_position_embeddings,
                       rope_parameters={**rope, "rope_theta": c.rope_theta})


@pytest.mark.parametrize("rope", ROPES)
@pytest.mark.parametrize("head_dim,theta", [(128, 1e7), (16, 1e4)])
def test_rope_matches_transformers(rope, head_dim, theta):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
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
# 3. a mixed layout with YaRN: training forward == propose == an independent reference

def tiny_target():
    return Target.build(TargetConfig.preset("tiny"))


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def mixed():
    with one_thread_ctx():
        t = tiny_target()
        out = []
        for W in (5, 20):          # shorter than the block (the window also cuts block keys) and longer
            base = DrafterConfig.from_target(t.config, n_feat=3, num_hidden_layers=3)
            cfg = DrafterConfig(**{**vars(base), "layer_types": [SLIDING, FULL, SLIDING], "sliding_window": W,
                                   "use_sliding_window": True, "rope_scaling": YARN})
            out.append(randomize_drafter_(Drafter(cfg), W))
        lens = [14, 37, 9]
        cu, doc, pos = packed_row(lens)
        tokens = torch.randint(0, 511, (int(cu[-1]),), generator=torch.Generator().manual_seed(0))
        feats = t.features(tokens, cu, out[0].config.target_layer_ids).clone()
        return t, out, dict(cu=cu, doc=doc, pos=pos, tokens=tokens, feats=feats)


@contextlib.contextmanager
def one_thread_ctx():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def train_h(d, t, r, anchors, keep, monkeypatch):
    calls = []
    orig = model._WeightedCE.apply
    def spy(h, *rest):
        calls.append(h.detach().clone())
        return orig(h, *rest)
    monkeypatch.setattr(model._WeightedCE, "apply", spy)
    S = len(r["tokens"])
    d(r["feats"], r["tokens"], torch.ones(S, dtype=torch.long), r["doc"], r["pos"], anchors, keep,
      t.embed_tokens.weight, t.lm_head.weight)
    monkeypatch.undo()
    return calls[0].view(len(anchors), d.config.block_size, -1)


def test_mixed_layout_train_serve_equivalence(mixed, monkeypatch):
    t, drafters, r = mixed
    S = len(r["tokens"])
    anchors = torch.tensor(list(range(S)) + [0, 0])             # every position (document starts too), 2 padded
    keep = torch.arange(S + 2) < S
    head = t.lm_head.weight
    for d in drafters:
        h = train_h(d, t, r, anchors, keep, monkeypatch)
        for a in range(S):
            s = max(x for x in r["cu"][:-1].tolist() if x <= a)
            _, logits = d.propose(r["feats"][s:a], r["pos"][s:a], int(r["tokens"][a]), int(r["pos"][a]),
                                  t.embed_tokens.weight, head)
            assert rel_err((h[a, 1:] @ head.T).float(), logits) < 1e-4, (d.config.sliding_window, a)


def ref_propose(d, ctx_feats, ctx_pos, anchor_token, anchor_pos, embed, head):
    """Independent fp32 reference of one drafting step with per-layer kinds: RoPE tables from transformers'
    Qwen3RotaryEmbedding (the config's rope_scaling), a sliding layer's query at position q sees key p iff
    q - (W-1) <= p <= q (loops), a full layer sees every key."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    c = d.config
    B, nh, nkv, hd, W = c.block_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.sliding_window
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w
    rotary = Qwen3RotaryEmbedding(hf_qwen3_config(c))

    def rope(x, p):
        cos, sin = rotary(x, p[None])
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos[0][:, None] + torch.cat([-x2, x1], -1) * sin[0][:, None]

    bpos = anchor_pos + torch.arange(B)
    kpos = torch.cat([ctx_pos, bpos])
    sees = {FULL: torch.ones(B, len(kpos), dtype=torch.bool),
            SLIDING: torch.tensor([[q - (W - 1) <= p <= q for p in kpos.tolist()] for q in bpos.tolist()])}
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


def test_mixed_layout_propose_matches_reference(mixed):
    t, drafters, r = mixed
    embed, head = t.embed_tokens.weight, t.lm_head.weight
    for d in drafters:
        for a in (14, 20, 40, 50, 51):       # a document start (empty context) and contexts past the window
            s = max(x for x in r["cu"][:-1].tolist() if x <= a)
            args = (r["feats"][s:a], r["pos"][s:a], int(r["tokens"][a]), int(r["pos"][a]), embed, head)
            logits = d.propose(*args)[1]
            assert rel_err(logits, ref_propose(d, *args)) < 1e-4, (d.config.sliding_window, a)
    # the layout matters: the same weights as all full layers, or with plain RoPE, give other logits
    d = drafters[0]
    args = (r["feats"][14:45], r["pos"][14:45], int(r["tokens"][45]), int(r["pos"][45]), embed, head)
    for other in (dict(layer_types=[FULL] * 3), dict(rope_scaling=None)):
        e = Drafter(DrafterConfig(**{**vars(d.config), **other}))
        e.load_state_dict(d.state_dict())
        assert rel_err(e.propose(*args)[1], d.propose(*args)[1]) > 1e-2, other


# -----------------------------------------------------------------------------
# 4. layouts: defaults, the published config in and out (train.py --init-drafter), errors at start

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
LAYOUT_FIELDS = ["layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "rope_scaling",
                 "rope_theta"]
NOT_WRITTEN = {"auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"}  # informational


def test_default_layouts():
    c = DrafterConfig.from_target(TargetConfig.preset("qwen3.6-27b"))
    assert c == config_from_json(PUBLISHED)                  # the published drafter, field for field
    assert DrafterConfig.from_target(TargetConfig.preset("qwen3.6-27b"), sliding_window=0).layer_types == [FULL] * 5
    assert DrafterConfig.from_target(TargetConfig.preset("tiny")).layer_types == [FULL] * 5
    tiny = DrafterConfig.from_target(TargetConfig.preset("tiny"), sliding_window=64, num_hidden_layers=3)
    assert (tiny.layer_types, tiny.sliding_window, tiny.use_sliding_window) == ([SLIDING, SLIDING, FULL], 64, True)
    assert c.windows() == {FULL: 0, SLIDING: 2048} and tiny.windows() == {FULL: 0, SLIDING: 64}


def write_published_tiny(path, rope_scaling, seed=0, **fields):
    """The published config's schema and key set with the tiny target's dimensions, and random weights."""
    t = TargetConfig.preset("tiny")
    cfg = dict(PUBLISHED, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_target_layers=t.num_hidden_layers, vocab_size=t.vocab_size,
               dflash_config={"mask_token_id": 511, "target_layer_ids": [1, 3, 5]}, sliding_window=48,
               max_position_embeddings=t.max_position_embeddings, rope_scaling=rope_scaling)
    cfg.update(fields)
    d = Drafter(config_from_json(cfg))
    torch.manual_seed(seed)
    d.save_pretrained(str(path))                        # the weights, in the format z-lab ships
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f)                                # and the published config file itself
    return cfg


def train_py(out, *flags):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--out", str(out), *flags], cwd=HERE,
                          capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "1"})


def test_published_config_trains_and_exports_unchanged(tmp_path):
    src = tmp_path / "published"
    cfg = write_published_tiny(src, YARN)
    r = train_py(tmp_path / "out", "--init-drafter", str(src), "--max-steps", "2", "--log-interval", "1",
                 "--eval-interval", "1000", "--budget", "128")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "drafter layout: 1 x full_attention + 4 x sliding_attention (window 48)" in r.stdout, r.stdout
    assert "self-check: skipped (CPU" in r.stdout
    with open(tmp_path / "out" / "drafter" / "config.json") as f:
        out = json.load(f)
    for k in LAYOUT_FIELDS:
        assert out[k] == cfg[k], k
    assert set(cfg) - set(out) == NOT_WRITTEN and set(out) - set(cfg) == {"torch_dtype"}
    for k in set(cfg) - NOT_WRITTEN:
        if k != "dflash_config":
            assert out[k] == cfg[k], k
    assert {**out["dflash_config"], "block_size": 16} == {**cfg["dflash_config"], "block_size": 16}
    keys = []
    for p in (src, tmp_path / "out" / "drafter"):
        with safe_open(str(p / "model.safetensors"), "pt") as f:
            keys.append(set(f.keys()))
    assert keys[0] == keys[1]
    # trained (weights moved), and the export loads as the same layout, in transformers too
    a, b = Drafter.from_pretrained(str(src)), Drafter.from_pretrained(str(tmp_path / "out" / "drafter"))
    assert a.config == b.config and any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    from transformers import Qwen3Config
    hf = Qwen3Config.from_pretrained(str(tmp_path / "out" / "drafter"))
    assert hf.layer_types == cfg["layer_types"] and hf.sliding_window == 48
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 4.0


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
    from transformers import Qwen3Config
    base = {k: v for k, v in PUBLISHED.items() if k != "layer_types"}
    for use, first in ((True, 2), (False, 2), (True, 0), (True, 5)):
        cfg = dict(base, use_sliding_window=use, max_window_layers=first, sliding_window=64)
        hf = Qwen3Config(num_hidden_layers=5, use_sliding_window=use, max_window_layers=first, sliding_window=64)
        c = config_from_json(cfg)
        assert c.layer_types == hf.layer_types, (use, first)


BAD = [
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


@pytest.mark.parametrize("fields,msg", BAD, ids=[m.split()[0] for _, m in BAD])
def test_unsupported_field_is_an_error(tmp_path, fields, msg):
    path = tmp_path / "d"
    cfg = write_published_tiny(path, None)
    cfg.update(fields)
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=msg.replace("(", r"\(")):
        Drafter.from_pretrained(str(path))


def test_init_drafter_errors_at_start(tmp_path):
    # train.py: one line, naming the file and the field, before anything runs
    for i, (fields, msg) in enumerate(BAD[:2]):
        path = tmp_path / f"d{i}"
        cfg = write_published_tiny(path, None)
        with open(path / "config.json", "w") as f:
            json.dump({**cfg, **fields}, f)
        r = train_py(tmp_path / f"o{i}", "--init-drafter", str(path), "--max-steps", "1")
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert lines[0].startswith(f"error: --init-drafter {path}: {path / 'config.json'}: ") and msg in lines[0]
    good = tmp_path / "good"
    write_published_tiny(good, None)
    r = train_py(tmp_path / "o3", "--init-drafter", str(good), "--sliding-window", "0")
    assert r.returncode != 0 and "drop --sliding-window" in r.stderr.strip().splitlines()[-1], r.stderr
    r = train_py(tmp_path / "o4", "--sliding-window", "-3")
    assert r.returncode != 0 and r.stderr.strip() == "error: --sliding-window -3: sliding window -3: tokens, or 0 " \
                                                       "for all full attention", r.stderr


# -----------------------------------------------------------------------------
# 5. the start-up self-check: its dense half and comparison on CPU (flex itself only runs on GPU)

def probe_config(**kw):
    return DrafterConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, layer_types=[SLIDING, SLIDING, FULL],
                         sliding_window=2048, rope_scaling=YARN, **kw)


def test_self_check_plumbing():
    dense = lambda d, inputs: d(*inputs)
    loss_err, grad_err, seconds = flex_matches_dense(probe_config(), "cpu", candidate=dense)
    assert loss_err == 0.0 and grad_err == 0.0 and seconds > 0
    rng = torch.get_rng_state()
    # a step that gets the window wrong by one token, or ignores it, fails the check
    def wrong(delta):
        def run(d, inputs):
            c = d.config
            d.config = DrafterConfig(**{**vars(c), "layer_types": [FULL] * 2} if delta is None else
                                     {**vars(c), "sliding_window": c.sliding_window + delta})
            try:
                return d(*inputs)
            finally:
                d.config = c
        return run
    for delta in (1, None):
        loss_err, grad_err, _ = flex_matches_dense(probe_config(), "cpu", candidate=wrong(delta))
        assert grad_err > 1e-3, (delta, loss_err, grad_err)
    assert torch.equal(torch.get_rng_state(), rng)                  # the caller's random stream is untouched


def test_block_lists_per_kind():
    c = probe_config()
    cu, doc, pos = packed_row([300, 212])
    anchors, keep = torch.tensor([5, 100, 299, 300, 450, 0]), torch.tensor([True] * 5 + [False])
    got = block_lists(c, anchors, keep, doc, 512)
    assert set(got) == {FULL, SLIDING}
    for kind, w in ((FULL, 0), (SLIDING, 2048)):
        assert all(torch.equal(a, b) for a, b in zip(got[kind], anchor_blocks(anchors, keep, doc, 512, 16, w)))
