"""
Train a DFlash drafter against a frozen target. Half the GPUs of each node run the target, the
other half the drafters; pair i is (local GPU i, local GPU i + half) and streams hidden states
target -> drafter.

  python train.py        # the demo: tiny target, demo data, CPU or 1 GPU
  torchrun --nproc_per_node=4 train.py --target /ckpt/Qwen3.6-27B --data data/mix --anchors 512 \
      --budget 8192      # 2 pairs
  torchrun --nproc_per_node=2 train.py --target qwen3.6-27b --anchors 512 --budget 8192  # preset
"""
import functools
import json
import math
import os
import sys
import time
import warnings
from contextlib import nullcontext
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

import checks
import checkpoint
from data import ArgParser, DataError, Packer, make_demo, number, open_dataset, package
from model import Drafter, DrafterConfig, drafter_step, sample_anchors
from layers import upload
from target import Target, TargetConfig
t_launch = time.perf_counter()      # the log's elapsed time counts from here

# -----------------------------------------------------------------------------
# arguments. number(int, 1): an int >= 1; a bad flag stops the run with one line naming it

parser = ArgParser(description=__doc__)
arg = parser.add_argument_group("data").add_argument
arg("--data", help="prepared dataset dir (prepare.py); default: the demo, in ./data/demo")
arg("--budget", type=number(int, 1), default=128, help="tokens per packed row, fixed")
arg("--eval-rows", type=number(int, 0), default=8, help="held-out rows per eval (DATA/val)")
arg = parser.add_argument_group("models").add_argument
arg("--target", default="tiny", help="a Qwen3.5/3.6 HF checkpoint dir (dense or MoE), or a "
    "preset (random weights): tiny, qwen3.6-27b, qwen3.5-35b-a3b")
arg("--drafter-layers", type=number(int, 1), help="drafter layers (default: published, else 5)")
arg("--n-feat", type=number(int, 1), help="tapped target layers (default: published, else 5 or 3)")
arg("--block-size", type=number(int, 2), default=16, help="tokens per block: anchor + drafted")
arg("--mask-token-id", type=number(int, 0), help="embedding row of the mask (default: z-lab's)")
arg("--arch", choices=("dflash", "dflash2"), help="drafter architecture (default: dflash2, "
    "dflash2.py; with --init-drafter, its own)")
arg("--init-drafter", help="start from a z-lab format drafter dir (its layout and RoPE)")
arg("--sliding-window", type=int, help="tokens a sliding layer sees (all layers but the last "
    "slide); 0: all full attention (default: the published drafter's, else 0)")
arg = parser.add_argument_group("optimization").add_argument
arg("--anchors", type=number(int, 1), default=16, help="draft blocks per document, at most")
arg("--row-anchors", type=number(int, 0), default=0, help="anchor slots per packed row; 0: the "
    "data's 90th percentile, at most 4 * budget / block-size")
arg("--gamma", type=number(float, 0, above=True), default=7.0, help="--loss dflash: slot k's "
    "weight exp(-(k-1)/gamma)")
arg("--loss", choices=("dpace", "dflash"), default="dpace", help="dpace: D-PACE (arXiv "
    "2605.18810); dflash: the published loss (DFlash's decayed CE)")
arg("--dpace-alpha", type=number(float, 0, hi=1), help="D-PACE smoothing alpha (0.5)")
arg("--selector-alpha", type=number(float, 0), default=0.1, help="dflash2: selector CE's weight")
arg("--objective", choices=("ce", "tv", "accept", "dspark"), default="ce", help="per slot: ce "
    "the label's; vs the target's p (distill.py): tv 1 - acceptance, accept -log it, dspark mixed")
arg("--objective-temperature", type=number(float, 0, above=True), help="tv/accept/dspark: of "
    "both distributions (1)")
arg("--lr", type=number(float, 0, above=True), default=6e-4, help="peak AdamW learning rate")
arg("--warmup", type=number(float, 0, hi=1), default=0.04, help="warmup share of the steps")
arg("--schedule", choices=("cosine", "wsd"), default="cosine", help="after warmup: cosine to 0, "
    "or wsd: the peak, then linear to 0 over the last 20%% of the steps")
arg("--epochs", type=number(int, 1), help="passes over the data (6; or --max-steps)")
arg("--max-steps", type=number(int, 1), help="optimizer steps (default: epochs' worth)")
arg("--grad-clip", type=number(float, 0, above=True), default=1.0, help="gradient-norm clip")
arg("--seed", type=number(int, 0), default=0, help="data order and anchor sampling seed")
arg = (group := parser.add_argument_group("logging, eval and checkpoints")).add_argument
arg("--out", default="out", help="output dir: log.jsonl, ckpt.pt, drafter/ (z-lab export)")
arg("--log-interval", type=number(int, 1), default=10, help="steps between log lines")
arg("--eval-interval", type=number(int, 1), default=100, help="steps between evals (and last)")
arg("--save-interval", type=number(int, 1), default=500, help="steps between saves (and last)")
arg("--wandb", metavar="PROJECT", help="also send train/eval records to this W&B project")
either = group.add_mutually_exclusive_group().add_argument
either("--resume", action="store_true", help="continue OUT/ckpt.pt exactly")
either("--overwrite", action="store_true", help="start over in an --out that holds a run")
arg = parser.add_argument_group("system").add_argument
arg("--no-compile", action="store_true", help="eager drafter step (debugging; dense flex bwd)")
arg("--plain-loss", action="store_true", help="the loss in plain autograd (model.plain_ce)")
arg("--no-cuda-graphs", action="store_true", help="no CUDA graph replays of launch-bound passes")
arg("--cache-dir", help="root of the per-rank Triton/Inductor caches (/tmp/dflash-cache-USER)")
arg("--fresh-cache", action="store_true", help="empty this run's Triton/Inductor caches first")
arg("--timeout", type=number(float, 0, above=True), default=900, help="seconds to wait for a peer")
args = parser.parse_args()
objective = checks.flags(parser, args)   # distill.py's objective, or None (CE)
final = objective is not None     # then the target's final hidden state rides with the taps
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
rank_cache, cache_dirs = checks.rank_caches(args.cache_dir, rank, args.fresh_cache)  # not shared
checks.explain_stops(rank, args.out, cache_dirs)

# -----------------------------------------------------------------------------
# ranks: per node the first half of the local ranks run targets, the second half drafters

local_rank = int(os.environ.get("LOCAL_RANK", 0))
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
if world > 1 and local_world % 2:
    sys.exit(f"error: {local_world} processes per node; DFlash pairs need an even number "
             "(half targets, half drafters)")
half = max(local_world // 2, 1)
role = "target+drafter" if world == 1 else "target" if local_rank < half else "drafter"
runs_target, runs_drafter = role != "drafter", role != "target"
peer = rank + half if local_rank < half else rank - half        # the other member of this pair
n_pairs, pair = max(world // 2, 1), (rank // local_world) * half + local_rank % half
# every pair's target and drafter rank, in pair order (world size 1: rank 0 plays both)
target_ranks = [r for r in range(world) if r % local_world < half]
drafter_ranks = [r + half for r in target_ranks] if world > 1 else [0]
log_rank = drafter_ranks[0]                                     # prints and writes the log
device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
cuda = device.type == "cuda"
if cuda:
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    import speedups
if world > 1:
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout),
                            device_id=device if cuda else None)
    drafter_group = dist.new_group(drafter_ranks)
    # log statistics travel on gloo (host memory): an NCCL collective on the world group would queue
    # on the target behind its sends of the next rows, which the drafter receives only after it
    stats_group = dist.new_group(backend="gloo") if cuda else None

def print0(*a):
    if rank == log_rank:
        print(*a, flush=True)

def sync():
    # this stream only: on a target a device-wide sync would also wait for its in-flight sends
    if cuda:
        torch.cuda.current_stream(device).synchronize()

# -----------------------------------------------------------------------------
# configs, and the start-up self-check: before any update, this torch's compiled flex step must
# equal the dense step on this run's mask kinds (checks.py), run in a second process meanwhile

preset = not os.path.isdir(args.target)
try:
    tcfg = TargetConfig.preset(args.target) if preset else TargetConfig.from_hf(args.target)
except FileNotFoundError as e:
    sys.exit(f"error: --target {args.target}: no {e.filename}: a Hugging Face checkpoint dir holds "
             "config.json and its *.safetensors")
except (ValueError, OSError) as e:   # an unknown preset, an unreadable or unsupported config.json
    sys.exit(f"error: --target {args.target}: {e}")
try:
    dcfg = DrafterConfig.from_target(
        tcfg, n_feat=args.n_feat, block_size=args.block_size, num_hidden_layers=args.drafter_layers,
        mask_token_id=args.mask_token_id, sliding_window=args.sliding_window,
        conv_kernel_size=2 if args.arch == "dflash2" or not (args.arch or args.init_drafter) else 0)
except ValueError as e:
    sys.exit(f"error: --sliding-window {args.sliding_window}: {e}")
skip = ("CPU: the dense path is the only one; flex has no CPU backward" if not cuda else
        "--no-compile: no compiled flex step" if args.no_compile else None)
self_check = checks.SelfCheck(dcfg, device, rank_cache, skip or role == "target" and "target"
                              or args.init_drafter and "until --init-drafter is loaded")

# -----------------------------------------------------------------------------
# data: the demo dataset is made on first use (the tiny target's greedy continuations)

data_dir = args.data or os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "demo")
try:
    if args.data is None:   # made by this target.py, or made anew (one rank: a file lock)
        make_demo(data_dir, log=print0)
    train_ds, val_dir = open_dataset(data_dir), os.path.join(data_dir, "val")
    val_ds = open_dataset(val_dir) if os.path.exists(val_dir) else None
except DataError as e:           # a missing meta.json, a truncated tokens.bin: named, with the fix
    sys.exit(f"error: --data {data_dir}: {e}")
packer = Packer(train_ds, args.budget, n_shards=n_pairs, shard=pair, seed=args.seed)
steps_per_epoch = packer.steps_per_epoch        # of epoch 0 (epochs differ by a row or so)
max_steps = args.max_steps or packer.total_steps(args.epochs)
budget, anchors_per_doc, block_size = args.budget, args.anchors, args.block_size
# the anchor slots of a row (one compiled shape): rows that want more are cut fairly across
# documents, fewer padded. What the first 512 rows of the plan ask for, by the sampler itself
probe = Packer(train_ds, budget, seed=args.seed)
demand = np.array([int(sample_anchors(torch.from_numpy(row.loss_mask), torch.from_numpy(row.doc),
                                      anchors_per_doc, 1)[2])
                   for row in (probe.next_row() for _ in range(min(512, probe.steps_per_epoch)))])
row_anchors_max = min(budget - 1, 4 * budget // block_size)   # the default's bound: 4x the row
p90 = int(-(-np.percentile(demand, 90) // 8) * 8)       # a multiple of 8: 128-row tiles
row_anchors = args.row_anchors or max(8, min(p90, row_anchors_max))
dropped = np.maximum(demand - row_anchors, 0).sum() / max(demand.sum(), 1)
supervised, lost, taps = train_ds.n_supervised, packer.truncated_supervised(), dcfg.target_layer_ids
checks.start(args, data_dir, train_ds, demand, lost, tcfg, dcfg)

# -----------------------------------------------------------------------------
# models: target ranks load the layers up to the last tapped one, drafters embed_tokens + lm_head

tdtype = torch.bfloat16 if cuda else torch.float32
last = tcfg.num_hidden_layers - 1 if final else max(taps)      # the last layer a target runs
kw = dict(device=device, dtype=tdtype, n_layers=last + 1 if runs_target else 0, head=runs_drafter)
try:
    target = Target.build(tcfg, **kw) if preset else Target.from_pretrained(args.target, **kw)
except (ValueError, KeyError, FileNotFoundError) as e:   # missing, misshapen, mis-scaled tensors
    sys.exit(f"error: --target {args.target}: {e.args[0] if isinstance(e, KeyError) else e}")
graphs_wanted = cuda and not args.no_compile and not args.no_cuda_graphs

if runs_drafter:
    torch.manual_seed(args.seed)        # every drafter rank starts from the same weights
    try:
        drafter = Drafter.from_pretrained(args.init_drafter) if args.init_drafter else Drafter(dcfg)
    except ValueError as e:
        sys.exit(f"error: --init-drafter {args.init_drafter}: {e}")
    if args.init_drafter:       # the trained layout: the init drafter's own (DFlash: + --arch's)
        drafter = checks.init_drafter(args, drafter, dcfg, tcfg)
        self_check = checks.SelfCheck(dcfg := drafter.config, device, rank_cache, skip)
    drafter = drafter.to(device)    # fp32 parameters (AdamW's master weights); a bf16 step on GPU
    params = list(drafter.parameters())
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=True)
    device_skip = bool(opt.defaults.get("fused"))   # it reads opt.found_inf (update())
    # THE drafter step (model.drafter_step: anchors, BlockMask lists, forward, loss) compiled
    # whole, backward through it; update() runs the all-reduce, clip and AdamW after it, eagerly
    whole_step = functools.partial(
        drafter_step, drafter, anchors_per_doc=anchors_per_doc, row_anchors=row_anchors,
        embed=target.embed_tokens.weight, head=target.lm_head.weight, gamma=args.gamma,
        flex=checks.flex_kernel_options(device), ce_chunk=0 if args.plain_loss else 1024,
        dpace=args.dpace_alpha if args.loss == "dpace" else None,
        selector_alpha=args.selector_alpha, objective=objective)
    if not args.no_compile:
        # a recompile after warm-up, or a hit recompile limit, would silently run flex_attention's
        # dense backward: both are errors instead (and, on GPU, flex run eagerly)
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        torch._inductor.config.fallback_random = True   # anchors drawn as eagerly: --no-compile's
        whole_step = torch.compile(whole_step, fullgraph=True, dynamic=False)
        if cuda:
            warnings.filterwarnings("error", ".*flex_attention called without torch.compile")
    step_fn = torch.enable_grad()(whole_step)   # one graph: under no_grad an eval would recompile

# the output dir, once the inputs are checked: one run at a time, none replaced by accident
ckpt_path = os.path.join(args.out, "ckpt.pt")
if rank == log_rank:
    checkpoint.claim(args.out, args.resume, args.overwrite, print0)

# -----------------------------------------------------------------------------
# resume: the drafter ranks read the checkpoint, which must be of this run (checkpoint.identity);
# every rank learns the step from the log rank

run = checkpoint.identity(args, n_pairs, train_ds.meta, row_anchors, dcfg, tcfg)
start_step, changed = 0, {}
if args.resume and runs_drafter:
    start_step, changed = checkpoint.load(ckpt_path, run, device, max_steps, drafter, opt,
                                          vars(args), world)
if world > 1:
    dist.broadcast(step_t := torch.tensor([start_step], device=device), log_rank)
    start_step = int(step_t)
packer.seek(start_step)     # every pair consumes one row per step: the step is the data position
val_rows = Packer(val_ds, budget, shuffle=False) if val_ds else None   # every pair evaluates them
eval_rows = [val_rows.next_row() for _ in range(min(args.eval_rows, val_rows.steps_per_epoch))
             ] if val_ds else []

# -----------------------------------------------------------------------------
# banner, and the log: OUT/log.jsonl (README: Reading the log) and the console

infos = [dict(rank=rank, role=role, pair=pair, caches=cache_dirs,
              device=torch.cuda.get_device_name(device) if cuda else "cpu")] * world
if world > 1:
    dist.all_gather_object(infos, infos[0])
print0(f"dflash train | torch {torch.__version__} | {world} process(es), {n_pairs} pair(s)")
print0("args: " + json.dumps(vars(args)))
for i in infos:
    print0(f"  rank {i['rank']}: {i['role']:<14} pair {i['pair']} on {i['device']} | "
           f"caches {' '.join(i['caches'])}")
print0(f"target: {args.target} ({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, "
       f"vocab {tcfg.vocab_size}), taps {taps}, layers 0..{last} loaded" + " and norm" * final)
n_params = sum(p.numel() for p in drafter.parameters()) if runs_drafter else 0
kinds = [f"{dcfg.layer_types.count(k)} x {k}" + (f" (window {w})" if w else "")
         for k, w in dcfg.windows().items()]
print0(f"drafter: {'DFlash2' if dcfg.conv_kernel_size else 'DFlash'}, {n_params / 1e6:.1f}M "
       f"params, block {block_size}, mask token {dcfg.mask_token_id}, "
       f"{'flex_attention (compiled)' if cuda else 'dense mask + SDPA'}; drafter layout: "
       f"{' + '.join(kinds)}, in order {' '.join(t.split('_')[0] for t in dcfg.layer_types)}; "
       f"rope theta {dcfg.rope_theta:g}, scaling {dcfg.rope_scaling}")
print0(f"self-check: {self_check.status}")
print0(f"data: {data_dir} ({len(train_ds)} samples), {steps_per_epoch} steps/epoch of "
       f"{n_pairs} x {budget} tokens, {max_steps} steps, truncated samples per epoch: "
       f"{packer.truncated} ({packer.truncated_tokens} tokens, {lost} of {supervised} "
       f"supervised); held-out rows: {len(eval_rows)}")
if lost > 0.05 * supervised:
    print0(f"warning: --budget {budget} truncates {lost / supervised:.1%} of the supervised tokens "
           "away; raise --budget, or split the long samples")
print0(f"anchors: up to {anchors_per_doc} per document, {row_anchors} slots per row ("
       + ("--row-anchors; " if args.row_anchors else "at most 4 * budget / block-size; "
          if p90 > row_anchors_max else "the 90th percentile; ")
       + f"the first {len(demand)} rows ask for median {np.median(demand):.0f}, max "
       f"{demand.max()}), {row_anchors * block_size} query tokens per row; the slots drop "
       f"{dropped:.1%} of the anchors asked for"
       + ("; raise --row-anchors to keep them" if dropped > 0.05 else ""))
log_file = open(os.path.join(args.out, "log.jsonl"), "a") if rank == log_rank else None
wandb = args.wandb and rank == log_rank and package("wandb", "--wandb").init(  # checked at start
    project=args.wandb, config=vars(args), name=os.path.basename(os.path.abspath(args.out)))

def log(record, line):
    # the record first: a step a user saw on screen is on disk too, whatever kills the job next
    record.setdefault("elapsed_s", round(time.perf_counter() - t_launch, 2))
    if log_file:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
    if wandb and record["kind"] in ("train", "eval"):   # numbers only, as kind/name
        wandb.log({f"{record['kind']}/{k}": v for k, v in record.items()
                   if isinstance(v, (int, float))}, step=record["step"])
    print0(line)

# =============================================================================
# definitions the loops use

# The schedule is the pair's lockstep contract: both roles walk this same sequence and never talk
# about it. Every "train" and "eval" item moves one row target -> drafter, every "log" item is one
# stats exchange in which every rank takes part ("save" is the log rank's alone). A role that
# skipped or added an item would wait for its peer until --timeout: change it here, for both.
def schedule(start):
    """Yields (step, kind, eval row)."""
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

def lr_at(step):
    warm = max(1, round(args.warmup * max_steps))
    if step < warm:
        return args.lr * (step + 1) / warm
    if args.schedule == "wsd":      # warmup-stable-decay
        return args.lr * min(1.0, (max_steps - step) / max(1, round(0.2 * max_steps)))
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, max_steps - warm)))

def mark():   # a point in time on this rank's GPU stream (no host sync); the host clock on CPU
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event

def ms(marks):   # the total of (start, end) mark spans
    return sum(a.elapsed_time(b) if cuda else (b - a) * 1e3 for a, b in marks)

def gather_stats(target_ms):
    # one small all-reduce over every rank per log line: row r holds rank r's (target ms, peak GiB)
    stats = torch.zeros(world, 2)
    stats[rank, 0] = target_ms
    stats[rank, 1] = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0
    if world > 1:
        dist.all_reduce(stats, group=stats_group)
    return stats

def add(sums, metrics):   # a window's metric sums stay on the device: no host sync per step
    for k, v in metrics.items():
        sums[k] = sums.get(k, 0) + v.detach().float()

def reduce(sums):   # all drafters' sums of a window, on the host; the window starts empty again
    for v in sums.values() if world > 1 else []:
        dist.all_reduce(v, group=drafter_group)
    m = {k: v.cpu() for k, v in sums.items()}
    sums.clear()
    return m

def unpack_row(packed):   # data.Row.packed's fields [5, budget] (int64), by name
    return dict(zip(("tokens", "loss_mask", "doc", "pos", "where"), packed))

def update(feats, packed, lr):
    """One optimizer step on one row at learning rate lr: the drafter step (anchors, compiled
    forward), backward, gradient all-reduce, clip, AdamW. Returns the step's metrics, with its
    non-finite flag (then the update was skipped), as device tensors. Keep it capture-safe: no
    host sync here with a fused optimizer (no .item(), no Python branch on a tensor value), as a
    launch-bound run replays it from a CUDA graph (speedups.UpdateGraph)."""
    for g in opt.param_groups:
        g["lr"] = lr
    out, wanted = step_fn(feats, unpack_row(packed))
    out["loss"].backward()
    if n_pairs > 1:
        for p in params:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=drafter_group)
    gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    nonfinite = ~(torch.isfinite(gnorm) & torch.isfinite(out["loss"]))
    if device_skip:         # torch's fused optimizers skip on device: no host sync
        opt.found_inf = nonfinite.float()
    if device_skip or not nonfinite.item():   # any other: the host decides (no CUDA-graph replay)
        opt.step()
    opt.zero_grad(set_to_none=True)
    # blocks: anchors kept; wanted: asked for before the slots' cut; gnorm: every drafter's
    return dict(out, loss=out["loss"].detach().nan_to_num(0.0), wanted=wanted, nonfinite=nonfinite,
                gnorm=gnorm.nan_to_num(0.0))

# The pair protocol. Per "train" and "eval" item of the schedule the target sends its drafter one
# row in one batched P2P op (NCCL serializes unbatched sends with every other op on the group):
#   features  [budget, (len(taps) + final) * hidden] in the target's dtype (bf16; fp32 on CPU):
#             the taps' outputs (final: then the last layer's, final-normed)
#   fields    [5, budget] int64: data.Row.packed
# The target runs ahead: it queues a row's forward once its GPU is done with the previous row,
# posts the send without waiting, then waits for the send of two rows before: at most two rows in
# flight (double-buffered). The drafter posts its receive only when it takes the row: a receive
# posted earlier keeps an NCCL kernel resident on its GPU through the whole step. World size 1:
# one process plays both sides and nothing travels.

# a launch-bound target forward is replayed from CUDA graphs, where the target offers it
features = lambda ids, cu, train: target.features(ids, cu, taps, final=final)
if graphs_wanted and runs_target and hasattr(target, "graphed_features"):
    features = target.graphed_features(taps, print0, final) or features

def target_row(kind, r):
    # the next row of `kind` (eval: held-out row r): its fields in one upload, then its features
    row = eval_rows[r] if kind == "eval" else packer.next_row()
    packed = upload(torch.from_numpy(row.packed()), device)
    return features(packed[0], torch.from_numpy(row.cu_seqlens), kind == "train"), packed

# =============================================================================
# target ranks: run ahead of the drafter, at most two rows in flight (the pair protocol above)

if role == "target":
    inflight, forwards = [], []
    for step, kind, r in schedule(start_step):
        if kind in ("eval", "train"):
            # the host waits for this GPU's previous row (and the send it waits on) before it
            # queues the next: rows in flight stay bounded, as their features stay allocated
            sync()
            t0 = mark()
            feats, packed = target_row(kind, r)
            forwards.append((t0, mark()))
            ops = [dist.P2POp(dist.isend, t, peer) for t in (feats, packed)]
            inflight.append((dist.batch_isend_irecv(ops), feats, packed))
            if len(inflight) > 2:        # reuse a slot only once the drafter has taken its row
                for work in inflight.pop(0)[0]:
                    work.wait()
        elif kind == "log":
            sync()
            gather_stats(ms(forwards) / max(len(forwards), 1))
            forwards = []
    for work in (w for works, _, _ in inflight for w in works):
        work.wait()
    sync()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)

# =============================================================================
# drafter ranks (and world size 1): receive rows, train

if world > 1:   # the receive buffers: features, fields
    bufs = (torch.empty(budget, (len(taps) + final) * tcfg.hidden_size, dtype=tdtype,
                        device=device),
            torch.empty(5, budget, dtype=torch.int64, device=device))

def next_row(kind, r):
    # (features, fields) of the next row of `kind` from this pair's target (world size 1: here)
    if world > 1:
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in bufs]):
            work.wait()
        return bufs
    feats, packed = target_row(kind, r)
    # autograd cannot save inference tensors (FeatureGraphs' replays return a copy already)
    return feats.clone() if feats.is_inference() else feats, packed

def window_record(step, m, seconds):
    """The train record of the log window that ends with train step `step` (README: Reading the
    log), from m, the drafters' metric sums. The ETA: the mean time of a step since the first one
    (which compiled), evals and saves included, times the steps left."""
    n, blocks, step_ms = len(step_marks) * n_pairs, m["blocks"].item(), 1e3 * seconds / len(
        step_marks)
    # the wait for a row (world size 1: the target's forward, here), the drafter's own step
    wait_ms, drafter_ms = (ms(t[a:a + 2] for t in step_marks) / len(step_marks) for a in (0, 1))
    stats = gather_stats(wait_ms if world == 1 else 0.0)
    target_ms, wait_ms = stats[target_ranks, 0].max().item(), wait_ms if world > 1 else 0.0
    s_step = ((time.perf_counter() - t_first) / (step - start_step) if step > start_step
              else seconds / len(step_marks))
    return dict(kind="train", step=step + 1, epoch=(step + 1) / steps_per_epoch,
                rows=[f[1:] for f in nonfinite_rows[:len(step_marks)].tolist()],
                loss=m["loss"].item() / n, accept=m["accept_sum"].item() / max(blocks, 1),
                lr=lr_at(step), gnorm=m["gnorm"].item() / n, tok_s=n * budget / seconds,
                blocks_s=blocks / seconds, anchors_row=blocks / n, row_anchors=row_anchors,
                anchors_cut=int(m["wanted"] - m["blocks"]),
                pad_frac=1 - blocks / (n * row_anchors), ms_step=step_ms, ms_target=target_ms,
                ms_wait=wait_ms, ms_drafter=drafter_ms, busy_target=target_ms / step_ms,
                busy_drafter=drafter_ms / step_ms, mem_gib=stats[:, 1].tolist(),
                s_per_step=s_step, eta_s=round((max_steps - step - 1) * s_step, 2),
                elapsed_s=round(time.perf_counter() - t_launch, 2),
                graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"])

def train_line(r):   # a train record as its console line (README: Reading the log)
    return (f"step {r['step']}/{max_steps} | ep {r['epoch']:.2f} | loss {r['loss']:.4f} | accept "
            f"{r['accept']:.3f} | lr {r['lr']:.2e} | gnorm {r['gnorm']:.2f} | {r['tok_s']:.0f} "
            f"tok/s {r['blocks_s']:.0f} blocks/s | anchors/row {r['anchors_row']:.0f} cut "
            f"{r['anchors_cut']} pad {r['pad_frac']:.0%} | ms target {r['ms_target']:.0f} wait "
            f"{r['ms_wait']:.0f} drafter {r['ms_drafter']:.0f} busy {r['busy_target']:.0%} "
            f"{r['busy_drafter']:.0%} | mem GiB {' '.join(f'{x:.1f}' for x in r['mem_gib'])} | "
            f"elapsed {timedelta(seconds=round(r['elapsed_s']))}, ETA "
            f"{timedelta(seconds=round(r['eta_s']))}")

line = f"start: logging to {args.out}/log.jsonl"
if args.resume:     # what a resumed run's later records supersede (README: Reading the log)
    line = (f"resume: step {start_step} of {ckpt_path}; changed: "
            + (", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "nothing"))
log(dict(kind="start", step=start_step, resume=args.resume, processes=world, pairs=n_pairs,
         changed=changed, args=vars(args), truncated=dict(
             samples=packer.truncated, tokens=packer.truncated_tokens, supervised=lost)), line)
if not args.no_compile:
    print0("compiling the drafter step: about a minute the first time, seconds once cached")
train_sums, eval_sums = {}, {}
nonfinite_rows = torch.zeros(args.log_interval, 3, dtype=torch.long, device=device)  # bad?, where
step_marks, t_window = [], time.perf_counter()
# on GPU the third step is timed for a CUDA-graph replay (one pair: no all-reduce in it)
graphed_update = (speedups.UpdateGraph(update, opt, 3, print0)
                  if graphs_wanted and n_pairs == 1 and device_skip else update)

for step, kind, r in schedule(start_step):
    if kind == "save" and rank == log_rank:
        # no data position or RNG state: the step gives both (packer.seek; anchors from the step)
        checkpoint.save(args.out, step, drafter, dict(
            optimizer=opt.state_dict(), args=vars(args), drafter_config=vars(dcfg), run=run,
            processes=world))
        print0(f"step {step}: saved {ckpt_path} and {args.out}/drafter/ (z-lab format)")

    elif kind == "eval":
        feats, packed = next_row("eval", r)
        torch.manual_seed(args.seed + 7919 * r)      # the same held-out anchors at every eval
        out, wanted = step_fn(feats, unpack_row(packed))
        add(eval_sums, dict(out, wanted=wanted))
        del out                                     # and the activations autograd saved
        if r == len(eval_rows) - 1:
            m = reduce(eval_sums)   # per block *accept_sum (accepted lengths), per slot *_hits
            n, blocks = m["slot_count"].sum().clamp(min=1), max(m["blocks"].item(), 1)
            rec = dict(kind="eval", step=step, loss=m["loss"].item() / (len(eval_rows) * n_pairs),
                       **{k[:-4]: m[k].item() / blocks for k in m if k.endswith("accept_sum")},
                       **{k[:-5]: (m[k] / n).item() for k in m if k.endswith("_hits")},
                       slot_acc=(m["slot_correct"] / m["slot_count"].clamp(min=1)).tolist()[1:])
            log(rec, f"eval step {step}: loss {rec['loss']:.4f} | " + " | ".join(
                f"{k.replace('_', ' ')} {v:.3f}" for k, v in rec.items() if type(v) is float
                and k != "loss") + " | slot acc " + " ".join(f"{a:.2f}" for a in rec["slot_acc"]))

    elif kind == "train":
        t0 = mark()
        feats, packed = next_row("train", None)
        t1 = mark()
        if self_check.process:
            print0(f"self-check: {self_check.join()}")
        torch.manual_seed(args.seed * 1_000_003 + step * 1009 + pair)  # anchors: (seed, step, pair)
        # the step after the compiling one, profiled: the profiler must see the fused flex backward
        probed = cuda and not args.no_compile and step == start_step + 1
        with checks.fused_backward(len(dcfg.windows())) if probed else nullcontext() as seen:
            metrics = graphed_update(feats, packed, lr_at(step))
        if probed:
            print0(f"step {step}: fused flex_attention backward verified (profiler saw "
                   f"{', '.join(seen)})")
        step_marks.append((t0, t1, mark()))
        if step == start_step:
            sync()
            t_first = time.perf_counter()
            print0(f"step {step}: first step done (drafter graph compiled) "
                   f"{t_first - t_launch:.0f} s after start")
            if not args.no_compile:
                torch._dynamo.config.error_on_recompile = True  # warm: a recompile is an error
        add(train_sums, metrics)
        nonfinite_rows[len(step_marks) - 1, 0] = metrics["nonfinite"]  # device copies, no sync
        nonfinite_rows[len(step_marks) - 1, 1:] = packed[4, :2]

    elif kind == "log":
        sync()
        m, n_window = reduce(train_sums), len(step_marks)
        if m["nonfinite"]:
            bad = [[step + 2 - n_window + i, e, x]
                   for i, (b, e, x) in enumerate(nonfinite_rows[:n_window].tolist()) if b]
            log(dict(kind="nonfinite", step=step + 1, rows=bad),
                f"step {step + 1}: non-finite loss or grad norm, update skipped at (step, epoch, "
                f"row) {bad} on this rank; {int(m['nonfinite'])} in the last {n_window} steps on "
                "all drafters")
            if m["nonfinite"] * 2 > n_window * n_pairs:
                sys.exit(f"error: {int(m['nonfinite'])} of the last {n_window} steps were "
                         "non-finite; stopping. Lower --lr or check the data")
        rec = window_record(step, m, time.perf_counter() - t_window)
        log(rec, train_line(rec))
        nonfinite_rows.zero_()
        step_marks, t_window = [], time.perf_counter()

if world > 1:
    print0(f"end: drafter weights identical across {n_pairs} drafter(s): max abs diff "
           f"{checks.weights_diff(params, log_rank, drafter_group):.3g}")
    dist.barrier()
    dist.destroy_process_group()
log(dict(kind="end", step=max_steps),
    f"done: {timedelta(seconds=round(time.perf_counter() - t_launch))} in all")
