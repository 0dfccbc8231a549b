"""
Train a DFlash drafter against a frozen target. Half the GPUs of each node run the target, the
other half the drafters; pair i is (local GPU i, local GPU i + half) and streams hidden states
target -> drafter.

  python train.py        # the demo: tiny target, demo data, CPU or 1 GPU
  torchrun --nproc_per_node=4 train.py --target /ckpt/Qwen3.6-27B --data data/mix --anchors 512 \
      --budget 8192      # 2 pairs
  torchrun --nproc_per_node=2 train.py --target qwen3.6-27b --anchors 512 --budget 8192  # preset
"""
# Reading order: setup (arguments, ranks, output dir, configs, the self-check, data, models, resume,
# banner, log), then the definitions the loops use (schedule, rows as tensors, the drafter's update,
# the pair protocol, the train step's one-offs, checkpoints), then the two loops: target, drafter.
import argparse
import errno
import fcntl
import functools
import getpass
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from datetime import timedelta

t_launch = time.perf_counter()      # the log's elapsed time counts from here
# numpy only: nothing before the cache settings below may import triton
from data import ArgParser, number

# -----------------------------------------------------------------------------
# arguments. number(int, 1): an int >= 1; a bad flag stops the run with one line naming it

parser = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
group = parser.add_argument_group("data")
group.add_argument("--data", default=None,
                   help="prepared dataset dir (prepare.py); default: the demo, in ./data/demo")
group.add_argument("--budget", type=number(int, 1), default=128,
                   help="tokens per packed row (the context length), fixed")
group.add_argument("--eval-rows", type=number(int, 0), default=8,
                   help="held-out rows per evaluation (from DATA/val)")
group.add_argument("--generate-prompts", type=number(int, 0), default=0,
                   help="at the end, tau of speculative decoding on this many DATA/val prompts")
group.add_argument("--generate-tokens", type=number(int, 1), default=64,
                   help="new tokens per --generate-prompts prompt")
group = parser.add_argument_group("models")
group.add_argument("--target", default="tiny",
                   help="a Qwen3.5/3.6 HF checkpoint dir (dense or MoE; demo: the small target "
                   "trained on code), or a preset (random weights): tiny, qwen3.6-27b, "
                   "qwen3.5-35b-a3b, qwen3.6-35b-a3b")
group.add_argument("--drafter-layers", type=number(int, 1), default=None,
                   help="drafter decoder layers (default: the published drafter's, else 5)")
group.add_argument("--n-feat", type=number(int, 1), default=None,
                   help="tapped target layers (default: the published drafter's, else 5 or 3)")
group.add_argument("--block-size", type=number(int, 2), default=16,
                   help="tokens per draft block: the anchor + block-size - 1 drafted tokens")
group.add_argument("--mask-token-id", type=number(int, 0), default=None,
                   help="embedding row of the masked slots (default: z-lab's for the vocab)")
group.add_argument("--init-drafter", default=None,
                   help="start from a z-lab format drafter dir (keeping its layout and RoPE)")
group.add_argument("--sliding-window", type=int, default=None,
                   help="tokens a sliding layer sees (all but the last slide); 0: all full "
                   "attention (default: the published drafter's, else 0)")
group = parser.add_argument_group("optimization")
group.add_argument("--anchors", type=number(int, 1), default=16,
                   help="draft blocks per document and step, at most (the recipe: 512)")
group.add_argument("--row-anchors", type=number(int, 0), default=0,
                   help="draft blocks per packed row, fixed; 0: the data's 90th percentile")
group.add_argument("--gamma", type=number(float, 0, above=True), default=7.0,
                   help="loss decay over block slots: weight exp(-(k-1)/gamma)")
group.add_argument("--loss", choices=("dflash", "dpace"), default="dflash",
                   help="dflash: decayed cross-entropy; dpace: D-PACE, expected-acceptance weights")
group.add_argument("--dpace-alpha", type=number(float, 0, hi=1), default=0.5,
                   help="D-PACE smoothing of the drafter's probability: (1 - alpha) q + alpha")
group.add_argument("--kd", type=number(float, 0, hi=1), default=0.0,
                   help="distillation weight W: (1 - W) CE + W KL(target || drafter) per slot")
group.add_argument("--lr", type=number(float, 0, above=True), default=6e-4,
                   help="peak AdamW learning rate")
group.add_argument("--warmup", type=number(float, 0, hi=1), default=0.04,
                   help="linear warmup, as a fraction of all steps; then cosine to 0")
group.add_argument("--epochs", type=number(int, 1), default=6,
                   help="passes over the training set (ignored with --max-steps)")
group.add_argument("--max-steps", type=number(int, 1), default=None,
                   help="optimizer steps (default: epochs * steps per epoch)")
group.add_argument("--grad-clip", type=number(float, 0, above=True), default=1.0,
                   help="global gradient-norm clip")
group.add_argument("--seed", type=number(int, 0), default=0,
                   help="data order and anchor sampling seed")
group = parser.add_argument_group("logging, eval and checkpoints")
group.add_argument("--out", default="out",
                   help="output dir: log.jsonl, ckpt.pt, drafter/ (z-lab export)")
group.add_argument("--log-interval", type=number(int, 1), default=10,
                   help="steps between log lines")
group.add_argument("--eval-interval", type=number(int, 1), default=100,
                   help="steps between held-out evaluations (and at the end)")
group.add_argument("--save-interval", type=number(int, 1), default=500,
                   help="steps between checkpoints (and at the end)")
either = group.add_mutually_exclusive_group()
either.add_argument("--resume", action="store_true",
                    help="continue OUT/ckpt.pt exactly (what defines the run must match)")
either.add_argument("--overwrite", action="store_true",
                    help="start over in an --out that holds a run (deleting its files first)")
group.add_argument("--wandb", default=None, metavar="PROJECT",
                   help="also send the records to this W&B project (WANDB_MODE=offline: no net)")
group.add_argument("--wandb-name", default=None, help="W&B run name (default: wandb's own)")
group = parser.add_argument_group("system")
group.add_argument("--no-compile", action="store_true",
                   help="run the drafter step eagerly (debugging; dense flex backward on GPU)")
group.add_argument("--no-cuda-graphs", action="store_true",
                   help="no CUDA graph replays, even of launch-bound passes (measured at start)")
group.add_argument("--cache-dir", default=None,
                   help="root of the per-rank Triton/Inductor caches (/tmp/dflash-cache-USER)")
group.add_argument("--fresh-cache", action="store_true",
                   help="empty this run's Triton/Inductor cache dirs first")
group.add_argument("--split-layer", default=None,
                   help="K: a pair runs target layers K..last tap on its drafter GPU; 0: none; "
                   "auto (default on a multi-GPU job): K from times measured at start")
group.add_argument("--timeout", type=number(float, 0, above=True), default=900,
                   help="seconds a rank waits for a peer before failing (covers the first compile)")
args = parser.parse_args()
if args.wandb:
    try:
        import wandb
    except ImportError:
        sys.exit("error: --wandb needs the wandb package: pip install wandb")

# Each rank gets its own Triton and Inductor cache unless the user set one, set before torch imports
# triton: ranks sharing a cache race on it; a cache on NFS corrupts (pytorch#173679, triton#2688)
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
default_root = os.path.join(tempfile.gettempdir(), f"dflash-cache-{getpass.getuser()}")
rank_cache = os.path.join(args.cache_dir or default_root, f"rank{rank}")
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(rank_cache, "triton"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(rank_cache, "inductor"))
cache_dirs = [os.environ["TRITON_CACHE_DIR"], os.environ["TORCHINDUCTOR_CACHE_DIR"]]
if args.fresh_cache:
    for d in cache_dirs:
        if os.path.isdir(d):
            shutil.rmtree(d)
        elif os.path.exists(d):
            os.remove(d)

def on_sigterm(signum, frame):
    # torchrun tears the whole job down when one process dies: say why, and how to go on
    print(f"rank {rank}: stopping on SIGTERM (another process of this job failed, or the job was "
          f"cancelled); continue from the last checkpoint with --resume --out {args.out}",
          file=sys.stderr, flush=True)
    os._exit(143)
signal.signal(signal.SIGTERM, on_sigterm)

def on_error(exc_type, value, tb):
    # e.g. a peer died and gloo/NCCL closed the connection: the traceback, then what to do about it
    sys.__excepthook__(exc_type, value, tb)
    print(f"rank {rank}: stopped by {exc_type.__name__}; continue from the last checkpoint with "
          f"--resume --out {args.out}. If this is a compile, autotune or cache error, a corrupted "
          f"cache can be the cause: rerun with --fresh-cache (this rank's caches: "
          f"{' '.join(cache_dirs)})", file=sys.stderr, flush=True)
sys.excepthook = on_error

import numpy as np
import torch
import torch.distributed as dist
from target import FeatureGraphs, Target, TargetConfig, choose_split, upload
from model import Drafter, DrafterConfig, drafter_loss, drafter_step, sample_anchors
from model import flex_backward_kernels, flex_kernel_options
from data import DataError, demo_of, open_dataset, Packer, make_demo
from safetensors import SafetensorError

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
# the other member of this rank's pair
peer = rank + half if local_rank < half else rank - half
n_pairs, pair = max(world // 2, 1), (rank // local_world) * half + local_rank % half
# every pair's target and drafter rank, in pair order (world size 1: rank 0 plays both)
target_ranks = [r for r in range(world) if r % local_world < half]
drafter_ranks = [r + half for r in target_ranks] if world > 1 else [0]
# the first drafter prints and writes the log
log_rank = drafter_ranks[0]
device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
cuda = device.type == "cuda"
if cuda:
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
if world > 1:
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=args.timeout),
                            device_id=device if cuda else None)
    drafter_group = dist.new_group(drafter_ranks)
    # log statistics travel on gloo (host memory): an NCCL collective on the world group would queue
    # on the target behind its sends of the next rows, which the drafter receives only after it
    stats_group = dist.new_group(backend="gloo") if cuda else None

def print0(*a):
    # the log rank's console (on a multi-GPU job that is the first drafter, not rank 0)
    if rank == log_rank:
        print(*a, flush=True)

def sync():
    # this stream only: on a target a device-wide sync would also wait for its in-flight sends
    if cuda:
        torch.cuda.current_stream(device).synchronize()

# -----------------------------------------------------------------------------
# the output dir: one run at a time, and no finished run replaced by accident (the log rank
# writes it, and holds OUT/lock for the run's life: the OS drops the lock when the process dies)

ckpt_path = os.path.join(args.out, "ckpt.pt")
if rank == log_rank:
    try:
        os.makedirs(args.out, exist_ok=True)
        lock = open(os.path.join(args.out, "lock"), "a+")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        sys.exit(f"error: --out {args.out} is in use: pid {lock.read().strip() or '?'} holds "
                 f"{lock.name}; wait for that run to end, or pick another --out")
    except OSError as e:
        # a file system without locks (Lustre mounted without -o flock): go on, unguarded
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            sys.exit(f"error: --out {args.out}: {e}")
        print0(f"warning: --out {args.out}: no file locks here ({e.strerror}); nothing keeps a "
               "second run out of it")
    lock.truncate(0), lock.write(f"{os.getpid()}\n"), lock.flush()
    if args.overwrite:
        for p in (ckpt_path, os.path.join(args.out, "log.jsonl")):
            if os.path.exists(p):
                os.remove(p)
        shutil.rmtree(os.path.join(args.out, "drafter"), ignore_errors=True)
    elif not args.resume and os.path.exists(ckpt_path):
        sys.exit(f"error: --out {args.out} holds a run ({ckpt_path}); continue it with --resume, "
                 "start over with --overwrite, or pick another --out")
    # what a stopped run was writing (ours: .tmp-PID; safetensors' own: .tmpXXXXXX): no live run
    # writes them, we hold the lock
    here = glob.escape(args.out)
    stale = [p for pattern in ("ckpt.pt.tmp-*", os.path.join("drafter", ".tmp*"))
             for p in glob.glob(os.path.join(here, pattern))]
    for p in stale:
        os.remove(p)
    if stale:
        print0(f"removed {len(stale)} file(s) a stopped run left half-written: {' '.join(stale)}")

# -----------------------------------------------------------------------------
# configs

preset = not os.path.isdir(args.target)
try:
    tcfg = TargetConfig.preset(args.target) if preset else TargetConfig.from_hf(args.target)
except (ValueError, OSError) as e:   # an unknown preset, an unreadable or unsupported config.json
    sys.exit(f"error: --target {args.target}: {e}")
try:
    dcfg = DrafterConfig.from_target(tcfg, n_feat=args.n_feat,
                                     num_hidden_layers=args.drafter_layers,
                                     block_size=args.block_size, mask_token_id=args.mask_token_id,
                                     sliding_window=args.sliding_window)
except ValueError as e:
    sys.exit(f"error: --sliding-window {args.sliding_window}: {e}")
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = "-"

# -----------------------------------------------------------------------------
# the drafter's start-up self-check: before any update, this torch's compiled flex step must equal
# the dense step on this run's layout (model.flex_matches_dense). A second process with its own
# caches runs it while this one starts, at a lower CPU priority: its compile hides behind the
# data, the target's autotuning and this process's own compile

class SelfCheck:
    """python model.py --self-check in a second process: start(config) it, join() it before the
    first update. status: what the banner and W&B report."""
    def __init__(self):
        self.process = None
        self.status = ("skipped (--no-compile: no compiled flex step)" if cuda else
                       "skipped (CPU: the dense path is the only one; flex has no CPU backward)")

    def start(self, config):
        if not (runs_drafter and cuda and not args.no_compile):
            return
        self.config = config
        self.log = tempfile.TemporaryFile()
        self.out = tempfile.NamedTemporaryFile(suffix=".json")
        env = dict(os.environ, **{v: os.path.join(rank_cache, "self-check", d) for v, d in
                                  (("TRITON_CACHE_DIR", "triton"),
                                   ("TORCHINDUCTOR_CACHE_DIR", "inductor"))})
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.py"),
             "--self-check", json.dumps(vars(config)), str(device), self.out.name], env=env,
            stdout=self.log, stderr=self.log)
        os.setpriority(os.PRIO_PROCESS, self.process.pid, 10)
        self.status = (f"in a second process (pid {self.process.pid}), joined before the first "
                       "update")

    def join(self, wandb_run):
        """Waits for the check, if one runs: a failure stops the run; a pass is printed and sent to
        W&B (wandb_run, or None)."""
        if self.process is None:
            return
        if self.process.wait():
            self.log.seek(0)
            why = (self.log.read().decode(errors="replace").strip().splitlines() or ["?"])[-1]
            sys.exit(f"error: self-check (python model.py --self-check ...) failed to run: {why}")
        out_err, grad_err, seconds = json.load(open(self.out.name))
        self.status = (f"compiled flex_attention == dense attention, "
                       f"{'+'.join(self.config.windows())} masks: output rel err {out_err:.1e}, "
                       f"max grad (q, k, v) rel err {grad_err:.1e} ({seconds:.0f} s, second "
                       "process)")
        if not (out_err < 1e-3 and grad_err < 1e-3):
            sys.exit(f"error: self-check failed: {self.status}; flex_attention of torch "
                     f"{torch.__version__} / triton {triton_version} computes wrong attention "
                     "on this GPU; use another torch release")
        print0(f"self-check: {self.status}")
        if wandb_run:
            wandb_run.config.update(dict(self_check=self.status), allow_val_change=True)
        self.process = None

self_check = SelfCheck()
if not args.init_drafter:
    self_check.start(dcfg)

# -----------------------------------------------------------------------------
# data: the demo dataset is made on first use (the tiny target's greedy continuations; --target
# demo, the demo target trained on code: its answers to prompts of code, in data/demo-code)

demo_dir, demo_target = demo_of(args.target)
data_dir = args.data or demo_dir
try:
    if args.data is None and not os.path.exists(os.path.join(data_dir, "train", "meta.json")):
        if local_rank == 0:
            print(f"building the demo dataset in {data_dir} ({args.target} target's answers)",
                  flush=True)
            make_demo(data_dir, target=demo_target)
        if world > 1:
            dist.barrier()
    train_ds = open_dataset(data_dir)
    val_dir = os.path.join(data_dir, "val")
    val_ds = open_dataset(val_dir) if os.path.exists(val_dir) else None
except DataError as e:           # a missing meta.json, a truncated tokens.bin: named, with the fix
    sys.exit(f"error: --data {data_dir}: {e}")
packer = Packer(train_ds, args.budget, n_shards=n_pairs, shard=pair, seed=args.seed)
steps_per_epoch = packer.steps_per_epoch
max_steps = args.max_steps or packer.total_steps(args.epochs)
budget, per_doc, block_size = args.budget, args.anchors, args.block_size
# the anchor capacity of a row: rows that want more are cut fairly across documents, fewer padded
# what the first 512 rows of the plan (all pairs') ask for, counted by the sampler itself
probe = Packer(train_ds, args.budget, seed=args.seed)
demand = np.array([int(sample_anchors(torch.from_numpy(row.loss_mask), torch.from_numpy(row.doc),
                                      per_doc, 1)[2])
                   for row in (probe.next_row() for _ in range(min(512, probe.steps_per_epoch)))])
# a multiple of 8: 128-row tiles
row_anchors = args.row_anchors or int(-(-np.percentile(demand, 90) // 8) * 8)
most_anchors = min(budget - 1, 4 * budget // block_size)
row_anchors = max(8, min(row_anchors, most_anchors))
# supervised tokens per epoch, and those past --budget in their sample (lost to truncation)
supervised, lost = train_ds.n_supervised, packer.truncated_supervised()
nothing = ("its loss mask is all zero; check the loss_mask of its input lines" if supervised == 0
           else f"all its supervised tokens lie past --budget {budget} in their samples "
           f"(truncated); raise --budget (longest sample: {train_ds.lengths.max()} tokens)"
           if lost == supervised else "no supervised token whose next token is supervised too "
           f"(an anchor) in its first {len(demand)} rows; check its loss_mask")

# -----------------------------------------------------------------------------
# models: target ranks load the layers up to the last tapped one, drafters embed_tokens + lm_head

taps = dcfg.target_layer_ids
n_feat = len(taps)
tdtype = torch.bfloat16 if cuda else torch.float32
start_checks = [
    (demand.any(), f"--data {data_dir}: nothing to learn: {nothing}"),
    (train_ds.vocab_size <= tcfg.vocab_size, f"--data {data_dir} was prepared for a vocab of "
     f"{train_ds.vocab_size} (largest token id {train_ds.meta.get('max_id', '?')}), past the "
     f"target's {tcfg.vocab_size}; prepare the data with the target's tokenizer"),
    (len(set(taps)) == len(taps), f"--n-feat {n_feat}: the target's {tcfg.num_hidden_layers} "
     f"layers give taps {taps}, with repeats; use --n-feat {max(1, tcfg.num_hidden_layers - 3)} "
     "or fewer"),
    (0 <= dcfg.mask_token_id < tcfg.vocab_size, f"--mask-token-id {dcfg.mask_token_id} is not a "
     f"row of the target's embedding (vocab {tcfg.vocab_size})"),
    (not args.generate_prompts or val_ds is not None, "--generate-prompts needs held-out prompts, "
     f"and {data_dir} has no val/ split; prepare it with --val N"),
    (budget >= 2 * block_size, f"--budget {budget} must hold at least two blocks "
     f"({2 * block_size} tokens)"),
    (args.row_anchors <= most_anchors, f"--row-anchors {args.row_anchors} is too many for "
     f"--budget {budget}: at most {most_anchors}"),
]
for ok, msg in start_checks:
    if not ok:
        sys.exit("error: " + msg)
# --split-layer: layers K..last of each pair's target run on its drafter GPU. The target rank
# loads 0..last anyway (it times them all) and drops K..last once K is known
last = max(taps)
split = args.split_layer or ("auto" if cuda else "0")
if world == 1 and split == "auto":
    split = "0"                 # one process runs the whole target
if split != "auto":
    if not split.isdigit() or int(split) > last:
        sys.exit(f"error: --split-layer {split}: 0 (no split), auto, or a layer 1..{last}, the "
                 f"last tapped one (taps {taps})")
    split = int(split)
    if split and args.kd:
        sys.exit(f"error: --split-layer {split} with --kd: not built (a split pair would run the "
                 "target's last layers on the drafter GPU); use --split-layer 0")
    if split and world == 1:
        sys.exit(f"error: --split-layer {split}: one process runs the whole target; a split needs "
                 "a pair (torchrun --nproc_per_node 2 or more)")
# --kd: the target also runs its last layers and sends its final hidden state after the taps, the
# teacher whose distribution (final norm, LM head: the drafter rank's) the drafter distils
sent = [*taps, tcfg.num_hidden_layers - 1] if args.kd else taps
if args.kd:
    split = 0       # not auto
n_layers = max(sent) + 1 if runs_target else 0
if args.generate_prompts and world == 1:
    # generation needs every layer and the head, not just the tapped ones
    n_layers = None

def load_target(**kw):
    kw = dict(device=device, dtype=tdtype, **kw)
    if preset:
        return Target.build(tcfg, **kw)
    try:
        return Target.from_pretrained(args.target, **kw)
    # missing, misshapen or mis-scaled tensors
    except (ValueError, KeyError, FileNotFoundError) as e:
        sys.exit(f"error: --target {args.target}: {e.args[0] if isinstance(e, KeyError) else e}")
target = load_target(n_layers=n_layers, head=runs_drafter)

if runs_drafter:
    # every drafter rank starts from the same weights (checked at the end)
    torch.manual_seed(args.seed)
    try:
        drafter = Drafter.from_pretrained(args.init_drafter) if args.init_drafter else Drafter(dcfg)
    except ValueError as e:
        sys.exit(f"error: --init-drafter {args.init_drafter}: {e}")
    drafter = drafter.to(device)
    d = drafter.config
    # the row capacity and metrics above assume --block-size; the mask token must be a target row
    if ((d.hidden_size, d.target_layer_ids, d.block_size) != (tcfg.hidden_size, taps, block_size)
            or args.mask_token_id not in (None, d.mask_token_id)
            or not 0 <= d.mask_token_id < tcfg.vocab_size):
        sys.exit(f"error: --init-drafter {args.init_drafter} (hidden {d.hidden_size}, taps "
                 f"{d.target_layer_ids}, block {d.block_size}, mask token {d.mask_token_id}) does "
                 f"not match the target and flags (hidden {tcfg.hidden_size}, taps {taps}, "
                 f"--block-size {block_size}, --mask-token-id {dcfg.mask_token_id}, vocab "
                 f"{tcfg.vocab_size})")
    layout = lambda c: (c.layer_types, c.windows())
    asked = args.init_drafter and args.sliding_window is not None
    if asked and layout(drafter.config) != layout(dcfg):
        sys.exit(f"error: --sliding-window {args.sliding_window} asks for layers {layout(dcfg)}, "
                 f"but --init-drafter {args.init_drafter} has {layout(drafter.config)}; "
                 "drop --sliding-window")
    # the trained layout: the init drafter's own, when there is one
    dcfg = drafter.config
    embed, head = target.embed_tokens.weight, target.lm_head.weight
    # the drafter's parameters are fp32 (AdamW's master weights); its step computes in bf16 on GPU
    opt = torch.optim.AdamW(drafter.parameters(), lr=args.lr, weight_decay=0.0, fused=True)
    flex = flex_kernel_options(device) if cuda else None            # flex_attention tiles
    params = list(drafter.parameters())
    if args.init_drafter:
        self_check.start(dcfg)      # on the init drafter's own layout
    # (--no-compile runs flex eagerly on purpose)
    if cuda and not args.no_compile:
        warnings.filterwarnings("error", message=".*flex_attention called without torch.compile.*")
    # the drafter step (model.drafter_step): the row's anchors, then forward and loss compiled as
    # one graph (model.drafter_loss); every call has the same shapes
    loss_fn = drafter_loss
    if not args.no_compile:
        # a recompile after warm-up, or a hit recompile limit, would silently run flex_attention's
        # dense backward: both are errors instead
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        loss_fn = torch.compile(drafter_loss, fullgraph=True, dynamic=False)
    step_fn = functools.partial(drafter_step, drafter, per_doc=per_doc, capacity=row_anchors,
                                embed=embed, head=head, gamma=args.gamma, flex=flex, loss=loss_fn,
                                dpace=args.dpace_alpha if args.loss == "dpace" else None,
                                kd=(args.kd, target.norm) if args.kd else None)

# -----------------------------------------------------------------------------
# resume: the drafter ranks read the checkpoint; every rank learns the step from the log rank

# What defines the run, saved with every checkpoint: a different value would train another drafter
# or other rows (the data is dealt to pairs row by row), so --resume refuses it. Anything else may
# change and is reported (a new --max-steps: the lr schedule of the new length, from here on).
identity = ("n_samples", "n_tokens", "n_supervised", "vocab_size")
run = {"pairs": n_pairs, "--data": {k: train_ds.meta.get(k) for k in identity},
       "--seed": args.seed, "--budget": budget, "--anchors": per_doc, "--row-anchors": row_anchors,
       "--block-size": block_size, "--gamma": args.gamma,
       "--drafter-layers": dcfg.num_hidden_layers, "--n-feat": n_feat,
       "--sliding-window": max(dcfg.windows().values()), "--mask-token-id": dcfg.mask_token_id,
       "drafter config": vars(dcfg), "target config": vars(tcfg)}
if args.loss != "dflash":      # (absent from dflash runs: their older checkpoints still resume)
    run.update({"--loss": args.loss, "--dpace-alpha": args.dpace_alpha})
if args.kd:
    run["--kd"] = args.kd
start_step, changed = 0, {}
unreadable = ("is not a readable checkpoint of this run; delete it to start over, or point --out "
              "at the right run")
if args.resume and runs_drafter:
    if not os.path.exists(ckpt_path):
        sys.exit(f"error: --resume but {ckpt_path} does not exist")
    try:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        was, start_step = ckpt["run"], ckpt["step"]
    except Exception as e:
        sys.exit(f"error: {ckpt_path} {unreadable} ({type(e).__name__}: {e})")
    for key, now in run.items():
        then = was.get(key)
        if now == then:
            continue
        if key == "pairs":
            why = (f"{now} pair(s) ({world} processes) differ from the checkpoint's {then}: rows "
                   f"are dealt to pairs; resume on {2 * then} processes ({then} pair(s))")
        elif isinstance(now, dict):       # name the fields
            then = then or {}
            fields = ", ".join(f"{k} {v} (checkpoint: {then.get(k)})" for k, v in now.items()
                               if v != then.get(k))
            why = (f"the {key} differs from the checkpoint's: {fields}; resume with the flags of "
                   f"its start record in {args.out}/log.jsonl")
        else:
            why = f"{key} {now} differs from the checkpoint's {then}; resume with {key} {then}"
        sys.exit(f"error: --resume: {why}, or start a new --out")
    if max_steps < start_step:
        sys.exit(f"error: --resume: the checkpoint is at step {start_step}, past this run's "
                 f"{max_steps} steps; raise --max-steps (or --epochs), or start a new --out")
    try:
        drafter.load_state_dict(ckpt["drafter"])
        opt.load_state_dict(ckpt["optimizer"])
    except Exception as e:
        sys.exit(f"error: {ckpt_path} {unreadable} ({type(e).__name__}: {e})")
    now_args = vars(args)
    changed = {f"--{k.replace('_', '-')}": [v, now_args.get(k)] for k, v in ckpt["args"].items()
               if k not in ("resume", "overwrite") and v != now_args.get(k)}
    if ckpt["processes"] != world:     # the same pairs: the same rows and anchors
        changed["processes"] = [ckpt["processes"], world]
if world > 1:
    step_t = torch.tensor([start_step], device=device)
    dist.broadcast(step_t, log_rank)
    start_step = int(step_t)
packer.seek(start_step)     # every pair consumes one row per step: the step is the data position
eval_rows = []
# the first held-out rows; every pair evaluates the same ones (eval is rare)
if val_ds is not None:
    val_packer = Packer(val_ds, budget, shuffle=False)
    n_eval = min(args.eval_rows, val_packer.steps_per_epoch)
    eval_rows = [val_packer.next_row() for _ in range(n_eval)]

# -----------------------------------------------------------------------------
# banner

info = dict(rank=rank, role=role, pair=pair, caches=cache_dirs,
            device=torch.cuda.get_device_name(device) if cuda else "cpu")
infos = [info] * world          # every rank's, on every rank
if world > 1:
    dist.all_gather_object(infos, info)
print0(f"dflash train | torch {torch.__version__} | triton {triton_version} | "
       f"{world} process(es), {n_pairs} pair(s)")
print0("args: " + json.dumps(vars(args)))
for i in infos:
    print0(f"  rank {i['rank']}: {i['role']:<14} pair {i['pair']} on {i['device']} | "
           f"caches {' '.join(i['caches'])}")
print0(f"target: {args.target} ({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, "
       f"vocab {tcfg.vocab_size}), taps {taps}, layers 0..{max(sent)} loaded"
       + (f"; --kd {args.kd}: the last layer's output sent too" if args.kd else ""))
if runs_drafter:
    n_params = sum(p.numel() for p in drafter.parameters())
    attention = "flex_attention (compiled)" if cuda else "dense mask + SDPA (CPU)"
    print0(f"drafter: {n_params / 1e6:.1f}M params, {dcfg.num_hidden_layers} layers, "
           f"block {block_size}, mask token {dcfg.mask_token_id}, attention: {attention}")
    kinds = [f"{dcfg.layer_types.count(k)} x {k}" + (f" (window {w})" if w else "")
             for k, w in dcfg.windows().items()]
    order = " ".join(t.split("_")[0] for t in dcfg.layer_types)
    print0(f"drafter layout: {' + '.join(kinds)}, in order {order}; "
           f"rope theta {dcfg.rope_theta:g}, scaling {dcfg.rope_scaling}")
    print0(f"self-check: {self_check.status}")
print0(f"data: {data_dir} ({len(train_ds)} samples), {steps_per_epoch} steps/epoch of {n_pairs} x "
       f"{budget} tokens, {max_steps} steps, truncated samples per epoch: {packer.truncated} "
       f"({packer.truncated_tokens} tokens, {lost} of {supervised} supervised); "
       f"held-out rows: {len(eval_rows)}")
if lost > 0.05 * supervised:
    print0(f"warning: --budget {budget} truncates {lost / supervised:.1%} of the supervised tokens "
           "away; raise --budget, or split the long samples")
sized_by = "--row-anchors" if args.row_anchors else "the 90th percentile of"
print0(f"anchors: up to {per_doc} per document, {row_anchors} per row ({sized_by} the first "
       f"{len(demand)} rows' demand: median {np.median(demand):.0f}, max {demand.max()}), "
       f"{row_anchors * block_size} query tokens per row")

# -----------------------------------------------------------------------------
# the log: OUT/log.jsonl (README: Reading the log), the console and W&B, all from the log rank

log_file = open(os.path.join(args.out, "log.jsonl"), "a") if rank == log_rank else None
wandb_run = None
if args.wandb and rank == log_rank:
    # the config: the args and the banner's facts
    try:
        wandb_run = wandb.init(project=args.wandb, name=args.wandb_name, config=dict(
            vars(args), world=world, pairs=n_pairs, devices=[i["device"] for i in infos],
            torch=torch.__version__, triton=triton_version, target_layers=tcfg.num_hidden_layers,
            taps=taps, drafter_layout=dcfg.layer_types, drafter_params=n_params,
            row_capacity=row_anchors, steps=max_steps, self_check=self_check.status))
    except wandb.errors.Error as e:     # e.g. no API key
        sys.exit(f"error: --wandb {args.wandb}: {e} (or log offline: WANDB_MODE=offline)")

def log(record, line):
    # the record first: a step a user saw on screen is on disk too, whatever kills the job next
    record.setdefault("elapsed_s", round(time.perf_counter() - t_launch, 2))
    if log_file:
        log_file.write(json.dumps(record) + "\n")
        log_file.flush()
    if wandb_run and record["kind"] in ("train", "eval", "generate"):
        # W&B: one key per number, "train/loss", "eval/slot_acc/3"
        kind = record["kind"]
        wandb_run.log({f"{kind}/{k}" + (f"/{i}" if isinstance(v, list) else ""): x
                 for k, v in record.items() if k not in ("kind", "step")
                 for i, x in enumerate(v if isinstance(v, list) else [v])
                 if isinstance(x, (int, float))}, step=record["step"])
    print0(line)

def hms(seconds):
    s = int(seconds)
    d, h, m = s // 86400, s // 3600 % 24, s // 60 % 60
    return (f"{d}d{h:02d}h" if d else f"{h}h{m:02d}m" if h else f"{m}m{s % 60:02d}s" if m
            else f"{s}s")

# =============================================================================
# definitions the loops use

# -----------------------------------------------------------------------------
# the schedule: both roles walk it, so targets and drafters never talk about it

def schedule(start):
    """Yields (step, kind, eval row). Every "train" and "eval" item moves one row target ->
    drafter; every "log" item is one stats exchange in which every rank takes part; "save" is the
    log rank's alone (it writes --out)."""
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

def events_after(step, interval):
    # evals or saves the schedule has left after `step`: every interval-th step, and the last
    return max_steps // interval - step // interval + (max_steps % interval > 0)

def lr_at(step):
    warm = max(1, round(args.warmup * max_steps))
    if step < warm:
        return args.lr * (step + 1) / warm
    return args.lr * 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, max_steps - warm)))

# -----------------------------------------------------------------------------
# a row as tensors, and time on the GPU

# packed fields, int64 [5, budget]; where: (epoch, row index), for the non-finite log
ROW_FIELDS = ("tokens", "loss_mask", "doc", "pos", "where")

def pack_row(row):
    where = np.zeros(budget, dtype=np.int64)
    where[:2] = row.epoch, row.index
    arrays = [row.tokens, row.loss_mask.astype(np.int64), row.doc.astype(np.int64), row.pos, where]
    return upload(torch.from_numpy(np.stack(arrays)), device)

def unpack_row(packed):
    return dict(zip(ROW_FIELDS, packed))

def mark():
    # a point in time on this rank's GPU stream (no host sync); the host clock on CPU, where work is
    # synchronous
    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()

def ms(a, b):
    return a.elapsed_time(b) if cuda else (b - a) * 1e3

def gather_stats(target_ms, mem_gib):
    # one small all-reduce over every rank per log line: row r holds rank r's (target ms, peak GiB)
    stats = torch.zeros(world, 2)
    stats[rank] = torch.tensor([target_ms, mem_gib])
    if world > 1:
        dist.all_reduce(stats, group=stats_group)
    return stats

def peak_gib():
    return torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0

# launch-bound passes (a small model) are replayed from CUDA graphs, decided on this run's own
# timing (launch_bound); not with an eager drafter step (debugging), not for MoE targets
graphs_wanted = cuda and not args.no_compile and not args.no_cuda_graphs

def launch_bound(what, fn, *a):
    """fn(*a), and whether a CUDA graph would speed it up: when the GPU is done within a quarter of
    the host's queueing time after the host is, the host sets the pace (a small model's step; a
    large one runs far longer on the GPU than it takes to queue)."""
    sync()
    t0 = time.perf_counter()
    out = fn(*a)
    t1 = time.perf_counter()
    sync()
    host, drain = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    bound = drain < host / 4
    print0(f"{what}: {host:.1f} ms to queue, GPU done {drain:.1f} ms later: "
           + ("launch-bound, replayed from a CUDA graph from now on" if bound else "run eagerly"))
    return out, bound

# -----------------------------------------------------------------------------
# the drafter's update (drafter ranks)

# The metrics of a window live in one device tensor (one all-reduce, no host sync per step), named
# here only. blocks: anchors kept; wanted: anchors the rows asked for before the capacity cut;
# gnorm: the same on every drafter (gradients are averaged before clipping)
METRICS = dict(loss=1, accept_sum=1, blocks=1, wanted=1, nonfinite=1, gnorm=1,
               slot_correct=block_size, slot_count=block_size)

def pack_metrics(out, wanted, nonfinite, gnorm):
    loss, gnorm = (x.detach().float().nan_to_num(0.0) for x in (out["loss"], gnorm))
    parts = [loss, out["accept_sum"], out["blocks"], wanted, nonfinite, gnorm,
             out["slot_correct"], out["slot_count"]]
    return torch.cat([p.float().view(-1) for p in parts])

def unpack_metrics(packed):
    values, at = {}, 0
    for name, size in METRICS.items():
        values[name] = packed[at:at + size] if size > 1 else packed[at]
        at += size
    return values

def reduce_drafters(t):
    if world > 1:
        dist.all_reduce(t, group=drafter_group)
    return t

def update(feats, row):
    """One optimizer step on one row: the drafter step (anchors, compiled forward), backward, clip,
    AdamW. Nothing in it syncs with the host, so it can be captured as a CUDA graph. Returns the
    window's metrics of the step and its non-finite flag (then AdamW skipped the update)."""
    out, wanted = step_fn(feats, row)
    out["loss"].backward()
    if n_pairs > 1:
        for p in params:
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=drafter_group)
    gnorm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
    nonfinite = ~(torch.isfinite(gnorm) & torch.isfinite(out["loss"]))
    # fused AdamW skips the update on device when set: no host sync
    opt.found_inf = nonfinite.float()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return pack_metrics(out, wanted, nonfinite, gnorm), nonfinite

def capture_update(feats, packed, step):
    """update() as a CUDA graph over input buffers the caller fills: features, packed fields and
    the learning rate (on the device). Its random anchors stay those of the eager step: a replay
    reads the RNG seed set just before it (torch's graph-safe Philox state)."""
    inputs = feats.clone(), packed.clone(), torch.tensor(lr_at(step), device=device)
    for group in opt.param_groups:
        # fused AdamW: the same kernel, a device lr, allowed inside a capture
        group.update(capturable=True, lr=inputs[2])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = update(inputs[0], unpack_row(inputs[1]))
    return graph, inputs, outputs

# -----------------------------------------------------------------------------
# the pair protocol. Per "train" and "eval" item of the schedule the target sends its drafter one
# row, in one batched P2P op (NCCL serializes unbatched sends with every other op on the group):
#   features  [budget, n_feat * hidden] in the target's dtype (bf16; fp32 on CPU): the taps' outputs
#             (--kd: [budget, (n_feat + 1) * hidden], the last layer's output after them)
#   fields    [5, budget] int64: ROW_FIELDS
# A pair split at layer K (--split-layer) sends, instead of the features, the taps below K
# [budget, n_below * hidden] (none below the first tap) and the hidden state after layer K-1
# [budget, hidden], same dtype; its drafter runs layers K..last and concatenates the features.
# The target runs ahead: it queues a row's forward once its GPU is done with the previous row,
# posts the row's send without waiting, and then waits for the send of two rows before: at most
# two rows are in flight while it computes the next, their tensors held until taken (double-
# buffered sends). The drafter posts its receive only when it takes the row. Every "log" item is
# one all-reduce of (target ms, peak GiB) over all ranks, on gloo. World size 1: one process
# plays both sides and nothing travels.

# --split-layer: a pair's target layers K..last move to its drafter GPU. Both sides measure on the
# next rows this pair trains on (move_layers), the ranks swap their numbers, and every rank picks
# the same K

SPLIT_ROWS = 4          # rows timed after one warm-up; K is chosen for the median row

def split_rows():
    # a packer of their own: the run's data position is untouched
    rows = Packer(train_ds, budget, n_shards=n_pairs, shard=pair, seed=args.seed)
    rows.seek(start_step)
    return [rows.next_row() for _ in range(SPLIT_ROWS)]

def agree_split(mine):
    """This rank's measurements -> K, the same on every rank (the same numbers, the same choice).
    mine: a target rank's [ms of layers 0..last, bytes of their weights, the largest layer's
    activation bytes]; a drafter rank's [step ms, bytes its step holds, usable bytes of its GPU]."""
    L = last + 1
    table = torch.zeros(world, 2 * L + 1, dtype=torch.float64)
    table[rank, :len(mine)] = torch.tensor(mine, dtype=torch.float64)
    dist.all_reduce(table, group=stats_group)
    t, d = table[target_ranks].numpy(), table[drafter_ranks].numpy()
    # besides the moved weights, the drafter GPU holds the received taps below K and hidden state
    # (at most n_feat rows of features) and the largest layer's activations
    extra = n_feat * budget * tcfg.hidden_size * tdtype.itemsize + t[:, 2 * L]
    try:
        c = choose_split(t[:, :L], d[:, 0], t[0, L:2 * L], d[:, 1] + extra,
                         d[:, 2] if cuda else None, None if split == "auto" else split)
    except ValueError as e:
        sys.exit(f"error: --split-layer {split}: {e}" if rank == log_rank else 1)
    K, gib = c["K"], lambda b: b.max() / 2**30
    print0(f"split: target layers 0..{last} measured on {SPLIT_ROWS} rows, median per layer "
           f"{np.median(t[:, :L]):.1f} ms (min {t[:, :L].min():.1f}, max {t[:, :L].max():.1f}), "
           f"{t[:, :L].sum(1).max():.0f} ms in all; drafter step (forward + backward) "
           f"{d[:, 0].max():.0f} ms" + (f", holding {gib(d[:, 1]):.1f} GiB" if cuda else ""))
    moved = f"layers {K}..{last} on the drafter GPU" if K else "nothing moved"
    busy = c["target"][K].max() / c["step"][K], c["drafter"][K].max() / c["step"][K]
    print0(f"split: --split-layer {K} ({moved}): predicted step {c['step'][K]:.0f} ms (unsplit "
           f"{c['step'][0]:.0f} ms), busy target {busy[0]:.0%} drafter {busy[1]:.0%}"
           + (f"; drafter GPU {gib(c['need'][K]):.1f} of {gib(d[:, 2]):.1f} GiB usable"
              if cuda and K else ""))
    if split == "auto" and c["fastest"] != K:
        f = c["fastest"]
        print0(f"split: --split-layer {f} would be faster ({c['step'][f]:.0f} ms) but needs "
               f"{gib(c['need'][f]):.1f} GiB of the drafter GPU's {gib(d[:, 2]):.1f} usable")
    return K

class TargetSide:
    """A target rank's side (world size 1: run inside DrafterSide). next(kind, r) -> ([tensors to
    send], packed fields) of the next row of `kind` (eval: held-out row r): one upload, whose tokens
    row feeds the target, made before its forward is queued. Unsplit: [features], launch-bound
    forwards replayed from CUDA graphs (FeatureGraphs) once the second train row is timed so; split
    at K: [taps below K (if any), hidden state after layer K-1]."""
    def __init__(self):
        self.split, self.train_rows, self.graphs = 0, 0, None

    def move_layers(self):
        """--split-layer, the target rank's part: every layer up to the last tap timed on this
        pair's next rows, after a warm-up forward; K agreed with the drafter; layers K..last
        dropped (now on the drafter GPU)."""
        rows = [(pack_row(row)[0], torch.from_numpy(row.cu_seqlens)) for row in split_rows()]
        target.features(*rows[0], taps)
        runs = [target.time_layers(ids, cu, last + 1) for ids, cu in rows]
        weights = [sum(p.numel() * p.element_size() for p in layer.parameters())
                   for layer in target.layers]
        self.split = agree_split([*np.median([t for t, _ in runs], 0), *weights,
                                  max(max(act) for _, act in runs)])
        for i in range(self.split, last + 1 if self.split else 0):
            target.layers[i] = None
        if cuda:
            torch.cuda.empty_cache()

    def next(self, kind, r):
        row = eval_rows[r] if kind == "eval" else packer.next_row()
        packed = pack_row(row)
        cu = torch.from_numpy(row.cu_seqlens)
        if self.split:
            below, hidden = target.features(packed[0], cu, taps, stop=self.split)
            return [below, hidden] if below.numel() else [hidden], packed
        if self.graphs:
            return [self.graphs(packed[0], cu)], packed
        self.train_rows += kind == "train"
        # the first train row autotunes fla's kernels; the second is timed
        if self.train_rows == 2 and graphs_wanted and not tcfg.num_experts:
            feats, bound = launch_bound("target forward", target.features, packed[0], cu, sent)
            self.graphs = FeatureGraphs(target, sent) if bound else None
            return [feats], packed
        return [target.features(packed[0], cu, sent)], packed

class DrafterSide:
    """A drafter rank's side (world size 1: with the target in this process). next(kind, r) ->
    (features, packed fields) of the next row from this pair's target. forwards: (start, end) marks
    of each train row's target layers run on this rank (world size 1: all of them; split: K..last),
    for the log."""
    def __init__(self):
        self.split, self.forwards = 0, []
        self.local = TargetSide() if world == 1 else None
        if world > 1:
            self.bufs = (torch.empty(budget, len(sent) * tcfg.hidden_size, dtype=tdtype,
                                     device=device),
                         torch.empty(len(ROW_FIELDS), budget, dtype=torch.int64, device=device))

    def move_layers(self):
        """--split-layer, the drafter rank's part: the drafter step timed on this pair's next rows
        (the first call compiles it): forward, backward and clip as in training, but no optimizer
        step, grads dropped and the global RNG restored, so the run trains exactly as an unsplit
        one; K agreed with the target; layers K..last built here, with the receive buffers of the
        taps below K and the hidden state after K-1."""
        feats, fields = self.bufs
        marks = []
        with torch.random.fork_rng(devices=[device] if cuda else []):
            feats.zero_()
            rows = split_rows()
            for i, row in enumerate([rows[0], *rows]):
                if i == 1 and cuda:     # the peak of a step, not of compiling (autotuning) it
                    torch.cuda.reset_peak_memory_stats(device)
                fields.copy_(pack_row(row))
                t0 = mark()
                out = step_fn(feats, unpack_row(fields))[0]
                out["loss"].backward()
                torch.nn.utils.clip_grad_norm_(drafter.parameters(), args.grad_clip)
                marks.append((t0, mark()))
                opt.zero_grad(set_to_none=True)
        sync()
        # and AdamW's exp_avg and exp_avg_sq, made at the first real step
        held = torch.cuda.max_memory_allocated(device) + 2 * sum(
            p.numel() * p.element_size() for p in drafter.parameters()) if cuda else 0
        # 90%: the CUDA context, NCCL's buffers and fragmentation are outside the allocator's count
        usable = 0.9 * torch.cuda.get_device_properties(device).total_memory if cuda else 0
        self.split = agree_split([np.median([ms(a, b) for a, b in marks[1:]]), held, usable])
        if self.split:
            self.upper = load_target(first=self.split, n_layers=last + 1, head=False)
            # none below the first tap
            below = sum(t < self.split for t in taps)
            self.split_bufs = [torch.empty(budget, n * tcfg.hidden_size, dtype=tdtype,
                                           device=device)
                               for n in ([below] if below else []) + [1]]

    def next(self, kind, r):
        if world == 1:
            t0 = mark()
            feats, packed = self.local.next(kind, r)
            if kind == "train":
                self.forwards.append((t0, mark()))
            # autograd cannot save inference tensors (FeatureGraphs' replays return a copy already)
            return feats[0].clone() if feats[0].is_inference() else feats[0], packed
        # the receive is posted only now, queued behind the previous step: a receive posted earlier
        # keeps an NCCL kernel resident on this GPU's SMs through the whole step; the target queued
        # its send long ago
        bufs = [*self.split_bufs, self.bufs[1]] if self.split else self.bufs
        for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, peer) for t in bufs]):
            work.wait()
        if self.split:
            # the target's layers K..last, here, from the hidden state after layer K-1; this pair's
            # row is walked here too, so its document bounds are on the host without a device sync
            row = eval_rows[r] if kind == "eval" else packer.next_row()
            t0 = mark()
            top = self.upper.features(None, torch.from_numpy(row.cu_seqlens), taps,
                                      h=self.split_bufs[-1])
            torch.cat([*self.split_bufs[:-1], top], dim=-1, out=self.bufs[0])
            if kind == "train":
                self.forwards.append((t0, mark()))
        return self.bufs

    def target_shapes(self):
        # row shapes the target has run or captured (world size 1, graphs on): a step that adds
        # one is a one-off for the ETA
        graphs = self.local and self.local.graphs
        return graphs and len(graphs.seen) + len(graphs.graphs)

# -----------------------------------------------------------------------------
# the train step's one-offs: the CUDA-graph capture, the fused-backward check, the ETA

class Updates:
    """update() for each train step: eagerly, or replayed from a CUDA graph once the one step timed
    for it (the third of the run, one pair only: all-reduced gradients stay eager) was
    launch-bound. updates(step, feats, packed) -> ((metrics, nonfinite flag), whether it was the
    timed step)."""
    def __init__(self):
        self.graph = None           # (graph, input buffers, outputs) once update() is captured

    def __call__(self, step, feats, packed):
        timed = step == start_step + 2 and graphs_wanted and n_pairs == 1
        if self.graph:
            graph, inputs, outputs = self.graph
            inputs[0].copy_(feats), inputs[1].copy_(packed), inputs[2].fill_(lr_at(step))
            graph.replay()
            return outputs, timed
        for group_ in opt.param_groups:
            group_["lr"] = lr_at(step)
        # compiled and its fused backward checked: timed
        if timed:
            outputs, bound = launch_bound("drafter step", update, feats, unpack_row(packed))
            self.graph = capture_update(feats, packed, step) if bound else None
        else:
            outputs = update(feats, unpack_row(packed))
        if step == start_step and not args.no_compile:
            # warm: from now on a recompile is an error
            torch._dynamo.config.error_on_recompile = True
        return outputs, timed

class FusedBackwardCheck:
    """The first train step after the one that compiled runs under the profiler (around the
    compile it would also record every autotuning kernel), which must see the fused flex_attention
    backward of every layer kind: no training on the dense fallback. `with check(step) as
    profiled:` around the step."""
    def __init__(self):
        self.done, self.prof = not cuda or args.no_compile, None

    def __call__(self, step):
        if not self.done and step > start_step:
            # acc_events: torch <= 2.12 warns "Profiler clears events at the end of each cycle"
            # even without a schedule (fixed by pytorch#180387); with one cycle it changes nothing
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                               acc_events=True)
        self.step = step
        return self

    def __enter__(self):
        if self.prof:
            self.prof.__enter__()
        return self.prof is not None

    def __exit__(self, exc_type, *exc):
        prof, self.prof = self.prof, None
        if prof is None or exc_type is not None:
            return False
        # a profiler that records CUDA activity only warns, as it stops, that it could not match
        # the host's op events to kernels ("Failed to recover relationship between all profiler
        # and kineto events", torch/csrc/profiler/collection.cpp); only kernel names are read here
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to recover relationship between "
                                    "all profiler and kineto events")
            prof.__exit__(None, None, None)
            kernels, fused = flex_backward_kernels(prof, kinds=len(dcfg.windows()))
        if not fused:
            raise RuntimeError(
                "the first step did not run a fused flex_attention backward kernel for each "
                f"of the {len(dcfg.windows())} layer kinds (saw {kernels}); refusing to train "
                "on the dense fallback (~17 GB per layer at 512 anchors / 8192 budget)")
        print0(f"step {self.step}: fused flex_attention backward verified "
               f"(profiler saw {', '.join(kernels)})")
        self.done = True
        return False

class ETA:
    """Plain steps at their mean time so far, plus the evals and saves still to come at their last
    cost; one-offs (the compiling first step, the profiled step, the one timed for CUDA graphs,
    those whose row shape the target had not yet captured, evals, saves) are timed apart."""
    def __init__(self):
        self.start = time.perf_counter()
        self.oneoff_s, self.oneoff_steps, self.evals, self.saves = 0.0, 0, [], []

    def train_step(self, step, t_host, oneoff):
        # a train step begun at t_host is queued: a one-off's time is booked apart, to its end
        if step == start_step or oneoff:
            sync()
            self.oneoff_s += time.perf_counter() - t_host
            self.oneoff_steps += 1
        if step == start_step:
            print0(f"step {step}: first step done (drafter graph compiled) "
                   f"{time.perf_counter() - self.start:.0f} s after start")

    def event(self, times, t0):
        # an eval (times: self.evals) or a save (self.saves) begun at t0 is done
        times.append(time.perf_counter() - t0)
        self.oneoff_s += times[-1]

    def estimate(self, step, now):
        """After train step `step`, at time now: (s per plain step, s per eval, s per save, evals
        and saves left, seconds left)."""
        plain_steps = step + 1 - start_step - self.oneoff_steps
        step_s = (now - self.start - self.oneoff_s) / max(plain_steps, 1)
        # before a warm eval is timed (the first one compiled): a row costs at most a train step
        eval_s = self.evals[-1] if len(self.evals) > 1 else len(eval_rows) * step_s
        save_s = self.saves[-1] if self.saves else 0.0
        evals_left = events_after(step, args.eval_interval) if eval_rows else 0
        saves_left = events_after(step, args.save_interval)
        left = (max_steps - step - 1) * step_s + evals_left * eval_s + saves_left * save_s
        return step_s, eval_s, save_s, evals_left, saves_left, left

# -----------------------------------------------------------------------------
# checkpoints (the log rank)

def save_checkpoint(step):
    # the export first: a run stopped between the two leaves an export at least as new as the
    # checkpoint, and --resume redoes both
    tmp = ckpt_path + f".tmp-{os.getpid()}"
    where = os.path.join(args.out, "drafter")
    try:
        drafter.save_pretrained(where, step=step)
        where = tmp
        # through a Python file: a failed write then carries its errno (torch.save(path) says only
        # "unexpected pos"). No data position or RNG state: the step gives both (packer.seek,
        # anchors drawn from (seed, step, pair))
        with open(tmp, "wb") as f:
            torch.save(dict(drafter=drafter.state_dict(), optimizer=opt.state_dict(), step=step,
                            args=vars(args), drafter_config=vars(dcfg), run=run,
                            processes=world), f)
        # atomic: a crash mid-write leaves the previous checkpoint intact
        os.replace(tmp, ckpt_path)
    except (OSError, RuntimeError, SafetensorError) as e:
        err = e.__context__ if isinstance(e, RuntimeError) else e
        if not isinstance(err, (OSError, SafetensorError)):
            raise
        if os.path.exists(tmp):
            os.remove(tmp)      # a full disk stays full otherwise
        sys.exit(f"error: --out {args.out}: cannot write {where} (step {step}): {err}; free space "
                 f"or fix permissions, then continue with --resume --out {args.out}")
    if wandb_run:
        wandb_run.summary["drafter"] = os.path.abspath(os.path.join(args.out, "drafter"))
    print0(f"step {step}: saved {ckpt_path} and {args.out}/drafter/ (z-lab format)")

# =============================================================================
# target ranks: run ahead of the drafter, at most two rows in flight (the pair protocol above)

if role == "target":
    target_side = TargetSide()
    if split:
        target_side.move_layers()
    inflight, forwards = [], []
    for step, kind, r in schedule(start_step):
        if kind in ("eval", "train"):
            # the host waits for this GPU's previous row (and for the send it waits on) before it
            # queues the next: rows in flight stay bounded, as their features stay allocated
            sync()
            t0 = mark()
            feats, packed = target_side.next(kind, r)
            forwards.append((t0, mark()))
            ops = [dist.P2POp(dist.isend, t, peer) for t in (*feats, packed)]
            inflight.append((dist.batch_isend_irecv(ops), feats, packed))
            if len(inflight) > 2:        # reuse a slot only once the drafter has taken its row
                for work in inflight.pop(0)[0]:
                    work.wait()
        elif kind == "log":
            sync()
            gather_stats(sum(ms(a, b) for a, b in forwards) / max(len(forwards), 1), peak_gib())
            forwards = []
    for works, _, _ in inflight:
        for work in works:
            work.wait()
    sync()
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)

# =============================================================================
# drafter ranks (and world size 1): receive rows, train

drafter_side = DrafterSide()
if split:
    drafter_side.move_layers()

# every start and resume: what a resumed run's later records supersede (README: Reading the log)
line = f"start: logging to {args.out}/log.jsonl"
if args.resume:
    line = (f"resume: step {start_step} of {ckpt_path}; changed: "
            + (", ".join(f"{k} {a} -> {b}" for k, (a, b) in changed.items()) or "nothing"))
truncated = dict(samples=packer.truncated, tokens=packer.truncated_tokens, supervised=lost)
log(dict(kind="start", step=start_step, resume=args.resume, processes=world, pairs=n_pairs,
         changed=changed, args=vars(args), truncated=truncated), line)

train_sums = torch.zeros(sum(METRICS.values()), device=device)
eval_sums = torch.zeros_like(train_sums)
# non-finite?, epoch, row
nonfinite_rows = torch.zeros(args.log_interval, 3, dtype=torch.long, device=device)
step_marks, n_window = [], 0
updates, fused_backward_check, eta = Updates(), FusedBackwardCheck(), ETA()
t_window = eta.start

for step, kind, r in schedule(start_step):
    if kind == "save":
        if rank == log_rank:
            t0 = time.perf_counter()
            save_checkpoint(step)
            eta.event(eta.saves, t0)

    elif kind == "eval":
        if r == 0:
            t_eval = time.perf_counter()
        feats, packed = drafter_side.next("eval", r)
        torch.manual_seed(args.seed + 7919 * r)      # the same held-out anchors at every eval
        out, wanted = step_fn(feats, unpack_row(packed))
        zero = torch.zeros((), device=device)
        eval_sums += pack_metrics(out, wanted, zero, zero)
        del out                                     # and the activations autograd saved
        if r == len(eval_rows) - 1:
            m = unpack_metrics(reduce_drafters(eval_sums).to("cpu", copy=True))
            eval_sums.zero_()
            # slot 0: the anchor
            slot_acc = (m["slot_correct"] / m["slot_count"].clamp(min=1)).tolist()[1:]
            rec = dict(kind="eval", step=step, loss=m["loss"].item() / (len(eval_rows) * n_pairs),
                       accept=m["accept_sum"].item() / max(m["blocks"].item(), 1),
                       slot_acc=slot_acc)
            log(rec, f"eval step {step}: loss {rec['loss']:.4f} | accept {rec['accept']:.3f} | "
                     f"slot acc {' '.join(f'{a:.2f}' for a in slot_acc)}")
            eval_accept = rec["accept"]
            eta.event(eta.evals, t_eval)

    elif kind == "train":
        t_host, t0, shapes = time.perf_counter(), mark(), drafter_side.target_shapes()
        feats, packed = drafter_side.next("train", None)
        t1 = mark()
        self_check.join(wandb_run)
        # anchors: a function of (seed, step, pair)
        torch.manual_seed(args.seed * 1_000_003 + step * 1009 + pair)
        with fused_backward_check(step) as profiled:
            (metrics, nonfinite), timed = updates(step, feats, packed)
            step_marks.append((t0, t1, mark()))
        eta.train_step(step, t_host, profiled or timed or drafter_side.target_shapes() != shapes)
        train_sums += metrics
        nonfinite_rows[n_window, 0] = nonfinite                     # device copies, no host sync
        nonfinite_rows[n_window, 1:] = unpack_row(packed)["where"][:2]
        n_window += 1

    elif kind == "log":
        sync()
        seconds = time.perf_counter() - t_window
        m = unpack_metrics(reduce_drafters(train_sums).to("cpu", copy=True))
        forwards = drafter_side.forwards
        local_ms = sum(ms(a, b) for a, b in forwards) / n_window if forwards else 0.0
        stats = gather_stats(local_ms, peak_gib())
        # world size 1: the target ran inside the wait span, so it is taken out of it
        wait_ms = sum(ms(a, b) for a, b, _ in step_marks) / n_window - local_ms
        drafter_ms = sum(ms(b, c) for _, b, c in step_marks) / n_window
        n_bad = int(m["nonfinite"])
        flags = nonfinite_rows[:n_window].tolist()
        if n_bad:
            # steps counted as in the train records (step k: the k-th update)
            rows = [[step + 2 - n_window + i, epoch, index]
                    for i, (bad, epoch, index) in enumerate(flags) if bad]
            log(dict(kind="nonfinite", step=step + 1, rows=rows),
                f"step {step + 1}: non-finite loss or grad norm, update skipped at (step, epoch, "
                f"row) {rows} on this rank; {n_bad} in the last {n_window} steps on all drafters")
            if n_bad * 2 > n_window * n_pairs:
                sys.exit(f"error: {n_bad} of the last {n_window} steps were non-finite; stopping. "
                         "Lower --lr or check the data")
        rows_done = n_window * n_pairs
        step_ms = seconds * 1e3 / n_window
        now = time.perf_counter()
        elapsed = now - t_launch
        step_s, eval_s, save_s, evals_left, saves_left, left = eta.estimate(step, now)
        target_ms = stats[target_ranks, 0].max().item()
        # a split pair's target layers K..last, on the drafter GPU (its local_ms)
        moved_ms = stats[drafter_ranks, 0].max().item() if drafter_side.split else 0.0
        rec = dict(kind="train", step=step + 1, epoch=(step + 1) / steps_per_epoch,
                   # (epoch, row) of the data plan this pair trained, per step of the window
                   rows=[[epoch, index] for _, epoch, index in flags],
                   loss=m["loss"].item() / rows_done,
                   accept=m["accept_sum"].item() / max(m["blocks"].item(), 1),
                   lr=lr_at(step), gnorm=m["gnorm"].item() / rows_done,
                   # context tokens, all pairs
                   tok_s=rows_done * budget / seconds,
                   # supervised draft blocks
                   blocks_s=m["blocks"].item() / seconds,
                   # supervised drafted tokens
                   drafted_tok_s=m["slot_count"].sum().item() / seconds,
                   anchors_row=m["blocks"].item() / rows_done, row_anchors=row_anchors,
                   # asked for, over the capacity
                   anchors_cut=int(m["wanted"] - m["blocks"]),
                   pad_frac=1 - m["blocks"].item() / (rows_done * row_anchors),
                   ms_step=step_ms, ms_target=target_ms, ms_wait=wait_ms, ms_drafter=drafter_ms,
                   split_layer=drafter_side.split, ms_target_on_drafter=moved_ms,
                   # per GPU (world 1: one GPU)
                   busy_target=target_ms / step_ms, busy_drafter=(drafter_ms + moved_ms) / step_ms,
                   mem_gib=stats[:, 1].tolist(), eta_s=round(left, 2),
                   # compiled on this rank so far (log() adds elapsed_s)
                   graphs=torch._dynamo.utils.counters["stats"]["unique_graphs"])
        log(rec, f"step {rec['step']}/{max_steps} | ep {rec['epoch']:.2f} | "
                 f"loss {rec['loss']:.4f} | accept {rec['accept']:.3f} | lr {rec['lr']:.2e} | "
                 f"gnorm {rec['gnorm']:.2f} | "
                 f"{rec['tok_s']:.0f} tok/s {rec['blocks_s']:.0f} blocks/s | "
                 f"anchors/row {rec['anchors_row']:.0f} cut {rec['anchors_cut']} "
                 f"pad {rec['pad_frac']:.0%} | ms target {target_ms:.0f}"
                 f"{f'+{moved_ms:.0f}' if drafter_side.split else ''} wait {wait_ms:.0f} "
                 f"drafter {drafter_ms:.0f} busy {rec['busy_target']:.0%} "
                 f"{rec['busy_drafter']:.0%} | "
                 f"mem GiB {' '.join(f'{x:.1f}' for x in rec['mem_gib'])} | "
                 f"{hms(elapsed)} elapsed, ETA {hms(left)}")
        if step + 1 - start_step <= args.log_interval:
            print0(f"expected run length: {hms(elapsed + left)} ({max_steps - start_step} "
                   f"steps of {step_s * 1e3:.0f} ms, {evals_left} evals of {eval_s:.1f} s, "
                   f"{saves_left} saves of {save_s:.1f} s to go)")
        train_sums.zero_(), nonfinite_rows.zero_()
        step_marks, n_window, t_window = [], 0, time.perf_counter()
        drafter_side.forwards = []

if args.generate_prompts and world > 1:
    print0("--generate-prompts skipped: a multi-process job's drafter ranks hold only the target's "
           f"embedding and head; run `python generate.py --target {args.target} "
           f"--drafter {args.out}/drafter` on one GPU")
elif args.generate_prompts and rank == log_rank:
    import generate
    exported = Drafter.from_pretrained(os.path.join(args.out, "drafter"), device=device,
                                       dtype=tdtype)
    prompts = generate.dataset_prompts(data_dir, args.generate_prompts, log=print0)
    prompts = [p.to(device) for p in prompts]
    eos = set(generate.hf_eos(args.target))
    res = generate.evaluate(target, exported, prompts, args.generate_tokens, eos, log=print0)
    proxy = eval_accept if eval_rows else None
    log(dict(kind="generate", step=max_steps, proxy_accept=proxy, **res),
        f"generate: tau {res['tau']:.3f} on {len(prompts)} held-out prompts with the exported "
        f"drafter (held-out proxy accept {proxy if proxy is not None else float('nan'):.3f})")

if world > 1:
    # data parallel must leave every drafter with the same weights: check it, do not assume it
    diff = torch.zeros((), device=device)
    for p in params:
        reference = p.detach().clone()
        dist.broadcast(reference, log_rank, group=drafter_group)
        diff = torch.maximum(diff, (reference - p.detach()).abs().max())
    diff = reduce_drafters(diff).item()
    print0(f"end: drafter weights identical across {n_pairs} drafter(s): max abs diff {diff:.3g}")
    dist.barrier()
    dist.destroy_process_group()
log(dict(kind="end", step=max_steps), f"done: {hms(time.perf_counter() - t_launch)} in all")
if wandb_run:
    wandb_run.finish()
