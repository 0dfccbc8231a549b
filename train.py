"""
Train a DFlash drafter against a frozen target. Half the GPUs of each node run the target, the other half the
drafters; pair i is (local GPU i, local GPU i + half) and streams hidden states target -> drafter.

  python train.py                                                   # demo: tiny target, demo data, CPU or 1 GPU
  torchrun --nproc_per_node=4 train.py --target /ckpt/Qwen3.6-27B --data data/mix --anchors 512 --budget 8192
  torchrun --nproc_per_node=2 train.py --target qwen3.6-27b --anchors 512 --budget 8192   # one pair, random target
"""
import argparse
import getpass
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
g = p.add_argument_group("data")
g.add_argument("--data", default=None, help="prepared dataset dir (data.py prepare); default: the demo data, built in ./data/demo on first use")
g.add_argument("--budget", type=int, default=128, help="tokens per packed row (context length S), fixed for every step")
g.add_argument("--eval-rows", type=int, default=8, help="held-out rows per evaluation (from DATA/val)")
g = p.add_argument_group("models")
g.add_argument("--target", default="tiny", help="HF checkpoint dir of a Qwen3.5/3.6 model, or a preset: tiny, qwen3.6-27b (random weights)")
g.add_argument("--drafter-layers", type=int, default=5, help="drafter decoder layers")
g.add_argument("--n-feat", type=int, default=None, help="tapped target layers (default 5; 3 for the 8-layer tiny target)")
g.add_argument("--block-size", type=int, default=16, help="tokens per draft block: the anchor + block-size-1 drafted tokens")
g.add_argument("--mask-token-id", type=int, default=None, help="embedding row used for masked slots (default: z-lab's for the vocab)")
g.add_argument("--init-drafter", default=None, help="start from a z-lab format drafter dir instead of random init")
g = p.add_argument_group("optimization")
g.add_argument("--anchors", type=int, default=16, help="draft blocks per row (N); the drafter sees N*block-size query tokens")
g.add_argument("--gamma", type=float, default=7.0, help="loss decay over block slots: weight exp(-(k-1)/gamma)")
g.add_argument("--lr", type=float, default=6e-4, help="peak AdamW learning rate")
g.add_argument("--warmup", type=float, default=0.04, help="linear warmup, as a fraction of all steps; then cosine to 0")
g.add_argument("--epochs", type=int, default=6, help="passes over the training set (ignored with --max-steps)")
g.add_argument("--max-steps", type=int, default=None, help="optimizer steps to run (default: epochs * steps per epoch)")
g.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip")
g.add_argument("--seed", type=int, default=0, help="data order and anchor sampling seed")
g = p.add_argument_group("logging, eval and checkpoints")
g.add_argument("--out", default="out", help="output dir: log.jsonl, ckpt.pt, drafter/ (z-lab export)")
g.add_argument("--log-interval", type=int, default=10, help="steps between log lines")
g.add_argument("--eval-interval", type=int, default=100, help="steps between held-out evaluations (and at the end)")
g.add_argument("--save-interval", type=int, default=500, help="steps between checkpoints (and at the end)")
g.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
g = p.add_argument_group("system")
g.add_argument("--no-compile", action="store_true", help="run the drafter step eagerly (debugging only; dense flex backward on GPU)")
g.add_argument("--cache-dir", default=None, help="root of the per-rank Triton/Inductor caches (default /tmp/dflash-cache-USER)")
g.add_argument("--fresh-cache", action="store_true", help="empty this run's Triton/Inductor cache dirs first (a corrupted cache is then one flag away from fixed)")
g.add_argument("--timeout", type=float, default=900, help="seconds a rank waits for a peer before failing (covers the first compile)")
args = p.parse_args()

# Each rank gets its own Triton and Inductor cache unless the user set one, and they are set before torch
# imports triton: ranks sharing a cache race on it, and a cache on NFS corrupts (reference/compile.md sec. 3).
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
cache_root = args.cache_dir or os.path.join(tempfile.gettempdir(), f"dflash-cache-{getpass.getuser()}")
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_root, f"rank{rank}", "triton"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(cache_root, f"rank{rank}", "inductor"))
cache_dirs = [os.environ["TRITON_CACHE_DIR"], os.environ["TORCHINDUCTOR_CACHE_DIR"]]
if args.fresh_cache:
    for d in cache_dirs:
        if os.path.isdir(d):
            shutil.rmtree(d)
        elif os.path.exists(d):
            os.remove(d)

def on_sigterm(signum, frame):
    # torchrun tears the whole job down when one process dies: say why, and how to go on, instead of a bare kill
    print(f"rank {rank}: stopping on SIGTERM (another process of this job failed, or the job was cancelled); "
          f"continue from the last checkpoint with --resume --out {args.out}", file=sys.stderr, flush=True)
    os._exit(143)
signal.signal(signal.SIGTERM, on_sigterm)

def on_error(tp, value, tb):
    # e.g. a peer died and gloo/NCCL closed the connection: the traceback, then what to do about it
    sys.__excepthook__(tp, value, tb)
    print(f"rank {rank}: stopped by {tp.__name__}; continue from the last checkpoint with --resume --out {args.out}. "
          f"If this is a compile, autotune or cache error, a corrupted cache can be the cause: rerun with "
          f"--fresh-cache (this rank's caches: {' '.join(cache_dirs)})", file=sys.stderr, flush=True)
sys.excepthook = on_error

import numpy as np
import torch
import torch.distributed as dist
from model import Target, TargetConfig, Drafter, DrafterConfig, sample_anchors, anchor_blocks
from data import open_dataset, Packer, make_demo

# -----------------------------------------------------------------------------
# ranks: per node the first half of the local ranks run targets, the second half drafters

local_rank, local_world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
if world > 1 and local_world % 2:
    sys.exit(f"error: {local_world} processes per node; DFlash pairs need an even number (half targets, half drafters)")
half = max(local_world // 2, 1)
is_target, is_drafter = world == 1 or local_rank < half, world == 1 or local_rank >= half
peer = rank + half if local_rank < half else rank - half          # the other member of this rank's pair
n_pairs, pair = max(world // 2, 1), (rank // local_world) * half + local_rank % half
log_rank = 0 if world == 1 else half                              # the first drafter prints the log
device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
cuda = device.type == "cuda"
if cuda:
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
if world > 1:
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout),
                            device_id=device if cuda else None)
    drafter_ranks = [r for r in range(world) if r % local_world >= half]
    drafter_group = dist.new_group(drafter_ranks)
    # log statistics travel on gloo (host memory): an NCCL collective on the world group would queue on the target
    # behind its sends of the next rows, which the drafter receives only after that collective: deadlock
    stats_group = dist.new_group(backend="gloo") if cuda else None
master = rank == log_rank

def print0(*a):
    if master:
        print(*a, flush=True)

def sync():
    if cuda:       # this stream only: on a target a device-wide sync would also wait for its in-flight sends
        torch.cuda.current_stream(device).synchronize()

# -----------------------------------------------------------------------------
# data: the demo dataset is made on first use (the tiny target's own greedy continuations, data.py demo)

os.makedirs(args.out, exist_ok=True)
data_dir = args.data or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo")
if args.data is None and not os.path.exists(os.path.join(data_dir, "train", "meta.json")):
    if local_rank == 0:
        print(f"building the demo dataset in {data_dir} (tiny target's greedy continuations)", flush=True)
        make_demo(data_dir)
    if world > 1:
        dist.barrier()
train_ds = open_dataset(data_dir)
val_dir = os.path.join(data_dir, "val")
val_ds = open_dataset(val_dir) if os.path.exists(os.path.join(val_dir, "meta.json")) else None
packer = Packer(train_ds, args.budget, n_shards=n_pairs, shard=pair, seed=args.seed)
steps_per_epoch = packer.steps_per_epoch
max_steps = args.max_steps or packer.total_steps(args.epochs)
S, N, B = args.budget, args.anchors, args.block_size

# -----------------------------------------------------------------------------
# models: target ranks load the layers up to the last tapped one, drafter ranks only embed_tokens + lm_head

preset = not os.path.isdir(args.target)
tcfg = TargetConfig.preset(args.target) if preset else TargetConfig.from_hf(args.target)
n_feat = args.n_feat or (3 if tcfg.num_hidden_layers < 16 else 5)
dcfg = DrafterConfig.from_target(tcfg, n_feat=n_feat, num_hidden_layers=args.drafter_layers,
                                 block_size=args.block_size, mask_token_id=args.mask_token_id)
taps = dcfg.target_layer_ids
tdtype = torch.bfloat16 if cuda else torch.float32
checks = [(train_ds.vocab_size <= tcfg.vocab_size, f"--data {data_dir}: token ids reach {train_ds.vocab_size - 1}, "
           f"past the target's vocab ({tcfg.vocab_size}); prepare the data with the target's tokenizer"),
          (0 <= dcfg.mask_token_id < tcfg.vocab_size, f"--mask-token-id {dcfg.mask_token_id} is not a row of the "
           f"target's embedding (vocab {tcfg.vocab_size})"),
          (S >= 2 * B, f"--budget {S} must hold at least two blocks ({2 * B} tokens)"),
          (N * B <= 4 * S and N < S, f"--anchors {N} is too many for --budget {S}: at most {min(S - 1, 4 * S // B)}")]
for ok, msg in checks:
    if not ok:
        sys.exit("error: " + msg)
load = Target.build if preset else Target.from_pretrained
n_layers = max(taps) + 1 if is_target else 0
target = load(tcfg if preset else args.target, device=device, dtype=tdtype, n_layers=n_layers, head=is_drafter)

if is_drafter:
    torch.manual_seed(args.seed)      # every drafter rank starts from the same weights (checked at the end)
    drafter = (Drafter.from_pretrained(args.init_drafter) if args.init_drafter else Drafter(dcfg)).to(device)
    if drafter.config.hidden_size != tcfg.hidden_size or drafter.config.target_layer_ids != taps:
        sys.exit(f"error: --init-drafter {args.init_drafter} (hidden {drafter.config.hidden_size}, taps "
                 f"{drafter.config.target_layer_ids}) does not match the target (hidden {tcfg.hidden_size}, taps {taps})")
    embed, head = target.embed_tokens.weight, target.lm_head.weight
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0, fused=True)  # fp32 master weights
    # flex_attention tiles: the inductor defaults assume ~227 KB of shared memory per block (H100/H200/B200);
    # cards with ~100 KB (RTX PRO 6000 Blackwell, consumer parts) need the smaller tiles below.
    flex = None
    if cuda:
        props = torch.cuda.get_device_properties(device)
        smem = getattr(props, "shared_memory_per_block_optin", 0)
        flex = {} if smem >= 200 * 1024 else dict(BLOCK_M=64, BLOCK_N=64, num_stages=2, bwd_BLOCK_M1=32,
                                                   bwd_BLOCK_N1=64, bwd_BLOCK_M2=32, bwd_BLOCK_N2=32)
    autocast = torch.autocast("cuda", torch.bfloat16) if cuda else nullcontext()

    def drafter_step(feats, meta, anchors, keep, blocks):
        # BlockMask, forward, loss: one graph for train and one for eval, fixed shapes
        with autocast:
            return drafter(feats, meta[0], meta[1], meta[2], meta[3], anchors, keep, embed, head, args.gamma, flex, blocks)

    def eval_step(*a):
        with torch.no_grad():
            return drafter_step(*a)

    train_graph, eval_graph = drafter_step, eval_step
    if not args.no_compile:
        # a recompile after warm-up, or a hit recompile limit, would silently run flex_attention's dense
        # backward (~17 GB per layer at 512 anchors / 8192 budget): make both an error instead
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        train_graph = torch.compile(drafter_step, fullgraph=True, dynamic=False)
        eval_graph = torch.compile(eval_step, fullgraph=True, dynamic=False)
    # Anchors and the BlockMask's block lists are computed on device (a few eager kernels, no host sync) just
    # before the graph and enter it as inputs: inductor's flex lowering fails on mask_mod tensors computed inside
    # the same graph ("convert FlexibleLayout to FixedLayout first"), and a compiled create_block_mask takes
    # minutes to compile its sort (torch 2.11; see anchor_blocks).
    def draw(meta):
        anchors, keep = sample_anchors(meta[1], meta[2], N)
        return anchors, keep, (anchor_blocks(anchors, keep, meta[2], S, B) if cuda else None)
    train_fn = lambda feats, meta: train_graph(feats, meta, *draw(meta))
    eval_fn = lambda feats, meta: eval_graph(feats, meta, *draw(meta))
    if cuda:
        warnings.filterwarnings("error", message=".*flex_attention called without torch.compile.*")

# -----------------------------------------------------------------------------
# transport: a row travels as meta int64 [5, S] (tokens, loss_mask, doc, pos, header) + features [S, n*H]

def row_meta(row):
    header = np.zeros(S, dtype=np.int64)
    header[:2] = row.epoch, row.index
    return torch.from_numpy(np.stack([row.tokens, row.loss_mask.astype(np.int64), row.doc.astype(np.int64),
                                      row.pos, header])).to(device)

def target_features(row):
    ids = torch.from_numpy(row.tokens).to(device)
    return target.features(ids, torch.from_numpy(row.cu_seqlens), taps)

def lr_at(step):
    warm = max(1, round(args.warmup * max_steps))
    if step < warm:
        return args.lr * (step + 1) / warm
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, max_steps - warm)))

def schedule(start):
    # the sequence of work both roles agree on, so targets and drafters never need to talk about it
    for step in range(start, max_steps + 1):
        if step > start and (step % args.save_interval == 0 or step == max_steps):
            yield step, "save", None
        if eval_rows and (step % args.eval_interval == 0 or step == max_steps):
            for r in range(len(eval_rows)):
                yield step, "eval", r
        if step < max_steps:
            yield step, "train", None
        if step < max_steps and ((step + 1) % args.log_interval == 0 or step + 1 == max_steps):
            yield step, "log", None

def mark():
    # a point in time on this rank's GPU stream (no host sync); the host clock on CPU, where work is synchronous
    if cuda:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    return time.perf_counter()

def ms(a, b):
    return a.elapsed_time(b) if cuda else (b - a) * 1e3

def gather_stats(values):
    # one small all-reduce over every rank per log line: [world, k], each rank fills its own row
    t = torch.zeros(world, len(values))
    t[rank] = torch.tensor(values)
    if world > 1:
        dist.all_reduce(t, group=stats_group)
    return t

# -----------------------------------------------------------------------------
# resume: the drafter ranks read the checkpoint; every rank learns the step from the first drafter

start_step, ckpt_path = 0, os.path.join(args.out, "ckpt.pt")
if args.resume and is_drafter:
    if not os.path.exists(ckpt_path):
        sys.exit(f"error: --resume but {ckpt_path} does not exist")
    try:
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        drafter.load_state_dict(ck["drafter"])
        opt.load_state_dict(ck["optimizer"])
        start_step = ck["step"]
    except Exception as e:
        sys.exit(f"error: {ckpt_path} is not a readable checkpoint of this run ({type(e).__name__}: {e}); "
                 "delete it to start over, or point --out at the right run")
if world > 1:
    t = torch.tensor([start_step], device=device)
    dist.broadcast(t, log_rank)
    start_step = int(t)
packer.seek(start_step)     # every pair consumes one row per step: the step is the data position
eval_rows = []
if val_ds is not None:      # the first held-out rows; every pair evaluates the same ones (eval is rare)
    vp = Packer(val_ds, S, shuffle=False)
    eval_rows = [vp.next_row() for _ in range(min(args.eval_rows, vp.steps_per_epoch))]

# -----------------------------------------------------------------------------
# banner

n_params = sum(p.numel() for p in drafter.parameters()) if is_drafter else 0
info = dict(rank=rank, role=("target+drafter" if world == 1 else "target" if is_target else "drafter"), pair=pair,
            device=(torch.cuda.get_device_name(device) if cuda else "cpu"), caches=cache_dirs)
infos = [info]
if world > 1:
    infos = [None] * world
    dist.all_gather_object(infos, info)
try:
    import triton
    tv = triton.__version__
except ImportError:
    tv = "-"
print0(f"dflash train | torch {torch.__version__} | triton {tv} | {world} process(es), {n_pairs} pair(s)")
print0("args: " + json.dumps(vars(args)))
for i in infos:
    print0(f"  rank {i['rank']}: {i['role']:<14} pair {i['pair']} on {i['device']} | caches {' '.join(i['caches'])}")
print0(f"target: {args.target} ({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, vocab {tcfg.vocab_size}), "
       f"taps {taps}, layers 0..{max(taps)} loaded")
print0(f"drafter: {n_params / 1e6:.1f}M params, {dcfg.num_hidden_layers} layers, block {B}, mask token {dcfg.mask_token_id}"
       + (", attention: flex_attention (compiled)" if cuda else ", attention: dense mask + SDPA (CPU: flex has no backward)"))
print0(f"data: {data_dir} ({len(train_ds)} samples), {steps_per_epoch} steps/epoch of {n_pairs} x {S} tokens, "
       f"{max_steps} steps, truncated samples per epoch: {packer.truncated}; held-out rows: {len(eval_rows)}")

# -----------------------------------------------------------------------------
# target ranks: run ahead of the drafter with at most two rows in flight (double-buffered isends)

if is_target and world > 1:
    inflight, fwd = [], []
    for step, kind, r in schedule(start_step):
        if kind in ("eval", "train"):
            row = eval_rows[r] if kind == "eval" else packer.next_row()
            m0 = mark()
            feats, meta = target_features(row), row_meta(row)
            fwd.append((m0, mark()))
            # one batched P2P op per row: NCCL serializes unbatched sends with every other op on the group
            inflight.append((dist.batch_isend_irecv([dist.P2POp(dist.isend, t_, peer) for t_ in (feats, meta)]), feats, meta))
            if len(inflight) > 2:        # reuse a slot only once the drafter has taken its row
                for w in inflight.pop(0)[0]:
                    w.wait()
        elif kind == "log":
            sync()
            gather_stats([sum(ms(a, b) for a, b in fwd) / max(len(fwd), 1),
                          torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0])
            fwd = []
    for works, _, _ in inflight:
        for w in works:
            w.wait()
    sync()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)

# -----------------------------------------------------------------------------
# drafter ranks (and world size 1): receive rows, train

buf = (torch.empty(S, n_feat * tcfg.hidden_size, dtype=tdtype, device=device),
       torch.empty(5, S, dtype=torch.int64, device=device)) if world > 1 else None   # (feats, meta) of this row
tfwd = []                                                         # world size 1: (start, end) of each target forward

def next_row(kind, r):
    """The next (feats, meta) from this pair's target. In world size 1 the target runs here, in this process."""
    if world == 1:
        row = eval_rows[r] if kind == "eval" else packer.next_row()
        m0 = mark()
        feats = target_features(row)
        if kind == "train":
            tfwd.append((m0, mark()))
        return feats.clone(), row_meta(row)      # a clone: autograd cannot save tensors made in inference mode
    # The receive is posted only now, queued behind the previous step: one posted earlier keeps an NCCL kernel
    # resident on this GPU's SMs through the whole step (H200: drafter step 306 ms instead of 244 ms). The target
    # queued its send when its forward ended, so the row lands as soon as the step does.
    for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t_, peer) for t_ in buf]):
        w.wait()
    return buf

def save_checkpoint(step):
    if rank == log_rank:
        tmp = ckpt_path + f".tmp-{os.getpid()}"
        torch.save(dict(drafter=drafter.state_dict(), optimizer=opt.state_dict(), step=step, args=vars(args),
                        drafter_config=vars(dcfg), data=dict(rows_per_pair=step, seed=args.seed),
                        rng=dict(seed=args.seed, note="anchors are reseeded from (seed, step, pair) every step")), tmp)
        os.replace(tmp, ckpt_path)      # atomic: a crash mid-write leaves the previous checkpoint intact
        drafter.save_pretrained(os.path.join(args.out, "drafter"))
        print0(f"step {step}: saved {ckpt_path} and {os.path.join(args.out, 'drafter')}/ (z-lab format)")

def reduce_drafters(t):
    if world > 1:
        dist.all_reduce(t, group=drafter_group)
    return t

params = list(drafter.parameters())
logf = open(os.path.join(args.out, "log.jsonl"), "a") if master else None
def log(rec, line):
    print0(line)
    if master:
        logf.write(json.dumps(rec) + "\n")
        logf.flush()

if not cuda:
    print0("CPU: attention runs as SDPA over the dense anchor mask (same mask_mod as the GPU BlockMask)")
K = 4 + 2 * B                                    # loss, accept sum, blocks, non-finite, per-slot correct/count
acc, eval_acc = torch.zeros(K, device=device), torch.zeros(K, device=device)
gnorm_sum = torch.zeros((), device=device)
bad_rows = torch.zeros(args.log_interval, 3, dtype=torch.long, device=device)   # non-finite?, epoch, row
times, checked_fused, t_window, n_window = [], not cuda, time.perf_counter(), 0
t_start = t_window

def metrics(out, bad):
    return torch.cat([torch.stack([out["loss"].detach().float().nan_to_num(0.0), out["accept_sum"].float(),
                                   out["blocks"].float(), bad.float()]), out["slot_correct"].float(), out["slot_count"].float()])

for step, kind, r in schedule(start_step):
    if kind == "save":
        save_checkpoint(step)
    elif kind == "eval":
        feats, meta = next_row("eval", r)
        torch.manual_seed(args.seed + 7919 * r)      # the same held-out anchors at every eval
        eval_acc += metrics(eval_fn(feats, meta), torch.zeros((), device=device))
        if r == len(eval_rows) - 1:
            e = reduce_drafters(eval_acc).tolist()
            eval_acc.zero_()
            slots = [c / max(n, 1) for c, n in zip(e[5:4 + B], e[5 + B:])]
            rec = dict(kind="eval", step=step, loss=e[0] / (len(eval_rows) * n_pairs), accept=e[1] / max(e[2], 1),
                       slot_acc=slots)
            log(rec, f"eval step {step}: loss {rec['loss']:.4f} | accept {rec['accept']:.3f} | "
                     f"slot acc {' '.join(f'{a:.2f}' for a in slots)}")
    elif kind == "train":
        m0 = mark()
        feats, meta = next_row("train", None)
        m1 = mark()
        torch.manual_seed(args.seed * 1_000_003 + step * 1009 + pair)   # anchors: a function of (seed, step, pair)
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step)
        # the fused-backward check profiles the first step after the one that compiled (a profiler around
        # compilation would also record every autotuning kernel)
        prof = None if checked_fused or step == start_step else torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        if prof:
            prof.__enter__()
        out = train_fn(feats, meta)
        out["loss"].backward()
        if n_pairs > 1:
            for p_ in params:
                dist.all_reduce(p_.grad, op=dist.ReduceOp.AVG, group=drafter_group)
        gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        bad = ~(torch.isfinite(gnorm) & torch.isfinite(out["loss"]))
        opt.found_inf = bad.float()     # fused AdamW skips the update on device when set: no host sync per step
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append((m0, m1, mark()))
        if step == start_step:
            sync()
            print0(f"step {step}: first step done (drafter graph compiled) {time.perf_counter() - t_start:.0f} s after start")
            if not args.no_compile:
                torch._dynamo.config.error_on_recompile = True  # warm: from now on a recompile is an error
        if prof:
            prof.__exit__(None, None, None)
            # the fused backward is an inductor template kernel, triton_tem_fused_flex_attention_backward_* (seen on
            # H200); flex_attention outside a compiled graph runs the dense math backward and no such kernel
            fused = sorted({e.name for e in prof.events() if "flex_attention_backward" in e.name}, key=lambda n: "_tem_" not in n)
            if not any("_tem_" in n for n in fused) and not args.no_compile:
                raise RuntimeError("the first step did not run the fused flex_attention backward kernel; refusing to "
                                   "train on the dense fallback (~17 GB per layer at 512 anchors / 8192 budget)")
            print0(f"step {step}: fused flex_attention backward verified (profiler saw {', '.join(fused) or 'none'})")
            checked_fused = True
        acc += metrics(out, bad)
        gnorm_sum += gnorm.detach().nan_to_num(0.0)
        bad_rows[n_window, 0], bad_rows[n_window, 1:] = bad, meta[4, :2]   # device copies, no host sync
        n_window += 1
    elif kind == "log":
        sync()
        n, dt = n_window, time.perf_counter() - t_window
        a = reduce_drafters(acc).tolist()
        tf = sum(ms(x, y) for x, y in tfwd) / n if tfwd else 0.0
        st = gather_stats([tf, torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0])
        wait = sum(ms(x, y) for x, y, _ in times) / n - tf    # world size 1: the target ran inside that span
        dstep = sum(ms(y, z) for _, y, z in times) / n
        if a[3]:
            rows = [[step + 1 - n + i, *r_[1:]] for i, r_ in enumerate(bad_rows[:n].tolist()) if r_[0]]
            log(dict(kind="nonfinite", step=step, rows=rows), f"step {step}: non-finite loss or grad norm, update "
                f"skipped at (step, epoch, row) {rows} on this rank; {int(a[3])} in the last {n} steps on all drafters")
            if a[3] * 2 > n * n_pairs:
                sys.exit(f"error: {int(a[3])} of the last {n} steps were non-finite; stopping. Lower --lr or check the data")
        rec = dict(kind="train", step=step + 1, epoch=(step + 1) / steps_per_epoch, loss=a[0] / (n * n_pairs),
                   accept=a[1] / max(a[2], 1), lr=lr_at(step), gnorm=gnorm_sum.item() / n, tok_s=n * S * n_pairs / dt,
                   ms_target=st[:, 0].max().item(), ms_wait=wait, ms_drafter=dstep, mem_gib=st[:, 1].tolist(),
                   graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"])   # compiled on this rank, so far
        log(rec, f"step {rec['step']}/{max_steps} | ep {rec['epoch']:.2f} | loss {rec['loss']:.4f} | accept "
                 f"{rec['accept']:.3f} | lr {rec['lr']:.2e} | gnorm {rec['gnorm']:.2f} | {rec['tok_s']:.0f} tok/s | "
                 f"ms target {rec['ms_target']:.0f} wait {wait:.0f} drafter {dstep:.0f} | "
                 f"mem GiB {' '.join(f'{m:.1f}' for m in rec['mem_gib'])}")
        acc.zero_(), gnorm_sum.zero_(), bad_rows.zero_()
        times, tfwd, n_window, t_window = [], [], 0, time.perf_counter()

if world > 1:
    # data parallel must leave every drafter with the same weights: check it, do not assume it
    diff = torch.zeros((), device=device)
    for p_ in params:
        q = p_.detach().clone()
        dist.broadcast(q, log_rank, group=drafter_group)
        diff = torch.maximum(diff, (q - p_.detach()).abs().max())
    print0(f"end: drafter weights identical across {n_pairs} drafter(s): max abs diff {reduce_drafters(diff).item():.3g}")
    dist.barrier()
    dist.destroy_process_group()
