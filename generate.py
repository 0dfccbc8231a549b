"""
Greedy speculative decoding with the target and an exported DFlash drafter, run the way a serving
engine runs it (z-lab/dflash's dflash_generate loop), beside plain greedy decoding of the same
target: the real acceptance length tau, and a check that both decodes give the same tokens.

  # demo: tiny target, demo held-out prompts
  python generate.py --drafter out/drafter --max-new-tokens 48
  python generate.py --target demo --drafter out/drafter       # the demo target trained on code
  python generate.py --target /ckpt/Qwen3.6-27B --drafter out/drafter --prompts gsm8k.jsonl \\
      --tokenizer /ckpt/Qwen3.6-27B --chat-template-kwargs '{"enable_thinking": false}' \\
      --max-new-tokens 512
  # GPU cost
  python generate.py --target qwen3.6-27b --drafter random --random-prompts 2 --prompt-len 1024

One cycle: the drafter proposes B-1 tokens from [last committed token, mask x (B-1)], its context
being the target features of every position before that token; the target verifies the block in
one forward; the longest prefix of proposals equal to the target's argmax is accepted, plus the
target's own next token (the bonus).
tau = mean over cycles of (accepted + 1), the accept length SGLang and z-lab's benchmark print.
Prompts: the val split of --data (the tokens before each sample's first supervised one), or
--prompts JSONL (messages, ShareGPT conversations or {"prompt": str}; a final assistant message
is dropped) rendered by --tokenizer's chat template as the engine renders them, or random ids.
--eos defaults to the checkpoint's generation_config.json, else config.json; none for a preset.
--replay gives the same tau without decoding (replay() below): hundreds of prompts in seconds.
No KV cache: every target forward re-runs the whole sequence (prefix + block), and the greedy
decode does the same per token. Short and obviously right; the cost per forward grows with the
context (numbers in README).
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from target import Target, TargetConfig, positions_from_cu
from model import Drafter, DrafterConfig, row_attention
from data import ArgParser, Bad, DataError, demo_of, kwargs_arg, load_line, number, open_dataset
from prepare import Chat

# -----------------------------------------------------------------------------
# the two decodes (one prompt at a time, ids on the target's device)

def _forward(target, ids, layer_ids, at):
    # one target forward over the whole sequence: features [T, n_feat*H], logits [len(at), vocab]
    cu = torch.tensor([0, len(ids)])
    return target.features_and_logits(ids, cu, layer_ids, at=torch.tensor(at, device=ids.device))

def _finish(new, max_new, eos):
    # the committed tokens up to max_new, cut after the first end-of-sequence token
    new = new[:max_new].tolist()
    stop = [i for i, t in enumerate(new) if t in eos]
    return new[:stop[0] + 1] if stop else new

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)

def speculative(target, drafter, prompt, max_new, eos=()):
    """Greedy speculative decoding of `prompt` [P]. Returns (new tokens, acc+1 per cycle, target
    forwards). Cycle k starts at anchor a = the position of the last committed token; the
    drafter's context is the target features of positions < a (the anchor's own hidden state does
    not exist before its forward)."""
    B, taps, dev = drafter.config.block_size, drafter.config.target_layer_ids, prompt.device
    embed, head = target.embed_tokens.weight, target.lm_head.weight
    P = len(prompt)
    # prefill: the first token and the context
    ctx, logits = _forward(target, prompt, taps, [P - 1])
    seq = torch.cat([prompt, logits.argmax(-1)])
    accepted = []
    while len(seq) - P < max_new and not any(t in eos for t in seq[P:].tolist()):
        a = len(seq) - 1  # anchor: the last committed token
        # draft [B-1]: the proposals for the block's mask slots
        draft, _ = drafter.propose(ctx, torch.arange(a, device=dev), seq[a], a, embed, head)
        feats, logits = _forward(target, torch.cat([seq, draft]), taps, list(range(a, a + B)))
        posterior = logits.argmax(-1)  # [B]: the target's next token after each block slot
        # leading proposals the target agrees with
        acc = int((draft == posterior[:-1]).cumprod(0).sum())
        seq = torch.cat([seq, draft[:acc], posterior[acc:acc + 1]])
        ctx = torch.cat([ctx, feats[a:a + acc + 1]])  # the anchor and the accepted proposals
        accepted.append(acc + 1)
    return _finish(seq[P:], max_new, eos), accepted, 1 + len(accepted)

def drafter_sampler(drafter, embed, head, temperature, generator):
    """draft(feats, tokens, doc, pos, anchors) -> (B-1 proposals per anchor [n, B-1], their
    distributions [n, B-1, vocab]): each block slot sampled from the drafter's own
    softmax(logits / temperature), every slot of every anchor from one forward (propose_at)."""
    def draft(feats, tokens, doc, pos, anchors):
        logits = propose_at(drafter, feats, tokens, doc, pos, anchors, embed, head, argmax=False)
        q = (logits / temperature).softmax(-1)
        x = torch.multinomial(q.flatten(0, 1), 1, generator=generator)[:, 0]
        return x.view(q.shape[:2]), q
    return draft

def _packed(seqs):
    # sequences as the documents of one row: ids, cu_seqlens (CPU), doc and pos (on the device)
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    dev = seqs[0].device
    return (torch.cat(seqs), cu, torch.repeat_interleave(torch.arange(len(seqs)), lens).to(dev),
            positions_from_cu(cu).to(dev))

def speculative_sampling(target, draft, prompts, max_new, temperature, generator, B, taps, eos=()):
    """speculative() at temperature > 0, verified as SGLang and vLLM verify (Leviathan et al.,
    arXiv:2211.17192), for many prompts at once: per cycle one draft call for every live prompt's
    anchor and one target forward over each prompt + its proposals, packed as the documents of one
    row. Proposal x_i (draft: drafter_sampler) is accepted with probability min(1, p_i(x_i) /
    q_i(x_i)), p_i the target's softmax(logits / temperature) after slot i; the first rejected slot
    takes a token drawn from max(p_i - q_i, 0) renormalised, a block accepted whole the target's
    own next token. Each output follows the target's sampling distribution exactly. Returns (new
    tokens per prompt, acc+1 per cycle per prompt)."""
    n, dev = len(prompts), prompts[0].device
    sample = lambda p: torch.multinomial(p, 1, generator=generator)[:, 0]
    ids, cu, _, _ = _packed(prompts)
    feats, logits = target.features_and_logits(ids, cu, taps, at=(cu[1:] - 1).to(dev))
    first = sample((logits / temperature).softmax(-1))
    seqs = [torch.cat([p, first[j:j + 1]]) for j, p in enumerate(prompts)]
    # features of each prompt's committed positions but its last (the anchor: none yet)
    ctx = [feats[cu[j]:cu[j + 1]] for j in range(n)]
    cycles = [[] for _ in prompts]
    live = [j for j, t in enumerate(first.tolist()) if t not in eos and max_new > 1]
    k = torch.arange(B, device=dev)
    while live:
        # the drafter: each live sequence a document, the anchor's feature row a placeholder
        ids, cu, doc, pos = _packed([seqs[j] for j in live])
        f = torch.cat([torch.cat([ctx[j], ctx[j].new_zeros(1, ctx[j].shape[1])]) for j in live])
        a = (cu[1:] - 1).to(dev)                                   # anchors, in the packed row
        x, q = draft(f, ids, doc, pos, a)                          # [m, B-1], [m, B-1, V]
        ids, cu, _, _ = _packed([torch.cat([seqs[j], x[i]]) for i, j in enumerate(live)])
        at = (cu[:-1].to(dev) + torch.tensor([len(seqs[j]) - 1 for j in live], device=dev))
        feats, logits = target.features_and_logits(ids, cu, taps, at=(at[:, None] + k).view(-1))
        p = (logits / temperature).softmax(-1).view(len(live), B, -1)          # [m, B, V]
        u = torch.rand(x.shape, generator=generator, device=dev)
        px, qx = p[:, :-1].gather(-1, x[..., None])[..., 0], q.gather(-1, x[..., None])[..., 0]
        acc = (u * qx < px).long().cumprod(1).sum(1)               # u < p/q, without dividing by 0
        m = torch.arange(len(live), device=dev)
        q0 = torch.cat([q, torch.zeros_like(q[:, :1])], 1)         # no q after the last slot
        rest = (p[m, acc] - q0[m, acc]).clamp(min=0)
        bonus = sample(rest / rest.sum(-1, keepdim=True))
        still = []
        for i, (j, c, xs, b) in enumerate(zip(live, acc.tolist(), x.tolist(), bonus.tolist())):
            seqs[j] = torch.cat([seqs[j], x[i, :c], bonus[i:i + 1]])
            ctx[j] = feats[int(cu[i]):int(cu[i]) + len(seqs[j]) - 1]
            cycles[j].append(c + 1)
            if len(seqs[j]) - len(prompts[j]) < max_new and not any(t in eos for t in xs[:c] + [b]):
                still.append(j)
        live = still
    return [_finish(s[len(p):], max_new, eos) for s, p in zip(seqs, prompts)], cycles

def greedy(target, prompt, max_new, eos=()):
    """Plain greedy decoding, one full-sequence target forward per token. Returns the new tokens."""
    seq = prompt
    for _ in range(max_new):
        nxt = _forward(target, seq, (), [len(seq) - 1])[1].argmax(-1)
        seq = torch.cat([seq, nxt])
        if int(nxt) in eos:
            break
    return seq[len(prompt):].tolist()

def divergence(target, prompt, spec, ref):
    """None if the two decodes agree; else a line naming the first differing new token and saying
    whether the target's own top-2 logits there (recomputed on the common prefix) are close enough
    for rounding to flip."""
    i = next((i for i, (s, r) in enumerate(zip(spec, ref)) if s != r), min(len(spec), len(ref)))
    if i == len(spec) == len(ref):
        return None
    ids = torch.cat([prompt, prompt.new_tensor(ref[:i])])
    top2 = _forward(target, ids, (), [len(ids) - 1])[1][0].topk(2).values
    gap = float(top2[0] - top2[1])
    bf16 = target.embed_tokens.weight.dtype == torch.bfloat16
    near = gap <= (2 ** -7 if bf16 else 1e-4) * abs(float(top2[0]))  # bf16 keeps 8 significant bits
    why = ("a near-tie: a forward over the block and one over the prefix round differently" if near
           else "NOT a near-tie: a bug")
    s, r = (x[i] if i < len(x) else "end" for x in (spec, ref))
    return (f"DIVERGES at new token {i}: spec {s} vs greedy {r}, "
            f"target's top-2 logit gap there {gap:.3g} ({why})")

@torch.inference_mode()
def evaluate(target, drafter, prompts, max_new, eos=(), log=print):
    """Both decodes on every prompt; one line per prompt and a summary through `log`.
    Returns the totals."""
    dev = target.embed_tokens.weight.device
    B = drafter.config.block_size
    # warm-up, untimed: autotuning, first kernel launches
    speculative(target, drafter, prompts[0], 2 * B, eos)
    hist = [0] * (B + 1)                   # hist[k]: cycles that committed k tokens (accepted + 1)
    tot = dict(spec_new=0, greedy_new=0, spec_fwd=0, spec_s=0.0, greedy_s=0.0, identical=0)
    for n, prompt in enumerate(prompts):
        _sync(dev)
        t0 = time.perf_counter()
        spec, accepted, spec_fwd = speculative(target, drafter, prompt, max_new, eos)
        _sync(dev)
        t1 = time.perf_counter()
        ref = greedy(target, prompt, max_new, eos)       # one target forward per token
        _sync(dev)
        t2 = time.perf_counter()
        for x in accepted:
            hist[x] += 1
        diff = divergence(target, prompt, spec, ref)
        for key, value in (("spec_new", len(spec)), ("greedy_new", len(ref)),
                           ("spec_fwd", spec_fwd), ("spec_s", t1 - t0), ("greedy_s", t2 - t1),
                           ("identical", diff is None)):
            tot[key] += value
        tau = sum(accepted) / max(len(accepted), 1)
        log(f"prompt {n}: {len(prompt)} tokens -> {len(spec)} new | "
            f"tau {tau:.2f} over {len(accepted)} cycles | "
            f"target forwards spec {spec_fwd} greedy {len(ref)} | "
            f"tok/s spec {len(spec) / (t1 - t0):.1f} greedy {len(ref) / (t2 - t1):.1f} | "
            f"{diff or 'identical to greedy'}")
    cycles = sum(hist)
    res = dict(tau=sum(k * c for k, c in enumerate(hist)) / max(cycles, 1), hist=hist[1:],
               prompts=len(prompts), identical=tot["identical"], new_tokens=tot["spec_new"],
               spec_forwards=tot["spec_fwd"], greedy_forwards=tot["greedy_new"],
               spec_tok_s=tot["spec_new"] / tot["spec_s"],
               greedy_tok_s=tot["greedy_new"] / tot["greedy_s"],
               spec_ms_per_forward=1e3 * tot["spec_s"] / tot["spec_fwd"],
               greedy_ms_per_forward=1e3 * tot["greedy_s"] / max(tot["greedy_new"], 1))
    log(f"total: tau {res['tau']:.3f} (mean accepted+1 over {cycles} cycles of block {B}) | "
        f"{tot['spec_new']} new tokens | "
        f"target forwards spec {tot['spec_fwd']} greedy {tot['greedy_new']} | "
        f"tok/s spec {res['spec_tok_s']:.1f} greedy {res['greedy_tok_s']:.1f} "
        f"(x{res['spec_tok_s'] / res['greedy_tok_s']:.2f}) | "
        f"ms per target forward: spec {res['spec_ms_per_forward']:.1f} (drafting included) "
        f"greedy {res['greedy_ms_per_forward']:.1f}")
    log("accepted+1 per cycle, count of cycles: "
        + " ".join(f"{k}:{c}" for k, c in enumerate(hist) if k))
    log(f"speculative == greedy on {tot['identical']}/{len(prompts)} prompts")
    return res

# -----------------------------------------------------------------------------
# tau by replay: no decoding

def propose_at(drafter, feats, tokens, doc, pos, anchors, embed, head, argmax=True):
    """Drafter.propose for N anchors of one packed row at once: block j = [tokens[anchors[j]],
    mask x (B-1)], its context the features of its document before the anchor (the training mask,
    dense). feats [S, n_feat*H], tokens/doc/pos [S], anchors [N] ascending -> proposals [N, B-1]
    (argmax=False: their logits [N, B-1, vocab])."""
    c, N, S = drafter.config, anchors.shape[0], tokens.shape[0]
    k = torch.arange(c.block_size, device=tokens.device)
    block = torch.full((N, c.block_size), c.mask_token_id, dtype=torch.long, device=tokens.device)
    block[:, 0] = tokens[anchors]
    keep = torch.ones(N, dtype=torch.bool, device=tokens.device)
    attend = row_attention(c, anchors, keep, doc, S)
    h = drafter.hidden(feats, pos, F.embedding(block.view(-1), embed),
                       (pos[anchors][:, None] + k).view(-1), attend)
    logits = (h.view(N, c.block_size, -1)[:, 1:] @ head.t()).float()
    return logits.argmax(-1) if argmax else logits

@torch.inference_mode()
def replay(target, drafter, seqs, prompt_lens, max_new, eos=(), batch=64):
    """The accepted lengths speculative() would give, without decoding. Its output is the greedy
    continuation (evaluate checks it), so where each cycle starts is fixed by that continuation
    and the drafter: one target forward over prompt + continuation gives every context feature and
    every verification argmax, and the drafter proposes once per cycle for all prompts of a batch.
    seqs: 1-D id tensors, prompt j (prompt_lens[j] tokens) and its greedy continuation of at least
    max_new + B - 1 tokens, past any end-of-sequence token (the last cycle may accept proposals
    beyond max_new or eos, as speculative() does). Returns (acc+1 per cycle for each prompt,
    positions where the continuation differs from the forward's argmax: 0 unless rounding
    differs between the decode and the forward)."""
    B, taps = drafter.config.block_size, drafter.config.target_layer_ids
    embed, head = target.embed_tokens.weight, target.lm_head.weight
    dev, out, differ = embed.device, [], 0
    eos_t = torch.tensor(sorted(eos) or [-1], device=dev)
    for s in range(0, len(seqs), batch):
        chunk, P = seqs[s:s + batch], torch.tensor(prompt_lens[s:s + batch])
        row, cu, doc, pos = _packed([x.to(dev) for x in chunk])
        lens = cu.diff()
        short = (lens < P + max_new + B - 1).nonzero()
        assert not len(short), (f"replay: sequence {s + int(short[0])} has {int(lens[short[0]])} "
                                f"tokens, needs prompt + {max_new + B - 1}")
        feats, logits = target.features_and_logits(row, cu, taps)
        post = logits.argmax(-1)                 # [S]: the target's next token after each position
        new = (pos >= P.to(dev)[doc]) & (pos > 0)
        differ += int(((row[1:] != post[:-1]) & new[1:]).sum())
        a = (cu[:-1] + P).to(dev)                # each prompt's anchor: the prefill's token
        n_new = torch.ones(len(chunk), dtype=torch.long, device=dev)
        done = torch.isin(post[a - 1], eos_t) | (n_new >= max_new)
        cycles, k = [[] for _ in chunk], torch.arange(B, device=dev)
        while not bool(done.all()):
            live = (~done).nonzero()[:, 0]
            at = a[live]
            draft = propose_at(drafter, feats, row, doc, pos, at, embed, head)      # [n, B-1]
            want = post[at[:, None] + k]                                            # [n, B]
            acc = (draft == want[:, :-1]).long().cumprod(1).sum(1)
            # committed this cycle: want[:, :acc+1] (the accepted proposals and the bonus)
            hit = torch.isin(want, eos_t) & (k <= acc[:, None])
            a[live], n_new[live] = at + acc + 1, n_new[live] + acc + 1
            done[live] = hit.any(1) | (n_new[live] >= max_new)
            for j, x in zip(live.tolist(), (acc + 1).tolist()):
                cycles[j].append(x)
        out += cycles
    return out, differ

def tau_summary(cycles, block_size):
    """tau = committed tokens / cycles over all prompts (the loop's total), with a 95% CI over
    prompts: the ratio estimator's, 1.96 * sqrt(sum_j (y_j - tau x_j)^2 / (n (n-1))) / mean(x) for
    prompt j's y_j tokens in x_j cycles; the mean over prompts of each one's own tau, with its CI
    (1.96 standard errors); the histogram of acc+1 (1..block_size)."""
    cycles = [c for c in cycles if c]
    n, x, y = len(cycles), [len(c) for c in cycles], [sum(c) for c in cycles]
    tau = sum(y) / max(sum(x), 1)
    per = [b / a for a, b in zip(x, y)]
    mean = sum(per) / max(n, 1)
    ci = ci_mean = 0.0
    if n > 1:
        ci = 1.96 * (sum((b - tau * a) ** 2 for a, b in zip(x, y)) / (n * (n - 1))) ** 0.5 / (
            sum(x) / n)
        ci_mean = 1.96 * (sum((t - mean) ** 2 for t in per) / (n - 1) / n) ** 0.5
    hist = [0] * block_size
    for c in cycles:
        for k in c:
            hist[k - 1] += 1
    return dict(tau=tau, tau_ci=ci, tau_mean=mean, tau_mean_ci=ci_mean, prompts=n,
                cycles=sum(x), hist=hist)

def tau_text(r):
    # tau_summary's dict as the commands print it, after "tau "
    return (f"{r['tau']:.3f} +- {r['tau_ci']:.3f} (accepted+1 per cycle over {r['cycles']} "
            f"cycles; 95% CI over {r['prompts']} prompts) | mean of per-prompt tau "
            f"{r['tau_mean']:.3f} +- {r['tau_mean_ci']:.3f}")

@torch.inference_mode()
def sampled_tau(target, drafter, prompts, max_new, temperature, seed, eos=()):
    """tau_summary of speculative sampling at `temperature` on `prompts` (on the target's
    device), the drafter's proposals from drafter_sampler, seeded."""
    c, g = drafter.config, torch.Generator(prompts[0].device).manual_seed(seed)
    draft = drafter_sampler(drafter, target.embed_tokens.weight, target.lm_head.weight,
                            temperature, g)
    cycles = speculative_sampling(target, draft, prompts, max_new, temperature, g, c.block_size,
                                  c.target_layer_ids, eos)[1]
    return tau_summary(cycles, c.block_size)

def load_target(path, device, dtype):
    """A checkpoint dir, or a preset's random weights."""
    if os.path.isdir(path):
        return Target.from_pretrained(path, device=device, dtype=dtype)
    return Target.build(TargetConfig.preset(path), device=device, dtype=dtype)

def hist_line(hist):
    # hist[k-1]: cycles that committed k tokens
    return "accepted+1 per cycle, count of cycles: " + " ".join(
        f"{k}:{n}" for k, n in enumerate(hist, 1) if n)

def replay_dataset(target_path, drafter_path, data_dir, max_new, n=None, device=None,
                   temperature=0.0, seed=0):
    """tau by replay on a dataset of prompts (loss mask 0) each followed by its greedy continuation
    (mask 1, >= max_new + B - 1 tokens past any eos), as quality.py writes them: tau_summary's
    dict, plus `differ`. temperature > 0: sampled_tau's dict from the same prompts (the
    continuations unused), seeded."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = load_target(target_path, device, dtype)
    drafter = Drafter.from_pretrained(drafter_path, device=device, dtype=dtype)
    ds = open_dataset(data_dir)
    seqs, lens = [], []
    for i in range(min(n or len(ds), len(ds))):
        tokens, mask = ds.sample(i)
        seqs.append(torch.from_numpy(tokens.astype("int64")))
        lens.append(int(mask.argmax()))
    eos = set(hf_eos(target_path))
    if temperature:
        return sampled_tau(target, drafter, [s[:p].to(device) for s, p in zip(seqs, lens)],
                           max_new, temperature, seed, eos)
    cycles, differ = replay(target, drafter, seqs, lens, max_new, eos)
    return dict(tau_summary(cycles, drafter.config.block_size), differ=differ)

@torch.inference_mode()
def show_block(target, drafter, prompt, path, log=print):
    """The first drafted block of `prompt` as text, beside the target's own greedy tokens there
    (tokenizer.json of checkpoint dir `path`, read by the tokenizers package)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return log("(pip install tokenizers to see a drafted block as text)")
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    B, taps = drafter.config.block_size, drafter.config.target_layer_ids
    ctx, logits = _forward(target, prompt, taps, [len(prompt) - 1])
    seq = torch.cat([prompt, logits.argmax(-1)])
    a = len(seq) - 1
    draft, _ = drafter.propose(ctx, torch.arange(a, device=seq.device), seq[a], a,
                               target.embed_tokens.weight, target.lm_head.weight)
    want = greedy(target, seq, B - 1)
    acc = int((draft.cpu() == torch.tensor(want)).cumprod(0).sum())
    log(f"prompt 0 ends {tok.decode(prompt[-24:].tolist())!r}, the target adds "
        f"{tok.decode([int(seq[a])])!r}")
    log(f"  drafted block: {tok.decode(draft.tolist())!r}")
    log(f"  the target's:  {tok.decode(want)!r} ({acc} of {B - 1} accepted)")

# -----------------------------------------------------------------------------
# prompts

def dataset_prompts(data_dir, n, log=print):
    """The prompts (tokens before the first supervised one) of the first n samples of DATA/val."""
    val = os.path.join(data_dir, "val")
    if not os.path.exists(os.path.join(val, "meta.json")):
        raise SystemExit(f"error: --data {data_dir} has no val/ split; "
                         "prepare it with `prepare.py --val N` "
                         "or pass --prompts chats.jsonl --tokenizer DIR")
    ds, prompts = open_dataset(val), []
    for i in range(len(ds)):
        if len(prompts) == n:
            break
        tokens, mask = ds.sample(i)
        first = int(mask.argmax())           # the first supervised token (every sample has one)
        if first == 0:
            log(f"{val} sample {i}: supervised from its first token, so it has no prompt; skipped")
            continue
        prompts.append(torch.from_numpy(tokens[:first].astype("int64")))
    return prompts

def chat_prompts(path, tokenizer, n, kwargs=None):
    """The first n JSONL prompts (messages, ShareGPT conversations or a prompt string, as
    prepare.py reads them) as the serving engine feeds them to the target: rendered by the
    checkpoint's chat template with add_generation_prompt=True and the same template kwargs, a
    final assistant message (a reference answer) dropped (prepare.Chat.prompt). Raises DataError."""
    chat, prompts = Chat(tokenizer, kwargs, cmd="generate.py --prompts"), []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if len(prompts) == n:
                break
            try:
                if line.strip():
                    prompts.append(torch.from_numpy(chat.prompt(load_line(line))))
            except Bad as e:
                raise DataError(f"{path}:{lineno}: {e.args[0]}: {e.args[1]}")
    return prompts

def hf_eos(path):
    # a checkpoint's eos ids: generation_config.json, else config.json (or its text_config); none
    # for a preset
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                cfg = json.load(f)
            eos = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))
            if eos is not None:
                return [eos] if isinstance(eos, int) else list(eos)
    return []

# -----------------------------------------------------------------------------

def main(argv=None):
    ap = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="tiny",
                    help="Qwen3.5/3.6 checkpoint dir, or a preset (random weights): tiny, "
                    "qwen3.6-27b, qwen3.5-35b-a3b, qwen3.6-35b-a3b")
    ap.add_argument("--drafter", required=True,
                    help="train.py's OUT/drafter, or `random`: untrained, the default geometry")
    ap.add_argument("--data", default=None,
                    help="prepared dataset dir: prompts from DATA/val; default ./data/demo")
    ap.add_argument("--prompts", default=None,
                    help="JSONL of chats instead, rendered as the engine does; needs --tokenizer")
    ap.add_argument("--tokenizer", default=None,
                    help="checkpoint dir whose chat template and tokenizer.json render --prompts")
    ap.add_argument("--chat-template-kwargs", type=kwargs_arg, default={},
                    help="JSON object of template variables for --prompts: those you serve with")
    ap.add_argument("--random-prompts", type=number(int, 0), default=0,
                    help="instead: this many prompts of uniform random ids (cost measurements)")
    ap.add_argument("--prompt-len", type=number(int, 1), default=1024,
                    help="tokens per random prompt")
    ap.add_argument("--num-prompts", type=number(int, 1), default=8,
                    help="prompts taken from --data or --prompts")
    ap.add_argument("--max-new-tokens", type=number(int, 1), default=256,
                    help="tokens generated per prompt (both decodes)")
    ap.add_argument("--eos", default=None,
                    help="comma-separated end-of-sequence ids; default: the checkpoint's")
    ap.add_argument("--seed", type=number(int, 0), default=0,
                    help="seed of --random-prompts and of --drafter random")
    ap.add_argument("--temperature", type=number(float, 0), default=0.0,
                    help="0: greedy; > 0: speculative sampling at this temperature (tau only)")
    ap.add_argument("--replay", action="store_true",
                    help="tau by replay (one greedy decode, one forward; the same tau, faster)")
    args = ap.parse_args(argv)
    try:
        eos = [int(x) for x in args.eos.split(",")] if args.eos else None
    except ValueError:
        sys.exit(f"error: --eos {args.eos}: comma-separated token ids, e.g. --eos 248046,248044")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.backends.cuda.matmul.allow_tf32 = True
    preset = not os.path.isdir(args.target)
    try:
        tcfg = TargetConfig.preset(args.target) if preset else TargetConfig.from_hf(args.target)
        if args.drafter == "random":      # train.py's default geometry, initialised on the device
            torch.manual_seed(args.seed)
            with torch.device(device):
                drafter = Drafter(DrafterConfig.from_target(tcfg))
            drafter = drafter.to(dtype=dtype)
        elif not os.path.exists(os.path.join(args.drafter, "config.json")):
            raise ValueError(f"--drafter {args.drafter}: no config.json there; "
                             "pass train.py's OUT/drafter")
        else:
            drafter = Drafter.from_pretrained(args.drafter, device=device, dtype=dtype)
    except (ValueError, KeyError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    c = drafter.config
    checks = [(c.hidden_size == tcfg.hidden_size,
               f"hidden size {c.hidden_size}, target's {tcfg.hidden_size}"),
              (c.vocab_size == tcfg.vocab_size,
               f"vocab {c.vocab_size}, target's {tcfg.vocab_size}"),
              (max(c.target_layer_ids) < tcfg.num_hidden_layers,
               f"target_layer_ids {c.target_layer_ids} past "
               f"the target's {tcfg.num_hidden_layers} layers"),
              (0 <= c.mask_token_id < tcfg.vocab_size,
               f"mask_token_id {c.mask_token_id} outside the vocab")]
    for ok, msg in checks:
        if not ok:
            sys.exit(f"error: --drafter {args.drafter} does not fit --target {args.target}: {msg}")
    # the prompts before the target: a bad prompt file fails in seconds, not after loading the
    # target's weights
    if args.random_prompts:
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, tcfg.vocab_size, (args.prompt_len,), generator=g)
                   for _ in range(args.random_prompts)]
    elif args.prompts and not args.tokenizer:
        sys.exit("error: --prompts needs --tokenizer DIR (the checkpoint whose chat template "
                 "renders the prompts)")
    else:
        data_dir = args.data or demo_of(args.target)[0]
        try:               # a missing file, a broken dataset or tokenizer: one line naming it
            prompts = (chat_prompts(args.prompts, args.tokenizer, args.num_prompts,
                                    args.chat_template_kwargs) if args.prompts
                       else dataset_prompts(data_dir, args.num_prompts))
        except (DataError, OSError) as e:
            sys.exit(f"error: {e}")
    if not prompts:
        sys.exit("error: no prompts (empty --prompts file or val split)")
    bad = [i for i, p in enumerate(prompts) if int(p.max()) >= tcfg.vocab_size]
    if bad:
        sys.exit(f"error: prompt {bad[0]} has token ids past the target's vocab "
                 f"({tcfg.vocab_size}): wrong tokenizer or dataset for this target")
    try:
        target = load_target(args.target, device, dtype)
    except (ValueError, KeyError, FileNotFoundError) as e:
        sys.exit(f"error: --target {args.target}: {e}")
    eos = hf_eos(args.target) if eos is None else eos
    print(f"target {args.target} on {device} ({dtype}) | "
          f"drafter {args.drafter}: {c.num_hidden_layers} layers, "
          f"block {c.block_size}, mask token {c.mask_token_id}, taps {c.target_layer_ids} | "
          f"{len(prompts)} prompts, {args.max_new_tokens} new tokens each, eos {eos or 'none'}")
    prompts = [p.to(device) for p in prompts]
    if args.temperature:
        r = sampled_tau(target, drafter, prompts, args.max_new_tokens, args.temperature,
                        args.seed, set(eos))
        print(f"sampling at T = {args.temperature}: tau {tau_text(r)}")
        print(hist_line(r["hist"]))
        return r
    if args.replay:
        t0 = time.time()
        seqs = target.greedy(prompts, args.max_new_tokens + c.block_size - 1)
        seqs = [s[:len(p) + args.max_new_tokens + c.block_size - 1] for s, p in zip(seqs, prompts)]
        cycles, differ = replay(target, drafter, seqs, [len(p) for p in prompts],
                                args.max_new_tokens, set(eos))
        r = tau_summary(cycles, c.block_size)
        print(f"replay: tau {tau_text(r)} | {differ} decoded tokens differ from the forward's "
              f"argmax | {time.time() - t0:.1f}s")
        print(hist_line(r["hist"]))
        return r
    res = evaluate(target, drafter, prompts, args.max_new_tokens, set(eos))
    if os.path.exists(os.path.join(args.target, "tokenizer.json")):
        show_block(target, drafter, prompts[0], args.target)
    return res

if __name__ == "__main__":
    main()
