"""
train.py's guards against a run that fails silently or obscurely: per-rank compile caches (ranks
sharing one race on it; a cache on NFS corrupts: pytorch#173679, triton#2688), a stop that says how
to go on, data and flags checked at start, flex_attention checked twice (SelfCheck, fused_backward):
a torch with a wrong flex trains on wrong gradients; outside a compiled graph or past the recompile
limit, flex silently runs a dense backward holding every layer's [heads, queries, keys] scores.
"""
import contextlib
import getpass
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings

import torch

import checkpoint
from model import SLIDING, TILE, DrafterConfig, row_attention

def rank_caches(root, rank, fresh=False):
    # this rank's cache dir, its Triton and Inductor caches, before anything compiles: under
    # --cache-dir root if given, else the environment's (a process that compiled set it), else /tmp
    set_ = os.environ.__setitem__ if root else os.environ.setdefault
    root = root or os.path.join(tempfile.gettempdir(), f"dflash-cache-{getpass.getuser()}")
    rank_cache = os.path.join(root, f"rank{rank}")
    for var, sub in (("TRITON_CACHE_DIR", "triton"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        set_(var, os.path.join(rank_cache, sub))
    dirs = [os.environ["TRITON_CACHE_DIR"], os.environ["TORCHINDUCTOR_CACHE_DIR"]]
    for d in (d for d in dirs if fresh and os.path.exists(d)):    # lazily: one may hold the other
        shutil.rmtree(d) if os.path.isdir(d) else os.remove(d)
    return rank_cache, dirs

def explain_stops(rank, out, cache_dirs):
    go_on = f"continue from the last checkpoint with --resume --out {out}"

    def on_sigterm(signum, frame):
        # torchrun tears the whole job down when one process dies: say why, and how to go on. To
        # fd 2, not sys.stderr: torch.distributed's excepthook swaps that for a StringIO while it
        # formats an error, which the SIGTERM that follows that error can interrupt
        os.write(2, f"rank {rank}: stopping on SIGTERM (another process of this job failed, or "
                 f"the job was cancelled); {go_on}\n".encode())
        os._exit(143)

    def on_error(exc_type, value, tb):
        # e.g. a peer died and gloo/NCCL closed the connection: the traceback, then what to do
        sys.__excepthook__(exc_type, value, tb)
        print(f"rank {rank}: stopped by {exc_type.__name__}; {go_on}. A compile, autotune or "
              "cache error can be a corrupted cache: rerun with --fresh-cache (this rank's "
              f"caches: {' '.join(cache_dirs)})", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, on_sigterm)
    sys.excepthook = on_error

def start(args, data_dir, ds, demand, lost, tcfg, dcfg):
    """Before train.py loads a model: the data teaches what the target can read, flags fit it."""
    taps, budget = dcfg.target_layer_ids, args.budget
    nothing = ("its loss mask is all zero; check the loss_mask of its input lines"
               if ds.n_supervised == 0 else f"all its supervised tokens lie past --budget {budget} "
               f"in their samples (truncated); raise --budget (longest sample: {ds.lengths.max()} "
               "tokens)" if lost == ds.n_supervised else "no supervised token whose next token is "
               f"supervised too (an anchor) in its first {len(demand)} rows; check its loss_mask")
    for ok, msg in [
            (demand.any(), f"--data {data_dir}: nothing to learn: {nothing}"),
            (ds.vocab_size <= tcfg.vocab_size, f"--data {data_dir} was prepared for a vocab of "
             f"{ds.vocab_size} (largest token id {ds.meta.get('max_id', '?')}), past the target's "
             f"{tcfg.vocab_size}; prepare the data with the target's tokenizer"),
            (len(set(taps)) == len(taps), f"--n-feat {len(taps)}: the target's "
             f"{tcfg.num_hidden_layers} layers give taps {taps}, with repeats; use --n-feat "
             f"{max(1, tcfg.num_hidden_layers - 3)} or fewer"),
            (0 <= dcfg.mask_token_id < tcfg.vocab_size, f"--mask-token-id {dcfg.mask_token_id} "
             f"is not a row of the target's embedding (vocab {tcfg.vocab_size})"),
            (budget >= 2 * args.block_size, f"--budget {budget} must hold at least two blocks"),
            (args.row_anchors < budget, f"--row-anchors {args.row_anchors} is too many for "
             f"--budget {budget}: at most {budget - 1}, one per position"),
            (not args.wandb or importlib.util.find_spec("wandb"),
             "--wandb needs the wandb package: pip install wandb")]:
        if not ok:
            sys.exit("error: " + msg)

def flags(parser, args):
    """train.py's flags as one run: a flag a combination would ignore is refused in one line,
    --resume takes its checkpoint's (checkpoint.run_flags), the defaults that depend on others set.
    -> the objective on the target's distribution (distill.py, imported only then), None for CE."""
    for wrong, msg in [
            (args.epochs and args.max_steps, "--epochs and --max-steps: give one"),
            (args.dpace_alpha is not None and args.loss != "dpace",
             "--dpace-alpha: for --loss dpace only"),
            (args.objective_temperature is not None and args.objective == "ce",
             "--objective-temperature: for --objective tv, accept or dspark only")]:
        if wrong:
            parser.error(msg)
    if args.resume:
        checkpoint.run_flags(parser, args)
    args.epochs = args.epochs or 6
    args.dpace_alpha = 0.5 if args.dpace_alpha is None else args.dpace_alpha
    if args.objective == "ce":
        return None
    import distill
    args.objective_temperature = args.objective_temperature or 1.0
    return distill.Objective(args.objective, args.objective_temperature)

def init_drafter(args, drafter, dcfg, tcfg):
    """--init-drafter's drafter against the target and the flags (dcfg: what they ask for): the
    row capacity and metrics assume --block-size; the mask token must be a target row. A DFlash
    drafter with --arch dflash2 is returned as DFlash2 (dflash2.upgrade: the same outputs)."""
    d = drafter.config
    if ((d.hidden_size, d.target_layer_ids, d.block_size)
            != (tcfg.hidden_size, dcfg.target_layer_ids, args.block_size)
            or args.mask_token_id not in (None, d.mask_token_id)
            or args.drafter_layers not in (None, d.num_hidden_layers)
            or not 0 <= d.mask_token_id < tcfg.vocab_size):
        sys.exit(f"error: --init-drafter {args.init_drafter} (hidden {d.hidden_size}, taps "
                 f"{d.target_layer_ids}, block {d.block_size}, mask token {d.mask_token_id}, "
                 f"{d.num_hidden_layers} layers) does not match the target and flags (hidden "
                 f"{tcfg.hidden_size}, taps {dcfg.target_layer_ids}, --block-size "
                 f"{args.block_size}, --mask-token-id {dcfg.mask_token_id}, vocab "
                 f"{tcfg.vocab_size}, --drafter-layers {args.drafter_layers})")
    layout = lambda c: (c.layer_types, c.windows())
    if args.sliding_window is not None and layout(d) != layout(dcfg):
        sys.exit(f"error: --sliding-window {args.sliding_window} asks for layers {layout(dcfg)}, "
                 f"but --init-drafter {args.init_drafter} has {layout(d)}; drop --sliding-window")
    if args.arch == "dflash" and d.conv_kernel_size:
        sys.exit(f"error: --arch dflash: --init-drafter {args.init_drafter} is DFlash2; drop it")
    if dcfg.conv_kernel_size and not d.conv_kernel_size:
        import dflash2
        return dflash2.upgrade(drafter, **{k: getattr(dcfg, k) for k in dflash2.FIELDS})
    return drafter

def weights_diff(params, src, group):
    """Data parallel must leave every drafter with the same weights: the largest difference from
    rank src's, over the group (checked, not assumed)."""
    import torch.distributed as dist
    diff = torch.zeros((), device=params[0].device)
    for p in params:
        reference = p.detach().clone()
        dist.broadcast(reference, src, group=group)
        diff = torch.maximum(diff, (reference - p.detach()).abs().max())
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    return diff.item()

@contextlib.contextmanager
def fused_backward(kinds):
    """Around a train step after the compiling one (around the compile the profiler would also
    record every autotuning kernel): raises unless a fused flex backward ran for each mask kind."""
    seen, prof = [], torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                            acc_events=True)  # else torch <= 2.12 warns (#180387)
    with warnings.catch_warnings():
        # a CUDA-only profiler cannot match host op events to kernels; only kernel names are read
        warnings.filterwarnings("ignore", message="Failed to recover relationship")
        with prof:
            yield seen
    seen += sorted({e.name for e in prof.events() if "flex_attention_backward" in e.name},
                   key=lambda n: "_tem_" not in n)
    if sum("_tem_" in n for n in seen) < kinds:
        raise RuntimeError(f"the first step did not run a fused flex_attention backward kernel "
                           f"for each of the {kinds} layer kinds (saw {seen}); refusing to train "
                           "on the dense fallback (~17 GB per layer at 512 anchors / 8192 budget)")

def flex_kernel_options(device):
    """flex_attention kernel options: 2 backward pipeline stages, not 3, with ~227 KB of shared
    memory per block (H100/H200/B200; faster, RESULTS.md); else tiles smaller than inductor's.
    None on the CPU: the drafter's dense path."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    if getattr(props, "shared_memory_per_block_optin", 0) >= 200 * 1024:
        return dict(bwd_num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, num_stages=2,
                bwd_BLOCK_M1=32, bwd_BLOCK_N1=64, bwd_BLOCK_M2=32, bwd_BLOCK_N2=32)

def check_row(B, device):
    """The self-check's row: 3 documents, anchors at random, at the documents' starts (empty
    contexts), 2 padded slots, and a run of 2 * 128 / B consecutive anchors deep in the 700-token
    document, so a 128-query tile sees whole 128-key tiles of context: flex skips mask_mod on such
    full tiles (anchor_blocks' lists alone decide them), as on every long real row.
    -> (S, doc, anchors, keep)"""
    lens, N, late = (700, 200, 124), 40, 2 * -(-TILE // B)
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
    pos = torch.arange(sum(lens), device=device)
    inside = torch.nonzero((doc[1:] == doc[:-1]) & ((pos[:-1] < 590) | (pos[:-1] >= 620))).view(-1)
    picked = inside[torch.randperm(len(inside), device=device)[:N - 5 - late]]
    starts = torch.tensor([0, lens[0], lens[0] + lens[1]], device=device)
    anchors = torch.cat([picked, starts, 600 + torch.arange(late, device=device)]).sort().values
    anchors = torch.cat([anchors, torch.zeros(2, dtype=torch.long, device=device)])
    return sum(lens), doc, anchors, torch.arange(len(anchors), device=device) < len(anchors) - 2

def flex_matches_dense(config, device, kernel_options=None, candidate=None):
    """Compiled flex_attention with THE mask of each layer kind, built as the step builds it, vs
    dense SDPA (fp32, no TF32): outputs and q, k, v gradients of a random linear loss on check_row
    (sliding windows cut to 300 so they bind and still leave full tiles).
    candidate(config, anchors, keep, doc, S) -> {kind: attend} replaces compiled flex (tests)."""
    t0, H, KVH, kinds = (time.perf_counter(), config.num_attention_heads,
                         config.num_key_value_heads, list(config.windows()))
    c = DrafterConfig(num_attention_heads=H, num_key_value_heads=KVH, head_dim=config.head_dim,
                      block_size=config.block_size, num_hidden_layers=len(kinds), layer_types=kinds,
                      sliding_window=min(config.sliding_window, 300) if SLIDING in kinds else None)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    with torch.random.fork_rng(devices=[device] if torch.device(device).type == "cuda" else []):
        torch.manual_seed(0)
        S, doc, anchors, keep = check_row(c.block_size, device)
        Q, KV = len(anchors) * c.block_size, S + len(anchors) * c.block_size
        # per kind: q [1, heads, Q, hd], k and v [1, kv heads, KV, hd], the loss weights of o
        data = {kind: [torch.randn(1, h, n, c.head_dim, device=device)
                       for h, n in ((H, Q), (KVH, KV), (KVH, KV), (H, Q))] for kind in kinds}
        apply = lambda attend: lambda qkv: {kind: attend[kind](*qkv[kind]) for kind in kinds}
        if candidate is None:   # only attention compiled: the whole step compiled was slower
            step = torch.compile(lambda qkv, anchors, keep, doc: apply(row_attention(
                c, anchors, keep, doc, S, kernel_options or {}))(qkv), fullgraph=True,
                dynamic=False)
            flex = lambda qkv: step(qkv, anchors, keep, doc)
        else:
            flex = apply(candidate(c, anchors, keep, doc, S))
        dense, results = apply(row_attention(c, anchors, keep, doc, S)), []
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            for run in (dense, flex):
                qkv = {k: [t.clone().requires_grad_() for t in data[k][:3]] for k in kinds}
                out = run(qkv)
                sum((out[kind] * data[kind][3]).sum() for kind in kinds).backward()
                results.append([t.detach().double() for kind in kinds
                                for t in (out[kind], *(x.grad for x in qkv[kind]))])
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
            torch._dynamo.reset()                    # the check's graph is none of the caller's
            torch._dynamo.utils.counters["stats"]["unique_graphs"] = graphs
    rel = [((a - b).norm() / b.norm().clamp(min=1e-30)).item() for a, b in zip(*results[::-1])]
    # per kind: output, dq, dk, dv -> (output rel err, max grad rel err, seconds)
    return max(rel[0::4]), max(r for i, r in enumerate(rel) if i % 4), time.perf_counter() - t0

class SelfCheck:
    """flex_matches_dense of `config` in a second process (own caches under `cache`, lower CPU
    priority): its compile hides behind the start-up; `skip`: a reason not to run it."""
    def __init__(self, config, device, cache, skip=None):
        self.process, self.status, self.config = None, f"skipped ({skip})", config
        if skip:
            return
        self.log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "self-check", "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "self-check", "inductor"))
        argv = [sys.executable, os.path.abspath(__file__), json.dumps(vars(config)), str(device)]
        self.process = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        os.setpriority(os.PRIO_PROCESS, self.process.pid, 10)
        self.status = f"in a second process (pid {self.process.pid}), joined before training"

    def join(self):
        failed, self.process = self.process.wait(), None
        self.log.seek(0)
        last = (self.log.read().strip().splitlines() or ["?"])[-1]
        if failed:
            sys.exit(f"error: self-check (python checks.py ...) failed to run: {last}")
        out_err, grad_err, seconds = json.loads(last)
        self.status = (f"compiled flex_attention == dense attention, "
                       f"{'+'.join(self.config.windows())} masks: output rel err {out_err:.1e}, "
                       f"max grad (q, k, v) rel err {grad_err:.1e} ({seconds:.0f} s, second "
                       "process)")
        if not (out_err < 1e-3 and grad_err < 1e-3):
            sys.exit(f"error: self-check failed: {self.status}; flex_attention of torch "
                     f"{torch.__version__} computes wrong attention on this GPU; use another "
                     "torch release")
        return self.status

if __name__ == "__main__":      # SelfCheck's second process: its result is the last line
    config, device = DrafterConfig(**json.loads(sys.argv[1])), torch.device(sys.argv[2])
    torch.cuda.set_device(device)
    print(json.dumps(flex_matches_dense(config, device, flex_kernel_options(device))))
