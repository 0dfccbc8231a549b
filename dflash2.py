"""
DFlash2: the DFlash drafter (model.py) plus two parts, as z-lab's DFlash2DraftModel defines them
(z-lab/dflash, dflash/model.py) and SGLang (PR #35371) and vLLM (PR #52816) serve them. model.py
imports this file only for a config with conv_kernel_size > 0. In reading order:
  1) the block-local convolution around each sublayer: a static per-channel kernel plus a dynamic
     per-group correction, taps never crossing a block start
  2) the candidate selector: per block slot the drafter's top-K, rescored by a low-rank transition
     from the previous slot's token; the walk that drafts with it, greedy or sampled
  3) its training terms: a K-way cross-entropy over each slot's top-K (teacher-forced), metrics
Notation: B slots per block, H hidden, K conv taps, G channels per group, r the selector's rank,
top_k candidates per slot, V the vocabulary.
"""
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

# the dflash_config fields DFlash2 adds (model.DrafterConfig's names; exported only by DFlash2)
FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")

# -----------------------------------------------------------------------------
# 1) the convolution

def convolve(x, delta, base, B):
    """out[j, c] = sum_t (base[t, c] + delta[j, t, c // G]) * x[j - t, c], x[j - t] = 0 before the
    block's slot 0. x [n*B, H] in block order, delta [n*B, K, H/G], base [K, H] -> [n*B, H]. Per
    tap out += base * x, then addcmul(out, delta, x): z-lab's accumulation order (bf16 parity)."""
    K, groups = delta.shape[1:]
    xb = x.view(-1, B, groups, x.shape[-1] // groups)               # [n, B, H/G, G]
    delta = delta.view(-1, B, K, groups, 1)                           # [n, B, K, H/G, 1]
    out = torch.zeros_like(xb)
    for t in range(K):
        # slot j reads slot j - t of its own block: shifted by t within each block, zeros first
        v = xb if t == 0 else F.pad(xb[:, :-t], (0, 0, 0, 0, t, 0))
        out = out + base[t].view(groups, -1).to(x.dtype) * v
        out = torch.addcmul(out, delta[:, :, t], v)
    return out.view(x.shape)

class Conv(nn.Module):
    """The grouped dynamic depthwise causal convolution around one sublayer: it convolves the
    sublayer's normed input u (z-lab's prepare) and its output (finish), both kernels corrected by
    one projection of u. Identity at init (base tap 0 = 1, the rest and the projection 0): the
    sublayer as DFlash computes it, exactly."""
    def __init__(self, c):
        super().__init__()
        H, K, G = c.hidden_size, c.conv_kernel_size, c.conv_group_size
        assert H % G == 0, f"hidden_size {H}: not a multiple of conv_group_size {G}"
        assert K <= c.block_size, f"conv_kernel_size {K} > block_size {c.block_size}"
        self.block_size = c.block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, K, H))          # [side, tap, channel]
        # rows ordered (side, tap, group), group fastest, as z-lab's .view(..., 2, K, H/G) reads
        self.kernel_projection = nn.Linear(H, 2 * K * (H // G), bias=False)
        with torch.no_grad():
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def forward(self, u, sublayer):   # the sublayer between the two sides
        K, B = self.base_kernel.shape[1], self.block_size
        d = self.kernel_projection(u).view(u.shape[0], 2, K, -1)        # [n*B, side, K, H/G]
        y = sublayer(convolve(u, d[:, 0], self.base_kernel[0], B))
        return convolve(y, d[:, 1], self.base_kernel[1], B)

# -----------------------------------------------------------------------------
# 2) the candidate selector and the walk

class _Unary(torch.autograd.Function):
    """The chunked head pass's logits vals [rows, k] at ids [rows, k] (no gradient of their own),
    given the gradient they have as (h @ head^T)[ids]: d/dh = sum_c g_c head[ids_c], one pointwise
    pass over [rows, H] (autograd's [rows, k, H] gather and reduction is several times slower)."""
    @staticmethod
    def forward(ctx, vals, h, head, ids):
        ctx.save_for_backward(head, ids)
        ctx.dtype = h.dtype
        return vals.clone()

    @staticmethod
    def backward(ctx, g):
        head, ids = ctx.saved_tensors
        dh = sum(g[:, c, None] * head[ids[:, c]].float() for c in range(ids.shape[1]))
        return None, dh.to(ctx.dtype), None, None

class Selector(nn.Module):
    """score_j(p -> c) = unary_j[c] + <A[p] * (P h_j), B[c]>: unary the drafter's logit of c, A, B
    the predecessor and successor codebooks [V, r] (bare tensors, as exported), P [H -> r]."""
    def __init__(self, c):
        super().__init__()
        self.config, self.top_k = c, c.selector_top_k
        self.hidden_projection = nn.Linear(c.hidden_size, c.selector_rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))
        self.successor_codebook = nn.Parameter(torch.empty(c.vocab_size, c.selector_rank))
        # successor 0: the selector starts as the plain top-1 (SpecForge's init); A, P normal(0.02)
        nn.init.normal_(self.hidden_projection.weight, std=0.02)
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.zeros_(self.successor_codebook)

    def candidates(self, logits, group=256):
        """torch.topk(logits [rows, V], top_k) -> (values fp32, ids) [rows, top_k], without its
        radix select over the whole vocabulary (the selector's slowest kernel): the top k lie
        in the k groups of `group` logits with the largest maxima (a group holding one has a max
        >= the k-th value, and at most k groups do), so a top k over those k * group logits (and
        the V % group last ones) is exact; at ties it may pick another of the tied ids."""
        (n, V), k = logits.shape, self.top_k
        if V < 4 * k * group:
            v, i = logits.topk(k, dim=-1)
            return v.float(), i
        m = V // group * group
        best = logits[:, :m].view(n, m // group, group).amax(-1).topk(k, dim=-1).indices  # [n, k]
        arange = lambda a, b: torch.arange(a, b, device=logits.device)
        ids = torch.cat([(best[..., None] * group + arange(0, group)).view(n, k * group),
                         arange(m, V).expand(n, -1)], 1)                # [n, k*group + V % group]
        v, i = logits.gather(1, ids).topk(k, dim=-1)
        return v.float(), ids.gather(1, i)

    def score(self, z, prev, cand, unary):
        # z = P h [..., r], prev [...] token ids, cand and unary [..., k] -> scores [..., k], fp32
        pair = torch.einsum("...r,...kr->...k", z * self.predecessor_codebook[prev],
                            self.successor_codebook[cand])
        return unary + pair.float()

    def walk(self, h, anchor, logits, temperature=0.0, u=None):
        """Drafts blocks slot by slot: slot j's candidates the top_k of logits[:, j], the first
        predecessor the anchor; greedy takes the best score, T > 0 draws from q = softmax(score /
        T) over the candidates (fp32) by inverse CDF at uniforms u [n, J]. h [n, J, H] (slots
        1..B-1, final-normed), anchor [n], logits [n, J, V] -> (path [n, J], candidates [n, J,
        top_k], q [n, J, top_k] or None)."""
        unary, cand = logits.float().topk(self.top_k, dim=-1)          # [n, J, top_k] each
        z, prev, path, qs = self.hidden_projection(h), anchor, [], []
        for j in range(h.shape[1]):     # sequential: slot j's scores depend on the last choice
            s = self.score(z[:, j], prev, cand[:, j], unary[:, j])       # [n, top_k]
            if temperature:
                q = (s / temperature).softmax(-1)
                i = (q.cumsum(-1) <= u[:, j, None]).sum(-1).clamp(max=self.top_k - 1)
                qs.append(q)
            else:
                i = s.argmax(-1)
            prev = cand[:, j].gather(1, i[:, None])[:, 0]
            path.append(prev)
        return torch.stack(path, 1), cand, torch.stack(qs, 1) if qs else None

    # -------------------------------------------------------------------------
    # 3) training terms

    def terms(self, out, h, head, labels, supervised, keep, top, alpha, obj=None):
        """Drafter.forward's dict `out` (its loss: the backbone's) plus alpha x the selector's mean
        K-way CE over the supervised slots, teacher-forced: slot k's predecessor the gold token
        at slot k - 1 (slot 1: the anchor), its candidates the top_k of its logits plus the gold
        token where missing (the loss only). h [N*B, H]; labels, supervised [N, B]; keep [N];
        top: the chunked head pass's (values [N*B, top_k + 1], top_k then the gold logit; ids
        [N*B, top_k]; obj: the target's p at the ids). obj (distill.Objective): its objective on
        the walk's q over the top_k instead of the CE, what sampling serves. Metrics as served
        (strict top_k): gold in the top_k, the selector's choice right, the walk's teacher-forced
        accepted length (a walk right so far has gold predecessors: it is the greedy walk's own;
        obj: its expected accepted length under sampling)."""
        (vals, cand, *p_at), (N, B), k = top, labels.shape, self.top_k
        y, prev = labels.reshape(-1), F.pad(labels[:, :-1], (1, 0)).reshape(-1)
        ids = torch.cat([cand, y[:, None]], 1)                          # [N*B, k + 1]
        s = self.score(self.hidden_projection(h), prev, ids, _Unary.apply(vals, h, head, ids))
        hit = cand == y[:, None]
        found = hit.any(-1)
        gold = s[:, k:].masked_fill(found[:, None], -torch.inf)        # counted once
        ce = F.cross_entropy(torch.cat([s[:, :k], gold], 1),
                             torch.where(found, hit.int().argmax(-1), k), reduction="none")
        sup, more = supervised.reshape(-1), {}
        if obj is not None:
            ce, a = obj.walk(s[:, :k], p_at[0], ce)
            more["walk_sampled_accept_sum"] = obj.accepted(a.view(N, B), supervised, keep)
        loss = (ce * sup).sum() / sup.sum().clamp(min=1)
        choice = cand.gather(1, s[:, :k].argmax(-1, keepdim=True))[:, 0]
        right = (choice == y).view(N, B) & supervised
        walked = 1 + right[:, 1:].long().cumprod(1).sum(1)              # anchor + leading right
        return dict(out, loss=out["loss"] + alpha * loss, selector_loss=loss.detach(),
                    topk_recall_hits=(found.view(N, B) & supervised).sum(),
                    selector_acc_hits=right.sum(), walk_accept_sum=(walked * keep).sum(), **more)

    def flops(self, Q):
        """Matmul FLOPs of DFlash2's parts in a training step (fwd + bwd) over Q block tokens: the
        conv projections (2 per layer), the selector's projection and its top_k + 1 scores."""
        c = self.config
        H, r, k = c.hidden_size, c.selector_rank, c.selector_top_k + 1
        conv = 2 * c.num_hidden_layers * 2 * Q * H * 2 * c.conv_kernel_size * H // c.conv_group_size
        return 3 * (conv + 2 * Q * H * r + 2 * Q * k * (r + H))

# -----------------------------------------------------------------------------
# 4) a DFlash drafter made DFlash2

def extend(drafter):
    """Drafter.__init__'s DFlash2 parts: a conv around each layer's attention and MLP, the
    selector; after its normal(0.02) draws, at their own init (the convs the identity)."""
    c = drafter.config
    for layer in drafter.layers:
        layer.attention_conv, layer.mlp_conv = Conv(c), Conv(c)
    drafter.candidate_selector = Selector(c)

def upgrade(drafter, **fields):
    """A DFlash drafter (e.g. --init-drafter's export) as a DFlash2 one with these DFLASH2 fields:
    every tensor it has copied, the new ones at their init (identity: the same outputs)."""
    new = type(drafter)(replace(drafter.config, **fields)).to(drafter.fc.weight.device)
    missing, unexpected = new.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("_conv." in k or "_selector." in k for k in missing), missing
    return new
