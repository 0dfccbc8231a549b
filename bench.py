"""
GPU checks and measurements (needs CUDA and fla-core; not part of the CPU test suite).

  python bench.py check                      # fla target == torch target on packed rows; flex step
                                             # == dense step (train.py's start-up self-check,
                                             # published and all-full layouts); CUDA graphs ==
                                             # eager (target forward; the demo, 200 steps)
  python bench.py target --budget 8192       # qwen3.6-27b forward: ms, MFU, memory; full-attention
                                             # kernels compared
  python bench.py target --target qwen3.5-35b-a3b
                                             # the MoE target (FLOPs on active parameters); its MoE
                                             # block alone: grouped GEMM vs one matmul per expert
  python bench.py drafter --anchors 512      # the 27B drafter's training step alone (train.py's
                                             # step, random features): compile time, ms, MFU, peak
                                             # memory, fused flex backward seen (per layer kind;
                                             # --sliding-window 0 for all full layers; --kd 0.5
                                             # with distillation)
  python bench.py sweep                      # the drafter step over anchors 128..1024 x budget
                                             # 4096..16384 (--shapes)
  python bench.py pair --anchors 512 --budget 8192 --steps 30
      # runs train.py itself: both roles in one process on GPU 0 (each role timed alone), then one
      # pair on GPUs 0-1 under torchrun; prints one table with MFU against the measured bf16
      # matmul peak (--target qwen3.5-35b-a3b: the MoE pair)
  python bench.py steps -- --max-steps 60
      # train.py itself (its arguments after --; here the demo) in this process under
      # torch.profiler, steps 30-49 recorded: per step wall ms, GPU kernel ms, kernel launches, host
      # syncs and copies, then the top GPU kernels and host ops (a chrome trace in --out)
  python bench.py split --mix long          # one GPU: train.py --split-layer auto's measurements
                                             # (per-layer target ms, the drafter step at the
                                             # capacity train.py picks) and its choice: predicted
                                             # step and busy shares, unsplit and split
  python bench.py pair --mix long --split-layer 0   # (or auto, the default) unsplit vs split pair
  python bench.py prepare --tokenizer /ckpt/Qwen3.6-27B --mb 1024 --prep-workers 1,16
      # CPU only: prepare.py on 1 GB of chat JSONL (written once to --out: slices of the
      # installed torch's .py files, thinking + answer per line): tokens/s per --workers value
  python bench.py load
      # writes (once, to --out/fp8-27b) a block-FP8 copy of random qwen3.6-27b tensors in the
      # official -FP8 layout (~30 GB, 128x128 scales), then times Target.from_pretrained of it onto
      # GPU 0 in bf16 in a fresh process: seconds, peak host memory (resident, anonymous, mmapped),
      # peak GPU memory, one tensor checked against a hand dequantization
"""
import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
import target as target_module
from target import Target, TargetConfig, choose_split, positions_from_cu
from model import Drafter, DrafterConfig, drafter_loss, drafter_step, sample_anchors
from model import flex_backward_kernels, flex_kernel_options, flex_matches_dense

p = argparse.ArgumentParser(description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("what", choices=["check", "target", "drafter", "sweep", "pair", "split", "steps",
                               "load", "prepare"])
p.add_argument("--anchors", type=int, default=512,
               help="draft blocks per row (drafter, sweep); per document (pair)")
p.add_argument("--row-anchors", type=int, default=0,
               help="pair mode: train.py --row-anchors (0: measured from the data)")
p.add_argument("--split-layer", default=None,
               help="pair mode: train.py --split-layer of the 2-GPU run (K, 0 or auto; default: "
               "train.py's, auto)")
p.add_argument("--mix", choices=["short", "long"], default="short",
               help="pair and split modes: synthetic documents of 1-3K (short) or 4-8K (long) "
               "tokens, loss on the second half of each")
p.add_argument("--budget", type=int, default=8192, help="tokens per row")
p.add_argument("--target", default="qwen3.6-27b",
               help="target preset, random weights (target, drafter, sweep, pair): qwen3.6-27b or "
               "qwen3.5-35b-a3b")
p.add_argument("--drafter-layers", type=int, default=None,
               help="drafter decoder layers (default: z-lab's published drafter for the target: 5 "
               "for the 27B, 6 for the 35B-A3B)")
p.add_argument("--sliding-window", type=int, default=None,
               help="tokens per sliding drafter layer, all but the last sliding (default: the "
               "published layout, 2048 for the 27B, 4096 for the 35B-A3B); 0: all full")
p.add_argument("--kd", type=float, default=0.0,
               help="drafter, pair: train.py's --kd W (the target's final hidden state sent too)")
p.add_argument("--steps", type=int, default=30,
               help="training steps per train.py run (the last 10 are timed)")
p.add_argument("--timeout", type=float, default=600, help="seconds allowed for each train.py run")
p.add_argument("--runs", default="one,pair",
               help="pair mode: which train.py runs (one: 1 GPU both roles; pair: 2 GPUs)")
p.add_argument("--shapes",
               default=",".join(f"{n}x{s}" for s in (4096, 8192, 16384)
                                for n in (128, 256, 512, 1024)),
               help="sweep mode: anchors x budget (tokens) pairs, comma-separated")
p.add_argument("--docs", type=int, default=4, help="documents per row (target, drafter)")
p.add_argument("--tokenizer", default=None,
               help="prepare mode: checkpoint dir (tokenizer.json + chat template), e.g. "
               "/ckpt/Qwen3.6-27B")
p.add_argument("--mb", type=int, default=1024, help="prepare mode: MB of chat JSONL to prepare")
p.add_argument("--prep-workers", default="1,16",
               help="prepare mode: prepare.py --workers values to time, comma-separated")
p.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "dflash-bench"),
               help="scratch dir")
# steps mode: what follows -- is train.py's command line
cut = sys.argv.index("--") if "--" in sys.argv else len(sys.argv)
args = p.parse_args(sys.argv[1:cut])
args.train_args = sys.argv[cut + 1:]
dev = torch.device("cuda")

def bench_ms(fn, iters=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return float(np.median(ts))

def matmul_peak():
    # the ceiling MFU is measured against: a large bf16 GEMM on random data, this card, now
    x = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    return 2 * 8192**3 / (bench_ms(lambda: x @ y, 20) * 1e-3)

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

def row_cu(S, docs):
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(64, S - 64), docs - 1, replace=False))
    return torch.tensor([0, *cuts, S])

def visible(dcfg, pos, anchors, keep):
    # {layer kind: (query, key) pairs its mask lets through}, for the drafter's attention FLOPs.
    # Full: each of an anchor's B rows sees its document's past (pos[anchor] keys) and its own
    # block (B keys). Sliding window W: the row at position q sees the positions max(0, q-W+1)..q,
    # all present (context, then block), so min(q+1, W)
    B = dcfg.block_size
    q = pos[anchors][:, None] + torch.arange(B, device=pos.device)      # [N, B] query positions
    full = (pos[anchors][:, None] + B).expand(-1, B)
    return {kind: (((q + 1).clamp(max=w) if w else full) * keep[:, None]).sum().item()
            for kind, w in dcfg.windows().items()}

@contextlib.contextmanager
def per_expert_matmuls():
    # the MoE blocks run one matmul per expert instead of the grouped GEMM, until the block exits
    grouped = target_module.expert_linear
    target_module.expert_linear = target_module.per_expert_linear
    try:
        yield
    finally:
        target_module.expert_linear = grouped

def doc_pos(cu):
    # boundaries -> (document id, position in document) per token, on the GPU, as a packed row
    # carries them
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff()).to(dev)
    return doc, positions_from_cu(cu).to(dev)

def mix_data(tcfg):
    """Synthetic data with the real shapes (pair, split): documents of 1-3K (short) or 4-8K (long)
    tokens, loss on their second half; written once to --out/data-MIX."""
    from data import write_dataset
    data = os.path.join(args.out, f"data-{args.mix}")
    if not os.path.exists(os.path.join(data, "train", "meta.json")):
        rng = np.random.default_rng(0)
        lo, hi = (1024, 3072) if args.mix == "short" else (4096, 8192)
        def samples(n):
            for _ in range(n):
                L = int(rng.integers(lo, hi))
                yield (rng.integers(0, tcfg.vocab_size, L).astype(np.uint32),
                       (np.arange(L) >= L // 2).astype(np.uint8))
        write_dataset(os.path.join(data, "train"), samples(400), vocab_size=tcfg.vocab_size,
                      force=True)
        write_dataset(os.path.join(data, "val"), samples(8), vocab_size=tcfg.vocab_size,
                      force=True)
    return data

if args.what == "check":
    # 1) the fla-core path (bf16) against the plain-torch path (fp32) on a packed row, real head
    # shapes
    cfg = TargetConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       linear_num_key_heads=4, linear_num_value_heads=12)
    cpu = Target.build(cfg)
    gpu = Target.build(cfg, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, 300, 1100, 1400, 2048])
    ids = torch.randint(0, 1024, (2048,))
    def gpu_vs_cpu(name, cpu, gpu):
        ref = cpu.features(ids, cu, [0, 1, 2, 3]).view(2048, 4, -1)
        out = gpu.features(ids.to(dev), cu, [0, 1, 2, 3]).view(2048, 4, -1).cpu()
        errs = [rel(out[:, i], ref[:, i]) for i in range(4)]
        print(f"{name} vs torch (fp32) target features, 3 packed docs, per layer rel err: "
              f"{['%.2e' % e for e in errs]}")
        assert max(errs) < 3e-2, f"{name}: the GPU path disagrees with the torch path"
    gpu_vs_cpu("fla (bf16)", cpu, gpu)
    # fla's kernels compiled every config at once (target.compile_configs_at_once): each Autotuner
    # this forward tuned is one of fla's, wrapped on the instance; triton's class is untouched
    import gc
    from triton.runtime.autotuner import Autotuner
    tuned = [a for a in gc.get_objects() if isinstance(a, Autotuner) and a.cache]
    bare = [getattr(a, "base_fn", a.fn).__name__ for a in tuned
            if not getattr(a, "configs_at_once", False)]
    print(f"autotuned kernels: {len(tuned)} tuned by the forward, of "
          f"{len(target_module.fla_autotuners())} in fla's modules; not compiled at once: "
          f"{bare or 'none'}; Autotuner.run is {Autotuner.run.__qualname__}")
    assert tuned and not bare and Autotuner.run.__qualname__ == "Autotuner.run", (
        "an autotuned kernel of the target's forward did not compile its configs at once")
    # the varlen chunk list the target hands fla (made on the host) is fla's own
    from fla.ops.utils import prepare_chunk_indices
    assert torch.equal(target_module._chunk_indices(tuple(cu.tolist()), dev),
                       prepare_chunk_indices(cu.to(dev), 64)), "chunk indices differ from fla's"
    # the target's CUDA graphs (train.py, launch-bound rows): rows of one shape (documents, 64-token
    # chunks) but other boundaries replay the captured graph and must equal the eager forward
    graphs = target_module.FeatureGraphs(gpu, [0, 1, 2, 3])
    shapes = [[0, 300, 1100, 1400, 2048], [0, 310, 1090, 1400, 2048], [0, 280, 1130, 1390, 2048],
              [0, 700, 2048], [0, 690, 2048], [0, 2048]]
    diff = 0.0
    for bounds in shapes * 3:
        row_ids, row_cu = torch.randint(0, 1024, (2048,), device=dev), torch.tensor(bounds)
        ref = gpu.features(row_ids, row_cu, [0, 1, 2, 3])
        diff = max(diff, (graphs(row_ids, row_cu) - ref).abs().max().item())
    print(f"target CUDA graphs: {len(graphs.graphs)} shapes captured, {len(shapes) * 3} rows: "
          f"max abs diff from the eager forward {diff:.1e}")
    assert diff == 0, "a replayed target forward differs from the eager one"
    # the MoE target the same way (grouped GEMM in bf16 on the GPU, one matmul per expert in fp32
    # on the CPU), with top-k = all experts: bf16 router logits pick other experts than fp32 ones
    # for a few % of tokens (near ties)
    moe_cfg = TargetConfig(**{**vars(cfg), "num_experts": 8, "num_experts_per_tok": 8,
                              "moe_intermediate_size": 512,
                              "shared_expert_intermediate_size": 512})
    gpu = Target.build(moe_cfg, device=dev, dtype=torch.bfloat16)
    cpu = Target.build(moe_cfg)
    cpu.load_state_dict({k: v.float().cpu() for k, v in gpu.state_dict().items()})
    gpu_vs_cpu("MoE target, fla + grouped GEMM (bf16)", cpu, gpu)
    # the MoE block at the 35B-A3B shapes (uneven expert groups, some maybe empty): grouped GEMM
    # against one matmul per expert, both bf16 from the same routing
    a3b = TargetConfig.preset("qwen3.5-35b-a3b")
    moe = Target.build(a3b, device=dev, dtype=torch.bfloat16, n_layers=1, head=False).layers[0].mlp
    x = torch.randn(8192, a3b.hidden_size, device=dev, dtype=torch.bfloat16)
    out = moe(x)
    with per_expert_matmuls():
        err = rel(out, moe(x))
    print(f"35B-A3B MoE block, 8192 tokens: grouped GEMM vs one matmul per expert (bf16): "
          f"rel err {err:.2e}")
    assert err < 1e-2, "torch._grouped_mm disagrees with the per-expert matmuls"
    # 2) compiled flex_attention with THE masks against dense-mask SDPA (train.py's start-up
    # self-check): outputs and q, k, v gradients, the published layout (sliding + full masks) and
    # all full
    for window in (2048, 0):
        dcfg = DrafterConfig.from_target(TargetConfig.preset("qwen3.6-27b"), sliding_window=window)
        out_err, grad_err, seconds = flex_matches_dense(dcfg, dev, flex_kernel_options(dev))
        print(f"compiled flex vs dense attention, masks {list(dcfg.windows())}: output rel err "
              f"{out_err:.1e}, max grad rel err {grad_err:.1e}, {seconds:.0f} s")
        assert out_err < 1e-3 and grad_err < 1e-3, (
            "flex BlockMask path disagrees with the dense path")
    # 3) train.py's demo with its launch-bound passes replayed from CUDA graphs (the target forward
    # and the whole update) against --no-cuda-graphs: the same records and final weights
    from safetensors.torch import load_file
    logs, weights = {}, {}
    for flag in ("", "--no-cuda-graphs"):
        out = os.path.join(args.out, "graphs" + flag)
        subprocess.run([sys.executable, "train.py", "--max-steps", "200", "--overwrite", "--out",
                        out] + [flag] * bool(flag), check=True, capture_output=True)
        logs[flag] = [{k: r[k] for k in ("kind", "step", "loss", "accept", "gnorm") if k in r}
                      for r in map(json.loads, open(os.path.join(out, "log.jsonl")))
                      if r["kind"] in ("train", "eval")]
        weights[flag] = load_file(os.path.join(out, "drafter", "model.safetensors"))
    diff = max((weights[""][k].float() - v.float()).abs().max().item()
               for k, v in weights["--no-cuda-graphs"].items())
    print(f"demo, 200 steps, CUDA graphs vs --no-cuda-graphs: {len(logs[''])} train/eval records "
          f"{'equal' if logs[''] == logs['--no-cuda-graphs'] else 'DIFFER'}, final weights max abs "
          f"diff {diff:.1e}")
    assert logs[""] == logs["--no-cuda-graphs"] and diff == 0, "CUDA graphs changed training"
    print("check: OK")

elif args.what == "target":
    peak = matmul_peak()
    cfg = TargetConfig.preset(args.target)
    taps = DrafterConfig.from_target(cfg).target_layer_ids
    t0 = time.time()
    target = Target.build(cfg, device=dev, dtype=torch.bfloat16, n_layers=max(taps) + 1, head=False)
    print(f"built {args.target} layers 0..{max(taps)} (random) in {time.time() - t0:.0f} s, "
          f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB of weights")
    cu = row_cu(args.budget, args.docs)
    ids = torch.randint(0, cfg.vocab_size, (args.budget,), device=dev)
    torch.cuda.reset_peak_memory_stats()
    ms = bench_ms(lambda: target.features(ids, cu, taps))
    fl = target.flops(cu, max(taps) + 1)
    print(f"target forward, {args.budget} tokens in {args.docs} docs, taps {taps}: {ms:.1f} ms, "
          f"{args.budget / ms * 1e3:.0f} tok/s, {fl / ms / 1e9:.0f} TFLOP/s, "
          f"MFU {fl / (ms * 1e-3) / peak:.1%} (matmul peak {peak / 1e12:.0f} TFLOP/s), "
          f"peak mem {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
          + (f" [FLOPs on active parameters: {cfg.num_experts_per_tok} of {cfg.num_experts} "
             "experts]" if cfg.num_experts else ""))
    if cfg.num_experts:
        # one MoE block over the row: the grouped GEMM against one matmul per expert (host sync for
        # the split)
        moe = target.layers[0].mlp
        x = torch.randn(args.budget, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
        active = target_module.active_params(moe)
        for name, swap in (("grouped GEMM (torch._grouped_mm)", contextlib.nullcontext()),
                           ("one matmul per expert", per_expert_matmuls())):
            with swap:
                ms = bench_ms(lambda: moe(x), 10)
            print(f"  MoE block, {args.budget} tokens, {name}: {ms:.2f} ms, "
                  f"{2 * args.budget * active / ms / 1e9:.0f} TFLOP/s "
                  f"(x {len(target.layers)} layers)")
    # the full-attention kernel choice, measured at this shape
    T, nh, nkv, hd = args.budget, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(nh, T, hd, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn(2, nkv, T, hd, device=dev, dtype=torch.bfloat16)
    cl = cu.tolist()
    def per_doc(gqa):
        if gqa:
            kk, vv = k, v
        else:
            kk, vv = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        for s, e in zip(cl[:-1], cl[1:]):
            F.scaled_dot_product_attention(q[:, s:e], kk[:, s:e], vv[:, s:e], is_causal=True,
                                           enable_gqa=gqa)
    from torch.nn.attention.flex_attention import flex_attention, create_block_mask
    doc = doc_pos(cu)[0]
    bm = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None, T, T,
                           device=dev)
    flex = torch.compile(flex_attention)
    cands = {"SDPA per document, enable_gqa": lambda: per_doc(True),
             "SDPA per document, K/V repeated": lambda: per_doc(False),
             "flex (document mask)": lambda: flex(q[None], k[None], v[None], block_mask=bm,
                                                  enable_gqa=True)}
    try:
        from torch.nn.attention.varlen import varlen_attn
        cu32 = cu.to(dev, torch.int32)
        mx = int(cu.diff().max())
        qv = q.transpose(0, 1).contiguous()
        kv_, vv = (t.repeat_interleave(nh // nkv, 0).transpose(0, 1).contiguous() for t in (k, v))
        cands["varlen_attn, K/V repeated"] = lambda: varlen_attn(qv, kv_, vv, cu32, cu32, mx, mx,
                                                                 window_size=(-1, 0))
    except Exception as e:      # varlen_attn's signature differs across torch releases
        print(f"varlen_attn not measured: {type(e).__name__}: {e}")
    for name, fn in cands.items():
        try:
            print(f"  full attention fwd, {T} tokens, {len(cl) - 1} docs, {name}: "
                  f"{bench_ms(fn, 10):.2f} ms")
        except Exception as e:
            print(f"  {name}: failed ({type(e).__name__}: {str(e)[:200]})")

elif args.what in ("drafter", "sweep"):
    peak = matmul_peak()
    tcfg = TargetConfig.preset(args.target)
    dcfg = DrafterConfig.from_target(tcfg, num_hidden_layers=args.drafter_layers,
                                     sliding_window=args.sliding_window)
    # embed_tokens, the final norm and lm_head only
    tgt = Target.build(tcfg, device=dev, dtype=torch.bfloat16, n_layers=0)
    torch.manual_seed(0)
    d = Drafter(dcfg).to(dev)
    opt = torch.optim.AdamW(d.parameters(), lr=6e-4, weight_decay=0.0, fused=True)
    kernel_options = flex_kernel_options(dev)   # as train.py: once, outside the compiled graph

    def drafter_bench(N, S):
        """train.py's drafter step alone at one shape: compile s, ms, TFLOP, peak GiB,
        fused-backward kernel, flex kernel split"""
        torch._dynamo.reset()                       # every shape compiles its own graph
        cu = row_cu(S, args.docs if args.what == "drafter" else max(2, S // 2048))
        doc, pos = doc_pos(cu)
        tokens = torch.randint(0, tcfg.vocab_size, (S,), device=dev)
        lm = (torch.rand(S, device=dev) < 0.7).long()
        # --kd: the teacher (the target's final hidden state) after the taps
        feats = torch.randn(S, (len(dcfg.target_layer_ids) + (args.kd > 0)) * tcfg.hidden_size,
                            device=dev, dtype=torch.bfloat16)
        row = dict(tokens=tokens, loss_mask=lm, doc=doc, pos=pos)
        loss = torch.compile(drafter_loss, fullgraph=True, dynamic=False)  # as train.py compiles it
        def step():
            # N anchors per row, from any document
            out, _ = drafter_step(d, feats, row, S, N, tgt.embed_tokens.weight, tgt.lm_head.weight,
                                  7.0, kernel_options, loss,
                                  kd=(args.kd, tgt.norm) if args.kd else None)
            out["loss"].backward()
            torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        t0 = time.time()
        step()
        torch.cuda.synchronize()
        compile_s = time.time() - t0
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA],
                                    acc_events=True) as prof:   # as train.py: no spurious warning
            step()
            torch.cuda.synchronize()
        kernels, fused = flex_backward_kernels(prof, kinds=len(dcfg.windows()))
        # where attention time goes: per flex kernel, calls and ms in one step (one kernel per
        # mask kind and direction; calls = layers of that kind)
        split = "; ".join(f"{e.key.replace('triton_tem_fused_', '')} x{e.count} "
                          f"{e.self_device_time_total / 1e3:.1f} ms"
                          for e in prof.key_averages() if "flex_attention" in e.key)
        torch.cuda.reset_peak_memory_stats()
        ms = bench_ms(step)
        fl = d.flops(S, N, visible(dcfg, pos, *sample_anchors(lm, doc, S, N)[:2]), args.kd > 0)
        seen = ", ".join(k for k in kernels if "_tem_" in k)
        return (compile_s, ms, fl, torch.cuda.max_memory_allocated() / 2**30,
                seen if fused else f"NOT SEEN ({seen})", split)

    grid = ([(args.anchors, args.budget)] if args.what == "drafter" else
            [tuple(map(int, x.split("x"))) for x in args.shapes.split(",")])
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"matmul peak {peak / 1e12:.0f} TFLOP/s | drafter layers {dcfg.layer_types} "
          f"window {dcfg.sliding_window} | {time.strftime('%Y-%m-%d')}")
    print("| anchors | budget | compile s | step ms | TFLOP | MFU | peak GiB "
          "| fused flex backward |\n|---|---|---|---|---|---|---|---|")
    splits = []
    for N, S in grid:
        try:
            c, ms, fl, mem, fused, split = drafter_bench(N, S)
            splits.append(f"flex kernels at {N}x{S}: {split}")
            print(f"| {N} | {S} | {c:.0f} | {ms:.0f} | {fl / 1e12:.0f} | "
                  f"{fl / (ms * 1e-3) / peak:.1%} | {mem:.1f} | {fused} |", flush=True)
        except torch.OutOfMemoryError:
            print(f"| {N} | {S} | out of memory |", flush=True)
            torch.cuda.empty_cache()
    print("\n".join(splits))

elif args.what == "pair":
    tcfg = TargetConfig.preset(args.target)
    data = mix_data(tcfg)
    common = ["train.py", "--target", args.target, "--data", data,
              "--anchors", str(args.anchors), "--row-anchors", str(args.row_anchors),
              "--budget", str(args.budget), "--max-steps", str(args.steps),
              "--log-interval", str(max(1, args.steps // 3)), "--eval-interval", "100000",
              "--save-interval", "100000", "--eval-rows", "1"]
    if args.sliding_window is not None:
        common += ["--sliding-window", str(args.sliding_window)]
    if args.drafter_layers is not None:
        common += ["--drafter-layers", str(args.drafter_layers)]
    if args.kd:
        common += ["--kd", str(args.kd)]
    split = [] if args.split_layer is None else ["--split-layer", args.split_layer]
    runs = {"one": [sys.executable] + common,
            "pair": ["torchrun", "--nproc_per_node=2"] + common + split}
    recs = {}
    for name in args.runs.split(","):
        if name not in runs:
            sys.exit(f"error: --runs {args.runs}: each run is one (1 GPU, both roles) or pair "
                     "(2 GPUs)")
        if name == "pair" and torch.cuda.device_count() < 2:
            print("one GPU only: pair not run")
            continue
        log = os.path.join(args.out, name)
        cmd = runs[name] + ["--out", log, "--overwrite"]      # train.py refuses a finished run
        if os.path.exists(os.path.join(log, "log.jsonl")):
            os.remove(os.path.join(log, "log.jsonl"))
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.Popen(cmd, start_new_session=True)
        try:
            print(f"{name}: exit code {proc.wait(timeout=args.timeout)}")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)      # torchrun and every rank it started
            print(f"{name}: killed after {args.timeout:.0f} s")
        path = os.path.join(log, "log.jsonl")     # absent if the run died before its first log line
        if os.path.exists(path):
            lines = [json.loads(l) for l in open(path) if '"train"' in l]
        else:
            lines = []
        # steady state: the last full log window after the one that compiled (the final one may be
        # short)
        if lines:
            recs[name] = lines[-2] if len(lines) > 2 else lines[-1]
    peak = matmul_peak()
    dcfg = DrafterConfig.from_target(tcfg, num_hidden_layers=args.drafter_layers,
                                     sliding_window=args.sliding_window)
    with torch.device("meta"):
        tmeta = Target(tcfg, n_layers=max(dcfg.target_layer_ids) + 1, head=False)
        dmeta = Drafter(dcfg)
    S = args.budget
    cu = row_cu(S, max(2, S // 2048))
    tfl = tmeta.flops(cu, max(dcfg.target_layer_ids) + 1)
    doc, pos = doc_pos(cu)
    def drafter_flops(rec):
        # at the compiled shape: every anchor slot of the row goes through the matmuls
        N = rec["row_anchors"]
        anchors, keep = sample_anchors(torch.ones(S, device=dev), doc, S, N)[:2]
        return dmeta.flops(S, N, visible(dcfg, pos, anchors, keep), args.kd > 0)
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"matmul peak {peak / 1e12:.0f} TFLOP/s | --anchors {args.anchors} "
          f"--row-anchors {args.row_anchors} --budget {S} | {args.mix} documents | "
          f"target {args.target} | drafter layers {dcfg.layer_types} | {time.strftime('%Y-%m-%d')}")
    print("| measure | value |\n|---|---|")
    for name, r in recs.items():
        # a split pair's target forward is two parts, on two GPUs one after the other
        moved = r.get("ms_target_on_drafter", 0)
        mfu_t = tfl / ((r["ms_target"] + moved) * 1e-3) / peak
        mfu_d = drafter_flops(r) / (r["ms_drafter"] * 1e-3) / peak
        print(f"| {name}: step | {r['ms_step']:.0f} ms: {r['tok_s']:.0f} context tok/s, "
              f"{r['blocks_s']:.0f} supervised blocks/s, "
              f"{r['drafted_tok_s']:.0f} drafted tokens/s |")
        print(f"| {name}: anchors per row (capacity), cut by it, padded | {r['anchors_row']:.0f} "
              f"({r['row_anchors']}), {r['anchors_cut']} in the window, {r['pad_frac']:.0%} |")
        on_drafter = f" + {moved:.0f} on the drafter GPU (layers {r['split_layer']}..)"
        print(f"| {name}: target fwd / drafter wait / drafter step | "
              f"{r['ms_target']:.0f}{on_drafter if moved else ''} (MFU {mfu_t:.0%}) / "
              f"{r['ms_wait']:.0f} / {r['ms_drafter']:.0f} ms (MFU {mfu_d:.0%}) |")
        print(f"| {name}: busy target GPU / drafter GPU | "
              f"{r['busy_target']:.0%} / {r['busy_drafter']:.0%} |")
        print(f"| {name}: peak memory per GPU | "
              f"{' / '.join(f'{m:.1f}' for m in r['mem_gib'])} GiB |")
        print(f"| {name}: compiled graphs on the drafter rank (train and eval) | "
              f"{r.get('graphs')} |")

elif args.what == "steps":
    # train.py as a user runs it, in this process; a global optimizer hook steps the profiler's
    # schedule, so nothing in train.py changes: steps 30-49 are recorded (after the compile and
    # train.py's own profiled step; two profilers cannot run at once)
    import runpy
    from torch.profiler import ProfilerActivity, profile, schedule
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * torch.cuda.is_available()
    n = 20
    prof = profile(activities=activities, schedule=schedule(wait=28, warmup=2, active=n, repeat=1))
    from torch.optim.optimizer import register_optimizer_step_post_hook
    hook = register_optimizer_step_post_hook(lambda *a: prof.step())
    sys.argv = ["train.py", "--out", os.path.join(args.out, "steps"), "--overwrite",
                *args.train_args]
    prof.start()
    runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "train.py"),
                   run_name="__main__")
    prof.stop()
    hook.remove()
    events = prof.key_averages()
    per_step = lambda *names: sum(e.count for e in events if e.key in names) / n
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    wall = [e.cpu_time_total / e.count for e in events if e.key.startswith("ProfilerStep")]
    launches = per_step("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                        "cudaLaunchKernelExC")
    syncs = per_step("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    print(f"\n{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'} | "
          f"torch {torch.__version__} | train.py {' '.join(args.train_args)} | {n} steps")
    print(f"per step: {sum(wall) / max(len(wall), 1) / 1e3:.1f} ms wall, "
          f"{sum(e.self_device_time_total for e in kernels) / n / 1e3:.1f} ms of GPU kernels, "
          f"{sum(e.count for e in kernels) / n:.0f} kernels, {launches:.0f} launches, host syncs "
          f"{syncs:.1f}, copies {per_step('cudaMemcpyAsync', 'cudaMemcpy'):.1f}")
    print("| GPU kernel | ms/step | calls/step |\n|---|---|---|")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]:
        print(f"| {e.key[:90]} | {e.self_device_time_total / n / 1e3:.2f} | {e.count / n:.0f} |")
    print("| host op (self time) | ms/step | calls/step |\n|---|---|---|")
    host = [e for e in events
            if e.device_type.name == "CPU" and not e.key.startswith("ProfilerStep")]
    for e in sorted(host, key=lambda e: -e.self_cpu_time_total)[:20]:
        print(f"| {e.key[:90]} | {e.self_cpu_time_total / n / 1e3:.2f} | {e.count / n:.0f} |")
    trace = os.path.join(args.out, "steps_trace.json")
    prof.export_chrome_trace(trace)
    print(f"chrome trace: {trace}")
elif args.what == "split":
    # what train.py --split-layer auto would choose for a pair, measured as train.py measures it but
    # on one GPU (both roles in turn): predictions, not a two-GPU run
    from data import open_dataset, Packer
    tcfg = TargetConfig.preset(args.target)
    dcfg = DrafterConfig.from_target(tcfg, num_hidden_layers=args.drafter_layers,
                                     sliding_window=args.sliding_window)
    taps, S, B = dcfg.target_layer_ids, args.budget, dcfg.block_size
    last = max(taps)
    ds = open_dataset(os.path.join(mix_data(tcfg), "train"))
    # the row capacity train.py picks (its anchors section): the 90th percentile of what the first
    # 512 rows ask for, a multiple of 8, at least 8
    probe = Packer(ds, S, seed=0)
    demand = [int(sample_anchors(torch.from_numpy(row.loss_mask), torch.from_numpy(row.doc),
                                 args.anchors, 1)[2])
              for row in (probe.next_row() for _ in range(min(512, probe.steps_per_epoch)))]
    N = args.row_anchors or int(-(-np.percentile(demand, 90) // 8) * 8)
    N = max(8, min(N, S - 1, 4 * S // B))
    # train.py's rows: one pair's first 4 (after one warm-up), as tensors on the GPU
    packer = Packer(ds, S, seed=0)
    rows = [packer.next_row() for _ in range(4)]
    on_dev = lambda x: torch.from_numpy(x.astype(np.int64)).to(dev)
    # 1) the target: every layer up to the last tap, per-layer ms (median over the rows) and the
    # activation peak of the largest
    target = Target.build(tcfg, device=dev, dtype=torch.bfloat16, n_layers=last + 1, head=False)
    target.features(on_dev(rows[0].tokens), torch.from_numpy(rows[0].cu_seqlens), taps)
    runs = [target.time_layers(on_dev(r.tokens), torch.from_numpy(r.cu_seqlens), last + 1)
            for r in rows]
    layer_ms = np.median([ms for ms, _ in runs], 0)
    act = max(max(a) for _, a in runs)
    weights = [sum(p.numel() * p.element_size() for p in layer.parameters())
               for layer in target.layers]
    del target
    torch.cuda.empty_cache()
    # 2) the drafter step as train.py times it: compiled, forward + backward + clip, no optimizer
    # step; zero features (the cost does not depend on their values)
    tgt = Target.build(tcfg, device=dev, dtype=torch.bfloat16, n_layers=0)   # embed + lm_head
    torch.manual_seed(0)
    d = Drafter(dcfg).to(dev)
    flex = flex_kernel_options(dev)
    feats = torch.zeros(S, len(taps) * tcfg.hidden_size, device=dev, dtype=torch.bfloat16)
    loss = torch.compile(drafter_loss, fullgraph=True, dynamic=False)      # as train.py compiles it
    step_ms = []
    for i, r in enumerate([rows[0], *rows]):                   # the first compiles
        if i == 1:      # as train.py: the peak of a step, not of compiling (autotuning) it
            torch.cuda.reset_peak_memory_stats()
        row = {k: on_dev(getattr(r, k)) for k in ("tokens", "loss_mask", "doc", "pos")}
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out, _ = drafter_step(d, feats, row, args.anchors, N, tgt.embed_tokens.weight,
                              tgt.lm_head.weight, 7.0, flex, loss)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(d.parameters(), 1.0)
        b.record()
        torch.cuda.synchronize()
        step_ms.append(a.elapsed_time(b))
        d.zero_grad(set_to_none=True)
    adam = 2 * sum(p.numel() * p.element_size() for p in d.parameters())
    held = torch.cuda.max_memory_allocated() + adam
    # 3) train.py's choice (its agree_split, one pair): the same function, the same memory terms
    usable = 0.9 * torch.cuda.get_device_properties(dev).total_memory
    extra = len(taps) * S * tcfg.hidden_size * 2 + act
    c = choose_split([layer_ms], [np.median(step_ms[1:])], weights, [held + extra], [usable])
    K, gib = c["K"], 2**30
    kinds = {k: [m for m, t in zip(layer_ms, tcfg.layer_types) if t == k]
             for k in ("linear_attention", "full_attention")}
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.target} | "
          f"--budget {S} --anchors {args.anchors} (capacity {N}) | {args.mix} documents | "
          f"drafter layers {dcfg.layer_types} | {time.strftime('%Y-%m-%d')}")
    print("target ms per layer 0..%d: %s" % (last, " ".join(f"{m:.1f}" for m in layer_ms)))
    print("| measure | value |\n|---|---|")
    print(f"| target layers 0..{last}, median of {len(rows)} rows | {layer_ms.sum():.0f} ms; per "
          f"layer GDN {np.mean(kinds['linear_attention']):.1f} ms, full attention "
          f"{np.mean(kinds['full_attention']):.1f} ms; {np.mean(weights) / gib:.2f} GiB of weights "
          f"per layer, activations up to {act / gib:.2f} GiB |")
    print(f"| drafter step (forward + backward + clip), capacity {N} anchors | "
          f"{np.median(step_ms[1:]):.0f} ms; {held / gib:.1f} GiB with AdamW's state |")
    cases = [("unsplit (--split-layer 0)", 0)] + [(f"--split-layer {K} (auto)", K)] * (K > 0)
    for name, k in cases:
        t, dr, st = c["target"][k, 0], c["drafter"][k, 0], c["step"][k]
        print(f"| PREDICTED {name} | step {st:.0f} ms ({S / st * 1e3:.0f} context tok/s): target "
              f"GPU {t:.0f} ms, drafter GPU {dr:.0f} ms; busy {t / st:.0%} / {dr / st:.0%}"
              + (f"; drafter GPU {c['need'][k, 0] / gib:.1f} of {usable / gib:.1f} GiB usable"
                 if k else "") + " |")
    if c["fastest"] != K:
        f = c["fastest"]
        print(f"| PREDICTED --split-layer {f} (does not fit) | step {c['step'][f]:.0f} ms, "
              f"needs {c['need'][f, 0] / gib:.1f} GiB |")
    print(f"| PREDICTED speed-up of auto over unsplit | {c['step'][0] / c['step'][K]:.2f}x "
          "rows/s |")

elif args.what == "load":
    # the official -FP8 layout: model.language_model.* + lm_head, every decoder Linear weight but
    # in_proj_a/b in e4m3 with fp32 weight_scale_inv [ceil(out/128), ceil(in/128)]; embeddings,
    # norms, conv, A_log, dt_bias unquantized (bf16, A_log fp32). Random values: load time and
    # memory do not depend on them
    from safetensors.torch import save_file
    tcfg = TargetConfig.preset("qwen3.6-27b")
    path, block, shard_bytes = os.path.join(args.out, "fp8-27b"), [128, 128], 5 << 30
    if not os.path.exists(os.path.join(path, "config.json")):
        os.makedirs(path, exist_ok=True)
        with torch.device("meta"):
            meta = Target(tcfg)
        shard, size, weight_map, n, t0 = {}, 0, {}, 0, time.time()
        def flush():
            global shard, size, n
            n += 1
            file = f"model-{n:05d}.safetensors"
            save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0
        for name, p in meta.named_parameters():
            key = name if name == "lm_head.weight" else "model.language_model." + name
            in_proj_ab = name.endswith(("in_proj_a.weight", "in_proj_b.weight"))
            if name.startswith("layers.") and p.dim() == 2 and not in_proj_ab:
                grid = (-(-p.shape[0] // 128), -(-p.shape[1] // 128))
                shard[key] = torch.randn(p.shape, device=dev).mul_(64).to(torch.float8_e4m3fn).cpu()
                shard[key + "_scale_inv"] = (torch.rand(grid, device=dev) * 1e-3 + 1e-4).cpu()
            else:
                dtype = torch.float32 if name.endswith("A_log") else torch.bfloat16
                shard[key] = (torch.randn(p.shape, device=dev) * 0.02).to(dtype).cpu()
            size += shard[key].nbytes
            if size >= shard_bytes:
                flush()
        flush()
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        text = {k: getattr(tcfg, k) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "layer_types",
            "num_attention_heads", "num_key_value_heads", "head_dim", "linear_num_key_heads",
            "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
            "linear_conv_kernel_dim", "rms_norm_eps", "max_position_embeddings")}
        text.update(model_type="qwen3_5_text", hidden_act="silu", attention_bias=False,
                    rope_parameters=dict(rope_type="default", rope_theta=tcfg.rope_theta,
                                         partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                                         mrope_interleaved=True))
        quant = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                     weight_block_size=block,
                     modules_to_not_convert=["lm_head", "model.visual", "mtp", "embed_tokens",
                                             "in_proj_a", "in_proj_b"])
        # written last: its presence marks a complete copy
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({"architectures": ["Qwen3_5ForConditionalGeneration"],
                       "model_type": "qwen3_5", "tie_word_embeddings": False,
                       "text_config": text, "quantization_config": quant}, f)
        gib = sum(os.path.getsize(os.path.join(path, f)) for f in set(weight_map.values())) / 2**30
        print(f"wrote {n} shards, {gib:.1f} GiB, to {path} in {time.time() - t0:.0f} s", flush=True)
    # the load in a fresh process, so its peak host RSS is the loader's alone
    child = r"""
import json, sys, threading, time, torch
from safetensors import safe_open
from target import Target
def rss():
    status = dict(l.split(":", 1) for l in open("/proc/self/status"))
    return {k: int(status[k].split()[0]) / 2**20 for k in ("VmRSS", "RssAnon", "RssFile")}
path = sys.argv[1]
torch.zeros(1, device="cuda")              # CUDA's own host memory is in the baseline
before, peak, done = rss(), rss(), threading.Event()
def sample():                              # peak of each kind of resident memory, every 5 ms
    while not done.wait(0.005):
        for k, v in rss().items():
            peak[k] = max(peak[k], v)
threading.Thread(target=sample, daemon=True).start()
t0 = time.time()
m = Target.from_pretrained(path, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
sec = time.time() - t0
done.set()
key = "model.language_model.layers.0.mlp.gate_proj.weight"
with open(path + "/model.safetensors.index.json") as f:
    wm = json.load(f)["weight_map"]
with safe_open(path + "/" + wm[key], "pt") as f:
    q = f.get_tensor(key).cuda()
with safe_open(path + "/" + wm[key + "_scale_inv"], "pt") as f:
    s = f.get_tensor(key + "_scale_inv").cuda()
rows, cols = q.shape
# every element's scale
full = s.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
same = torch.equal(m.layers[0].mlp.gate_proj.weight, (q.float() * full).to(torch.bfloat16))
params = sum(p.numel() * p.element_size() for p in m.parameters()) / 2**30
print(json.dumps(dict(load_s=round(sec, 1), before={k: round(v, 2) for k, v in before.items()},
                      peak={k: round(v, 2) for k, v in peak.items()},
                      gpu_peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      weights_gib=round(params, 2), gate_proj_equals_hand_dequant=same)))
"""
    res = subprocess.run([sys.executable, "-c", child, path], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    if res.returncode:
        sys.exit(res.stderr[-3000:])
    r = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"block-FP8 qwen3.6-27b -> bf16 on GPU 0 | {time.strftime('%Y-%m-%d')}")
    print("| measure | value |\n|---|---|")
    print(f"| Target.from_pretrained (read + dequantize; page cache as the write left it) | "
          f"{r['load_s']} s |")
    shard = max(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                if f.endswith(".safetensors")) / 2**30
    pk, b0 = r["peak"], r["before"]
    print(f"| host memory of the loading process: resident / anonymous / file-backed (mmapped "
          f"shard pages) | peak {pk['VmRSS']} / {pk['RssAnon']} / {pk['RssFile']} GiB; before "
          f"the load (CUDA up) {b0['VmRSS']} / {b0['RssAnon']} / {b0['RssFile']} GiB; largest "
          f"shard {shard:.1f} GiB |")
    print(f"| peak GPU memory / the bf16 weights | {r['gpu_peak_gib']} / {r['weights_gib']} GiB |")
    print(f"| layers.0.mlp.gate_proj == hand dequantization | "
          f"{r['gate_proj_equals_hand_dequant']} |")

elif args.what == "prepare":
    import glob
    import resource
    if not args.tokenizer:
        sys.exit("error: bench.py prepare needs --tokenizer DIR (a checkpoint directory with "
                 "tokenizer.json and a chat template)")
    src = os.path.join(args.out, f"chat-{args.mb}mb.jsonl")
    if not os.path.exists(src):
        # real text, code and prose (~3.5 characters a token): the installed torch's .py files,
        # cut into a ~1.7 KB question and an answer of ~9 KB thinking + ~3.5 KB text per line
        files = glob.glob(os.path.join(os.path.dirname(torch.__file__), "**", "*.py"),
                          recursive=True)
        corpus = "".join(open(f, errors="replace").read() for f in sorted(files))
        rng, size = np.random.default_rng(0), 0

        def cut(lo, hi):
            n = int(rng.integers(lo, hi))
            a = int(rng.integers(0, len(corpus) - n))
            return corpus[a:a + n]
        os.makedirs(args.out, exist_ok=True)
        with open(src + ".tmp", "w") as f:
            while size < args.mb * 2**20:
                line = json.dumps({"messages": [
                    {"role": "user", "content": cut(500, 3000)},
                    {"role": "assistant", "reasoning_content": cut(2000, 16000),
                     "content": cut(1000, 6000)}]}) + "\n"
                f.write(line)
                size += len(line)
        os.rename(src + ".tmp", src)
    mb = os.path.getsize(src) / 2**20
    print(f"prepare.py, {mb:.0f} MB of chat JSONL ({src}), "
          f"--tokenizer {args.tokenizer} | {os.cpu_count()} CPUs | {time.strftime('%Y-%m-%d')}")
    # M tokens per CPU-second: all processes' CPU time, which a loaded machine does not inflate
    print("| --workers | seconds | tokens | M tokens/s | M tokens per CPU-s | MB/s of JSONL | "
          "hours per 3B tokens | peak MB of one process so far |\n" + "|---" * 8 + "|")
    for w in map(int, args.prep_workers.split(",")):
        # the command itself, in a fresh process: its peak memory is the largest of any process
        out = os.path.join(args.out, f"prepared-{w}")
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu0 = ru.ru_utime + ru.ru_stime
        t0 = time.perf_counter()
        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                     "prepare.py"), "--input", src,
                        "--out", out, "--tokenizer", args.tokenizer, "--workers", str(w),
                        "--force"], check=True, stdout=subprocess.DEVNULL)
        dt = time.perf_counter() - t0
        with open(os.path.join(out, "train", "meta.json")) as f:
            n = json.load(f)["n_tokens"]
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu, peak = ru.ru_utime + ru.ru_stime - cpu0, ru.ru_maxrss >> 10
        print(f"| {w} | {dt:.1f} | {n} | {n / dt / 1e6:.2f} | {n / cpu / 1e6:.3f} | "
              f"{mb / dt:.1f} | {3e9 / (n / dt) / 3600:.2f} | {peak} |")
