"""
GPU speed-ups that change no number, imported on a GPU only: the drafter's update (UpdateGraph),
timed once, is replayed from a CUDA graph when launch-bound (a small model's step); launch_bound
also decides for the target's forward (target.py's FeatureGraphs). train.py --no-cuda-graphs: no
replays. bench.py check compares replays with eager.
"""
import time

import torch

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
