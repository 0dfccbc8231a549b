"""
GPU speed-ups that change no number, imported on a GPU only: fla's autotuned kernels compile all
their configs at once on a cold Triton cache; the drafter's update (UpdateGraph) and the target's
forward (FeatureGraphs), each timed once, are replayed from CUDA graphs when launch-bound (a small
model's step). train.py --no-cuda-graphs: no replays. bench.py check compares replays with eager.
"""
import os
import time

import numpy as np
import torch

from target import Docs, _chunk_list, _fla, positions_from_cu, upload

def fla_configs_at_once():
    """Triton's autotuner compiles each config of a kernel only as it benchmarks it. For each
    Autotuner instance in fla's modules (also behind triton.heuristics; not the class: no other
    kernel changes), a run with a new key first compiles every config together on a thread pool
    (triton >= 3.4's AsyncCompileMode), then benchmarks and picks as before. Returns the count."""
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import KernelInterface
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:                   # an older triton: one config after the other
        return 0
    _fla()                                # imports the modules of the target's kernels
    found = {}
    for name, module in list(sys.modules.items()):
        if module is not None and name.split(".")[0] == "fla":
            for kernel in list(vars(module).values()):
                while isinstance(kernel, KernelInterface):
                    if isinstance(kernel, Autotuner) and not hasattr(kernel, "configs_at_once"):
                        found[id(kernel)] = kernel
                    kernel = getattr(kernel, "fn", None)
    pool = ThreadPoolExecutor(min(32, os.cpu_count() or 1))

    def wrap(tuner):
        run = tuner.run                   # the class's Autotuner.run, bound to this instance

        def run_all_compiled(*args, **kwargs):
            # Autotuner.run's own key: the key args' values, then every tensor argument's dtype
            named = {k: v for k, v in {**dict(zip(tuner.arg_names, args)), **kwargs}.items()
                     if k in tuner.arg_names}
            key = tuple([named[k] for k in tuner.keys if k in named]
                        + [str(v.dtype) for v in named.values() if hasattr(v, "dtype")])
            if len(tuner.configs) > 1 and key not in tuner.cache:
                # a config that fails to compile is left to the benchmark, which rules it out
                with AsyncCompileMode(pool, ignore_errors=True):
                    tuner.warmup(*args, **{k: v for k, v in kwargs.items() if k != "warmup"})
            return run(*args, **kwargs)
        # an instance attribute: kernel[grid](...) and an outer Heuristics look up .run on the
        # instance, so they call this; Autotuner.run itself is untouched
        tuner.run, tuner.configs_at_once = run_all_compiled, True

    for tuner in found.values():
        wrap(tuner)
    return len(found)

def launch_bound(what, fn, *a, log=print):
    """fn(*a), and whether a CUDA graph would speed it up: the host sets the pace when the GPU
    is done within a quarter of its queueing time after the host (a small model's step)."""
    stream = torch.cuda.current_stream()
    stream.synchronize()
    t0 = time.perf_counter()
    out = fn(*a)
    t1 = time.perf_counter()
    stream.synchronize()
    host, drain = (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3
    bound = drain < host / 4
    log(f"{what}: {host:.1f} ms to queue, GPU done {drain:.1f} ms later: "
        + ("launch-bound, replayed from a CUDA graph from now on" if bound else "run eagerly"))
    return out, bound

class UpdateGraph:
    """train.py's update(feats, fields, lr) -> metrics: eager, and from its call number `timed`
    on (a warm step) replayed from a CUDA graph if that call was launch-bound: the values copied
    into the graph's buffers, its outputs returned (overwritten by the next replay). lr is a device
    tensor there, which fused AdamW reads inside the graph once capturable. Random draws use the
    seed set before each replay (graph-safe Philox), as eagerly."""
    def __init__(self, update, opt, timed, log=print):
        self.update, self.opt, self.timed, self.log = update, opt, timed, log
        self.calls, self.graph = 0, None

    def __call__(self, feats, packed, lr):
        self.calls += 1
        if self.graph is not None:
            for buf, v in zip(self.buffers, (feats, packed, lr)):
                buf.copy_(v) if torch.is_tensor(v) else buf.fill_(v)
            self.graph.replay()
            return self.outputs
        if self.calls != self.timed:
            return self.update(feats, packed, lr)
        out, bound = launch_bound("drafter step", self.update, feats, packed, lr, log=self.log)
        if bound:
            for group in self.opt.param_groups:
                group["capturable"] = True
            self.buffers = feats.clone(), packed.clone(), torch.tensor(lr, device=feats.device)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.outputs = self.update(*self.buffers)
        return out

class FeatureGraphs:
    """target.features(ids, cu_seqlens, layer_ids) from CUDA graphs. Kernel grids depend on a
    row only through its document count and fla's 64-token chunk count: one graph per such shape,
    captured its second time (fla's autotuner must have tuned), the row's values copied in before a
    replay. Flash attention gets the row length as the longest document: a bigger grid, the same
    result. One shared memory pool: outputs are copied out. Dense targets only (MoE syncs)."""
    def __init__(self, target, layer_ids, log=print):
        self.target, self.layer_ids, self.log = target, layer_ids, log
        self.graphs, self.seen, self.pool, self.train_rows, self.bound = {}, set(), None, 0, None

    def __call__(self, ids, cu_seqlens, train=True):
        # the first train row autotunes fla's kernels, the second is timed: replays if bound
        if not self.bound:
            self.train_rows += train
            if self.train_rows != 2 or self.bound is not None:
                return self.target.features(ids, cu_seqlens, self.layer_ids)
            out, self.bound = launch_bound("target forward", self.target.features, ids,
                                           cu_seqlens, self.layer_ids, log=self.log)
            return out
        bounds = cu_seqlens.numpy()
        chunks = _chunk_list(bounds)
        key, dev, T = (len(bounds), len(chunks)), ids.device, ids.shape[0]
        if key not in self.graphs:
            if key not in self.seen:
                self.seen.add(key)
                return self.target.features(ids, cu_seqlens, self.layer_ids)
            # fresh buffers: fla caches what it derives from cu_seqlens by tensor identity
            new = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)
            docs = Docs(new(len(bounds)), None, new(len(chunks), 2), T)
            inputs, graph = (new(T), docs, new(T)), torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.target.features(inputs[0], None, self.layer_ids,
                                           prepared=(docs, inputs[2]))
            self.pool, self.graphs[key] = graph.pool(), (graph, inputs, out)
        graph, (ids_in, docs, pos), out = self.graphs[key]
        # one upload: boundaries, positions, chunk list
        host = np.concatenate([bounds, positions_from_cu(cu_seqlens).numpy(), chunks.ravel()])
        host = upload(torch.from_numpy(host), dev).split([len(bounds), T, chunks.size])
        ids_in.copy_(ids), docs.cu.copy_(host[0]), pos.copy_(host[1])
        docs.chunks.view(-1).copy_(host[2])
        graph.replay()
        return out.clone()
