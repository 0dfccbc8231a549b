"""
Greedy speculative decoding with the target and an exported DFlash drafter, the way a serving
engine runs it (z-lab/dflash's dflash_generate loop), beside plain greedy decoding of the same
target: the real acceptance length tau (accepted + 1 per cycle, as SGLang and z-lab's benchmark
print it), and a check that both decodes give the same tokens.

  python generate.py --drafter out/drafter --max-new-tokens 48   # tiny target, demo prompts
  python generate.py --target /ckpt/Qwen3.6-27B --drafter out/drafter --prompts gsm8k.jsonl \\
      --tokenizer /ckpt/Qwen3.6-27B --chat-template-kwargs '{"enable_thinking": false}'
"""
import itertools
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from layers import positions_from_cu
from target import Target, TargetConfig
from model import Drafter, row_attention
from data import ArgParser, Bad, DataError, kwargs_arg, load_line, number, open_dataset
from prepare import Chat

# -----------------------------------------------------------------------------
# the decodes

def speculative(target, drafter, prompt, max_new, eos=()):
    """Greedy speculative decoding of `prompt` [P] with Drafter.propose (the serving forward) ->
    (new tokens, acc+1 per cycle, target forwards): speculative sampling, distributions one-hot."""
    c, embed, head = drafter.config, target.embed_tokens.weight, target.lm_head.weight

    def draft(feats, tokens, doc, pos, anchors):      # one prompt: anchors = [its last position]
        a = len(tokens) - 1
        x = drafter.propose(feats[:a], pos[:a], tokens[a], a, embed, head)[0][None]
        return x, F.one_hot(x, len(head)).float()
    (new,), (cycles,) = speculative_sampling(target, draft, [prompt], max_new, 0, None,
                                             c.block_size, c.target_layer_ids, eos)
    return new, cycles, 1 + len(cycles)

def _packed(seqs):  # sequences as one row's documents: ids, cu_seqlens (CPU), doc, pos (device)
    lens, dev = torch.tensor([len(s) for s in seqs]), seqs[0].device
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
    return (torch.cat(seqs), cu, torch.repeat_interleave(torch.arange(len(seqs)), lens).to(dev),
            positions_from_cu(cu).to(dev))

def sampling_probs(logits, temperature, top_p=1.0, top_k=0):
    """The distribution a serving engine samples from (z-lab's _sampling_probs; SGLang and vLLM
    alike): softmax(logits / T) over the top_k largest (0: all), then the smallest head of them,
    by probability, whose mass reaches top_p, renormalised; T = 0: one-hot on the argmax."""
    if not temperature:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    s = logits.float() / temperature
    if 0 < top_k < s.shape[-1]:
        v, i = s.topk(top_k, -1)
        s = torch.full_like(s, -torch.inf).scatter(-1, i, v)
    p = s.softmax(-1)
    if top_p < 1:    # keep a token if the mass before it (in descending order) is under top_p
        sp, order = p.sort(-1, descending=True)
        p = torch.zeros_like(p).scatter(-1, order, sp * (sp.cumsum(-1) - sp < top_p))
        p = p / p.sum(-1, keepdim=True)
    return p

def speculative_sampling(target, draft, prompts, max_new, temperature, generator, B, taps, eos=(),
                         top_p=1.0, top_k=0):
    """Speculative decoding of many prompts at once, verified as SGLang and vLLM verify (Leviathan
    et al., arXiv:2211.17192). A cycle: draft() proposes B-1 tokens per prompt from [last committed
    token, mask x (B-1)] and the target features before that token; one target forward over every
    prompt + its proposals gives p_i, the target's sampling_probs after slot i (T = 0: one-hot on
    the argmax); x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), the first
    rejected slot redrawn from max(p_i - q_i, 0), a block accepted whole followed by a draw from
    p_B: each output follows the target's sampling distribution exactly. No KV cache: every forward
    re-runs the whole sequences. Returns (new tokens, acc+1 per cycle) per prompt."""
    dev, k = prompts[0].device, torch.arange(B, device=prompts[0].device)
    sample = lambda p: torch.multinomial(p, 1, generator=generator)[:, 0]
    probs = lambda logits: sampling_probs(logits, temperature, top_p, top_k)
    ids, cu, _, _ = _packed(prompts)
    feats, logits = target.features_and_logits(ids, cu, taps, at=(cu[1:] - 1).to(dev))
    first = sample(probs(logits))
    seqs = [torch.cat([p, first[j:j + 1]]) for j, p in enumerate(prompts)]
    # features of each prompt's committed positions but its last (the anchor: none yet)
    ctx, cycles = [feats[cu[j]:cu[j + 1]] for j in range(len(prompts))], [[] for _ in prompts]
    news = [[t] for t in first.tolist()]    # the committed tokens, on the host
    going = lambda j: len(news[j]) < max_new and not any(t in eos for t in news[j][-B:])
    live = list(filter(going, range(len(prompts))))
    while live:
        # one draft call for every live anchor (a placeholder feature row there), then the forward
        ids, cu, doc, pos = _packed([seqs[j] for j in live])
        f = torch.cat([torch.cat([ctx[j], ctx[j].new_zeros(1, ctx[j].shape[1])]) for j in live])
        x, q = draft(f, ids, doc, pos, (cu[1:] - 1).to(dev))      # [m, B-1], [m, B-1, V]
        ids, cu, _, _ = _packed([torch.cat([seqs[j], x[i]]) for i, j in enumerate(live)])
        at = (cu[:-1].to(dev) + torch.tensor([len(seqs[j]) - 1 for j in live], device=dev))
        feats, logits = target.features_and_logits(ids, cu, taps, at=(at[:, None] + k).view(-1))
        p = probs(logits).view(len(live), B, -1)                               # [m, B, V]
        u = torch.rand(x.shape, generator=generator, device=dev)
        px, qx = p[:, :-1].gather(-1, x[..., None])[..., 0], q.gather(-1, x[..., None])[..., 0]
        acc = (u * qx < px).long().cumprod(1).sum(1)               # u < p/q, without dividing by 0
        rest = (p - F.pad(q, (0, 0, 0, 1)))[torch.arange(len(live), device=dev), acc]  # q: 0 at B
        bonus = sample(rest.clamp(min=0))                 # max(p - q, 0); multinomial renormalises
        xs, bs = x.tolist(), bonus.tolist()     # copies to the host per cycle, not per prompt
        for i, (j, c) in enumerate(zip(live, acc.tolist())):
            seqs[j] = torch.cat([seqs[j], x[i, :c], bonus[i:i + 1]])
            news[j], cycles[j] = news[j] + xs[i][:c] + [bs[i]], cycles[j] + [c + 1]
            # a finished prompt lets go of this cycle's features
            ctx[j] = feats[int(cu[i]):int(cu[i]) + len(seqs[j]) - 1] if going(j) else None
        live = list(filter(going, live))
    news = [n[:max_new] for n in news]          # cut after the first end-of-sequence token
    return [next((n[:i + 1] for i, t in enumerate(n) if t in eos), n) for n in news], cycles

def greedy(target, prompt, max_new, eos=()):
    """Plain greedy decoding, one full-sequence target forward per token. Returns the new tokens."""
    seq = prompt
    for _ in range(max_new):
        seq = torch.cat([seq, target.logits(seq, torch.tensor([0, len(seq)]), at=[-1]).argmax(-1)])
        if int(seq[-1]) in eos:
            break
    return seq[len(prompt):].tolist()

def divergence(target, prompt, spec, ref):
    """None if the two decodes agree; else a line naming the first differing new token and whether
    the target's own top-2 logits there are close enough for rounding to flip."""
    if spec == ref:
        return None
    i = next((i for i, (s, r) in enumerate(zip(spec, ref)) if s != r), min(len(spec), len(ref)))
    ids = torch.cat([prompt, prompt.new_tensor(ref[:i])])
    top, second = target.logits(ids, torch.tensor([0, len(ids)]), at=[-1])[0].topk(2)[0].tolist()
    bf16 = target.embed_tokens.weight.dtype == torch.bfloat16   # bf16 keeps 8 significant bits
    near = top - second <= (2 ** -7 if bf16 else 1e-4) * abs(top)
    s, r = (x[i] if i < len(x) else "end" for x in (spec, ref))
    return (f"DIVERGES at new token {i}: spec {s} vs greedy {r}, target's top-2 logit gap there "
            f"{top - second:.3g} (" + ("a near-tie: forwards over other lengths round differently)"
                                       if near else "NOT a near-tie: a bug)"))

@torch.inference_mode()
def evaluate(target, drafter, prompts, max_new, eos=(), log=print):
    """Both decodes on every prompt: a line per prompt, a summary through `log`, the totals."""
    cycles, fwd, n_ref, same = [], 0, 0, 0
    for i, prompt in enumerate(prompts):
        spec, acc, f = speculative(target, drafter, prompt, max_new, eos)
        ref = greedy(target, prompt, max_new, eos)       # one target forward per token
        diff = divergence(target, prompt, spec, ref)
        cycles, fwd, n_ref, same = cycles + [acc], fwd + f, n_ref + len(ref), same + (not diff)
        log(f"prompt {i}: {len(prompt)} tokens -> {len(spec)} new | tau "
            f"{sum(acc) / max(len(acc), 1):.2f} over {len(acc)} cycles | target forwards spec {f} "
            f"greedy {len(ref)} | {diff or 'identical to greedy'}")
    r = dict(tau_summary(cycles, drafter.config.block_size), identical=same, spec_forwards=fwd,
             greedy_forwards=n_ref)
    log(f"total: tau {tau_text(r)} | target forwards spec {fwd} greedy {n_ref}\n"
        f"{hist_line(r['hist'])}\nspeculative == greedy on {same}/{len(prompts)} prompts")
    return r

# -----------------------------------------------------------------------------
# tau by replay: no decoding; tau under sampling

def propose_at(drafter, target, ctx, tokens, doc, pos, anchors, temperature=0.0, generator=None,
               top_p=1.0, top_k=0):
    """Drafter.propose for N anchors of one packed row at once, each block's context the features
    of its document before its anchor (the training mask, dense): ctx [S, H] = drafter.context,
    tokens/doc/pos [S], anchors [N] ascending -> (proposals [N, B-1], their distributions q
    [N, B-1, V] at T > 0, else None): DFlash the argmax or draws from sampling_probs, DFlash2
    the candidate selector's walk, q zero outside each slot's candidates (dflash2.py; z-lab's
    walk applies neither top_p nor top_k)."""
    c, k = drafter.config, torch.arange(drafter.config.block_size, device=tokens.device)
    block = torch.where(k == 0, tokens[anchors][:, None], c.mask_token_id)  # [N, B]: anchor, masks
    attend = row_attention(c, anchors, torch.ones_like(anchors, dtype=torch.bool), doc, len(tokens))
    h = drafter.hidden(ctx, pos, F.embedding(block.view(-1), target.embed_tokens.weight),
                       (pos[anchors][:, None] + k).view(-1), attend)
    h = h.view(len(anchors), c.block_size, -1)[:, 1:]                       # [N, B-1, H]
    logits = (h @ target.lm_head.weight.t()).float()
    if c.conv_kernel_size:      # the walk draws its slots by inverse CDF at uniforms, in order
        u = temperature and torch.rand(logits.shape[:2], generator=generator, device=h.device)
        x, cand, q = drafter.candidate_selector.walk(h, tokens[anchors], logits, temperature, u)
        return x, q if q is None else torch.zeros_like(logits).scatter_(-1, cand, q)
    if not temperature:
        return logits.argmax(-1), None
    q = sampling_probs(logits, temperature, top_p, top_k)
    return torch.multinomial(q.flatten(0, 1), 1, generator=generator).view(q.shape[:2]), q

@torch.inference_mode()
def replay(target, drafter, seqs, prompt_lens, max_new, eos=(), batch=64):
    """speculative()'s acc+1 per cycle per prompt, without decoding: its output is the greedy
    continuation, so one forward over prompt j (prompt_lens[j] ids of seqs[j]) and >= max_new + B-1
    ids of its continuation (past any eos: a last cycle may accept beyond it) gives every context
    feature and verifying argmax. Also: continuation tokens that differ from the argmax (0 unless
    the decode and the forward round differently)."""
    c, dev, out, differ = drafter.config, target.lm_head.weight.device, [], 0
    B, k, eos_t = c.block_size, torch.arange(c.block_size, device=dev), torch.tensor(
        sorted(eos) or [-1], device=dev)
    short = [j for j, (x, p) in enumerate(zip(seqs, prompt_lens)) if len(x) < p + max_new + B - 1]
    assert not short, f"replay: sequences {short} too short: each needs prompt + {max_new + B - 1}"
    for s in range(0, len(seqs), batch):
        chunk, P = seqs[s:s + batch], torch.tensor(prompt_lens[s:s + batch])
        row, cu, doc, pos = _packed([x.to(dev) for x in chunk])
        feats, logits = target.features_and_logits(row, cu, c.target_layer_ids)
        ctx = drafter.context(feats)             # fused once for the batch's every cycle
        post = logits.argmax(-1)                 # [S]: the target's next token after each position
        differ += int(((row[1:] != post[:-1]) & (pos >= P.to(dev)[doc])[1:] & (pos[1:] > 0)).sum())
        a0 = (cu[:-1] + P).to(dev)               # each prompt's first anchor: the prefill's token
        a, done = a0.clone(), torch.isin(post[a0 - 1], eos_t) | (max_new <= 1)
        out += [[] for _ in chunk]
        while len(live := (~done).nonzero()[:, 0]):
            at = a[live]
            draft = propose_at(drafter, target, ctx, row, doc, pos, at)[0]         # [n, B-1]
            want = post[at[:, None] + k]                                            # [n, B]
            acc = (draft == want[:, :-1]).long().cumprod(1).sum(1)
            a[live] = at + acc + 1     # committed: want[:, :acc+1], the accepted and the bonus
            done[live] = ((torch.isin(want, eos_t) & (k <= acc[:, None])).any(1)
                          | (a[live] - a0[live] + 1 >= max_new))
            for j, x in zip(live.tolist(), (acc + 1).tolist()):
                out[s + j].append(x)
    return out, differ

def tau_summary(cycles, block_size):
    """tau = committed tokens / cycles over all prompts (the loop's total), with the ratio
    estimator's 95% CI over prompts, 1.96 * sqrt(sum_j (y_j - tau x_j)^2 / (n (n-1))) / mean(x) for
    prompt j's y_j tokens in x_j cycles; the mean of per-prompt tau with its CI; the histogram."""
    cycles = [c for c in cycles if c]
    n, x, y = len(cycles), [len(c) for c in cycles], [sum(c) for c in cycles]
    tau, per = sum(y) / max(sum(x), 1), [b / a for a, b in zip(x, y)]
    # 1.96 standard errors of a mean (the residuals y_j - tau x_j sum to 0)
    ci = lambda v: 1.96 * statistics.stdev(v) / n ** 0.5 if n > 1 else 0.0
    return dict(tau=tau, tau_ci=ci([b - tau * a for a, b in zip(x, y)]) / (sum(x) / max(n, 1)),
                tau_mean=sum(per) / max(n, 1), tau_mean_ci=ci(per), prompts=n, cycles=sum(x),
                hist=[sum(c.count(k) for c in cycles) for k in range(1, block_size + 1)])

def tau_text(r):  # tau_summary's dict as the commands print it, after "tau "
    return (f"{r['tau']:.3f} +- {r['tau_ci']:.3f} (accepted+1 per cycle over {r['cycles']} "
            f"cycles; 95% CI over {r['prompts']} prompts) | mean of per-prompt tau "
            f"{r['tau_mean']:.3f} +- {r['tau_mean_ci']:.3f}")

def hist_line(hist):  # hist[k-1]: cycles that committed k tokens
    return "accepted+1 per cycle, count of cycles: " + " ".join(
        f"{k}:{n}" for k, n in enumerate(hist, 1) if n)

@torch.inference_mode()
def sampled_tau(target, drafter, prompts, max_new, temperature, seed, eos=(), top_p=1.0, top_k=0):
    """tau_summary of speculative sampling at temperature, top_p, top_k (sampling_probs)."""
    c, g = drafter.config, torch.Generator(prompts[0].device).manual_seed(seed)

    def draft(feats, tokens, doc, pos, anchors):      # [n, B-1] proposals, [n, B-1, V] their q
        return propose_at(drafter, target, drafter.context(feats), tokens, doc, pos, anchors,
                          temperature, g, top_p, top_k)
    return tau_summary(speculative_sampling(target, draft, prompts, max_new, temperature, g,
                                            c.block_size, c.target_layer_ids, eos, top_p, top_k)[1],
                       c.block_size)

def load_target(path, device, dtype):  # a checkpoint dir, or a preset's random weights
    return (Target.from_pretrained(path, device=device, dtype=dtype) if os.path.isdir(path)
            else Target.build(TargetConfig.preset(path), device=device, dtype=dtype))

def device_dtype(device=None):   # default: the GPU if any; bf16 there, fp32 on the CPU
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32

def replay_dataset(target_path, drafter_path, data_dir, max_new, n=None, device=None,
                   temperature=0.0, seed=0, top_p=1.0, top_k=0):
    """tau by replay on a dataset of prompts (loss mask 0) each followed by its greedy continuation
    (mask 1, >= max_new + B - 1 tokens past any eos), as quality.py writes them: tau_summary's
    dict, plus `differ`. temperature > 0: sampled_tau's dict from the same prompts, seeded."""
    device, dtype = device_dtype(device)
    target = load_target(target_path, device, dtype)
    drafter = Drafter.from_pretrained(drafter_path, device=device, dtype=dtype)
    (seqs, lens), eos = zip(*_samples(data_dir, n)), set(hf_eos(target_path))
    if temperature:
        return sampled_tau(target, drafter, [s[:p].to(device) for s, p in zip(seqs, lens)],
                           max_new, temperature, seed, eos, top_p, top_k)
    cycles, differ = replay(target, drafter, seqs, lens, max_new, eos)
    return dict(tau_summary(cycles, drafter.config.block_size), differ=differ)

# -----------------------------------------------------------------------------
# prompts

def _samples(path, n=None):  # (ids, index of the first supervised token) of the first n samples
    ds = open_dataset(path)
    return ((torch.from_numpy(t.astype("int64")), int(m.argmax()))
            for t, m in map(ds.sample, range(min(n or len(ds), len(ds)))))

def dataset_prompts(data_dir, n):
    """The first n prompts of DATA/val: the tokens before each sample's first supervised one."""
    val = os.path.join(data_dir, "val")
    if not os.path.exists(os.path.join(val, "meta.json")):
        raise DataError(f"--data {data_dir} has no val/ split; prepare it with `prepare.py --val "
                        "N` or pass --prompts chats.jsonl --tokenizer DIR")
    return list(itertools.islice((s[:p] for s, p in _samples(val) if p), n))

def chat_prompts(path, tokenizer, n, kwargs=None):
    """The first n JSONL prompts as the serving engine renders them (prepare.Chat.prompt)."""
    chat, prompts = Chat(tokenizer, kwargs, cmd="generate.py --prompts"), []
    with open(path) as f:
        for lineno, line in itertools.islice(((i, s) for i, s in enumerate(f, 1) if s.strip()), n):
            try:
                prompts.append(torch.from_numpy(chat.prompt(load_line(line))))
            except Bad as e:
                raise DataError(f"{path}:{lineno}: {e}")
    return prompts

def hf_eos(path):  # eos ids: generation_config.json, else config.json (text_config); preset: []
    for file in (os.path.join(path, n) for n in ("generation_config.json", "config.json")):
        cfg = json.load(open(file)) if os.path.exists(file) else {}
        eos = cfg.get("eos_token_id", cfg.get("text_config", {}).get("eos_token_id"))
        if eos is not None:
            return [eos] if isinstance(eos, int) else list(eos)
    return []

# -----------------------------------------------------------------------------

def main(argv=None):
    ap = ArgParser(description=__doc__)
    arg = ap.add_argument
    arg("--target", default="tiny", help="Qwen3.5/3.6 checkpoint dir, or a target.py preset")
    arg("--drafter", required=True, help="train.py's OUT/drafter (a z-lab format drafter dir)")
    arg("--data", help="prepared dataset dir: prompts from DATA/val; default ./data/demo")
    arg("--prompts", help="JSONL of chats instead (messages, ShareGPT conversations or "
        "{\"prompt\": str}; a final assistant message dropped), rendered as the engine does")
    arg("--tokenizer", help="checkpoint dir whose chat template and tokenizer render --prompts")
    arg("--chat-template-kwargs", type=kwargs_arg, default={},
        help="JSON object of template variables for --prompts: those you serve with")
    arg("--num-prompts", type=number(int, 1), default=8, help="prompts taken")
    arg("--max-new-tokens", type=number(int, 1), default=256, help="tokens decoded per prompt")
    arg("--eos", help="comma-separated end-of-sequence ids; default: the checkpoint's")
    arg("--seed", type=number(int, 0), default=0, help="of --temperature's sampling")
    arg("--temperature", type=number(float, 0), default=0.0, help="> 0: speculative sampling")
    arg("--top-p", type=number(float, 0, hi=1, above=True), default=1.0, help="with --temperature: "
        "sample from the likeliest tokens holding this much mass, as served (Qwen3.6: 0.95)")
    arg("--top-k", type=number(int, 0), default=0, help="with --temperature: sample from the k "
        "likeliest tokens, as served (Qwen3.6: 20); 0: all")
    arg("--replay", action="store_true", help="tau by replay: the same tau, without decoding")
    args = ap.parse_args(argv)
    try:
        eos = {int(x) for x in args.eos.split(",")} if args.eos else None
    except ValueError:
        sys.exit(f"error: --eos {args.eos}: comma-separated token ids, e.g. --eos 248046,248044")
    if (args.top_p < 1 or args.top_k) and not args.temperature:
        sys.exit("error: --top-p/--top-k shape speculative sampling: give --temperature > 0 too")
    if args.prompts and not args.tokenizer:
        sys.exit("error: --prompts needs --tokenizer DIR (its chat template renders them)")
    if not os.path.exists(os.path.join(args.drafter, "config.json")):
        sys.exit(f"error: --drafter {args.drafter}: no config.json there (train.py's OUT/drafter)")
    device, dtype = device_dtype()
    try:  # the drafter and the prompts before the target's weights: a bad file fails in seconds
        tcfg = (TargetConfig.from_hf(args.target) if os.path.isdir(args.target)
                else TargetConfig.preset(args.target))
        drafter = Drafter.from_pretrained(args.drafter, device=device, dtype=dtype)
        demo = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo")
        prompts = (chat_prompts(args.prompts, args.tokenizer, args.num_prompts,
                                args.chat_template_kwargs) if args.prompts
                   else dataset_prompts(args.data or demo, args.num_prompts))
        c, V, L, H = drafter.config, tcfg.vocab_size, tcfg.num_hidden_layers, tcfg.hidden_size
        fit, bad = f"--drafter {args.drafter} does not fit --target {args.target}: ", [
            i for i, p in enumerate(prompts) if int(p.max()) >= V]
        for wrong, msg in [
                ((c.hidden_size, c.vocab_size) != (H, V), f"{fit}hidden size {c.hidden_size}, "
                 f"vocab {c.vocab_size}; the target's {H}, {V}"),
                (max(c.target_layer_ids) >= L,
                 f"{fit}target_layer_ids {c.target_layer_ids} past the target's {L} layers"),
                (not 0 <= c.mask_token_id < V, f"{fit}mask_token_id {c.mask_token_id} outside "
                 "the vocab"), (not prompts, "no prompts (empty --prompts file or val split)"),
                (bad, f"prompts {bad} have token ids past the target's vocab ({V}): wrong "
                 "tokenizer or dataset for this target")]:
            if wrong:
                sys.exit(f"error: {msg}")
        target = load_target(args.target, device, dtype)
    except (ValueError, KeyError, OSError) as e:       # DataError is a ValueError
        sys.exit(f"error: {e}")
    eos, N, B = set(hf_eos(args.target) if eos is None else eos), args.max_new_tokens, c.block_size
    print(f"target {args.target} on {device} ({dtype}) | drafter {args.drafter}: "
          f"{c.num_hidden_layers} layers, block {B}, mask token {c.mask_token_id}, taps "
          f"{c.target_layer_ids} | {len(prompts)} prompts, {N} new tokens each, eos "
          f"{sorted(eos) or 'none'}")
    prompts, t0 = [p.to(device) for p in prompts], time.time()
    if not (args.temperature or args.replay):
        return evaluate(target, drafter, prompts, N, eos)
    if args.temperature:
        r = sampled_tau(target, drafter, prompts, N, args.temperature, args.seed, eos, args.top_p,
                        args.top_k)
        how = f"sampling at T = {args.temperature}, top-p {args.top_p}, top-k {args.top_k}"
    else:                  # the greedy continuations, decoded with the target's KV caches
        seqs = [s[:len(p) + N + B - 1] for s, p in zip(target.greedy(prompts, N + B - 1), prompts)]
        cycles, differ = replay(target, drafter, seqs, [len(p) for p in prompts], N, eos)
        r, how = tau_summary(cycles, B), f"replay ({differ} decoded tokens differ from the argmax)"
    print(f"{how}: tau {tau_text(r)} | {time.time() - t0:.1f}s\n{hist_line(r['hist'])}")
    return r

if __name__ == "__main__":
    main()
