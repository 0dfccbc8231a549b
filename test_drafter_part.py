"""CPU tests of the DFlash drafter in model.py (fp32): the tapped-layer formula and the tap itself, the anchor
mask against a brute-force predicate, train/serve equivalence (masked training forward vs the unmasked
serving `propose`, and `propose` vs an independent reference of dflash.md 1.4), loss weights / labels and the
acceptance proxy on hand-worked rows, the chunked weighted CE, anchor sampling, the z-lab checkpoint format,
and the published Qwen3.6-27B drafter geometry.
Facts: ../shared/reference/dflash.md sections 1.2-1.6, 2.2, 2.3, 3.3-3.6, 4 and ../shared/DESIGN.md."""
import contextlib
import copy
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import model
from model import (Drafter, DrafterConfig, Target, TargetConfig, anchor_mask_mod, default_target_layer_ids,
                   positions_from_cu, rope_cos_sin, sample_anchors)


@contextlib.contextmanager
def single_thread():
    # tiny tensors: intra-op threads only add overhead, and OpenMP spin-waiting on 2 busy cores is very slow
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def one_thread():
    with single_thread():   # module-scoped fixtures below set up before this one runs: they use it too
        yield


def rel_err(a, b):
    a, b = a.float(), b.float()
    assert a.shape == b.shape, f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
    return (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)


def randomize_drafter_(d, seed):
    """Unit-scale random weights (the 0.02 init makes every block nearly the same) and norm weights != 1, so a
    norm that is skipped or applied to the wrong tensor shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in d.named_parameters():
            r = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.3 * r if p.dim() == 1 else r * p.shape[-1] ** -0.5)
    return d


_TINY = {}

def tiny_target():
    # built once per session (deterministic weights), read-only
    if "t" not in _TINY:
        _TINY["t"] = Target.build(TargetConfig.preset("tiny"))
    return _TINY["t"]


def cu_of(lens):
    return torch.tensor([0] + list(lens)).cumsum(0)


def doc_of(cu):
    return torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())


# -----------------------------------------------------------------------------
# 1. default target_layer_ids: the table of dflash.md 1.3

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
    """target.features(ids, cu, [i, ...]) is the OUTPUT of decoder layer i (HF hidden_states[i+1]), concatenated
    in the order asked, per packed document (a tap of layer i-1's output, i.e. hidden_states[i], fails)."""
    t = tiny_target()
    c = t.config
    cu = cu_of([9, 14, 7])
    ids = torch.randint(0, c.vocab_size, (int(cu[-1]),), generator=torch.Generator().manual_seed(0))
    rope = rope_cos_sin(positions_from_cu(cu), int(c.head_dim * c.partial_rotary_factor), c.rope_theta)
    h, outs = t.embed_tokens(ids), []
    with torch.no_grad():
        for layer in t.layers:
            h = layer(h, rope, cu, cu.tolist())
            outs.append(h)
    for taps in ([0, 3, 5], [5, 1], [1, 3, 5]):
        f = t.features(ids, cu, taps)
        assert f.shape == (len(ids), len(taps) * c.hidden_size)
        assert rel_err(f, torch.cat([outs[i] for i in taps], -1)) < 1e-6, taps
    # and the neighbours really differ (so the check above pins the index)
    assert rel_err(outs[2], outs[3]) > 1e-2 and rel_err(t.embed_tokens(ids), outs[0]) > 1e-2


# -----------------------------------------------------------------------------
# 2. the anchor mask: mask_mod on broadcast indices == a brute-force evaluation of the spec (dflash.md 3.5)

def brute_mask(anchors, keep, doc, S, B):
    """Written from the spec with loops: KV = [context (S) | block_0 .. block_{N-1}], Q = the blocks. A query of
    kept block j sees context kv with kv < anchor_j (strict) and doc[kv] == doc[anchor_j], and the B keys of its own
    block; a padded block (keep False) sees nothing."""
    N = len(anchors)
    rows = []
    for q in range(N * B):
        j = q // B
        a = anchors[j]
        row = []
        for kv in range(S + N * B):
            if not keep[j]:
                row.append(False)
            elif kv < S:
                row.append(kv < a and doc[kv] == doc[a])
            else:
                row.append(j * B <= kv - S < (j + 1) * B)
        rows.append(row)
    return torch.tensor(rows)


def random_row(rng, S, n_docs):
    cuts = sorted(rng.sample(range(1, S), n_docs - 1))
    doc = [0] * S
    for c in cuts:
        for i in range(c, S):
            doc[i] += 1
    return doc, [0] + cuts


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
    ref = brute_mask(anchors, keep, doc, S, B)
    assert got.shape == ref.shape and got.dtype == torch.bool
    assert torch.equal(got, ref), f"{(got != ref).sum().item()} cells differ"
    # flex also evaluates padded tiles past Q_LEN / KV_LEN: no out-of-range indexing there
    mm(0, 0, torch.arange(N * B + 2 * B)[:, None], torch.arange(S + N * B + 128)[None, :])


# -----------------------------------------------------------------------------
# 3. train/serve equivalence: the masked training forward == propose() with only the anchor's own past as context

def ref_propose_logits(d, ctx_feats, ctx_pos, anchor_token, anchor_pos, embed, head):
    """Independent fp32 reference of one drafting step (dflash.md 1.1/1.4): c = hidden_norm(fc(feats)) feeds k/v
    of every layer unchanged; per layer pre-norm Qwen3 block, q/k RMSNorm per head, NeoX RoPE (keys at
    [ctx_pos ; block_pos], queries at block_pos), GQA (head i reads kv head i // (nh/nkv)), no mask, SwiGLU;
    final norm; logits of block slots 1..B-1."""
    c = d.config
    B, nh, nkv, hd = c.block_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * w

    def rope(x, p):
        inv = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = (p.double()[:, None] * inv[None]).float()[:, None, :]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    ctx = rms(ctx_feats @ d.fc.weight.T, d.hidden_norm.weight)
    h = embed[torch.tensor([anchor_token] + [c.mask_token_id] * (B - 1))]
    bpos = anchor_pos + torch.arange(B)
    kpos = torch.cat([ctx_pos, bpos])
    for L in d.layers:
        a = L.self_attn
        x = rms(h, L.input_layernorm.weight)
        kvin = torch.cat([ctx, x])
        q = rope(rms((x @ a.q_proj.weight.T).view(B, nh, hd), a.q_norm.weight), bpos)
        k = rope(rms((kvin @ a.k_proj.weight.T).view(-1, nkv, hd), a.k_norm.weight), kpos)
        v = (kvin @ a.v_proj.weight.T).view(-1, nkv, hd)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        p = (torch.einsum("qhd,khd->hqk", q, k) * hd ** -0.5).softmax(-1)
        h = h + torch.einsum("hqk,khd->qhd", p, v).reshape(B, nh * hd) @ a.o_proj.weight.T
        y = rms(h, L.post_attention_layernorm.weight)
        h = h + (F.silu(y @ L.mlp.gate_proj.weight.T) * (y @ L.mlp.up_proj.weight.T)) @ L.mlp.down_proj.weight.T
    return rms(h, d.norm.weight)[1:] @ head.T


class Spy:
    """Wraps _WeightedCE.apply to record the forward's own (h, head, labels, w, chunk)."""
    def __init__(self, monkeypatch, replace=None):
        self.calls, self.orig, self.replace = [], model._WeightedCE.apply, replace
        monkeypatch.setattr(model._WeightedCE, "apply", self)

    def __call__(self, h, head, labels, w, chunk):
        self.calls.append((h.detach().clone(), labels.clone(), w.clone()))
        if self.replace is not None:
            return self.replace(h, head, labels, w, chunk)
        return self.orig(h, head, labels, w, chunk)


@pytest.fixture(scope="module")
def setup3():
    with single_thread():
        yield make_setup3()


def make_setup3():
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
        loss_mask[cu[:-1] + 1] = 1                        # every document start is a valid anchor
        n_valid = int(((loss_mask[1:] > 0) & (doc[1:] == doc[:-1])).sum())
        # full: n > #valid, so every valid anchor (document starts included) is kept and 3 slots are padding
        n = n_valid + 3 if full else 6
        torch.manual_seed(int(S))
        anchors, keep = sample_anchors(loss_mask, doc, n)
        feats = t.features(tokens, cu, cfg.target_layer_ids).clone()
        rows.append(dict(cu=cu, S=S, tokens=tokens, doc=doc, pos=pos, loss_mask=loss_mask, anchors=anchors,
                         keep=keep, feats=feats, full=full))
    return t, d, rows


def train_h(monkeypatch, d, t, r, feats=None):
    spy = Spy(monkeypatch)
    d(r["feats"] if feats is None else feats, r["tokens"], r["loss_mask"], r["doc"], r["pos"], r["anchors"],
      r["keep"], t.embed_tokens.weight, t.lm_head.weight)
    monkeypatch.undo()
    (h, _, _), = spy.calls
    return h.view(len(r["anchors"]), d.config.block_size, -1)


def test_train_serve_equivalence(setup3, monkeypatch):
    t, d, rows = setup3
    embed, head = t.embed_tokens.weight, t.lm_head.weight
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
            tok, logits = d.propose(r["feats"][s:a], r["pos"][s:a], int(r["tokens"][a]), int(r["pos"][a]), embed, head)
            assert logits.shape == (d.config.block_size - 1, t.config.vocab_size)
            assert torch.equal(tok, logits.argmax(-1))
            assert rel_err(train_logits, logits) < 1e-4, (a, s)
    assert n_start >= 5   # anchors at document starts (empty context) were among those compared


def test_propose_matches_reference(setup3):
    t, d, rows = setup3
    embed, head = t.embed_tokens.weight, t.lm_head.weight
    r = rows[0]
    for a in (0, 14, 20, 40, 50):   # document starts (empty context) and mid-document anchors
        s = max(x for x in r["cu"][:-1].tolist() if x <= a)
        args = (r["feats"][s:a], r["pos"][s:a], int(r["tokens"][a]), int(r["pos"][a]), embed, head)
        _, logits = d.propose(*args)
        assert rel_err(logits, ref_propose_logits(d, *args)) < 1e-4, a


def test_training_context_is_strictly_before_anchor(setup3, monkeypatch):
    t, d, rows = setup3
    r = rows[0]
    starts = r["cu"][:-1].tolist()
    h = train_h(monkeypatch, d, t, r)
    g = torch.Generator().manual_seed(5)
    checked = 0
    for j in range(len(r["anchors"])):
        a = int(r["anchors"][j])
        s = max(x for x in starts if x <= a)
        if not r["keep"][j] or a == s or s == 0:
            continue                                      # need a-1 in the same document and an earlier document
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
# 4. loss weights, labels and the acceptance proxy on a hand-worked row (block size 5, gamma 2)

#                  0  1  2  3  4  5  6  7  8  9 10 11 12 13
HAND_DOC = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
HAND_LM = [0, 1, 1, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]
HAND_ANCHORS = [0, 1, 4, 6, 9, 12, 0]
HAND_KEEP = [True] * 6 + [False]
# supervised slots, worked out by hand: slot k of anchor a is supervised iff keep, k >= 1, a+k < S, loss_mask[a+k]
# and doc[a+k] == doc[a]
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
    with single_thread():
        yield make_hand()


def make_hand():
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


def run(d, t, r, gamma=GAMMA, **kw):
    return d(r["feats"], r["tokens"], r["loss_mask"], r["doc"], r["pos"], r["anchors"], r["keep"],
             t.embed_tokens.weight, t.lm_head.weight, gamma=gamma, **kw)


def test_loss_weights_and_labels_by_hand(hand, monkeypatch):
    t, d, r = hand
    spy = Spy(monkeypatch)
    out = run(d, t, r, ce_chunk=7)
    (h, labels, w), = spy.calls
    N, S = len(HAND_ANCHORS), len(HAND_DOC)
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
    ce = F.cross_entropy(h @ t.lm_head.weight.T, labels, reduction="none").view(N, HB)
    ce_ref = F.cross_entropy(h.view(N, HB, -1)[sup] @ t.lm_head.weight.T, exp_lab[sup], reduction="none")
    ref = (exp_w[sup] * ce_ref).sum() / exp_w.sum()
    assert abs(out["loss"].item() - ref.item()) <= 1e-5 * ref.item()
    assert abs(out["loss"].item() - ((exp_w * ce).sum() / exp_w.sum()).item()) <= 1e-5 * ref.item()
    # per-slot counts: slot 0 never supervised
    assert out["slot_count"].tolist() == torch.tensor(HAND_SUP).sum(0).tolist() == [0, 6, 3, 3, 3]
    assert out["blocks"].item() == 6
    # gamma matters (the decay is applied) and the loss is differentiable wrt the drafter
    assert abs(run(d, t, r, gamma=7.0)["loss"].item() - out["loss"].item()) > 1e-4
    d.zero_grad()
    out["loss"].backward()
    assert all(torch.isfinite(p.grad).all() for p in d.parameters()) and d.fc.weight.grad.abs().sum() > 0


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
    N, V = len(HAND_ANCHORS), t.config.vocab_size

    def fake(h, head, labels, w, chunk):
        ok = torch.tensor([[1] + row for row in raw]).view(-1).bool()
        pred = torch.where(ok, labels, (labels + 1) % V)
        return (h.sum() * 0.0).float(), pred

    Spy(monkeypatch, replace=fake)
    out = run(d, t, r)
    assert out["accept_sum"].item() == 3 + 2 + 2 + 1 + 5 + 2
    assert out["blocks"].item() == 6
    assert out["accept_sum"].item() / out["blocks"].item() == pytest.approx(15 / 6)
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
        r["anchors"], r["keep"] = sample_anchors(r["loss_mask"], r["doc"], 4)
        assert not r["keep"].any() and (r["anchors"] == 0).all()
    else:                             # kept anchors, but every slot falls past the row end / unsupervised
        r["loss_mask"] = torch.tensor([1] * 12 + [0, 0])
        r["anchors"], r["keep"] = torch.tensor([11, 13]), torch.tensor([True, True])
    d.zero_grad()
    out = run(d, t, r)
    assert out["loss"].item() == 0.0 and out["slot_count"].sum().item() == 0
    assert out["accept_sum"].item() == (0 if case == "no_anchors" else 2) and out["blocks"].item() == r["keep"].sum()
    out["loss"].backward()
    for n, p in d.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and (p.grad == 0).all(), n


# -----------------------------------------------------------------------------
# 5. the chunked weighted CE == plain autograd over full logits

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
    loss, pred = model._WeightedCE.apply(h, W, y, w, chunk)
    (3.0 * loss).backward()                               # the upstream gradient is honoured
    hr = h0.clone().requires_grad_()
    logits = hr @ W.T
    ref = (w * F.cross_entropy(logits, y, reduction="none")).sum()
    (3.0 * ref).backward()
    assert loss.shape == () and abs(loss.item() - ref.item()) <= 1e-5 * ref.item()
    assert rel_err(h.grad, hr.grad) < 1e-5
    assert (h.grad[w == 0] == 0).all()
    assert torch.equal(pred, logits.argmax(-1)) and not pred.requires_grad


# -----------------------------------------------------------------------------
# 6. anchor sampling

def check_anchors(loss_mask, doc, n, anchors, keep):
    S = loss_mask.shape[0]
    valid = [a for a in range(S - 1) if loss_mask[a + 1] and doc[a + 1] == doc[a]]
    assert anchors.shape == keep.shape == (n,) and anchors.dtype == torch.long and keep.dtype == torch.bool
    m = int(keep.sum())
    assert m == min(n, len(valid))
    assert keep[:m].all() and not keep[m:].any()           # padded slots come last
    assert (anchors[m:] == 0).all()
    kept = anchors[:m].tolist()
    assert kept == sorted(set(kept))                       # sorted, unique
    for a in kept:
        assert a + 1 < S and loss_mask[a + 1] == 1 and doc[a + 1] == doc[a]
    return kept, valid


def test_sample_anchors_invariants():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    for it in range(40):
        S = int(torch.randint(30, 81, (), generator=g))
        cuts = torch.randperm(S - 1, generator=g)[: int(torch.randint(0, 5, (), generator=g))] + 1
        doc = torch.zeros(S, dtype=torch.long)
        for c in cuts.tolist():
            doc[c:] += 1
        loss_mask = (torch.rand(S, generator=g) < [0.5, 0.1, 0.9, 0.0][it % 4]).long()
        for n in (1, 8, S - 1):
            anchors, keep = sample_anchors(loss_mask, doc, n)
            kept, valid = check_anchors(loss_mask, doc, n, anchors, keep)
            if n >= len(valid):
                assert kept == valid                      # fewer valid than n: all of them, exactly


def test_sample_anchors_uniform():
    #            0  1  2  3  4  5  6  7  8  9 10 11 12 13 14 15 16 17 18 19
    loss_mask = torch.tensor([0, 1, 1, 0, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1])
    doc = torch.tensor([0] * 9 + [1] * 7 + [2] * 4)         # pos 8 -> 9 and 15 -> 16 cross a document boundary
    valid = [0, 1, 3, 4, 5, 9, 10, 12, 16, 18]
    n, draws = 3, 2000
    torch.manual_seed(1)
    counts = torch.zeros(20)
    for _ in range(draws):
        anchors, keep = sample_anchors(loss_mask, doc, n)
        assert keep.all()
        counts[anchors] += 1
    assert torch.nonzero(counts).view(-1).tolist() == valid
    expected = draws * n / len(valid)                        # 600; binomial sd ~ 20
    assert ((counts[valid] - expected).abs() < 0.15 * expected).all(), counts[valid]


# -----------------------------------------------------------------------------
# 7. save/load in the z-lab format (dflash.md 2.2, 2.3)

def test_save_load_roundtrip_and_format(tmp_path, setup3):
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
    _, _, rows = setup3
    r = rows[0]
    embed, head = t.embed_tokens.weight, t.lm_head.weight
    args = (r["feats"][14:20], r["pos"][14:20], int(r["tokens"][20]), int(r["pos"][20]), embed, head)
    assert torch.equal(loaded.propose(*args)[1], ref.propose(*args)[1])
    fwd = lambda m: m(r["feats"], r["tokens"], r["loss_mask"], r["doc"], r["pos"], r["anchors"], r["keep"], embed, head)
    assert torch.equal(fwd(loaded)["loss"], fwd(ref)["loss"])

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
# 8. the published Qwen3.6-27B drafter geometry (dflash.md 1.2, 5)

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
