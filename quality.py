"""
tau of a drafter trained here, on a target that has learned something: a small Qwen3.5 target
trained from scratch on Python source every machine running this trainer has (the standard library,
numpy, torch), its answers as the recipe makes them (temperature 0.7, SpecForge's default), a
drafter trained on them by train.py, and tau replayed exactly on greedy continuations of held-out
prompts, mean +- 95% CI. All is cached under --work by its settings; runs side by side share it.

  python quality.py                              # build or reuse; the defaults; tau on test
  python quality.py --split dev -- --lr 1e-3     # tune on dev: flags after -- go to train.py
  python quality.py --split dev --compare "--loss dflash" ""   # side by side, one table
  python quality.py --compare "--max-steps 1500" "--max-steps 3000" ""   # converged?
A run (train.py's --out, keyed by the build, its flags and train.py's defaults) trains once: a
finished one is reused for every split and temperature.
"""
import contextlib
import fcntl
import glob
import hashlib
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.nn.functional as F

import generate
from data import ArgParser, DataError, number, package, write_dataset
from layers import positions_from_cu, rope_cos_sin, upload
from target import Docs, Target, TargetConfig

EOT, MASK = "<|endoftext|>", "<|mask|>"   # ids 0 and vocab-1 (train.py's default mask id)
SKIP = {"test", "tests", "testing", "__pycache__", "site-packages", "dist-packages", "idlelib",
        "turtledemo", "lib2to3", "ensurepip"}
HERE = os.path.dirname(os.path.abspath(__file__))

def digest(obj):   # the cache's names: a short hash of a JSON value
    return hashlib.sha1(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:10]

@dataclass
class Build:
    """Everything the target and its data depend on; the cache key. --target-FIELD on the command
    line, described by HELP."""
    vocab: int = 4096
    hidden: int = 384
    layers: int = 8
    intermediate: int = 1024
    seq: int = 512
    batch: int = 64
    steps: int = 1500
    lr: float = 3e-3
    max_files: int = 0
    train_prompts: int = 8000      # 4000 -> 8000 gained beyond the 95% CI on dev (RESULTS.md)
    eval_prompts: int = 512
    new_tokens: int = 256
    temperature: float = 0.7
    seed: int = 0

    def key(self, fields=None):
        return digest({k: getattr(self, k) for k in fields} if fields else asdict(self))

HELP = dict(vocab="target BPE vocab, tokens (<|endoftext|> and <|mask|> included)",
            hidden="target width d_model", layers="target decoder layers: every 4th full "
            "attention, the rest Gated DeltaNet", intermediate="target SwiGLU width",
            seq="target training row, tokens", batch="target training rows per step",
            steps="target optimizer steps", lr="target peak AdamW lr (warmup 5%%, cosine to 10%%)",
            max_files="corpus files read (0: all; tests use few)",
            train_prompts="prompts whose sampled answers train the drafter",
            eval_prompts="dev and test prompts, each (128 cannot resolve a 5%% change in tau)",
            new_tokens="tokens per answer (eval: + the block size, the replay's lookahead)",
            temperature="sampling temperature of the drafter's training answers",
            seed="seed of the target, the prompts and the answers")

# what the target alone depends on: a build differing in its data only reuses an earlier target
TARGET_FIELDS = ("vocab", "hidden", "layers", "intermediate", "seq", "batch", "steps", "lr",
                 "max_files", "seed")

# -----------------------------------------------------------------------------
# the cache under --work, shared by processes side by side

def lock(path):
    # processes sharing path take turns on path.lock; the kernel drops a dead process's lock
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    f = open(path + ".lock", "a")
    with contextlib.suppress(OSError):   # a filesystem without locks: once keeps one copy
        fcntl.flock(f, fcntl.LOCK_EX)
    return f

def once(path, make, key=None):
    """Dir path made by make(tmp) in a tmp dir of this process's own, renamed whole (never half made
    at path), unless a peer holding the lock (key's, else path's) made it: True if this call did."""
    if not os.path.exists(path):
        with lock(key or path):
            if not os.path.exists(path):
                tmp = f"{path}.tmp-{os.getpid()}"
                shutil.rmtree(tmp, ignore_errors=True)   # a killed process's of the same pid
                try:
                    make(tmp)
                    os.rename(tmp, path)
                    return True
                except OSError:   # unless a peer's copy (same settings) got there first
                    if not os.path.isdir(path):
                        raise
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)   # ours, if it is not at path
    return False

# -----------------------------------------------------------------------------
# the corpus: installed Python source, split by a hash of each file's path

def corpus(max_files=0):
    # [(split, text)] of the .py files of the stdlib, numpy and torch (no tests), in a fixed order
    files = []
    for name, root in [("stdlib", sysconfig.get_paths()["stdlib"]),
                       ("numpy", os.path.dirname(np.__file__)),
                       ("torch", os.path.dirname(torch.__file__))]:
        for d, dirs, names in os.walk(root):
            dirs[:] = sorted(x for x in dirs if x not in SKIP and not x.startswith("config-"))
            for f in sorted(n for n in names if n.endswith(".py")):
                rel = f"{name}/{os.path.relpath(os.path.join(d, f), root)}"
                text = open(os.path.join(d, f), encoding="utf-8", errors="replace").read()
                h = int(hashlib.sha1(rel.encode()).hexdigest()[:8], 16) % 100
                split = "train" if h < 80 else "draft" if h < 90 else "dev" if h < 95 else "test"
                if text.strip():
                    files.append((split, text))
    return files[:max_files] if max_files else files

def tokenized(b, tdir=None):
    """The tokenizer of checkpoint tdir (default: a byte-level BPE trained on the train split) and
    every file as token ids + EOT, per split."""
    tk, files = package("tokenizers", "quality.py"), corpus(b.max_files)
    texts = {s: [t for sp, t in files if sp == s] for s in ("train", "draft", "dev", "test")}
    tok = (tk.Tokenizer.from_file(os.path.join(tdir, "tokenizer.json")) if tdir
           else tk.Tokenizer(tk.models.BPE()))
    if not tdir:
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        tok.train_from_iterator(texts["train"], tk.trainers.BpeTrainer(
            vocab_size=b.vocab - 1, special_tokens=[EOT], show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet()))
        tok.add_special_tokens([MASK])   # never in the text: the drafter's mask slots, last id
        assert tok.token_to_id(EOT) == 0 and tok.token_to_id(MASK) == b.vocab - 1
    enc = {s: [np.array(e.ids + [0], "i4") for e in tok.encode_batch(t)] for s, t in texts.items()}
    print(f"corpus: {len(files)} files, {sum(map(len, enc['train'])) / 1e6:.2f}M train tokens")
    return tok, enc

# -----------------------------------------------------------------------------
# the target: a Qwen3.5 text model through target.py's own layers, saved as an HF checkpoint

def hf_config(b):
    # heads of 64 (kv heads a third, GDN key heads half); under 256 wide the `tiny` preset's
    # layout (4 heads of hidden/2, GDN 2 key and 4 value heads of hidden/4), the demo's geometry
    n = max(1, b.hidden // 64)
    h, kv, d, gk, gv, gd = ((n, max(1, n // 3), 64, max(1, n // 2), n, 64) if b.hidden >= 256
                            else (4, 2, b.hidden // 2, 2, 4, b.hidden // 4))
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(b.layers)]
    return dict(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=b.vocab,
                hidden_size=b.hidden, intermediate_size=b.intermediate, num_hidden_layers=b.layers,
                full_attention_interval=4, layer_types=kinds, num_attention_heads=h,
                num_key_value_heads=kv, head_dim=d, linear_num_key_heads=gk,
                linear_num_value_heads=gv, linear_key_head_dim=gd, linear_value_head_dim=gd,
                linear_conv_kernel_dim=4, rms_norm_eps=1e-6, hidden_act="silu",
                max_position_embeddings=4096, rope_parameters=dict(
                    rope_type="default", rope_theta=100000.0, partial_rotary_factor=0.25),
                tie_word_embeddings=False, eos_token_id=0, torch_dtype="bfloat16")

def save_hf(model, cfg, tok, out, shard_bytes=15 << 20):
    """config.json, generation_config.json, tokenizer.json and safetensors shards (bf16; the GDN's
    A_log and dt_bias fp32) of at most shard_bytes (small enough to travel between machines) with
    their index."""
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    state = {("" if k == "lm_head.weight" else "model.") + k: (v if v.dtype != torch.float32 or
             k.endswith(("A_log", "dt_bias")) else v.to(torch.bfloat16)).detach().cpu().contiguous()
             for k, v in model.state_dict().items()}
    shards, size, where = [{}], 0, {}
    for k, v in state.items():
        if shards[-1] and size + v.nbytes > shard_bytes:
            shards, size = shards + [{}], 0
        shards[-1][k], size = v, size + v.nbytes
    for i, s in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(s, os.path.join(out, name), metadata=dict(format="pt"))
        where.update(dict.fromkeys(s, name))
    index = dict(metadata=dict(total_size=sum(v.nbytes for v in state.values())), weight_map=where)
    for name, obj in (("model.safetensors.index.json", index), ("config.json", cfg),
                      ("generation_config.json", dict(eos_token_id=cfg["eos_token_id"]))):
        with open(os.path.join(out, name), "w") as f:
            json.dump(obj, f, indent=1)
    tok.save(os.path.join(out, "tokenizer.json"))

def train_target(b, cfg, stream, dev_stream, device):
    """AdamW on next-token cross-entropy over random rows of the train stream: the model, the train
    and the dev loss. The GDN core is target.py's plain-torch delta rule, compiled on GPU."""
    tc = TargetConfig(**{k: v for k, v in {**cfg, **cfg["rope_parameters"]}.items()  # + RoPE's
                         if k in TargetConfig.__dataclass_fields__})
    B, T, cuda = b.batch, b.seq, device.type == "cuda"
    torch._dynamo.config.recompile_limit = 64   # pad_docs: a frame of its own seen in many shapes
    torch.manual_seed(b.seed)
    model = Target.build(tc, device=device).requires_grad_(True)
    cu = torch.arange(0, B * T + 1, T)
    docs = Docs.of(cu, device, kernels=False)     # every row one document
    rope = rope_cos_sin(positions_from_cu(cu).to(device),
                        int(tc.head_dim * tc.partial_rotary_factor), tc.rope_theta)
    # one compiled graph per layer kind (the layers share their code), the rest eager
    run_layer = (torch.compile if cuda else lambda f: f)(lambda layer, h: layer(h, rope, docs))

    @torch.autocast(device.type, torch.bfloat16, enabled=cuda)
    def step_loss(s):   # on B random rows of stream s
        rows = np.stack([s[a:a + T + 1] for a in rng.integers(0, len(s) - T - 1, B)])
        rows = upload(torch.from_numpy(rows.astype(np.int64)), device)
        h = model.embed_tokens(rows[:, :-1].reshape(-1))
        for layer in model.layers:
            h = run_layer(layer, h)
        return F.cross_entropy(model.lm_head(model.norm(h)).float(), rows[:, 1:].reshape(-1))
    groups = [dict(params=[p for p in model.parameters() if (p.dim() >= 2) == matrix],
                   weight_decay=0.1 if matrix else 0.0) for matrix in (True, False)]
    opt = torch.optim.AdamW(groups, lr=b.lr, betas=(0.9, 0.95), fused=cuda)
    rng, warm, t0, losses = np.random.default_rng(b.seed), max(1, b.steps // 20), time.time(), []
    for step in range(b.steps):
        lr = b.lr * (step + 1) / warm if step < warm else b.lr * (0.1 + 0.45 * (1 + math.cos(
            math.pi * (step - warm) / max(1, b.steps - warm))))
        for g in opt.param_groups:
            g["lr"] = lr
        loss = step_loss(stream)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step % 100 == 0 or step == b.steps - 1:
            print(f"target step {step}/{b.steps} | loss {float(loss.detach()):.3f} | lr {lr:.2e} | "
                  f"{time.time() - t0:.1f}s", flush=True)
    # grad on, as the compiled layers were traced: under no_grad each of them would recompile
    dev_loss = sum(float(step_loss(dev_stream).detach()) for _ in range(8)) / 8
    return model.requires_grad_(False), float(torch.stack(losses[-50:]).mean()), dev_loss

# -----------------------------------------------------------------------------
# answers: prompts cut from held-out files, continued by the target

def cut_prompts(docs, n, rng, tok, lo=32, hi=192):
    # n prompts of lo..hi tokens, each from a random document (token arrays) right after a newline
    nl = [i for t, i in tok.get_vocab().items() if "\u010a" in t]   # the byte-level BPE's "\n"
    out = []
    while len(out) < n:
        d = docs[rng.integers(len(docs))]
        starts = np.flatnonzero(np.isin(d[:-hi], nl)) + 1
        if len(starts):
            a = starts[rng.integers(len(starts))]
            out.append(d[a:a + rng.integers(lo, hi + 1)])
    return out

def cut_at_eos(ans, eos=0):
    # an answer up to its first end-of-text (<|endoftext|> is id 0), that included
    hit = np.flatnonzero(ans == eos)
    return ans[:hit[0] + 1] if len(hit) else ans

def continued(target, prompts, new, temperature, seed, device, chunk=4096):
    g, out = torch.Generator(device).manual_seed(seed), []
    for c in range(0, len(prompts), chunk):
        ps = [torch.from_numpy(p.astype(np.int64)).to(device) for p in prompts[c:c + chunk]]
        seqs = target.greedy(ps, new, temperature=temperature, generator=g).cpu().numpy()
        out += [s[len(p):len(p) + new] for s, p in zip(seqs, ps)]
    return out

def build(b, work, device):
    """The target dir and the data dir for settings b, built once. Builds sharing
    a target take turns: one started beside another making its target waits, then copies it."""
    root = os.path.join(work, f"build-{b.key()}")

    def make(tmp):
        t0, tdir = time.time(), os.path.join(tmp, "target")

        def write(name, prompts, answers):   # the prompt unsupervised, the answer supervised
            write_dataset(os.path.join(tmp, "data", name), ((np.concatenate([p, a]), np.arange(
                len(p) + len(a)) >= len(p)) for p, a in zip(prompts, answers)), b.vocab)
        for path in sorted(glob.glob(os.path.join(work, "build-" + "[0-9a-f]" * 10, "build.json"))):
            old = json.load(open(path))
            if all(old["settings"].get(k) == getattr(b, k) for k in TARGET_FIELDS):
                print(f"reusing the target of {os.path.dirname(path)}")
                shutil.copytree(os.path.join(os.path.dirname(path), "target"), tdir)
                losses = old["train_loss"], old["dev_loss"]
                break
        tok, enc = tokenized(b, tdir if os.path.isdir(tdir) else None)
        if not os.path.isdir(tdir):
            cfg = hf_config(b)
            model, *losses = train_target(b, cfg, np.concatenate(enc["train"]),
                                          np.concatenate(enc["dev"]), device)
            save_hf(model, cfg, tok, tdir)
        # from here on the target as every user of the checkpoint sees it: bf16 (fp32 on CPU), fla
        target = generate.load_target(tdir, *generate.device_dtype(device))
        rng = np.random.default_rng(b.seed)
        prompts = {s: cut_prompts(enc[s], n, rng, tok) for s, n in
                   (("draft", b.train_prompts), ("dev", b.eval_prompts), ("test", b.eval_prompts))}
        answers = continued(target, prompts["draft"], b.new_tokens, b.temperature, b.seed, device)
        write("train", prompts["draft"], map(cut_at_eos, answers))
        for s in ("dev", "test"):
            # greedy, block_size tokens past the answer (the last cycle may accept them), past eos
            ans = continued(target, prompts[s], b.new_tokens + 16, 0.0, b.seed, device)
            write(f"{s}-greedy", prompts[s], ans)
            if s == "dev":   # train.py's held-out rows: the answers as the drafter trains on them
                write("val", prompts[s], [cut_at_eos(a[:b.new_tokens]) for a in ans])
        with open(os.path.join(tmp, "build.json"), "w") as f:
            json.dump(dict(settings=asdict(b), train_loss=losses[0], dev_loss=losses[1],
                           seconds=dict(total=time.time() - t0), device=str(device)), f, indent=1)
    made = once(root, make, key=os.path.join(work, f"target-{b.key(TARGET_FIELDS)}"))
    info = json.load(open(os.path.join(root, "build.json")))
    print("built" if made else "reusing the target and data in", root, f"(build time "
          f"{info['seconds']['total']:.0f}s): target loss train {info['train_loss']:.3f} dev "
          f"{info['dev_loss']:.3f}")
    return os.path.join(root, "target"), os.path.join(root, "data")

# -----------------------------------------------------------------------------
# runs: train.py once per (build, flags), tau per split and temperature, each kept in the run dir

# the lab's train.py flags before the user's (after --): 128 anchors per document (25% cut by the
# row's slots); every eligible one (--anchors 512 --row-anchors 3072: 2.6x the blocks, 2x the time)
# gained less than the 95% CI on dev (RESULTS.md)
LAB = ["--anchors", "128", "--budget", "4096", "--eval-rows", "16"]

def run_flags(user):
    flags = [*LAB, *user]
    if not {"--max-steps", "--epochs"} & set(flags):    # train.py takes one or the other
        flags += ["--epochs", "12"]
    return flags

def train_once(out, tdir, ddir, flags, retrain=False):
    """train.py into out, unless a finished run is there (its `end` record and its export): the
    record of that run, {train_s, proxy, anchors}. A peer training into the same out waits."""
    log = os.path.join(out, "log.jsonl")
    records = lambda: list(map(json.loads, open(log))) if os.path.exists(log) else []
    with lock(out):
        if retrain or not (os.path.exists(os.path.join(out, "drafter", "model.safetensors"))
                           and any(r["kind"] == "end" for r in records())):
            shutil.rmtree(out, ignore_errors=True)       # its taus too
            cmd = [sys.executable, os.path.join(HERE, "train.py"), "--target", tdir, "--data", ddir,
                   "--out", out, "--cache-dir", out + ".cache", *flags]   # caches of its own
            print("train: " + " ".join(cmd[1:]), flush=True)   # then minutes of silence
            with open(out + ".log", "w") as f:   # written as train.py runs
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
            if rc:
                sys.exit(f"error: train.py failed (exit {rc}), log {out}.log:\n"
                         + open(out + ".log").read()[-3000:])
        else:
            print(f"reusing the finished run {out} (--retrain to train it again)", flush=True)
    recs = records()
    ev = [r for r in recs if r["kind"] == "eval"][-1]
    anchors = next((ln.strip() for ln in open(out + ".log") if ln.startswith("anchors:")), "")
    print(f"{anchors}\neval step {ev['step']}: loss {ev['loss']:.4f} | accept {ev['accept']:.3f} "
          "(the proxy, dev rows) | slot acc " + " ".join(f"{a:.2f}" for a in ev["slot_acc"]))
    return dict(train_s=recs[-1]["elapsed_s"], proxy=ev["accept"], anchors=anchors)

def setting_name(temp, top_p=1.0, top_k=0):   # a sampling setting as the table heads it
    return "greedy" if not temp else f"T {temp:g}" + (
        f" p {top_p:g} k {top_k}" if (top_p, top_k) != (1.0, 0) else "")

def tau_once(out, tdir, ddir, b, split, n, setting, device):
    # generate.replay_dataset's dict for the run's export at setting (T, top-p, top-k), once
    temp, top_p, top_k = setting
    name = setting_name(*setting).replace(" ", "")    # greedy, T1, T0.6p0.95k20
    path = os.path.join(out, f"tau-{split}-{name}-n{n or 'all'}.json")
    if not os.path.exists(path):
        t0 = time.time()
        res = generate.replay_dataset(tdir, os.path.join(out, "drafter"), os.path.join(
            ddir, f"{split}-greedy"), b.new_tokens, n, device, temp, b.seed, top_p, top_k)
        res["seconds"] = time.time() - t0
        with open(path + f".tmp-{os.getpid()}", "w") as f:
            json.dump(res, f)
        os.replace(path + f".tmp-{os.getpid()}", path)
    res = json.load(open(path))
    print(f"tau {split} {setting_name(*setting)}: {generate.tau_text(res)} | {res['seconds']:.1f}s"
          "\n" + generate.hist_line(res["hist"]), flush=True)
    return res

def table(rows, settings):
    # one line per configuration: tau +- 95% CI per setting, greedy per prompt; the proxy; train s
    pm = lambda r, k: f"{r[k]:.3f} +- {r[k + '_ci']:.3f}"
    head = ["configuration", *map(setting_name, *zip(*settings)), "per-prompt", "proxy", "train s"]
    body = [[name, *(pm(t, "tau") for t in taus), pm(taus[0], "tau_mean"), f"{run['proxy']:.3f}",
             f"{run['train_s']:.0f}"] for name, run, taus in rows]
    w = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]
    return "\n".join(" | ".join(c.ljust(n) for c, n in zip(r, w)) for r in [head] + body)

def sampling(s):   # --tau-served: "T,TOP_P,TOP_K" with T > 0, top-p in (0, 1], top-k >= 0
    if not s:
        return None
    t, p, k = s.split(",")
    if not (float(t) > 0 and 0 < float(p) <= 1 and int(k) >= 0):
        raise ValueError(s)
    return float(t), float(p), int(k)

def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)   # flags after -- go to train.py
    ap = ArgParser(description=__doc__)
    add = ap.add_argument
    add("--work", default=os.path.join(HERE, "data", "quality"), help="cache of builds and runs")
    add("--split", choices=("dev", "test"), default="test", help="tune on dev, report on test")
    add("--prompts", type=number(int, 1), help="replayed prompts (default: all of the split)")
    add("--tau-temperature", type=number(float, 0), default=1.0, help="> 0: also tau sampled at "
        "this temperature; 0: none")
    add("--tau-served", type=sampling, default="0.6,0.95,20", metavar="T,TOP_P,TOP_K",
        help="also tau sampled as served (Qwen3.6's thinking defaults); '': none")
    add("--compare", nargs="+", metavar="'FLAGS'", default=[], help="train.py flags of each "
        "configuration, one quoted string each ('' the lab's defaults), trained side by side")
    add("--retrain", action="store_true", help="train again a run that finished")
    add("--build-only", action="store_true", help="build the target and data, stop")
    for f, v in asdict(Build()).items():
        add("--target-" + f.replace("_", "-"), type=type(v), default=v, dest=f, help=HELP[f])
    args = ap.parse_args(argv[:cut])
    if args.compare and cut < len(argv):
        ap.error("--compare: each configuration's flags go in it, none after --")
    settings = [(0.0, 1.0, 0)] + [(args.tau_temperature, 1.0, 0)] * (args.tau_temperature > 0) + [
        args.tau_served] * bool(args.tau_served)
    b, device = Build(**{f: getattr(args, f) for f in asdict(Build())}), generate.device_dtype()[0]
    try:
        tdir, ddir = build(b, args.work, device)
    except DataError as e:
        sys.exit(f"error: {e}")
    if args.build_only:
        return
    # --compare: a child quality.py per configuration, side by side on this GPU; the table from
    # what they kept in their run dirs (train.py's --out, keyed by the build, the flags and
    # train.py's defaults as its --help gives them: a changed default trains anew)
    configs, procs, t0 = [shlex.split(c) for c in args.compare] or [argv[cut + 1:]], [], time.time()
    defaults = " ".join(subprocess.run([sys.executable, os.path.join(HERE, "train.py"), "--help"],
                                       capture_output=True, text=True).stdout.split())
    outs = [os.path.join(args.work, "run-" + digest([b.key(), run_flags(u), defaults]))
            for u in configs]
    i = argv.index("--compare") if args.compare else 0   # its strings: right after it
    own = argv[:i] + argv[i + 1 + len(args.compare):]
    for user, out in zip(configs, outs) if args.compare else []:
        log = out + ".quality.log"
        print(f"'{' '.join(user)}': log {log}", flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), *own, "--", *user]
        procs.append((subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT), log))
    for p, log in procs:
        if p.wait():
            sys.exit(f"error: {log}:\n" + open(log).read()[-3000:])
    if procs:
        print(f"{len(procs)} configurations side by side: {time.time() - t0:.0f} s", flush=True)
    rows = []
    for user, out in zip(configs, outs):
        run = train_once(out, tdir, ddir, run_flags(user), args.retrain and not procs)
        taus = [tau_once(out, tdir, ddir, b, args.split, args.prompts, st, device)
                for st in settings]
        rows.append((" ".join(user) or "(defaults)", run, taus))
    print(f"\nsplit {args.split}, {rows[0][2][0]['prompts']} prompts: tau over cycles (greedy, "
          "sampled: T, top-p, top-k) and the mean of per-prompt tau (greedy), +- 95% CI over "
          "prompts\n" + table(rows, settings))
    return rows

if __name__ == "__main__":
    main()
