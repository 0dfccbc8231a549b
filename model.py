"""
The DFlash drafter and its training objective (Chen et al., "DFlash: Block Diffusion for Flash
Speculative Decoding", arXiv:2602.06036), in reading order:
  1) anchor sampling: which positions of a packed row start a draft block this step
  2) THE anchor mask_mod: which keys each block query may see (one definition for every path),
     and the same mask as flex_attention BlockMask lists, in closed form
  3) the loss: weighted CE (or distill.py's objective) through the target's frozen LM head, chunked
  4) the drafter: Qwen3 layers over a block [anchor, mask x (B-1)] whose keys/values also see the
     target's fused hidden states; its training forward, the serving-side `propose`, FLOPs
  5) export: save/load in the z-lab format that SGLang, vLLM and z-lab/dflash load
  6) the drafter step: one packed row's anchors, forward and loss (train.py compiles it)
Notation: S context tokens in a packed row, N anchors (draft blocks) per row, B tokens per block.
"""
import functools
import json
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from layers import MLP, Attention, RMSNorm, apply_rope, check_rope, rope_cos_sin, rope_type

# -----------------------------------------------------------------------------
# 1) anchors

def sample_anchors(loss_mask, doc, anchors_per_doc, row_anchors):
    """The anchors of one packed row as the DFlash recipe samples them (paper sec. 4.2): in every
    document, min(anchors_per_doc, eligible) positions uniformly without replacement, a eligible
    iff loss_mask[a] = loss_mask[a+1] = 1 in one document (a served token whose next token is
    supervised); past its `row_anchors` slots a row keeps the lowest-ranked draws of every document
    (max-min fair). Sorted (keeps flex tiles sparse), on device, no host sync. Returns anchors
    [row_anchors] (0 in padded slots), keep [row_anchors] bool and the number wanted before the
    slots cut (0-d)."""
    S, dev = loss_mask.shape[0], loss_mask.device
    supervised = loss_mask > 0
    eligible = supervised[:-1] & supervised[1:] & (doc[:-1] == doc[1:])       # [S-1]
    key = torch.rand(S - 1, device=dev, dtype=torch.float64)
    # group the eligible positions by document, in random order within each; the rest sort last
    order = torch.argsort(torch.where(eligible, doc[:-1] + key, float("inf")))
    sorted_doc, i = doc[:-1][order], torch.arange(S - 1, device=dev)
    group_start = F.pad(sorted_doc[1:] != sorted_doc[:-1], (1, 0), value=True)
    first = torch.where(group_start, i, 0).cummax(0).values
    rank = torch.empty_like(i)
    rank[order] = i - first                                  # draw order within the document
    wanted = eligible & (rank < anchors_per_doc)
    score = torch.where(wanted, rank + key, float("inf"))    # the slots: lowest ranks first
    score = F.pad(score, (0, max(0, row_anchors - (S - 1))), value=float("inf"))  # > S - 1 slots
    picked = score.topk(row_anchors, largest=False).indices
    anchors = torch.where(score[picked] < float("inf"), picked, S).sort().values   # padded: last
    keep = anchors < S
    return torch.where(keep, anchors, 0), keep, wanted.sum()

# -----------------------------------------------------------------------------
# 2) the mask

def anchor_mask_mod(anchors, keep, doc, S, B, window=0):
    """THE training mask as a flex_attention mask_mod. KV = [context (S) | block_0 .. block_{N-1}],
    Q = the blocks. A query of block j sees context kv < anchor_j in the anchor's document
    (strictly before: the anchor's own hidden state does not exist yet at serving time), plus all
    B keys of its own block in both directions. Padded slots (keep False) see nothing. Indices are
    clamped: flex also evaluates padded tiles. Per-step values are device tensors: no recompile.
    window > 0 (a sliding layer), as SGLang, vLLM and SpecForge serve and train it: the query at
    anchor+k sees context from anchor+k-(window-1) and block slots k-(window-1)..k (causal)."""
    N = anchors.shape[0]
    # int32, as flex's q_idx/kv_idx: int64 arithmetic on every tile element slows the backward
    anchors, doc = anchors.int(), doc.int()
    def mask_mod(b, h, q_idx, kv_idx):
        j = (q_idx // B).clamp(max=N - 1)
        a = anchors[j]
        context = (kv_idx < a) & (doc[kv_idx.clamp(max=S - 1)] == doc[a])
        own_block = (kv_idx >= S) & ((kv_idx - S) // B == j)
        if window:
            k, slot = q_idx % B, (kv_idx - S) % B     # the query at row a+k, a block key at a+slot
            context = context & (kv_idx > a + k - window)
            own_block = own_block & (slot <= k)
            if window < B:                            # (else k - slot < B <= window always)
                own_block = own_block & (k - slot < window)
        return (context | own_block) & keep[j]
    return mask_mod

TILE = 128      # the BlockMask tile (queries x keys)

def anchor_blocks(anchors, keep, doc, S, B, window=0):
    """The BlockMask lists of anchor_mask_mod in closed form, sort-free on the device: (kv_num,
    kv_idx, full_kv_num, full_kv_idx, q_num, q_idx, full_q_num, full_q_idx) exactly as
    create_block_mask returns them, minus its argsort (a Triton sort compiling for minutes,
    pytorch/pytorch#182060). Each document one run of `doc` (as packed), a query row of anchor j
    sees one interval of context, [start of a_j's document, a_j), and one of its own block."""
    N, dev = anchors.shape[0], anchors.device
    new_doc = F.pad(doc[1:] != doc[:-1], (1, 0), value=True)
    doc_start = torch.where(new_doc, torch.arange(S, device=dev), 0).cummax(0).values  # [S]
    r = torch.arange(-(-N * B // TILE) * TILE, device=dev)[:, None]     # (tile-padded) query rows
    j, k = r // B, r % B                                                 # their anchor, block slot
    real = j < N
    j = j.clamp(max=N - 1)
    a, kept = anchors[j], keep[j]
    lo, hi = doc_start[a], a                                             # context [lo, hi)
    blo, bhi = S + B * j, S + B * j + B                                  # own block [blo, bhi)
    if window:
        lo = lo.maximum(a + k - (window - 1))
        blo, bhi = blo + (k - (window - 1)).clamp(min=0), blo + k + 1
    k0 = torch.arange(0, S + N * B, TILE, device=dev)[None, :]           # first key of each kv tile
    k1 = k0 + TILE
    sees_context = lo.maximum(k0) < hi.minimum(k1)
    sees_block = blo.maximum(k0) < bhi.minimum(k1)
    hit = kept & real & (sees_context | sees_block)
    # a tile is [k0, ctx_end) context, [blk_start, k1) blocks
    ctx_end, blk_start = k1.clamp(max=S), k0.clamp(min=S)
    context_full = (k0 >= ctx_end) | ((lo <= k0) & (ctx_end <= hi))
    block_full = (blk_start >= k1) | ((blo <= blk_start) & (k1 <= bhi))
    full = kept & real & context_full & block_full
    R = hit.shape[0] // TILE
    hit = hit.view(R, TILE, -1).any(1)                                   # [q tiles, kv tiles]
    full = full.view(R, TILE, -1).all(1)
    partial = hit & ~full
    # as flex's own: block count per row, indices of the set blocks first, ascending, then the
    # rest; placed by running counts (a sort in a compiled graph compiles for minutes)
    def ordered(dense):
        d = dense.to(torch.int32)
        count = d.sum(-1, dtype=torch.int32)
        slot = torch.where(dense, d.cumsum(-1), count[:, None] + (1 - d).cumsum(-1)) - 1
        at = torch.arange(d.shape[-1], device=dev, dtype=torch.int32).expand_as(d)
        # flex reads the index lists row-major: contiguous (a transpose's are not)
        idx = torch.empty(d.shape, dtype=torch.int32, device=dev)
        return count[None, None], idx.scatter_(-1, slot.long(), at)[None, None]
    return (*ordered(partial), *ordered(full), *ordered(partial.t()), *ordered(full.t()))

# -----------------------------------------------------------------------------
# 3) the loss

def dpace_weights(q, valid, alpha):
    """D-PACE's position weights (arXiv 2605.18810; SpecForge's _dpace_weight) for blocks [..., B]:
    q the drafter's probability of each slot's label, smoothed q' = (1 - alpha) q + alpha (1 at
    invalid slots); weight_k = sum over valid j >= k of prod_{i <= j} q'_i, the expected accepted
    length from slot k on; zero at invalid slots. Detached by the caller."""
    smooth = torch.where(valid, (1 - alpha) * q + alpha, torch.ones_like(q))
    prefix = smooth.cumprod(-1) * valid
    return prefix.flip(-1).cumsum(-1).flip(-1) * valid

def ce_terms(z, y):   # logits z [n, V] (fp32), labels y [n, 1] -> CE, d CE/dz, label probability
    ce = (lse := z.logsumexp(-1)) - z.gather(1, y)[:, 0]
    dz = (z - lse[:, None]).exp().scatter_add(1, y, torch.full_like(y, -1, dtype=z.dtype))
    return ce, dz, (-ce).exp()

class _WeightedCE(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T, y_i) over the frozen LM head W in chunks of rows (the [N*B, vocab]
    logits never exist at once), the gradient wrt h made in the forward (no second logits GEMM in
    the backward). dpace=alpha: w is the 0/1 supervision, each block's weights dpace_weights of the
    slots' acceptances (chunks of whole blocks of B rows), constants. obj (distill.Objective): its
    objective vs the target's logits t_h @ W^T (t_h [rows, H]), made in the same chunks. top
    (DFlash2's candidates): each row's top-k logits, its label's, their ids (obj: + p there)."""
    @staticmethod
    def forward(ctx, h, weight, labels, w, chunk, B=None, dpace=None, top=None, t_h=None, obj=None):
        loss, pred, acc, grads, tops = h.new_zeros((), dtype=torch.float32), [], [], [], []
        for s in range(0, h.shape[0], chunk):
            x = h[s:s + chunk]
            if s:
                # one chunk after another: without a data dependency on the last chunk's result
                # torch.compile fuses the chunks' kernels into one, which holds every chunk's logits
                # at once. g - g is 0 (NaN only if the step already is); the compiler folds g * 0.
                g = (grads[-1] if grads else loss.view(1, 1))[:1, :1]
                x = x + (g - g).to(x.dtype)
            logits = (raw := x @ weight.t()).float()    # DFlash2's top-k reads raw: half the bytes
            y, w_chunk = labels[s:s + chunk, None], w[s:s + chunk]
            ce, dz, a, *p = (ce_terms(logits, y) if obj is None   # a: the label's p, obj's min sum
                             else obj.terms(logits, (t_h[s:s + chunk] @ weight.t()).float(), y))
            if dpace is not None:
                w_chunk = dpace_weights(a.view(-1, B), w_chunk.view(-1, B) > 0, dpace).view(-1)
            loss = loss + (w_chunk * ce.masked_fill(w_chunk == 0, 0.0)).sum()   # no NaN * 0
            pred.append(logits.argmax(-1))
            acc.append(a)
            tops += [_top(top, raw, logits.gather(1, y), *p)] if top is not None else []
            if ctx.needs_input_grad[0]:
                grads.append((dz * w_chunk[:, None]).to(weight.dtype) @ weight)
        out = (torch.cat(pred), torch.cat(acc), *(torch.cat(t) for t in zip(*tops)))
        ctx.mark_non_differentiable(*out)
        ctx.save_for_backward(torch.cat(grads) if grads else h.new_zeros(0))
        return loss, *out

    @staticmethod
    def backward(ctx, g_loss, *_):
        (dh,) = ctx.saved_tensors
        return (dh * g_loss).to(dh.dtype), *[None] * 9

def _top(top, logits, gold, p=None):   # DFlash2's: (top-k logits, the gold one), ids (, p there)
    v, i = top(logits)
    return (torch.cat([v, gold], 1), i) + (() if p is None else (p.gather(1, i),))

def plain_ce(h, weight, labels, w, B, dpace=None, top=None, t_h=None, obj=None):
    """_WeightedCE's value as plain autograd over full-vocab logits [rows, vocab] at once: the
    reference, and where to prototype another loss (ce_chunk=0; train.py --plain-loss)."""
    logits = (h @ weight.t()).float()
    ce = F.cross_entropy(logits, labels, reduction="none")     # a: the label's probability
    ce, a, *p = (obj.plain(logits, (t_h @ weight.t()).float(), labels[:, None]) if obj
                 else (ce, (-ce.detach()).exp()))
    if dpace is not None:
        w = dpace_weights(a.view(-1, B), w.view(-1, B) > 0, dpace).view(-1)
    top = () if top is None else _top(top, x := logits.detach(), x.gather(1, labels[:, None]), *p)
    return (w * ce.masked_fill(w == 0, 0.0)).sum(), logits.argmax(-1), a, *top

# -----------------------------------------------------------------------------
# 4) the drafter

def default_target_layer_ids(n_target_layers, n_feat):
    # z-lab/SpecForge/SGLang: evenly spaced from layer 1 to L-3, e.g. [1,16,31,46,61] for 64 layers
    if n_feat == 1:
        return [n_target_layers // 2]
    return [int(round(1 + i * (n_target_layers - 4) / (n_feat - 1))) for i in range(n_feat)]

FULL, SLIDING = "full_attention", "sliding_attention"   # the HF layer_types a drafter has

# z-lab's published drafters by target (layers, hidden size, routed experts), read by from_target
PUBLISHED_DRAFTERS = {
    # z-lab/Qwen3.6-27B-DFlash (and Qwen3.5-27B): 4 x sliding 2048 + 1 full, taps [1,16,31,46,61]
    (64, 5120, 0): dict(n_feat=5, num_hidden_layers=5, sliding_window=2048, mask_token_id=248070),
    # z-lab/Qwen3.5-35B-A3B-DFlash and Qwen3.6-35B-A3B-DFlash (June 2026): 5 x sliding 4096 + 1 full
    (40, 2048, 256): dict(n_feat=8, num_hidden_layers=6, sliding_window=4096, mask_token_id=248077,
                          intermediate_size=6144),
}

@dataclass
class DrafterConfig:
    hidden_size: int = 5120             # equals the target's (block embeddings are the target's)
    intermediate_size: int = 17408      # SwiGLU width (z-lab uses the target's)
    num_hidden_layers: int = 5          # drafter decoder layers
    num_attention_heads: int = 32       # Qwen3-style attention, independent of the target's
    num_key_value_heads: int = 8
    head_dim: int = 128
    target_layer_ids: list = field(default_factory=lambda: [1, 16, 31, 46, 61])  # tapped layers
    num_target_layers: int = 64         # engines range-check target_layer_ids against it
    block_size: int = 16                # anchor + 15 drafted tokens
    mask_token_id: int = 248070         # the target's embedding row used for the 15 masked slots
    vocab_size: int = 248320            # the target's (embedding and LM head are borrowed)
    rope_theta: float = 1e7             # the target's
    max_position_embeddings: int = 262144
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False   # copied from the target (informational)
    layer_types: list = None            # per layer FULL or SLIDING (None: all FULL)
    sliding_window: int = None          # tokens a SLIDING query sees, itself included (HF meaning)
    use_sliding_window: bool = None     # HF Qwen3Config's switch (None: True iff a layer slides)
    max_window_layers: int = None       # HF Qwen3Config field; only exported
    rope_scaling: dict = None           # None (plain RoPE) or {"rope_type": "linear"/"yarn", ...}
    conv_kernel_size: int = 0           # > 0: DFlash2 (dflash2.py), the conv's taps; 0: DFlash
    conv_group_size: int = 16           # DFlash2: channels per dynamic kernel group
    selector_rank: int = 256            # DFlash2: the candidate selector's codebook rank
    selector_top_k: int = 16            # DFlash2: candidates per block slot

    def __post_init__(self):
        L = self.num_hidden_layers
        self.layer_types = list(self.layer_types or [FULL] * L)
        slides = SLIDING in self.layer_types
        if self.use_sliding_window is None:
            self.use_sliding_window = slides
        self.max_window_layers = L if self.max_window_layers is None else self.max_window_layers
        bad = [t for t in self.layer_types if t not in (FULL, SLIDING)]
        for ok, msg in [
                (len(self.layer_types) == L,
                 f"layer_types has {len(self.layer_types)} entries for {L} layers"),
                (not bad, f"layer_types: {bad[0] if bad else ''!r} is not supported ({FULL} or "
                 f"{SLIDING})"),
                (not slides or (type(self.sliding_window) is int and self.sliding_window > 0),
                 f"sliding_window {self.sliding_window!r}: sliding layers need a positive window "
                 "(tokens)"),
                (not slides or self.use_sliding_window, "use_sliding_window is false but "
                 "layer_types has sliding layers (HF then drops sliding_window)")]:
            if not ok:
                raise ValueError(msg)
        def fail(field, value, why):
            raise ValueError(f"rope_scaling: {field} {value!r} is not supported ({why})")
        check_rope(self.rope_scaling, fail)

    def windows(self):
        # {layer kind: window} of the kinds present (0: full attention): the masks a step builds
        return {t: self.sliding_window if t == SLIDING else 0
                for t in sorted(set(self.layer_types))}

    @classmethod
    def from_target(cls, t, n_feat=None, sliding_window=None, **overrides):
        """Defaults: z-lab's published drafter for the target's geometry, else 3 taps under 16
        target layers (5 from 16 up) and 5 full-attention layers. sliding_window: tokens per
        sliding layer, all layers but the last sliding as published; 0: all full attention."""
        pub = PUBLISHED_DRAFTERS.get((t.num_hidden_layers, t.hidden_size, t.num_experts), {})
        n_feat = n_feat or pub.get("n_feat", 3 if t.num_hidden_layers < 16 else 5)
        # attention: published 32 x 128 (8 kv) from 1024 wide, heads of 64 (kv 2) below, 4 x 16
        # under 256 (the CPU demo: 16-dim heads on a 384-wide target learn ~nothing, RESULTS.md)
        if t.hidden_size >= 1024:
            heads, kv_heads, head_dim = 32, 8, 128
        elif t.hidden_size >= 256:
            heads, head_dim = t.hidden_size // 64, 64
            kv_heads = 2 if heads % 2 == 0 else 1
        else:
            heads, kv_heads, head_dim = 4, 2, 16
        known_mask = {248320: 248070, 151936: 151669}   # z-lab's mask ids for Qwen3.5/3.6, Qwen3
        dense_width = 3 * t.hidden_size if t.num_experts else t.intermediate_size  # MoE: no SwiGLU
        kw = dict({k: getattr(t, k) for k in ("hidden_size", "vocab_size", "rope_theta",
                                              "max_position_embeddings", "rms_norm_eps",
                                              "tie_word_embeddings")},
                  intermediate_size=pub.get("intermediate_size", dense_width),
                  num_hidden_layers=pub.get("num_hidden_layers", cls.num_hidden_layers),
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  target_layer_ids=default_target_layer_ids(t.num_hidden_layers, n_feat),
                  num_target_layers=t.num_hidden_layers,
                  mask_token_id=pub.get("mask_token_id",
                                        known_mask.get(t.vocab_size, t.vocab_size - 1)))
        kw.update({k: v for k, v in overrides.items() if v is not None})
        sliding_window = pub.get("sliding_window", 0) if sliding_window is None else sliding_window
        if sliding_window < 0:
            raise ValueError(f"sliding window {sliding_window}: tokens, or 0 for all full "
                             "attention")
        L = kw["num_hidden_layers"]
        if sliding_window and L > 1:
            kw.update(layer_types=[SLIDING] * (L - 1) + [FULL], sliding_window=sliding_window)
        return cls(**kw)

def drafter_rope(pos, c):
    # NeoX-style cos, sin [T, head_dim] in fp32 at positions pos [T], with c's rope_scaling
    return rope_cos_sin(pos, c.head_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)

def _dense_attention(allowed):
    # allowed [Q, KV] bool (None: every key); queries that see nothing (padded) get zeros, as flex's
    blind = None if allowed is None else ~allowed.any(-1)[:, None]
    def attend(q, k, v):
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
        return o if blind is None else o.masked_fill(blind, 0.0)
    return attend

def row_attention(config, anchors, keep, doc, S, flex=None):
    """{layer kind: attend(q, k, v)}: THE mask of each kind present, dense + SDPA (flex None, CPU)
    or a BlockMask from anchor_blocks with flex's kernel options (GPU, compiled)."""
    B, attend = config.block_size, {}
    Q, KV = anchors.shape[0] * B, S + anchors.shape[0] * B
    for kind, window in config.windows().items():
        mask_mod = anchor_mask_mod(anchors, keep, doc, S, B, window)
        if flex is None:
            q_idx, kv_idx = (torch.arange(n, device=anchors.device) for n in (Q, KV))
            attend[kind] = _dense_attention(mask_mod(0, 0, q_idx[:, None], kv_idx[None, :]))
        else:
            from torch.nn.attention.flex_attention import BlockMask, flex_attention
            bm = BlockMask((Q, KV), *anchor_blocks(anchors, keep, doc, S, B, window),
                           BLOCK_SIZE=(TILE, TILE), mask_mod=mask_mod)
            attend[kind] = functools.partial(flex_attention, block_mask=bm, enable_gqa=True,
                                             kernel_options=flex or None)
    return attend

class DrafterLayer(nn.Module):
    """A Qwen3 decoder layer: queries the block, keys and values [context ; block]."""
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)
        self.attention_conv = self.mlp_conv = None      # DFlash2's (dflash2.extend)

    def forward(self, h, ctx, rope_q, rope_kv, attend):
        def attention(x):
            a, Q, KV = self.self_attn, x.shape[0], ctx.shape[0] + x.shape[0]
            kv_in, hd = torch.cat([ctx, x]), a.head_dim            # context keys, then the block's
            q = apply_rope(a.q_norm(a.q_proj(x).view(Q, a.n_heads, hd)), *rope_q)
            k = apply_rope(a.k_norm(a.k_proj(kv_in).view(KV, a.n_kv_heads, hd)), *rope_kv)
            v = a.v_proj(kv_in).view(KV, a.n_kv_heads, hd)
            o = attend(*(t.transpose(0, 1)[None] for t in (q, k, v)))  # [1, heads, Q, hd]
            return a.o_proj(o[0].transpose(0, 1).reshape(Q, a.n_heads * hd))
        wrap = lambda conv, f, x: conv(x, f) if conv is not None else f(x)
        h = h + wrap(self.attention_conv, attention, self.input_layernorm(h))
        return h + wrap(self.mlp_conv, self.mlp, self.post_attention_layernorm(h))

class Drafter(nn.Module):
    def __init__(self, config):
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList([DrafterLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for p in self.parameters():      # Qwen3 init: normal(0.02) matrices, norms at 1
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        if c.conv_kernel_size:           # DFlash2: convolutions, a candidate selector
            import dflash2
            dflash2.extend(self)

    def context(self, feats):   # target features [S, n_feat*H] -> [S, H], k/v of every layer
        return self.hidden_norm(self.fc(feats))

    def hidden(self, ctx, ctx_pos, block_emb, block_pos, attend):
        """ctx [S, H] = context(target features), block_emb [Q, H], positions for RoPE, attend
        {layer kind: attention function} -> [Q, H], final-normed."""
        c, rope_q = self.config, drafter_rope(block_pos, self.config)
        rope_kv = drafter_rope(torch.cat([ctx_pos, block_pos]), c)
        h = block_emb.to(ctx.dtype)
        for layer, kind in zip(self.layers, c.layer_types):
            h = layer(h, ctx, rope_q, rope_kv, attend[kind])
        return self.norm(h)

    def forward(self, feats, tokens, loss_mask, doc, pos, anchors, keep, embed, head, gamma=7.0,
                flex=None, ce_chunk=1024, dpace=None, selector_alpha=0.1, objective=None):
        """Masked training forward over one packed row: feats [S, n_feat*H] (objective, distill.py:
        + the target's final hidden states [S, H]); tokens, loss_mask, doc, pos [S]; anchors, keep
        [N] (sample_anchors); embed, head the target's [vocab, H]; flex None (dense mask + SDPA,
        CPU) or flex_attention's kernel options (GPU, compiled); dpace=alpha: D-PACE's weights, no
        decay; ce_chunk 0: plain_ce; DFlash2: + selector_alpha x its selector's loss. -> sums"""
        c, S, N, B = self.config, tokens.shape[0], anchors.shape[0], self.config.block_size
        if objective is not None:   # the target's final hidden states: p at slot k from anchor+k-1
            feats, final = feats[:, :-c.hidden_size], feats[:, -c.hidden_size:]
        k = torch.arange(B, device=tokens.device)
        idx = anchors[:, None] + k                         # [N, B] absolute positions of the block
        inside, idx = idx < S, idx.clamp(max=S - 1)
        is_anchor = (k == 0) & keep[:, None]
        # [N, B]: the anchor's token, then mask tokens (all mask tokens in a padded slot)
        block_ids = tokens[anchors][:, None].expand(N, B).masked_fill(~is_anchor, c.mask_token_id)
        attend = row_attention(c, anchors, keep, doc, S, flex)
        block_pos = (pos[anchors][:, None] + k).view(-1)   # RoPE positions anchor..anchor+B-1
        h = self.hidden(self.context(feats), pos, F.embedding(block_ids.view(-1), embed),
                        block_pos, attend)
        # labels: slot k predicts the token AT anchor+k (no extra shift); slot 0 is the anchor
        same_doc = doc[idx] == doc[anchors][:, None]
        supervised = keep[:, None] & (k > 0) & inside & (loss_mask[idx] > 0) & same_doc
        w = supervised.float() * torch.exp(-(k - 1).clamp(min=0).float() / gamma)    # [N, B]
        labels, chunk, norm = tokens[idx], ce_chunk, w.sum().clamp(min=1e-6)
        if dpace is not None:
            # D-PACE: no decay; the sum over the row's samples (documents with an anchor), as
            # SpecForge divides by its batch of samples; chunks of whole blocks
            w, chunk = supervised.float(), max(B, ce_chunk // B * B)
            d = doc[anchors]
            norm = (keep & torch.cat([keep[:1], d[1:] != d[:-1]])).sum().clamp(min=1)
        pick = self.candidate_selector.candidates if c.conv_kernel_size else None   # DFlash2
        wce, pred, a, *top = (_WeightedCE.apply if ce_chunk else plain_ce)(
            h, head, labels.view(-1), w.view(-1), *((chunk,) if ce_chunk else ()), B, dpace, pick,
            objective and final[(idx - 1).clamp(min=0)].flatten(0, 1), objective)
        correct = (pred.view(N, B) == labels) & supervised
        accepted = 1 + correct[:, 1:].long().cumprod(1).sum(1)  # anchor + leading correct slots
        out = dict(loss=wce / norm, accept_sum=(accepted * keep).sum(),
                   blocks=keep.sum(), slot_correct=correct.sum(0), slot_count=supervised.sum(0))
        if objective is not None:   # teacher-forced, the expected accepted length at its T
            out["sampled_accept_sum"] = objective.accepted(a.view(N, B), supervised, keep)
        return out if pick is None else self.candidate_selector.terms(
            out, h, head, labels, supervised, keep, top, selector_alpha, objective)

    @torch.no_grad()
    def propose(self, ctx_feats, ctx_pos, anchor_token, anchor_pos, embed, head):
        """What a serving engine runs: context the target's features before the anchor, block
        [anchor, mask x (B-1)] at anchor_pos...; sliding layers as SGLang (models/dflash.py) and
        vLLM (models/qwen3_dflash.py) run them: q sees p iff q - (W-1) <= p <= q, full layers
        every key. -> (B-1 tokens: DFlash2 the selector's greedy walk, the logits)"""
        c, dev = self.config, ctx_feats.device
        block = torch.full((c.block_size,), c.mask_token_id, dtype=torch.long, device=dev)
        block[0] = anchor_token
        block_pos = anchor_pos + torch.arange(c.block_size, device=dev)
        q_at, kv_at = block_pos[:, None], torch.cat([ctx_pos, block_pos])[None, :]
        sees = lambda w: (kv_at <= q_at) & (q_at - kv_at < w) if w else None   # [B, ctx + B]
        attend = {kind: _dense_attention(sees(w)) for kind, w in c.windows().items()}
        h = self.hidden(self.context(ctx_feats), ctx_pos, F.embedding(block, embed), block_pos,
                        attend)
        logits = (h[1:] @ head.t()).float()
        if c.conv_kernel_size:   # DFlash2: the candidate selector's greedy walk from the anchor
            return self.candidate_selector.walk(h[None, 1:], block[:1], logits[None])[0][0], logits
        return logits.argmax(-1), logits

    def flops(self, S, N, visible=None, objective=False):
        """Matmul FLOPs of a training step (fwd + bwd) at S context tokens and N anchors (objective:
        + the target's logits); attention from visible, {kind: (query, key) pairs} (None: none)."""
        c, Q = self.config, N * self.config.block_size
        q_o_mlp = c.hidden_size * (2 * c.num_attention_heads * c.head_dim + 3 * c.intermediate_size)
        kv = 2 * c.hidden_size * c.num_key_value_heads * c.head_dim
        fwd = 2 * c.num_hidden_layers * (Q * q_o_mlp + (S + Q) * kv)
        pairs = sum((visible or {}).get(kind, 0) for kind in c.layer_types)
        attn = 4 * c.num_attention_heads * c.head_dim * pairs          # QK^T and PV
        fc = 2 * S * self.fc.in_features * c.hidden_size               # no input grad: fwd + dW
        head = 2 * Q * c.vocab_size * c.hidden_size
        extra = self.candidate_selector.flops(Q) if c.conv_kernel_size else 0   # DFlash2's
        return 3 * (fwd + attn) + 2 * fc + (2 + objective) * head + extra  # frozen head: logits, dh

    # -------------------------------------------------------------------------
    # 5) export in the z-lab format

    def save_pretrained(self, out_dir, step=None):
        """z-lab format: config.json + model.safetensors (bf16, keys without a `model.` prefix),
        each replaced atomically; `step` goes into the safetensors metadata."""
        from safetensors.torch import save_file
        os.makedirs(out_dir, exist_ok=True)
        cfg = asdict(self.config)   # every field; mask_token_id, target_layer_ids in dflash_config
        dflash = dict(block_size=cfg["block_size"], mask_token_id=cfg.pop("mask_token_id"),
                      target_layer_ids=cfg.pop("target_layer_ids"))
        d2 = {k: cfg.pop(k) for k in list(cfg) if k.startswith(("conv_", "selector_"))}  # DFlash2
        if d2["conv_kernel_size"]:   # z-lab's unary transforms off: the raw head logits
            dflash.update(d2, output_multiplier=1.0, final_logit_softcapping=0.0)
        arch = "DFlash2DraftModel" if d2["conv_kernel_size"] else "DFlashDraftModel"
        cfg = dict(architectures=[arch], model_type="qwen3", dflash_config=dflash,
                   **cfg, hidden_act="silu", attention_bias=False, attention_dropout=0.0,
                   initializer_range=0.02, dtype="bfloat16", torch_dtype="bfloat16", use_cache=True)
        tensors = {k: v.detach().to(torch.bfloat16).contiguous().cpu()
                   for k, v in self.state_dict().items()}
        tmp = os.path.join(out_dir, f".tmp-{os.getpid()}")
        meta = {"format": "pt", **({"step": str(step)} if step is not None else {})}
        try:
            save_file(tensors, tmp + ".safetensors", metadata=meta)
            with open(tmp + ".json", "w") as f:
                json.dump(cfg, f, indent=2)
            # safetensors creates 0600; give it config.json's mode (0644 under umask 022), so a
            # server running as another user can read it
            os.chmod(tmp + ".safetensors", os.stat(tmp + ".json").st_mode & 0o777)
            os.replace(tmp + ".safetensors", os.path.join(out_dir, "model.safetensors"))
            os.replace(tmp + ".json", os.path.join(out_dir, "config.json"))
        finally:            # a failed write (a full disk) leaves no half-written file behind
            for p in filter(os.path.exists, (tmp + ".safetensors", tmp + ".json")):
                os.remove(p)

    @classmethod
    def from_pretrained(cls, path, device="cpu", dtype=torch.float32):
        """Loads a z-lab format drafter. A missing file or field, a config field this drafter
        cannot honour, a tensor of the wrong shape: a one-line ValueError naming the file."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        files = [os.path.join(path, f) for f in ("config.json", "model.safetensors")]
        for f in files:
            if not os.path.isfile(f):
                raise ValueError(f"{f} not found: a z-lab format drafter dir holds config.json "
                                 "and model.safetensors")
        try:
            with open(files[0]) as f:
                config = config_from_json(json.load(f))
        except (ValueError, KeyError, TypeError, AttributeError) as e:   # KeyError: no such field
            raise ValueError(f"{files[0]}: {f'no field {e}' if isinstance(e, KeyError) else e}"
                             ) from None
        model = cls(config)
        try:
            weights = load_file(files[1])
        except SafetensorError as e:
            raise ValueError(f"{files[1]}: {e}") from None
        # the exact key set and shapes, named (load_state_dict's error is a page long)
        want = model.state_dict()
        for k in sorted(want.keys() | weights.keys()):
            have = tuple(weights[k].shape) if k in weights else "missing"
            need = tuple(want[k].shape) if k in want else "absent"
            if have != need:
                raise ValueError(f"{files[1]} does not fit {files[0]}: tensor {k} is {have}, the "
                                 f"config makes it {need}")
        model.load_state_dict(weights)
        return model.to(device=device, dtype=dtype)

def config_from_json(cfg):
    """DrafterConfig of a z-lab config.json dict (HF Qwen3Config fields + dflash_config), RoPE in
    transformers 4.x spelling (z-lab's `rope_scaling` + top-level `rope_theta`) or 5.x's."""
    dflash = cfg.get("dflash_config", {})
    if not {"mask_token_id", "target_layer_ids"} <= set(dflash):
        raise ValueError("no dflash_config with mask_token_id and target_layer_ids: not a DFlash "
                         "drafter config")
    # DrafterConfig's fields, at the top level or (DFlash2's) in dflash_config
    kw = {k: v for k, v in {**cfg, **dflash}.items() if k in DrafterConfig.__dataclass_fields__}
    kw.update(block_size=dflash.get("block_size", cfg.get("block_size", 16)),
              mask_token_id=dflash["mask_token_id"], target_layer_ids=dflash["target_layer_ids"])
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = rope.pop("rope_theta", cfg.get("rope_theta"))
    rotary = rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kw.update(rope_theta=theta, rope_scaling=rope if rope_type(rope) != "default" else None)
    if "layer_types" not in cfg:   # HF Qwen3Config's rule: sliding from max_window_layers on
        slides = cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None
        kw["layer_types"] = [SLIDING if slides and i >= cfg.get("max_window_layers", 28) else FULL
                             for i in range(cfg["num_hidden_layers"])]
    causal = cfg.get("is_causal", dflash.get("causal"))   # vLLM: one value for every layer
    kinds = set(kw["layer_types"])
    for ok, msg in [
            (theta is not None, "no rope_theta (top level or in rope_parameters)"),
            (not (set(rope) & {FULL, SLIDING}), "rope_parameters per layer type are not supported"),
            (cfg.get("hidden_act", "silu") == "silu",
             f"hidden_act {cfg.get('hidden_act')!r}: only silu is supported"),
            (not cfg.get("attention_bias"),
             "attention_bias true is not supported (q/k/v/o have no bias)"),
            (not cfg.get("attention_dropout"), f"attention_dropout "
             f"{cfg.get('attention_dropout')}: not supported (the drafter trains without dropout)"),
            (rotary == 1.0, f"partial_rotary_factor {rotary}: only 1.0 is supported"),
            (rope_type(rope) != "yarn" or "original_max_position_embeddings" not in cfg,
             "top-level original_max_position_embeddings is not supported: put it in rope_scaling"),
            (causal is None or kinds == {SLIDING if causal else FULL},
             f"is_causal / dflash_config.causal {causal}: this drafter trains sliding layers "
             f"causal, full ones bidirectional, as the engines serve layer_types {sorted(kinds)}"),
            ((dflash.get("output_multiplier", 1), dflash.get("final_logit_softcapping", 0)) == (
                1, 0), "output_multiplier 1, final_logit_softcapping 0 only: the raw logits")]:
        if not ok:
            raise ValueError(msg)
    return DrafterConfig(**kw)

# -----------------------------------------------------------------------------
# 6) the drafter step

def drafter_step(drafter, feats, row, *, anchors_per_doc, row_anchors, flex=None, **kw):
    """THE drafter step before its backward, what train.py compiles whole. One packed row
    ({"tokens", "loss_mask", "doc", "pos"} [S], on device): its anchors (per document, slots per
    row), their BlockMask lists (flex, GPU), Drafter.forward(**kw) under bf16 autocast on GPU ->
    (its dict, the anchors wanted before the slots' cut)."""
    anchors, keep, wanted = sample_anchors(row["loss_mask"], row["doc"], anchors_per_doc,
                                           row_anchors)
    with torch.autocast("cuda", torch.bfloat16) if feats.is_cuda else nullcontext():
        return drafter(feats, **{k: row[k] for k in ("tokens", "loss_mask", "doc", "pos")},
                       anchors=anchors, keep=keep, flex=flex, **kw), wanted
