"""
GPU checks and measurements (needs CUDA, and fla-core for the Qwen target's checks; not part of
the CPU test suite), of any target.py that implements the Target interface.

  python bench.py check     # fla, CUDA graphs, grouped GEMM (Qwen), compiled flex == references
  python bench.py target [--target qwen3.5-35b-a3b]   # the forward: ms, MFU, memory
  python bench.py drafter --anchors 512 [--sliding-window 0]   # train.py's step alone
"""
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from unittest import mock

import numpy as np
import torch
import checks
from layers import positions_from_cu
from target import Target, TargetConfig
from model import Drafter, DrafterConfig, drafter_step, sample_anchors
from data import ArgParser

p = ArgParser(description=__doc__)
arg = p.add_argument
arg("what", choices=["check", "target", "drafter"])
arg("--anchors", type=int, default=512, help="draft blocks per row")
arg("--budget", type=int, default=8192, help="tokens per row")
arg("--target", default="qwen3.6-27b", help="a target.py preset (qwen3.6-27b, qwen3.5-35b-a3b) "
    "or a checkpoint dir: its geometry, random weights")
arg("--drafter-layers", type=int, help="drafter layers (default: z-lab's published drafter's)")
arg("--sliding-window", type=int, help="drafter window (default: published); 0: all full")
arg("--arch", choices=("dflash", "dflash2"), default="dflash2", help="as train.py's")
arg("--objective", choices=("ce", "tv", "accept", "dspark"), default="ce", help="as train.py's; "
    "target: also the forward to the final norm")
arg("--out", default=os.path.join(tempfile.gettempdir(), "dflash-bench"), help="scratch dir")
args, dev, bf16 = p.parse_args(), torch.device("cuda"), torch.bfloat16
final = args.objective != "ce"   # the target's final hidden state travels too (train.py's)
if not torch.cuda.is_available():
    sys.exit("error: bench.py needs a CUDA GPU (it checks and times GPU kernels)")
TRAIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py")
try:
    tcfg = (TargetConfig.from_hf(args.target) if os.path.isdir(args.target)
            else TargetConfig.preset(args.target))
    dcfg = DrafterConfig.from_target(tcfg, num_hidden_layers=args.drafter_layers,
                                     sliding_window=args.sliding_window,
                                     conv_kernel_size=2 if args.arch == "dflash2" else None)
except (ValueError, OSError) as e:
    sys.exit(f"error: --target {args.target}: {e}")

def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3

def bench_ms(fn, iters=5):   # the median of `iters` runs after a warm one (compiles, autotunes)
    return float(np.median([timed(fn) for _ in range(iters + 1)][1:]))

def matmul_peak():
    # the ceiling MFU is measured against: a large bf16 GEMM on random data, this card, now
    x, y = torch.randn(2, 8192, 8192, device=dev, dtype=bf16)
    return 2 * 8192**3 / (bench_ms(lambda: x @ y, 20) * 1e-3)

def packed_row(S, docs):
    # `docs` documents in S tokens: boundaries (CPU), and document id and position per token (GPU)
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(64, S - 64), docs - 1, replace=False))
    cu = torch.tensor([0, *cuts, S])
    doc = torch.repeat_interleave(torch.arange(docs), cu.diff()).to(dev)
    return cu, doc, positions_from_cu(cu).to(dev)

def drafter_flops(drafter, S, N, doc, pos, loss_mask):
    # train.py's step at S tokens and N anchor slots, with the (query, key) pairs its masks let
    # through: with full attention an anchor's B rows see its document's past (pos[anchor] keys)
    # and its block (B); with window W the row at position q sees min(q+1, W) (context, block)
    anchors, keep, B = *sample_anchors(loss_mask, doc, S, N)[:2], dcfg.block_size
    q = pos[anchors][:, None] + torch.arange(B, device=dev)             # [N, B] query positions
    full = (pos[anchors][:, None] + B).expand(-1, B)
    visible = {kind: (((q + 1).clamp(max=w) if w else full) * keep[:, None]).sum().item()
               for kind, w in dcfg.windows().items()}
    return drafter.flops(S, N, visible, final)

def qwen_kernel_checks(per_expert_linear):
    # 1) fla (bf16) == plain torch (fp32) on a packed row,
    # dense and MoE (top-k = all: bf16 and fp32 router logits pick other experts at near ties)
    toy = dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
               num_attention_heads=8, num_key_value_heads=2, linear_num_key_heads=4,
               linear_num_value_heads=12)
    moe = dict(toy, num_experts=8, num_experts_per_tok=8, moe_intermediate_size=512,
               shared_expert_intermediate_size=512)
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    cu, ids, taps = torch.tensor([0, 300, 1100, 1400, 2048]), torch.randint(1024, (2048,)), range(4)
    for name, c in (("MoE target, fla + grouped GEMM (bf16)", moe), ("fla (bf16)", toy)):
        gpu = Target.build(TargetConfig(**c), device=dev, dtype=bf16)   # dense last: graphs below
        cpu = Target.build(TargetConfig(**c))
        cpu.load_state_dict({k: v.float().cpu() for k, v in gpu.state_dict().items()})
        ref, out = cpu.features(ids, cu, taps), gpu.features(ids.to(dev), cu, taps).cpu()
        errs = [rel(o, r) for o, r in zip(out.chunk(4, -1), ref.chunk(4, -1))]
        print(f"{name} vs torch (fp32) target features, 3 packed docs, per layer rel err: "
              f"{['%.2e' % e for e in errs]}")
        assert max(errs) < 3e-2, f"{name}: the GPU path disagrees with the torch path"
    # rows of one shape (documents, 64-token chunks), other boundaries: CUDA graph replays == eager.
    # Forced: whether this toy is launch-bound depends on the host; the check must not
    graphs, diff = gpu.graphed_features(taps), 0.0
    graphs.bound = True
    shapes = [[0, 300, 1100, 1400, 2048], [0, 310, 1090, 1400, 2048], [0, 280, 1130, 1390, 2048],
              [0, 700, 2048], [0, 690, 2048], [0, 2048]]
    for bounds in map(torch.tensor, shapes * 3):    # a shape's rows: eager, captured, replayed
        row = torch.randint(0, 1024, (2048,), device=dev)
        diff = max(diff, (gpu.features(row, bounds, taps) - graphs(row, bounds)).abs().max().item())
    print(f"target CUDA graphs: {len(graphs.graphs)} shapes captured, {len(shapes) * 3} rows: "
          f"max abs diff from the eager forward {diff:.1e}")
    assert diff == 0, "a replayed target forward differs from the eager one"
    # the 35B-A3B MoE block (uneven, maybe empty expert groups): grouped GEMM == per-expert matmuls
    a3b = TargetConfig.preset("qwen3.5-35b-a3b")
    block = Target.build(a3b, device=dev, dtype=bf16, n_layers=1, head=False).layers[0].mlp
    x = torch.randn(8192, a3b.hidden_size, device=dev, dtype=bf16)
    out = block(x)
    with mock.patch("target.expert_linear", per_expert_linear):  # host sync for the split
        err = rel(out, block(x))
    print(f"35B-A3B MoE block, 8192 tokens: grouped GEMM vs one matmul per expert (bf16): "
          f"rel err {err:.2e}")
    assert err < 1e-2, "torch._grouped_mm disagrees with the per-expert matmuls"

if args.what == "check":
    try:   # 1) the Qwen target's own GPU paths, against references only its target.py has
        from target import per_expert_linear
    except ImportError:
        print("skipped the fla, CUDA graph and grouped GEMM checks: target.py has no "
              "per_expert_linear (they are the Qwen target's)")
    else:
        qwen_kernel_checks(per_expert_linear)
    # 2) compiled flex == dense SDPA, outputs and gradients (train.py's self-check), both layouts
    for window in (2048, 0):
        c = DrafterConfig.from_target(tcfg, sliding_window=window)
        out_err, grad_err, seconds = checks.flex_matches_dense(c, dev,
                                                               checks.flex_kernel_options(dev))
        print(f"compiled flex vs dense attention, masks {list(c.windows())}: output rel err "
              f"{out_err:.1e}, max grad rel err {grad_err:.1e}, {seconds:.0f} s")
        assert out_err < 1e-3 and grad_err < 1e-3, "flex BlockMask path disagrees with dense"
    # 3) the demo with its launch-bound passes replayed from CUDA graphs == --no-cuda-graphs
    from safetensors.torch import load_file
    logs, weights = [], []
    for flag in ([], ["--no-cuda-graphs"]):
        out = os.path.join(args.out, "graphs" + "".join(flag))   # errors show, log lines do not
        subprocess.run([sys.executable, TRAIN, "--max-steps", "200", "--overwrite", "--out", out,
                        *flag], check=True, stdout=subprocess.DEVNULL)
        recs = map(json.loads, open(os.path.join(out, "log.jsonl")))
        logs.append([{k: r.get(k) for k in ("kind", "step", "loss", "accept", "gnorm")}
                     for r in recs if r["kind"] in ("train", "eval")])
        weights.append(load_file(os.path.join(out, "drafter", "model.safetensors")))
    diff = max((weights[0][k] - v).abs().max().item() for k, v in weights[1].items())
    print(f"demo, 200 steps, CUDA graphs vs --no-cuda-graphs: {len(logs[0])} train/eval records "
          f"{'equal' if logs[0] == logs[1] else 'DIFFER'}, final weights max abs diff {diff:.1e}")
    assert logs[0] == logs[1] and diff == 0, "CUDA graphs changed training"
    print("check: OK")

elif args.what == "target":
    peak, taps, T = matmul_peak(), dcfg.target_layer_ids, args.budget
    n = tcfg.num_hidden_layers if final else max(taps) + 1   # --objective: to the final norm
    target = Target.build(tcfg, device=dev, dtype=bf16, n_layers=n, head=False)
    weights, (cu, _, _) = torch.cuda.memory_allocated() / 2**30, packed_row(T, 4)
    ids = torch.randint(0, tcfg.vocab_size, (T,), device=dev)
    torch.cuda.reset_peak_memory_stats()
    ms, fl = bench_ms(lambda: target.features(ids, cu, taps, final=final)), target.flops(cu, n)
    print(f"{args.target} forward, layers 0..{n - 1}{' + norm' * final} (random; {weights:.1f} GiB "
          f"of weights), {T} tokens in 4 docs, taps {taps}: {ms:.1f} ms, {T / ms * 1e3:.0f} tok/s, "
          f"{fl / ms / 1e9:.0f} TFLOP/s, MFU {fl / (ms * 1e-3) / peak:.1%} (matmul peak "
          f"{peak / 1e12:.0f} TFLOP/s), peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} "
          "GiB" + (f" [FLOPs on active parameters: {tcfg.num_experts_per_tok} of "
                   f"{tcfg.num_experts} experts]" if tcfg.num_experts else ""))

elif args.what == "drafter":
    peak, N, S = matmul_peak(), args.anchors, args.budget
    tgt, d = Target.build(tcfg, device=dev, dtype=bf16, n_layers=0), Drafter(dcfg).to(dev)
    opt = torch.optim.AdamW(d.parameters(), lr=6e-4, weight_decay=0.0, fused=True)
    _, doc, pos = packed_row(S, 4)
    row = dict(tokens=torch.randint(0, tcfg.vocab_size, (S,), device=dev), doc=doc, pos=pos,
               loss_mask=(torch.rand(S, device=dev) < 0.7).long())
    feats = torch.randn(S, (len(dcfg.target_layer_ids) + final) * tcfg.hidden_size, device=dev,
                        dtype=bf16)
    # train.py's step, compiled whole; N anchors from any document
    kw = dict(anchors_per_doc=S, row_anchors=N, embed=tgt.embed_tokens.weight, gamma=7.0,
              head=tgt.lm_head.weight, flex=checks.flex_kernel_options(dev))
    if final:
        import distill
        kw["objective"] = distill.Objective(args.objective)
    drafter_step_c = torch.compile(functools.partial(drafter_step, d, **kw), fullgraph=True,
                                   dynamic=False)
    def step():
        drafter_step_c(feats, row)[0]["loss"].backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    compile_s = timed(step) / 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                acc_events=True) as prof:   # as checks.py: no spurious warning
        step()
        torch.cuda.synchronize()
    seen = sorted({e.name for e in prof.events() if "flex_attention_backward" in e.name})
    fused, seen = sum("_tem_" in k for k in seen) >= len(dcfg.windows()), ", ".join(seen)
    # where attention time goes: per flex kernel (one per mask kind and direction), calls, ms
    split = "; ".join(f"{e.key.replace('triton_tem_fused_', '')} x{e.count} "
                      f"{e.self_device_time_total / 1e3:.1f} ms"
                      for e in prof.key_averages() if "flex_attention" in e.key)
    torch.cuda.reset_peak_memory_stats()
    ms, fl = bench_ms(step), drafter_flops(d, S, N, doc, pos, row["loss_mask"])
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | matmul peak "
          f"{peak / 1e12:.0f} TFLOP/s | {args.arch} drafter, --objective {args.objective}, "
          f"layers {dcfg.layer_types} window "
          f"{dcfg.sliding_window} | {time.strftime('%F')}\n| anchors | "
          f"budget | compile s | step ms | TFLOP | MFU | peak GiB | fused flex backward |\n"
          f"{'|---' * 8}|\n| {N} | {S} | {compile_s:.0f} | {ms:.0f} | {fl / 1e12:.0f} | "
          f"{fl / (ms * 1e-3) / peak:.1%} | {torch.cuda.max_memory_allocated() / 2**30:.1f} | "
          f"{seen if fused else f'NOT SEEN ({seen})'} |\nflex kernels at {N}x{S}: {split}")
