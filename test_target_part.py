"""CPU tests of the Qwen3.5/3.6 hybrid target in model.py (fp32): the torch gated delta rule, packing,
checkpoint layouts and loader errors, the 27B geometry, and a layer-by-layer match against Hugging Face
transformers' own Qwen3.5 implementation (its pure-torch fallback path, no fla / causal_conv1d).
Facts: ../shared/reference/target.md sections 1-6 and 9."""
import importlib
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from model import Target, TargetConfig, positions_from_cu, torch_chunk_gated_delta_rule

LIN, FULL = "linear_attention", "full_attention"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # these models are tiny: intra-op threads only add overhead, and on a 2-core box shared with another busy
    # process OpenMP spin-waiting made this file ~10x slower (65 s vs 7 s measured)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_rel(actual, expected, tol=1e-4, what=""):
    # max abs error relative to the reference's largest magnitude
    actual, expected = actual.float(), expected.float()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    err, scale = (actual - expected).abs().max().item(), expected.abs().max().item()
    assert err <= tol * max(scale, 1e-6), f"{what}: max abs err {err:.3g} vs scale {scale:.3g} (rel tol {tol})"


def cu_of(lens):
    return torch.tensor([0] + list(lens)).cumsum(0)


def randomize_(model, seed):
    """Random values for every tensor of one of our models, norms included (1-D zero-centred norm weights get
    small offsets, so a loader or forward that mixes up w and 1+w shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 2.5 - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(r)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.3 * r)
            elif p.dim() == 1:
                p.copy_(0.3 * r)
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * r)
            else:
                p.copy_(r * p.shape[-1] ** -0.5)
    return model


# -----------------------------------------------------------------------------
# 1. the chunked torch gated delta rule against the per-token recurrence

def recurrent_delta_rule(q, k, v, g, beta):
    # S <- exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S <- S + k_t u^T;  o_t = S^T q_t   (fp64, per v-head)
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


@pytest.mark.parametrize("T,chunk,g_max", [(150, 64, 2.3), (1, 64, 2.3), (64, 64, 2.3), (77, 16, 2.3), (100, 64, 30.0)])
def test_chunk_delta_rule_matches_recurrence(T, chunk, g_max):
    gen = torch.Generator().manual_seed(T)
    HV, K, V = 3, 16, 8
    q = F.normalize(torch.randn(T, HV, K, generator=gen), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(T, HV, K, generator=gen), dim=-1)
    v = torch.randn(T, HV, V, generator=gen)
    # per-step decays from ~1 (long memory, so state crosses chunk boundaries) to exp(-g_max); g_max 30 makes
    # the in-chunk cumulative decay underflow exp() in fp32, which must give zeros, not inf/nan
    g = -torch.rand(T, HV, generator=gen) ** 3 * g_max
    beta = torch.rand(T, HV, generator=gen)
    o = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk=chunk)
    assert o.shape == (T, HV, V) and o.dtype == torch.float32
    ref = recurrent_delta_rule(q, k, v, g, beta)
    assert torch.isfinite(o).all()
    # with g_max 30 the in-chunk log-decay cumsum reaches ~-560, where fp32 keeps ~5e-5 relative precision of the
    # pairwise differences exp(gc_i - gc_j) (HF's torch_chunk_gated_delta_rule has the same 5e-5 error here)
    assert_rel(o, ref, 2e-5 if g_max < 10 else 2e-4, "chunk vs recurrent")
    if T > chunk and g_max < 10:   # the state carried into later chunks matters here (a reset per chunk would fail)
        assert (recurrent_delta_rule(q[chunk:], k[chunk:], v[chunk:], g[chunk:], beta[chunk:]) - ref[chunk:]).abs().max() > 1e-2


# -----------------------------------------------------------------------------
# 2. packing: a row of three documents equals the documents run alone

def test_positions_from_cu():
    assert positions_from_cu(cu_of([3, 1, 4])).tolist() == [0, 1, 2, 0, 0, 1, 2, 3]


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
    assert feats.shape == (sum(lens), len(layers) * cfg.hidden_size) and logits.shape == (sum(lens), cfg.vocab_size)
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = torch.tensor([0, e - s])
        assert_rel(feats[s:e], target.features(docs[d], one, layers), 3e-5, f"doc {d} features")
        assert_rel(logits[s:e], target.logits(docs[d], one), 3e-5, f"doc {d} logits")
    # the check has teeth: without the boundaries the later documents come out different
    joined = target.features(ids, torch.tensor([0, sum(lens)]), layers)
    assert (joined[lens[0]:] - feats[lens[0]:]).abs().max() > 1e-2


# -----------------------------------------------------------------------------
# 3. checkpoint layouts (official multimodal, sharded; text-only, single file), n_layers, head

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
    """Qwen3_5ForConditionalGeneration layout: model.language_model.* + lm_head.weight, plus vision and MTP
    tensors the loader must skip, sharded with an index."""
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
    tensors = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): t.contiguous() for n, t in sd.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["Qwen3_5ForCausalLM"], **text_config_json(cfg, flat_rope)}, f)


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
    assert h.embed_tokens.weight.dtype == torch.bfloat16 and h.layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.bfloat16
    assert h.layers[0].linear_attn.A_log.dtype == torch.float32 and h.layers[0].linear_attn.dt_bias.dtype == torch.float32
    assert torch.equal(h.layers[0].linear_attn.A_log, c["sd"]["layers.0.linear_attn.A_log"])


@pytest.mark.parametrize("layout", ["official", "text"])
def test_partial_builds(small_ckpts, layout):
    c = small_ckpts
    path = str(c["root"] / layout)
    full = Target.from_pretrained(path, dtype=torch.float32)
    taps = [1, 3]
    # target rank: layers up to the last tapped one, no head
    part = Target.from_pretrained(path, dtype=torch.float32, n_layers=max(taps) + 1, head=False)
    assert len(part.layers) == max(taps) + 1 and part.lm_head is None and part.norm is None
    assert all(not n.startswith(("layers.4.", "layers.5.", "norm.", "lm_head.")) for n, _ in part.named_parameters())
    torch.testing.assert_close(part.features(c["ids"], c["cu"], taps), full.features(c["ids"], c["cu"], taps),
                               rtol=0, atol=0)
    with pytest.raises(AssertionError):
        part.features(c["ids"], c["cu"], [4])
    # drafter rank: embed_tokens + lm_head only
    head = Target.from_pretrained(path, dtype=torch.float32, n_layers=0, head=True)
    assert len(head.layers) == 0 and head.norm is None
    assert {n for n, _ in head.named_parameters()} == {"embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(head.embed_tokens.weight, full.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, full.lm_head.weight)
    assert not torch.equal(head.lm_head.weight, head.embed_tokens.weight)


def test_tied_embeddings_text_only(tmp_path):
    cfg = TargetConfig(**{**SMALL, "num_hidden_layers": 2, "layer_types": [LIN, FULL], "tie_word_embeddings": True})
    src = randomize_(Target.build(cfg, dtype=torch.float32), 4)
    sd = {n: p.detach().clone() for n, p in src.state_dict().items() if n != "lm_head.weight"}
    write_text_only(str(tmp_path), cfg, sd, flat_rope=False)
    t = Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert torch.equal(t.lm_head.weight, sd["embed_tokens.weight"])
    ids, cu = torch.randint(0, cfg.vocab_size, (20,)), cu_of([20])
    ref = F.linear(src.norm(src.features(ids, cu, [1])), sd["embed_tokens.weight"])
    torch.testing.assert_close(t.logits(ids, cu), ref, rtol=0, atol=1e-5)


def test_config_layer_types_from_interval(tmp_path):
    cfg = TargetConfig(**SMALL)
    t = text_config_json(cfg)
    del t["layer_types"]
    t.update(num_hidden_layers=8, full_attention_interval=4)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": t}, f)
    got = TargetConfig.from_hf(str(tmp_path))
    assert got.layer_types == [LIN, LIN, LIN, FULL] * 2
    assert (got.rope_theta, got.partial_rotary_factor) == (1000.0, 0.5)


# -----------------------------------------------------------------------------
# 5. bad checkpoints raise the promised errors

def test_missing_tensor_in_index(small_ckpts, tmp_path):
    c = small_ckpts
    sd = dict(c["sd"])
    del sd["layers.2.linear_attn.in_proj_b.weight"]
    write_official(str(tmp_path), c["cfg"], sd)
    with pytest.raises(KeyError) as e:
        Target.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert "model.language_model.layers.2.linear_attn.in_proj_b.weight" in str(e.value) and str(tmp_path) in str(e.value)
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
                                             ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")])
def test_unsupported_model_type(small_ckpts, tmp_path, arch, model_type):
    c = small_ckpts
    write_text_only(str(tmp_path), c["cfg"], c["sd"])
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    cfg.update(architectures=[arch], model_type=model_type)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(cfg, f)
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
# 6. the 27B geometry and parameter count

def test_qwen36_27b_preset():
    c = TargetConfig.preset("qwen3.6-27b")
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (64, 5120, 17408, 248320)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 4, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim) == (16, 48, 128, 128)
    assert c.linear_conv_kernel_dim == 4 and c.rms_norm_eps == 1e-6 and c.rope_theta == 1e7
    assert c.partial_rotary_factor == 0.25 and c.tie_word_embeddings is False
    assert [i for i, t in enumerate(c.layer_types) if t == FULL] == list(range(3, 64, 4))
    assert all(t == LIN for i, t in enumerate(c.layer_types) if i % 4 != 3)
    with torch.device("meta"):
        m = Target(c)
    assert sum(p.numel() for p in m.parameters()) == 26_895_998_464
    assert len(m.state_dict()) == 851       # 48*14 + 16*11 + embed, norm, lm_head (target.md section 2)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["layers.0.linear_attn.in_proj_qkv.weight"] == (10240, 5120)
    assert shapes["layers.0.linear_attn.conv1d.weight"] == (10240, 1, 4)
    assert shapes["layers.0.linear_attn.A_log"] == (48,) and shapes["layers.0.linear_attn.norm.weight"] == (128,)
    assert shapes["layers.3.self_attn.q_proj.weight"] == (12288, 5120)
    assert shapes["layers.3.self_attn.k_proj.weight"] == (1024, 5120)
    assert shapes["layers.3.self_attn.o_proj.weight"] == (5120, 6144)
    assert shapes["lm_head.weight"] == (248320, 5120)


# -----------------------------------------------------------------------------
# 4. match Hugging Face transformers' Qwen3.5 (torch fallback path on CPU)

def hf_qwen3_5():
    """transformers' Qwen3.5 modeling module, imported with fla and causal_conv1d hidden: it binds those kernels
    at import time when they are installed, and their Triton kernels cannot run on CPU tensors."""
    name = "transformers.models.qwen3_5.modeling_qwen3_5"
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


def hf_model(partial_rotary_factor, seed):
    hf = hf_qwen3_5()
    Qwen3_5ForCausalLM, Qwen3_5TextConfig = hf.Qwen3_5ForCausalLM, hf.Qwen3_5TextConfig
    rot = int(32 * partial_rotary_factor) // 2
    cfg = Qwen3_5TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,   # layers 0-2 GDN, 3 attention
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=partial_rotary_factor,
                             mrope_section=[rot - 2 * (rot // 3), rot // 3, rot // 3], mrope_interleaved=True),
        attn_implementation="eager")
    assert cfg.layer_types == [LIN, LIN, LIN, FULL]
    torch.manual_seed(seed)
    m = Qwen3_5ForCausalLM(cfg).eval()
    assert m.config._attn_implementation == "eager"
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 1.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("linear_attn.norm.weight"):   # plain-weight gated norm (init ones)
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif p.dim() == 1:                                # zero-centred norms (init zeros): exercise 1 + w
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith("conv1d.weight"):
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return m


def hf_run(m, ids):
    """HF forward of one document -> (outputs of every decoder layer, logits). hidden_states[i+1] is layer i's
    output except the last entry, which this transformers version returns after the final norm; forward hooks
    give every layer's raw output."""
    raw, hooks = [], [layer.register_forward_hook(lambda mod, args, out: raw.append(out[0] if isinstance(out, tuple) else out))
                      for layer in m.model.layers]
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
    from safetensors import safe_open
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    keys = set()
    for file in files:
        with safe_open(os.path.join(path, file), "pt") as f:
            keys |= set(f.keys())
    assert "lm_head.weight" in keys and "model.embed_tokens.weight" in keys
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in keys and "model.layers.3.self_attn.q_norm.weight" in keys
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
        assert_rel(ours.features(ids, cu, [i]), hs[i], 1e-4, f"layer {i}")
    assert_rel(ours.features(ids, cu, [0, 1, 2, 3]), torch.cat(hs, -1), 1e-4, "all layers")
    assert_rel(ours.logits(ids, cu), logits, 1e-4, "logits")


def test_matches_hf_packed_documents(hf_pair):
    m, ours = hf_pair
    gen = torch.Generator().manual_seed(7)
    lens = [45, 100, 30]
    docs = [torch.randint(0, 300, (n,), generator=gen) for n in lens]
    ids, cu = torch.cat(docs), cu_of(lens)
    feats, logits = ours.features(ids, cu, [0, 1, 2, 3]), ours.logits(ids, cu)
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        hs, ref_logits = hf_run(m, docs[d])
        assert_rel(feats[s:e], torch.cat(hs, -1), 1e-4, f"doc {d} hidden states")
        assert_rel(logits[s:e], ref_logits, 1e-4, f"doc {d} logits")


def test_matches_hf_small_qk_norms(tmp_path):
    # GDN q/k vectors of tiny norm: HF and FLA l2-normalise as x / sqrt(|x|^2 + 1e-6), which is not a unit
    # vector there (F.normalize's x / max(|x|, eps) would be)
    m = hf_model(0.25, seed=8)
    with torch.no_grad():
        m.model.layers[1].linear_attn.in_proj_qkv.weight[:64] *= 1e-4     # q and k rows (2 * 2 heads * 16)
    ours = save_hf(m, str(tmp_path))
    ids = torch.randint(0, 300, (80,), generator=torch.Generator().manual_seed(9))
    hs, logits = hf_run(m, ids)
    assert_rel(ours.features(ids, cu_of([80]), [1]), hs[1], 1e-4, "layer 1")
    assert_rel(ours.logits(ids, cu_of([80])), logits, 1e-4, "logits")
