"""
The guards that flex_attention really computes THE mask, and with its fused backward (train.py on a
GPU; bench.py check). Outside a compiled graph, or past the recompile limit, flex silently runs a
dense math backward that holds every layer's [heads, queries, keys] scores (~17 GB per layer at 512
anchors / 8192 budget); a torch whose flex backward is wrong trains on wrong gradients. So:
  SelfCheck      before the first update: compiled flex == dense SDPA on this run's mask kinds and
                 head geometry, in a second process (`python checks.py CONFIG DEVICE`) while the
                 run starts
  fused_backward around the first warm step: the profiler must see the fused backward kernel
"""
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from model import SLIDING, DrafterConfig, block_lists, row_attention

def flex_backward_kernels(prof, kinds):
    """Names of the flex_attention backward kernels a torch.profiler run saw, fused ones first,
    and whether inductor's fused template (triton_tem_fused_flex_attention_backward_*) ran for all
    `kinds` masks (each mask_mod compiles its own)."""
    names = {e.name for e in prof.events() if "flex_attention_backward" in e.name}
    names = sorted(names, key=lambda n: "_tem_" not in n)
    return names, sum("_tem_" in n for n in names) >= kinds

@contextlib.contextmanager
def fused_backward(kinds):
    """Around one train step after the compiling one (around the compile the profiler would also
    record every autotuning kernel): raises unless the fused flex backward of each of the `kinds`
    masks ran. Yields a list that then holds the kernel names seen."""
    seen = []
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                  acc_events=True)   # torch <= 2.12 warns without it (#180387)
    with warnings.catch_warnings():
        # a CUDA-only profiler warns that it cannot match host op events to kernels; only kernel
        # names are read here
        warnings.filterwarnings("ignore", message="Failed to recover relationship")
        with prof:
            yield seen
    names, fused = flex_backward_kernels(prof, kinds)
    if not fused:
        raise RuntimeError(f"the first step did not run a fused flex_attention backward kernel "
                           f"for each of the {kinds} layer kinds (saw {names}); refusing to train "
                           "on the dense fallback (~17 GB per layer at 512 anchors / 8192 budget)")
    seen += names

def flex_matches_dense(config, device, kernel_options=None, candidate=None):
    """Compiled flex_attention (forward and fused backward) with THE mask of each layer kind of
    config, built as the training step builds it (closed-form lists -> BlockMask in the graph),
    against the dense mask + SDPA, in fp32 without TF32, with config's heads and block size, on a
    512-token row of 3 documents with anchors at document starts and padded slots (the window cut
    to 100 tokens so that it binds). Outputs and the q, k, v gradients of a random linear loss
    must agree. Only attention is compiled (compiling the whole step made the check slower).
    candidate(config, anchors, keep, doc, S) -> {kind: attend} replaces the compiled flex path
    (tests on CPU). Leaves the RNG and dynamo's graph count as it found them. Returns (output rel
    err, max gradient rel err, seconds)."""
    t0 = time.perf_counter()
    S, N, lens = 512, 24, (150, 230, 132)
    window = min(config.sliding_window, 100) if SLIDING in config.layer_types else None
    c = DrafterConfig(num_attention_heads=config.num_attention_heads,
                      num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
                      block_size=config.block_size, num_hidden_layers=len(config.windows()),
                      layer_types=list(config.windows()), sliding_window=window)
    kinds, Q, KV = list(c.windows()), N * c.block_size, S + N * c.block_size
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    devices = [device] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(device)
        inside = torch.nonzero(doc[1:] == doc[:-1]).view(-1)   # positions with a next token
        picked = inside[torch.randperm(len(inside), device=device)[:N - 5]]
        starts = torch.tensor([0, lens[0], lens[0] + lens[1]], device=device)  # empty contexts
        anchors = torch.cat([picked, starts, torch.zeros(2, dtype=torch.long, device=device)])
        anchors[:-2] = anchors[:-2].sort().values
        keep = torch.arange(N, device=device) < N - 2        # 2 padded slots, as sample_anchors'
        # per kind: q [1, heads, Q, hd], k and v [1, kv heads, KV, hd], the loss weights of o
        shapes = [(c.num_attention_heads, Q), (c.num_key_value_heads, KV),
                  (c.num_key_value_heads, KV), (c.num_attention_heads, Q)]
        data = {kind: [torch.randn(1, h, n, c.head_dim, device=device) for h, n in shapes]
                for kind in kinds}
        apply = lambda attend: lambda qkv: {kind: attend[kind](*qkv[kind]) for kind in kinds}
        if candidate is None:
            blocks = block_lists(c, anchors, keep, doc, S)
            step = torch.compile(
                lambda qkv, anchors, keep, doc, blocks: apply(row_attention(
                    c, anchors, keep, doc, S, kernel_options or {}, blocks))(qkv),
                fullgraph=True, dynamic=False)
            flex = lambda qkv: step(qkv, anchors, keep, doc, blocks)
        else:
            flex = apply(candidate(c, anchors, keep, doc, S))
        dense = apply(row_attention(c, anchors, keep, doc, S))
        results = []
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            for run in (dense, flex):
                qkv = {kind: [t.clone().requires_grad_() for t in data[kind][:3]]
                       for kind in kinds}
                out = run(qkv)
                sum((out[kind] * data[kind][3]).sum() for kind in kinds).backward()
                results.append([t.detach().double() for kind in kinds
                                for t in (out[kind], *(x.grad for x in qkv[kind]))])
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
            torch._dynamo.reset()                    # the check's graph is none of the caller's
            torch._dynamo.utils.counters["stats"]["unique_graphs"] = graphs
    rel = [((a - b).norm() / b.norm().clamp(min=1e-30)).item() for a, b in zip(*results[::-1])]
    # per kind: output, dq, dk, dv
    return max(rel[0::4]), max(r for i, r in enumerate(rel) if i % 4), time.perf_counter() - t0

class SelfCheck:
    """flex_matches_dense of `config` in a second process with caches of its own under `cache`,
    at a lower CPU priority: its compile hides behind the run's start-up; not run at all when
    given a `skip` reason. join() before the first update: a failure stops the run with one line;
    returns the status line."""
    def __init__(self, config, device, cache, skip=None):
        self.process, self.status = None, f"skipped ({skip})"
        if skip:
            return
        self.config, self.log = config, tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "self-check", "triton"),
                   TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "self-check", "inductor"))
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__),
                                         json.dumps(vars(config)), str(device)],
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT)
        os.setpriority(os.PRIO_PROCESS, self.process.pid, 10)
        self.status = f"in a second process (pid {self.process.pid}), joined before the first update"

    def join(self):
        if self.process is None:
            return self.status
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
            import triton
            sys.exit(f"error: self-check failed: {self.status}; flex_attention of torch "
                     f"{torch.__version__} / triton {triton.__version__} computes wrong attention "
                     "on this GPU; use another torch release")
        return self.status

if __name__ == "__main__":
    # SelfCheck's second process: python checks.py CONFIG_JSON DEVICE prints [output rel err,
    # max grad rel err, seconds] as its last line
    device = torch.device(sys.argv[2])
    torch.cuda.set_device(device)
    from model import flex_kernel_options
    print(json.dumps(flex_matches_dense(DrafterConfig(**json.loads(sys.argv[1])), device,
                                        flex_kernel_options(device))))
