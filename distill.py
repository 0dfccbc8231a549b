"""
Objectives against the target's own distribution (train.py --objective tv / accept / dspark).
Speculative sampling accepts a drafted slot with probability a = sum_x min(p(x), q(x)) = 1 - TV(p,
q) (Leviathan et al., arXiv:2211.17192), p the target's and q the drafter's distribution at the
served temperature. A cross-entropy on one sampled answer learns p only through its samples; these
learn it whole. p comes from the target's final post-norm hidden state at the position before each
label (it travels with the taps), made logits by the frozen LM head inside model._WeightedCE's
chunks: nothing vocabulary-sized is kept or sent. model.py never imports this file: the Objective
train.py builds for the flag carries its code in. Per supervised slot:
  tv      1 - a, the expected rejection (DSpark's TV term, arXiv 2607.05147)
  accept  -log a (the LK losses' acceptance term, arXiv 2602.23881): rarely accepted slots weigh
          more; with D-PACE's weights its gradient is nearly that of the expected accepted length
  dspark  0.1 CE of the label + 0.9 (1 - a): DSpark's mix, without its confidence head
weighted as --loss weighs CE (D-PACE's weights from a instead of the label's probability). DFlash2
serves q = softmax(score / T) over a slot's top-K candidates (dflash2.py): its selector term is the
same objective on that q (walk), the backbone's stays on the full softmax, which picks the
candidates; the two add as with CE (backbone + --selector-alpha x selector).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import ce_terms

EPS = 1e-6          # accept: -log(a + EPS), finite where the drafter misses p entirely

@dataclass(frozen=True)
class Objective:
    kind: str                   # tv, accept or dspark
    temperature: float = 1.0    # of p and q alike

    def _combine(self, a, ce):  # the objective of acceptance a [n] and the label's CE [n]
        miss = -(a + EPS).log() if self.kind == "accept" else 1 - a
        return 0.1 * ce + 0.9 * miss if self.kind == "dspark" else miss

    def terms(self, z, zt, y):
        """One chunk of slots: the drafter's logits z and the target's zt [n, V] (fp32), labels y
        [n, 1] -> (the objective [n], its gradient wrt z [n, V], a [n], p [n, V]). The gradient is
        by hand, so no autograd graph holds [n, V] tensors: with b = [q < p] (where min(p, q) is q),
        da/dz = q (b - sum_x q b) / T."""
        q, p = (z / self.temperature).softmax(-1), (zt / self.temperature).softmax(-1)
        qb = q * (q < p)
        a = torch.minimum(p, q).sum(-1)
        da = (qb - q * qb.sum(-1, keepdim=True)) / self.temperature
        dz = -da / (a + EPS)[:, None] if self.kind == "accept" else -da
        ce = None
        if self.kind == "dspark":   # + 0.1 x the label CE's gradient
            ce, dce, _ = ce_terms(z, y)
            dz = 0.1 * dce + 0.9 * dz
        return self._combine(a, ce), dz, a, p

    def plain(self, z, zt, y):
        """terms' objective, a (detached) and p, by plain autograd on full logits: the reference."""
        q, p = (z / self.temperature).softmax(-1), (zt / self.temperature).softmax(-1)
        a = torch.minimum(p, q).sum(-1)
        return self._combine(a, F.cross_entropy(z, y[:, 0], reduction="none")), a.detach(), p

    def walk(self, scores, p_at, ce):
        """DFlash2's selector term as served: q = softmax(scores / T) over the top-K candidates
        [n, K], p_at the target's p at their ids, ce the selector's K-way CE [n] -> (the
        objective [n], a [n] detached)."""
        a = torch.minimum(p_at, (scores / self.temperature).softmax(-1)).sum(-1)
        return self._combine(a, ce), a.detach()

    @staticmethod
    def accepted(a, supervised, keep):
        """The blocks' teacher-forced expected accepted lengths under sampling, summed over the
        kept blocks: 1 + sum over slots k >= 1 of prod_{i <= k} a_i, 0 past an unsupervised slot.
        a, supervised [N, B]; keep [N]."""
        return ((1 + (a * supervised)[:, 1:].cumprod(1).sum(1)) * keep).sum()
