"""
How many tokens does a drafter trained here get accepted, on a target that has learned something?
This builds (or reuses) a small Qwen3.5 target trained from scratch on Python source that every
machine running this trainer has (the standard library, numpy and torch), its answers as the recipe
makes them, trains a drafter with train.py and prints tau, the accepted length per speculative
cycle, replayed exactly on held-out prompts (generate.py's replay), mean +- 95% CI over prompts.

  python quality.py                              # build or reuse; the defaults; tau on test
  python quality.py --split dev -- --lr 1e-3     # tune on dev: flags after -- go to train.py
  python quality.py --curve 1500,3000,4500       # tau of runs of these many steps: converged?
  python quality.py --tau-temperature 1 -- --kd 0.5   # distilled; tau greedy and sampled at T = 1
  python quality.py --build-only                 # the target and its data, nothing else

Files are split by a hash of their path: 80% train the target, 10% give the drafter's training
prompts, 5% dev, 5% test. A prompt is 32-192 tokens of a held-out file from a line start; the
drafter trains on the target's answers sampled at temperature 0.7 (SpecForge's regenerate default),
tau is measured on greedy continuations. Everything is cached under --work by its settings; a build
that changes only the data (prompts, answer length or temperature) reuses an earlier build's target.
"""
import argparse
import glob
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass

import numpy as np

from data import ArgParser, DataError, cut_at_eos, number, open_dataset, package, write_dataset

EOT, MASK = "<|endoftext|>", "<|mask|>"   # ids 0 and vocab-1 (train.py's default mask id)
SKIP = {"test", "tests", "testing", "__pycache__", "site-packages", "dist-packages", "idlelib",
        "turtledemo", "lib2to3", "ensurepip"}

@dataclass
class Build:
    """Everything the target and its data depend on; the cache key."""
    vocab: int = 4096               # BPE vocab, EOT and MASK included
    hidden: int = 384               # the target's d_model
    layers: int = 8                 # decoder layers: every 4th full attention, the rest GDN
    intermediate: int = 1024        # SwiGLU width
    seq: int = 512                  # tokens per training row
    batch: int = 64                 # rows per step
    steps: int = 1500               # optimizer steps (the README has the build times)
    lr: float = 3e-3                # peak AdamW lr (warmup 5%, cosine to 10%)
    max_files: int = 0              # corpus files read (0: all), for tests
    train_prompts: int = 4000       # drafter training prompts (their sampled answers)
    eval_prompts: int = 128         # dev and test prompts each
    new_tokens: int = 256           # answer length (eval: + block_size, the replay's lookahead)
    temperature: float = 0.7        # answers of the drafter's training set
    seed: int = 0

    def key(self):
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]

# what the target alone depends on: a build differing in its data only reuses an earlier target
TARGET_FIELDS = ("vocab", "hidden", "layers", "intermediate", "seq", "batch", "steps", "lr",
                 "max_files", "seed")

def log(*a):
    print(*a, flush=True)

# -----------------------------------------------------------------------------
# the corpus: installed Python source, split by a hash of each file's path

def corpus(max_files=0):
    """[(split, name, text)] of the .py files of the standard library, numpy and torch (test
    folders skipped), in a fixed order."""
    import numpy
    import torch
    roots = [("stdlib", sysconfig.get_paths()["stdlib"]),
             ("numpy", os.path.dirname(numpy.__file__)),
             ("torch", os.path.dirname(torch.__file__))]
    files = []
    for name, root in roots:
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in SKIP and not x.startswith("config-"))
            for f in sorted(n for n in names if n.endswith(".py")):
                rel = f"{name}/{os.path.relpath(os.path.join(d, f), root)}"
                with open(os.path.join(d, f), encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
                h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 100
                split = "train" if h < 80 else "draft" if h < 90 else "dev" if h < 95 else "test"
                if text.strip():
                    files.append((split, rel, text))
    return files[:max_files] if max_files else files

def train_tokenizer(texts, vocab):
    tk = package("tokenizers", "quality.py")
    decoders, models, pre_tokenizers = tk.decoders, tk.models, tk.pre_tokenizers
    trainers = tk.trainers
    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 1, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([MASK])   # never in the text: the drafter's mask slots, the last id
    assert tok.token_to_id(EOT) == 0 and tok.token_to_id(MASK) == vocab - 1, tok.get_vocab_size()
    return tok

def distinct4(seqs):
    """Mean over sequences of distinct 4-grams / 4-grams: 1 for text that never repeats itself,
    near 0 for a loop."""
    r = [len({tuple(s[i:i + 4]) for i in range(len(s) - 3)}) / (len(s) - 3) for s in seqs
         if len(s) > 3]
    return float(np.mean(r)) if r else float("nan")

# -----------------------------------------------------------------------------
# the target: a Qwen3.5 text model through target.py's own layers, saved as an HF checkpoint

def hf_config(b):
    heads = max(1, b.hidden // 64)
    # heads of 64 (kv heads a third, GDN key heads half); under 256 wide the `tiny` preset's
    # layout (4 heads of hidden/2, GDN 2 key and 4 value heads of hidden/4), the demo's geometry
    wide = b.hidden >= 256
    att = dict(num_attention_heads=heads, num_key_value_heads=max(1, heads // 3), head_dim=64,
               linear_num_key_heads=max(1, heads // 2), linear_num_value_heads=heads,
               linear_key_head_dim=64, linear_value_head_dim=64) if wide else dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=b.hidden // 2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=b.hidden // 4,
        linear_value_head_dim=b.hidden // 4)
    return dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
                vocab_size=b.vocab, hidden_size=b.hidden, intermediate_size=b.intermediate,
                num_hidden_layers=b.layers, full_attention_interval=4,
                layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                             for i in range(b.layers)], **att, linear_conv_kernel_dim=4,
                rms_norm_eps=1e-6, hidden_act="silu", max_position_embeddings=4096,
                rope_parameters=dict(rope_type="default", rope_theta=100000.0,
                                     partial_rotary_factor=0.25),
                tie_word_embeddings=False, eos_token_id=0, torch_dtype="bfloat16")

def save_hf(model, cfg, tok, out, shard_bytes=15 << 20):
    """config.json, generation_config.json, tokenizer.json and bf16 safetensors shards of at most
    shard_bytes (small enough to travel between machines) with their index."""
    import torch
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    state = {("lm_head.weight" if k == "lm_head.weight" else "model." + k):
             v.detach().to(torch.bfloat16 if v.dtype == torch.float32 and not
                           k.endswith(("A_log", "dt_bias")) else v.dtype).cpu().contiguous()
             for k, v in model.state_dict().items()}
    shards, cur, size = [], {}, 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if cur and size + n > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = v, size + n
    shards.append(cur)
    where = {}
    for i, s in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, os.path.join(out, name), metadata=dict(format="pt"))
        where.update(dict.fromkeys(s, name))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(dict(metadata=dict(total_size=sum(v.numel() * v.element_size()
                                                    for v in state.values())),
                       weight_map=where), f, indent=1)
    for name, obj in (("config.json", cfg),
                      ("generation_config.json", dict(eos_token_id=cfg["eos_token_id"]))):
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=1)
    tok.save(os.path.join(out, "tokenizer.json"))

def train_target(b, cfg, stream, dev_stream, device):
    """AdamW on next-token cross-entropy over random rows of the train stream; returns the model
    and (train loss, dev loss). The GDN core runs target.py's plain-torch delta rule (fla's
    backward is not used), compiled on GPU."""
    import torch
    import torch.nn.functional as F
    from target import Docs, Target, TargetConfig, positions_from_cu, rope_cos_sin
    tc = TargetConfig(**{k: v for k, v in cfg.items() if k in TargetConfig.__dataclass_fields__},
                      rope_theta=cfg["rope_parameters"]["rope_theta"])
    cuda = device.type == "cuda"
    if cuda:    # pad_docs is its own frame (after a graph break) seen with several dtypes, shapes
        torch._dynamo.config.recompile_limit = 64
    torch.manual_seed(b.seed)
    model = Target.build(tc, device=device).requires_grad_(True)
    B, T = b.batch, b.seq
    cu = torch.arange(0, B * T + 1, T)
    docs = Docs.of(cu, device, kernels=False)     # every row one document
    rope = rope_cos_sin(positions_from_cu(cu).to(device),
                        int(tc.head_dim * tc.partial_rotary_factor), tc.rope_theta)

    # one compiled graph per layer kind (the layers share their code), the rest eager
    run_layer = torch.compile(lambda layer, h: layer(h, rope, docs)) if cuda else (
        lambda layer, h: layer(h, rope, docs))

    def step_loss(x, y):
        h = model.embed_tokens(x)
        for layer in model.layers:
            h = run_layer(layer, h)
        return F.cross_entropy(model.lm_head(model.norm(h)).float(), y)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=0.1), dict(params=other,
                             weight_decay=0.0)], lr=b.lr, betas=(0.9, 0.95), fused=cuda)
    rng = np.random.default_rng(b.seed)

    def batch(s):
        at = rng.integers(0, len(s) - T - 1, B)
        rows = np.stack([s[a:a + T + 1] for a in at]).astype(np.int64)
        rows = torch.from_numpy(rows).to(device)
        return rows[:, :-1].reshape(-1), rows[:, 1:].reshape(-1)
    warm = max(1, b.steps // 20)
    t0, losses = time.time(), []
    for step in range(b.steps):
        lr = b.lr * (step + 1) / warm if step < warm else b.lr * (0.1 + 0.45 * (1 + math.cos(
            math.pi * (step - warm) / max(1, b.steps - warm))))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(device.type, torch.bfloat16, enabled=cuda):
            loss = step_loss(*batch(stream))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % 100 == 0 or step == b.steps - 1:
            log(f"target step {step}/{b.steps} | loss {float(loss.detach()):.3f} | lr {lr:.2e} | "
                f"{time.time() - t0:.1f}s")
    with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=cuda):
        dev_loss = float(torch.stack([step_loss(*batch(dev_stream)) for _ in range(8)]).mean())
    train_loss = float(torch.stack(losses[-50:]).mean())
    return model.requires_grad_(False), train_loss, dev_loss

# -----------------------------------------------------------------------------
# answers: prompts cut from held-out files, continued by the target

def newline_ids(tok):
    # the byte-level BPE's tokens holding a newline ("\u010a" is its "\n")
    return np.array([i for t, i in tok.get_vocab().items() if "\u010a" in t], np.int64)

def cut_prompts(docs, n, rng, nl_ids, lo=32, hi=192):
    """n prompts of lo..hi tokens, each from a random document (token arrays) starting right after
    a newline token."""
    out = []
    while len(out) < n:
        d = docs[rng.integers(len(docs))]
        starts = np.flatnonzero(np.isin(d[:-hi], nl_ids)) + 1
        if len(starts):
            a = starts[rng.integers(len(starts))]
            out.append(d[a:a + rng.integers(lo, hi + 1)])
    return out

def continue_prompts(target, prompts, new, temperature, seed, device, chunk=4096):
    import torch
    g = torch.Generator(device).manual_seed(seed)
    out = []
    for c in range(0, len(prompts), chunk):
        ps = [torch.from_numpy(p.astype(np.int64)).to(device) for p in prompts[c:c + chunk]]
        seqs = target.greedy(ps, new, temperature=temperature, generator=g).cpu().numpy()
        out += [s[len(p):len(p) + new] for s, p in zip(seqs, ps)]
    return out

def sample_of(prompt, answer):
    # (ids, loss mask) of one sample: the prompt unsupervised, the answer supervised
    return np.concatenate([prompt, answer]), np.arange(len(prompt) + len(answer)) >= len(prompt)

SPLITS = ("train", "draft", "dev", "test")

def tokenized(b, work):
    """The BPE tokenizer and every file as token ids + EOT, per split; cached by the corpus and
    vocab settings (the target's size and steps do not change them)."""
    Tokenizer = package("tokenizers", "quality.py").Tokenizer
    key = hashlib.sha1(json.dumps([b.vocab, b.max_files]).encode()).hexdigest()[:10]
    root = os.path.join(work, f"corpus-{key}")
    if not os.path.exists(os.path.join(root, "tokens.npz")):
        files = corpus(b.max_files)
        by_split = {s: [t for sp, _, t in files if sp == s] for s in SPLITS}
        tok = train_tokenizer(by_split["train"], b.vocab)
        arrays = {}
        for s, texts in by_split.items():
            ids = [e.ids + [0] for e in tok.encode_batch(texts)]
            arrays[s] = np.array([i for x in ids for i in x], np.int32)
            arrays[s + "_offsets"] = np.cumsum([0] + [len(x) for x in ids])
        os.makedirs(root + ".tmp", exist_ok=True)
        tok.save(os.path.join(root + ".tmp", "tokenizer.json"))
        np.savez(os.path.join(root + ".tmp", "tokens.npz"), **arrays)
        os.replace(root + ".tmp", root)
        log(f"corpus: {len(files)} files, {sum(map(len, by_split['train'])) / 1e6:.1f} MB of "
            f"train text -> {len(arrays['train']) / 1e6:.2f}M tokens | "
            + " ".join(f"{s} {len(v)} files" for s, v in by_split.items()))
    z = np.load(os.path.join(root, "tokens.npz"))
    enc = {s: np.split(z[s], z[s + "_offsets"][1:-1]) for s in SPLITS}
    return Tokenizer.from_file(os.path.join(root, "tokenizer.json")), enc

def build(b, work, device):
    """The target dir and the data dir for settings b, built once and reused."""
    import torch
    from target import Target
    root = os.path.join(work, f"build-{b.key()}")
    tdir, ddir = os.path.join(root, "target"), os.path.join(root, "data")
    info_path = os.path.join(root, "build.json")
    if os.path.exists(info_path):
        with open(info_path) as f:
            info = json.load(f)
        log(f"reusing the target and data in {root} (built in {info['seconds']['total']:.0f}s)")
        return tdir, ddir, info
    secs, t0 = {}, time.time()
    tok, enc = tokenized(b, work)
    secs["corpus+tokenizer"] = time.time() - t0
    stream = np.concatenate(enc["train"])
    t1, tmp = time.time(), root + f".tmp-{os.getpid()}"
    for path in sorted(glob.glob(os.path.join(work, "build-*", "build.json"))):
        with open(path) as f:
            old = json.load(f)
        if all(old["settings"].get(k) == getattr(b, k) for k in TARGET_FIELDS):
            log(f"reusing the target of {os.path.dirname(path)}")
            shutil.copytree(os.path.join(os.path.dirname(path), "target"),
                            os.path.join(tmp, "target"))
            train_loss, dev_loss = old["train_loss"], old["dev_loss"]
            break
    else:
        cfg = hf_config(b)
        model, train_loss, dev_loss = train_target(b, cfg, stream, np.concatenate(enc["dev"]),
                                                   device)
        save_hf(model, cfg, tok, os.path.join(tmp, "target"))
    secs["target"] = time.time() - t1
    # from here on the target as every user of the checkpoint sees it: bf16 (fp32 on CPU), fla
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = Target.from_pretrained(os.path.join(tmp, "target"), device=device, dtype=dtype)
    t2, rng = time.time(), np.random.default_rng(b.seed)
    nl = newline_ids(tok)
    prompts = {s: cut_prompts(enc[s], n, rng, nl) for s, n in
               (("draft", b.train_prompts), ("dev", b.eval_prompts), ("test", b.eval_prompts))}
    answers = continue_prompts(target, prompts["draft"], b.new_tokens, b.temperature, b.seed,
                               device)
    write_dataset(os.path.join(tmp, "data", "train"),
                  (sample_of(p, cut_at_eos(a)) for p, a in zip(prompts["draft"], answers)), b.vocab)
    d4 = {}
    for s in ("dev", "test"):
        # greedy, block_size tokens past the answer (the last cycle may accept them) and past eos
        ans = continue_prompts(target, prompts[s], b.new_tokens + 16, 0.0, b.seed, device)
        write_dataset(os.path.join(tmp, "data", f"{s}-greedy"),
                      (sample_of(p, a) for p, a in zip(prompts[s], ans)), b.vocab)
        d4[s] = distinct4([a[:b.new_tokens] for a in ans])
        if s == "dev":   # train.py's held-out rows: the answers as the drafter is trained on them
            write_dataset(os.path.join(tmp, "data", "val"),
                          (sample_of(p, cut_at_eos(a[:b.new_tokens]))
                           for p, a in zip(prompts[s], ans)), b.vocab)
    corpus_d4 = distinct4([d[i:i + b.new_tokens] for d in enc["test"]
                           for i in range(0, len(d) - b.new_tokens, 4 * b.new_tokens)])
    secs["answers"] = time.time() - t2
    secs["total"] = time.time() - t0
    info = dict(settings=asdict(b), train_loss=train_loss, dev_loss=dev_loss,
                distinct4_greedy=d4, distinct4_corpus=corpus_d4, seconds=secs,
                mask_row_norm=float(target.embed_tokens.weight[b.vocab - 1].float().norm()),
                mean_row_norm=float(target.embed_tokens.weight[:-1].float().norm(dim=1).mean()),
                train_tokens=int(len(stream)), device=str(device))
    with open(os.path.join(tmp, "build.json"), "w") as f:
        json.dump(info, f, indent=1)
    os.replace(tmp, root)
    log(f"built {root}: target loss train {train_loss:.3f} dev {dev_loss:.3f} | distinct 4-grams "
        f"greedy dev {d4['dev']:.2f} test {d4['test']:.2f}, corpus {corpus_d4:.2f} | "
        + " ".join(f"{k} {v:.0f}s" for k, v in secs.items()))
    return tdir, ddir, info

def zero_mask_row(tdir, mask_id):
    """A copy of checkpoint tdir (next to it) whose embedding row mask_id is zero: the drafter's
    mask slots then enter as zeros; the target's text never holds the token, so nothing else
    changes."""
    from safetensors.torch import load_file, save_file
    out = tdir + "-zero-mask"
    if not os.path.exists(out):
        shutil.copytree(tdir, out + ".tmp")
        with open(os.path.join(tdir, "model.safetensors.index.json")) as f:
            shard = json.load(f)["weight_map"]["model.embed_tokens.weight"]
        state = load_file(os.path.join(tdir, shard))
        state["model.embed_tokens.weight"][mask_id] = 0
        save_file(state, os.path.join(out + ".tmp", shard), metadata=dict(format="pt"))
        os.replace(out + ".tmp", out)
    return out

def export_demo(b, work, tdir, info, out, n_train=512, n_val=64):
    """The demo target (train.py --target demo): the checkpoint, its build record, and prompts of
    16-48 tokens from the drafter's files (train) and the dev files (val) as token ids."""
    tok, enc = tokenized(b, work)
    rng = np.random.default_rng(b.seed)
    nl = newline_ids(tok)
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(tdir):
        shutil.copy(os.path.join(tdir, f), out)
    with open(os.path.join(out, "build.json"), "w") as f:
        json.dump(info, f, indent=1)
    arrays = {}
    for split, src, n in (("train", "draft", n_train), ("val", "dev", n_val)):
        ps = cut_prompts(enc[src], n, rng, nl, lo=16, hi=48)
        arrays[split] = np.concatenate(ps).astype(np.int16 if b.vocab <= 2**15 else np.int32)
        arrays[split + "_offsets"] = np.cumsum([0] + [len(p) for p in ps])
    np.savez(os.path.join(out, "prompts.npz"), **arrays)
    log(f"exported the demo target to {out}: " + ", ".join(
        f"{f} {os.path.getsize(os.path.join(out, f)) / 1e3:.0f} KB"
        for f in sorted(os.listdir(out))))

def feature_stats(tdir, ddir, device, rows=8):
    """Scale of what the drafter reads: per tapped layer, the RMS over tokens and channels, the
    largest |value| and the share of the squared norm in the top 1% of channels."""
    import torch
    from model import DrafterConfig
    from target import Target, TargetConfig
    tc = TargetConfig.from_hf(tdir)
    taps = DrafterConfig.from_target(tc).target_layer_ids
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = Target.from_pretrained(tdir, device=device, dtype=dtype, n_layers=max(taps) + 1,
                                    head=False)
    ds = open_dataset(os.path.join(ddir, "val"))
    ids = [torch.from_numpy(ds.sample(i)[0].astype(np.int64)) for i in range(min(rows, len(ds)))]
    cu = torch.tensor([0] + np.cumsum([len(x) for x in ids]).tolist())
    f = target.features(torch.cat(ids).to(device), cu, taps).float()
    f = f.view(f.shape[0], len(taps), -1)
    for i, t in enumerate(taps):
        x = f[:, i]
        ch = x.pow(2).mean(0)
        top = ch.topk(max(1, ch.numel() // 100)).values.sum() / ch.sum()
        log(f"features of layer {t}: rms {x.pow(2).mean().sqrt():.2f} | max |x| "
            f"{x.abs().max():.1f} | top 1% channels {100 * top:.0f}% of the energy")

# -----------------------------------------------------------------------------

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    ours, passed = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [])
    ap = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                    "data", "quality"), help="cache dir of targets, data and runs")
    ap.add_argument("--out", default=None, help="train.py's --out (-N per --curve step count; "
                    "default WORK/run-<hash>)")
    ap.add_argument("--split", choices=("dev", "test"), default="test",
                    help="prompts tau is measured on: tune on dev, report on test")
    ap.add_argument("--prompts", type=number(int, 1), default=None,
                    help="replayed prompts (default: all of the split)")
    ap.add_argument("--tau-temperature", type=number(float, 0), default=0.0,
                    help="> 0: also tau of speculative sampling at this temperature")
    ap.add_argument("--curve", default=None, metavar="N,N,...",
                    help="learning curve: a train.py run per step count (--max-steps N), tau each")
    ap.add_argument("--build-only", action="store_true", help="build the target and data, stop")
    ap.add_argument("--export-demo", default=None, metavar="DIR",
                    help="build, then write the target and prompts of code to DIR as train.py's "
                    "demo target (the repo's demo/), stop")
    ap.add_argument("--mask-row", choices=("target", "zero"), default="target",
                    help="the mask token's embedding row as trained (never seen: its init, decayed)"
                    " or zero (a copy of the target with that row zeroed)")
    for f, v in asdict(Build()).items():
        ap.add_argument("--target-" + f.replace("_", "-"), type=type(v), default=v, dest=f,
                        help=f"target build setting {f} (class Build)")
    args = ap.parse_args(ours)
    import torch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b = Build(**{f: getattr(args, f) for f in asdict(Build())})
    t0 = time.time()
    try:
        tdir, ddir, info = build(b, args.work, device)
    except DataError as e:
        sys.exit(f"error: {e}")
    log(f"target: loss train {info['train_loss']:.3f} dev {info['dev_loss']:.3f} | distinct "
        f"4-grams of greedy answers {info['distinct4_greedy']['test']:.2f} (corpus "
        f"{info['distinct4_corpus']:.2f}) | mask row norm {info['mask_row_norm']:.2f}, mean row "
        f"{info['mean_row_norm']:.2f}")
    if args.mask_row == "zero":
        tdir = zero_mask_row(tdir, b.vocab - 1)
    feature_stats(tdir, ddir, device)
    if args.export_demo:
        return export_demo(b, args.work, tdir, info, args.export_demo)
    if args.build_only:
        return
    import generate
    here = os.path.dirname(os.path.abspath(__file__))
    defaults = ["--anchors", "128", "--budget", "4096", "--epochs", "12", "--eval-rows", "16"]
    curve = [int(n) for n in args.curve.split(",")] if args.curve else [None]
    for steps in curve:
        flags = [*defaults, *passed, *(["--max-steps", str(steps)] if steps else [])]
        key = hashlib.sha1(json.dumps([b.key(), args.mask_row, flags]).encode()).hexdigest()[:10]
        out = ((f"{args.out}-{steps}" if steps else args.out) if args.out
               else os.path.join(args.work, f"run-{key}"))
        cmd = [sys.executable, os.path.join(here, "train.py"), "--target", tdir, "--data", ddir,
               "--out", out, "--overwrite", *flags]
        log("train: " + " ".join(cmd[1:]))
        t1 = time.time()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with open(out + ".log", "w") as f:
            f.write(proc.stdout)
        if proc.returncode:
            sys.exit(f"error: train.py failed (exit {proc.returncode}), log {out}.log:\n"
                     + proc.stdout[-3000:])
        t_train = time.time() - t1
        with open(os.path.join(out, "log.jsonl")) as f:
            records = [json.loads(line) for line in f]
        ev = [r for r in records if r["kind"] == "eval"][-1]
        t2 = time.time()
        res = generate.replay_dataset(tdir, os.path.join(out, "drafter"),
                                      os.path.join(ddir, f"{args.split}-greedy"), b.new_tokens,
                                      args.prompts, device)
        t_tau = time.time() - t2
        log(f"tau {args.split} {generate.tau_text(res)} | proxy accept {ev['accept']:.3f} (dev "
            f"rows) | eval loss {ev['loss']:.3f} | step {ev['step']}")
        log("slot acc " + " ".join(f"{a:.2f}" for a in ev["slot_acc"]))
        log(generate.hist_line(res["hist"]))
        if args.tau_temperature:
            t3 = time.time()
            res = generate.replay_dataset(tdir, os.path.join(out, "drafter"),
                                          os.path.join(ddir, f"{args.split}-greedy"), b.new_tokens,
                                          args.prompts, device, args.tau_temperature, b.seed)
            log(f"tau {args.split} at T = {args.tau_temperature} {generate.tau_text(res)} "
                f"(speculative sampling) | {time.time() - t3:.1f}s")
            log(generate.hist_line(res["hist"]))
        log(f"times: build {info['seconds']['total']:.0f}s (cached after the first) | train "
            f"{t_train:.0f}s | tau {t_tau:.1f}s | total {time.time() - t0:.0f}s")

if __name__ == "__main__":
    main()
