"""
train.py end to end, in real processes on CPU: the demo run, torchrun pairs over gloo, resume, and the
faults a long job meets (bad flags, bad checkpoints, a non-finite loss, a killed rank, a crash mid-save,
a broken compile cache, two nodes); the published z-lab drafter config in and out (--init-drafter);
generate.py's command line. Minutes: each test trains the tiny target's
drafter a few steps.
Run: python -m pytest -q test_smoke.py test_train.py (the demo dataset is built once, in data/demo)
"""
import json
import math
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import Qwen3Config

from data import Packer, open_dataset, write_dataset
from model import Drafter, DrafterConfig
from target import TargetConfig
from test_smoke import (BAD_LAYOUTS, YARN, demo_data, edit_config, tiny_target, write_published_tiny,
                        write_text_only)

HERE = os.path.dirname(os.path.abspath(__file__))


def fork_trainer(path, target=os.path.join(HERE, "target.py")):
    """The trainer's files (every .py but the tests) copied into path (a forker's checkout), target.py
    from `target`."""
    path.mkdir()
    for f in os.listdir(HERE):
        if f.endswith(".py") and not f.startswith("test_"):
            shutil.copy(os.path.join(HERE, f), path / f)
    shutil.copy(target, path / "target.py")
    return path


def clean_env():
    # like a fresh shell: inductor writes its default TORCHINDUCTOR_CACHE_DIR into os.environ once
    # anything in this process compiled, and an inherited value would (rightly) be taken as the
    # user's choice for all ranks
    drop = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, "OMP_NUM_THREADS": "1"}


def train_cmd(out, *flags, nproc=1, port=29500, nnodes=1, node_rank=0):
    """The command line of `train.py --out OUT FLAGS`: plain python for one process, else torchrun
    with nproc processes per node, nnodes nodes on loopback (this one is node node_rank)."""
    script = [os.path.join(HERE, "train.py"), "--out", str(out), *map(str, flags)]
    if nproc == 1 and nnodes == 1:
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
            f"--node_rank={node_rank}", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={port}", *script]


def start(out, *flags, popen_kw=None, **cmd_kw):
    """Starts train.py (see train_cmd); p.stdout is its stdout and stderr, interleaved."""
    return subprocess.Popen(train_cmd(out, *flags, **cmd_kw), cwd=HERE, env=clean_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, **(popen_kw or {}))


def train(out, *flags, ok=True, **kw):
    """Runs train.py to its end, checks that it succeeded (ok) or failed (not ok), returns its output."""
    p = start(out, *flags, **kw)
    try:
        text = p.communicate(timeout=900)[0]
    finally:
        p.kill()   # a no-op once it has exited; a hung run is not left behind
    assert (p.returncode == 0) == ok, f"{' '.join(p.args)} exited {p.returncode}:\n{text[-4000:]}"
    return text


def generate_cmd(*flags):
    """The command line of `generate.py FLAGS`."""
    return [sys.executable, os.path.join(HERE, "generate.py"), *map(str, flags)]


def run_apart(cmd):
    """Runs a train_cmd or generate_cmd to its end; returns the CompletedProcess, with stdout and stderr
    apart (for the checks that an error is one line on stderr)."""
    return subprocess.run(cmd, cwd=HERE, env=clean_env(), capture_output=True, text=True, timeout=900)


def train_log(out, kind="train"):
    """The records of one kind ("train", "eval", ...) in OUT/log.jsonl, in order."""
    with open(os.path.join(out, "log.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def losses(out):
    return {r["step"]: r["loss"] for r in train_log(out)}


def printed_steps(text):
    """The steps of the train lines a run printed ("step 5/8 | ..."), in order."""
    return [int(s) for s in re.findall(r"^step (\d+)/\d+ \|", text, re.M)]


def max_abs_diff(text):
    """The end-of-run check that data parallel left every drafter with the same weights."""
    m = re.search(r"^end: drafter weights identical across \d+ drafter\(s\): max abs diff (\S+)$",
                  text, re.M)
    assert m, text[-2000:]
    return float(m.group(1))


# ==================================================================================================
# runs: defaults, torchrun pairs over gloo, resume

def test_train_demo_defaults(tmp_path):
    """`python train.py` as a new user runs it: tiny target, demo data, defaults. Held-out acceptance
    must rise."""
    t0 = time.time()
    train(tmp_path)
    evals = train_log(tmp_path, "eval")
    print(f"python train.py: {time.time() - t0:.0f} s, held-out accept {evals[0]['accept']:.3f} -> "
          f"{evals[-1]['accept']:.3f}, loss {evals[0]['loss']:.3f} -> {evals[-1]['loss']:.3f}")
    assert evals[0]["accept"] < 1.05 and evals[-1]["accept"] > 1.12, [e["accept"] for e in evals]
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.5
    # the ETA's arithmetic: the steps left at the mean time of a step since the first (which
    # compiled), evals and saves included
    lines, steps = train_log(tmp_path), train_log(tmp_path, "end")[0]["step"]
    assert lines[-1]["step"] == steps and lines[-1]["eta_s"] == 0
    for r in lines:
        assert r["s_per_step"] > 0 and r["eta_s"] == round((steps - r["step"]) * r["s_per_step"], 2)
    # the z-lab export reproduces the trained drafter (fp32 master weights rounded to bf16, as exported)
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    trained = Drafter(DrafterConfig(**ck["drafter_config"]))
    trained.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in ck["drafter"].items()})
    exported = Drafter.from_pretrained(str(tmp_path / "drafter"))
    tgt = tiny_target()
    ids = torch.randint(1, 500, (40,))
    feats = tgt.features(ids, torch.tensor([0, 40]), trained.config.target_layer_ids)
    args = (feats[:30], torch.arange(30), ids[30], torch.tensor(30), tgt.embed_tokens.weight,
            tgt.lm_head.weight)
    assert torch.equal(trained.propose(*args)[1], exported.propose(*args)[1])


@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_pairs_gloo(tmp_path, nproc):
    """One pair (2 processes) and two pairs (4): targets stream features to drafters, drafters
    all-reduce."""
    flags = ["--max-steps", "6", "--log-interval", "3", "--eval-interval", "3"]
    out = train(tmp_path, *flags, nproc=nproc, port=29500 + nproc)
    assert f"{nproc // 2} pair(s)" in out and max_abs_diff(out) == 0.0, out[-2000:]
    log = train_log(tmp_path)
    assert len(log) == 2 and all(math.isfinite(r["loss"]) for r in log)
    assert len(log[-1]["mem_gib"]) == nproc                             # every rank reported
    assert all(r["graphs"] == 1 for r in log), [r["graphs"] for r in log]   # one graph: train and eval


def test_resume_continues_exactly(tmp_path):
    """8 steps straight == 4 steps, a stop (killed after its step-4 checkpoint), --resume with no flag
    repeated (the run's own flags), 4 more."""
    flags = ["--max-steps", "8", "--log-interval", "1", "--eval-interval", "1000",
             "--save-interval", "4"]
    train(tmp_path / "a", *flags)
    b = tmp_path / "b"
    p = start(b, *flags)
    for line in p.stdout:
        if "step 4: saved" in line:
            break
    p.kill()
    p.wait()
    assert p.returncode == -signal.SIGKILL       # killed before its end
    resumed = train(b, "--resume")
    assert printed_steps(resumed) == [5, 6, 7, 8]  # it continued from the step-4 checkpoint
    assert "changed: nothing" in resumed, resumed[-2000:]
    a_loss, b_loss = losses(tmp_path / "a"), losses(b)
    for s in (5, 6, 7, 8):
        assert abs(a_loss[s] - b_loss[s]) < 1e-5, (s, a_loss[s], b_loss[s])


def curve(out):
    """Every train and eval record's loss, acceptance and grad norm, by (kind, step); the last wins."""
    with open(os.path.join(out, "log.jsonl")) as f:
        return {(r["kind"], r["step"]): (r["loss"], r["accept"], r.get("gnorm"))
                for r in map(json.loads, f) if r["kind"] in ("train", "eval")}


@pytest.mark.parametrize("objective", [[], ["--objective", "tv", "--objective-temperature", "0.8"]],
                         ids=["ce", "tv"])
def test_pair_trains_what_one_process_trains(tmp_path, objective):
    """One pair (the target rank streams features to the drafter rank) trains what one process
    trains: the same losses, acceptance and grad norms, exactly, over 8 steps and 2 evals; with an
    objective on the target's distribution too (its final hidden state travels with the taps), whose
    eval logs the expected accepted lengths under sampling."""
    flags = ["--max-steps", "8", "--log-interval", "1", "--eval-interval", "4", *objective]
    text = train(tmp_path / "pair", *flags, nproc=2, port=29547 + bool(objective))
    train(tmp_path / "one", *flags)
    assert curve(tmp_path / "pair") == curve(tmp_path / "one") and len(curve(tmp_path / "one")) == 11
    evals = [{r["step"]: r.get("sampled_accept") for r in train_log(tmp_path / k, "eval")} for k in ("pair", "one")]
    assert evals[0] == evals[1] and all((v is not None) == bool(objective) for v in evals[0].values())
    assert ("layers 0..7 loaded and norm" in text) == bool(objective)   # all 8 of the tiny target


# ==================================================================================================
# the Target interface (target.py's top): a second target written only against it trains



def test_target_interface(tmp_path):
    """A plain Llama-style target (testdata/llama_target.py, written only against the Target interface at the top of
    target.py) equals transformers' LlamaForCausalLM layer by layer, in its logits and its greedy decode, and
    trains on the demo its own tiny preset makes: one process and one pair over gloo give the same curve."""
    from transformers import LlamaConfig, LlamaForCausalLM
    fork = fork_trainer(tmp_path / "fork", os.path.join(HERE, "testdata", "llama_target.py"))  # no Qwen file
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=16, tie_word_embeddings=False)).eval()
    hf.save_pretrained(tmp_path / "llama")
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from target import Target; "
            "t = Target.from_pretrained(sys.argv[2], dtype=torch.float32); ids = torch.load(sys.argv[3]); "
            "cu = torch.tensor([0, 20, 50]); torch.save((t.features(ids, cu, [0, 2, 4]), t.logits(ids, cu), "
            "t.greedy([ids[:20], ids[20:]], 8)), sys.argv[4])")
    ids = torch.randint(0, 512, (50,))
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run([sys.executable, "-c", code, fork, tmp_path / "llama", tmp_path / "ids.pt",
                    tmp_path / "feats.pt"], check=True)
    ours, logits, seqs = torch.load(tmp_path / "feats.pt")
    with torch.no_grad():      # each packed document on its own; greedy: each prompt decoded alone
        for row, (s, e) in enumerate(((0, 20), (20, 50))):
            out = hf(ids[None, s:e], output_hidden_states=True)
            for j, layer in enumerate((0, 2, 4)):
                torch.testing.assert_close(ours.view(50, 3, 64)[s:e, j], out.hidden_states[layer + 1][0],
                                           rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(logits[s:e], out.logits[0], rtol=1e-4, atol=1e-5)
            seq = ids[s:e]
            for _ in range(8):
                seq = torch.cat([seq, hf(seq[None]).logits[0, -1:].argmax(-1)])
            assert torch.equal(seqs[row, :e - s + 8], seq)
    # no --data: the fork's own demo, which its target.py's tiny preset makes
    flags = ["--target", tmp_path / "llama", "--max-steps", 6, "--log-interval", 1, "--eval-interval", 3]
    for name, kw in (("one", {}), ("pair", dict(nproc=2, port=29561))):
        script = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                  "--master_addr=127.0.0.1", "--master_port=29561"] if kw else [sys.executable]
        r = subprocess.run([*script, fork / "train.py", "--out", tmp_path / name, *map(str, flags)],
                           cwd=fork, env=clean_env(), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "target: " + str(tmp_path / "llama") + " (6 layers, hidden 64, vocab 512)" in r.stdout
    assert curve(tmp_path / "one") == curve(tmp_path / "pair") and len(curve(tmp_path / "one")) == 9


def test_fork_runs_every_command(tmp_path):
    """With testdata/llama_target.py as target.py (no Qwen file), every command runs on the Target interface
    alone: the product modules import (quality.py trains a Qwen3.5 target itself: Qwen-only); train.py with no
    --data trains on a demo its own tiny preset made (not the Qwen demo the checkout held), with an objective on
    the target's distribution (its features(final=True)); bench.py says in one line that it needs a GPU;
    generate.py decodes the export with speculative == greedy."""
    fork = fork_trainer(tmp_path / "fork", os.path.join(HERE, "testdata", "llama_target.py"))
    shutil.copytree(demo_data(), fork / "data" / "demo")     # the Qwen target's demo: made anew
    run = lambda *cmd: subprocess.run([sys.executable, *map(str, cmd)], cwd=fork, env=clean_env(),
                                      capture_output=True, text=True, timeout=900)
    r = run("-c", "import checkpoint, checks, data, dflash2, generate, layers, model, plot, prepare, regenerate, "
                  "speedups")
    assert r.returncode == 0, r.stderr[-3000:]
    r = run("train.py", "--out", tmp_path / "out", "--max-steps", 3, "--eval-interval", 1000, "--objective", "tv")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"demo: wrote {fork / 'data' / 'demo'}/train: 384 samples" in r.stdout
    r = run("bench.py", "drafter")
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stdout == "" and r.stderr == "error: bench.py needs a CUDA GPU (it checks and times GPU kernels)\n", r.stderr
    r = run("generate.py", "--drafter", tmp_path / "out" / "drafter", "--num-prompts", 2, "--max-new-tokens", 16)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "speculative == greedy on 2/2 prompts" in r.stdout, r.stdout[-3000:]


# ==================================================================================================
# faults: bad flags and files, non-finite loss, killed rank, crash mid-save, broken cache, two nodes

def test_start_checks(tmp_path):
    """Each mismatch is caught at start with one line that names the flag or file."""
    demo = demo_data()
    big = tmp_path / "bigvocab"
    sample = (np.arange(600, dtype=np.uint32), np.ones(600, np.uint8))
    write_dataset(str(big / "train"), [sample], vocab_size=1000)
    fails = lambda name, *flags, **kw: train(tmp_path / name, *flags, ok=False, **kw)
    assert "was prepared for a vocab of 1000 (largest token id 599), past the target's 512" in fails(
        "o1", "--data", big)
    assert "--mask-token-id 99999 is not a row of the target's embedding" in fails(
        "o2", "--mask-token-id", "99999")
    assert "--row-anchors 200 is too many for --budget 128: at most 127, one per position" in fails(
        "o3", "--row-anchors", "200")
    assert "--budget 16 must hold at least two blocks" in fails("o4", "--budget", "16")
    # a drafter on taps [1, 5], not the default [1, 3, 5]
    other = Drafter(DrafterConfig.from_target(TargetConfig.preset("tiny"), n_feat=2))
    other.save_pretrained(str(tmp_path / "other"))
    assert "does not match the target" in fails("o5", "--init-drafter", tmp_path / "other")
    # blocks of 8 under --block-size 16; another mask token than --mask-token-id asks for
    eight = Drafter(DrafterConfig.from_target(TargetConfig.preset("tiny"), block_size=8))
    eight.save_pretrained(str(tmp_path / "eight"))
    assert "block 8, mask token" in fails("o5b", "--init-drafter", tmp_path / "eight")
    assert "--mask-token-id 7, vocab" in fails("o5c", "--init-drafter", tmp_path / "eight", "--block-size", "8",
                                               "--mask-token-id", "7")
    assert "DFlash pairs need an even number" in fails("o6", "--data", demo, nproc=3, port=29531)


def test_bad_checkpoint_and_nonfinite(tmp_path):
    """A truncated or foreign ckpt.pt is named in the error; a run whose loss goes non-finite skips those
    updates on device, logs them with step and row, and stops with a message when they repeat."""
    out = tmp_path / "o"
    train(out, "--max-steps", "2", "--log-interval", "1", "--save-interval", "2")
    good = (out / "ckpt.pt").read_bytes()
    (out / "ckpt.pt").write_bytes(good[: len(good) // 2])
    bad = f"{out / 'ckpt.pt'} is not a readable checkpoint"
    assert bad in train(out, "--max-steps", "4", "--resume", ok=False)
    torch.save({"model": {}}, out / "ckpt.pt")
    assert bad in train(out, "--max-steps", "4", "--resume", ok=False)
    flags = ["--max-steps", "40", "--log-interval", "10", "--lr", "1e30"]
    msg = train(tmp_path / "nan", *flags, ok=False)
    assert "non-finite loss or grad norm, update skipped at (step, epoch, row)" in msg, msg[-3000:]
    assert "stopping" in msg, msg[-3000:]


def test_nonfinite_skipped_whatever_the_optimizer(tmp_path):
    """A fork that swaps AdamW for SGD with momentum (no found_inf) and gets one infinite gradient at its
    third update: that update is skipped and logged, the run ends with finite weights, and the curve
    before it is the unedited SGD fork's."""
    curves = {}
    for name, inject in (("clean", False), ("inf", True)):
        fork = fork_trainer(tmp_path / name)
        src = (fork / "train.py").read_text()
        swap = ("opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=True)",
                "opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)")
        hit = ('    out["loss"].backward()\n',
               '    out["loss"].backward()\n    calls.append(1)\n    if len(calls) == 3:\n'
               '        params[0].grad.view(-1)[0] = float("inf")\n')
        assert swap[0] in src and hit[0] in src
        src = src.replace(*swap).replace("def update(", "calls = []\n\ndef update(")
        (fork / "train.py").write_text(src.replace(*hit) if inject else src)
        flags = ["--out", fork / "o", "--max-steps", 6, "--log-interval", 2, "--eval-interval", 1000, "--lr",
                 0.05, "--data", demo_data()]
        r = subprocess.run([sys.executable, fork / "train.py", *map(str, flags)],
                           cwd=fork, env=clean_env(), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        curves[name] = losses(fork / "o")
    assert [r["rows"] for r in train_log(tmp_path / "inf" / "o", "nonfinite")] == [[[3, 0, 2]]]
    assert curves["inf"][2] == curves["clean"][2]                    # the steps before it alike
    assert all(math.isfinite(v) for v in curves["inf"].values()) and curves["inf"][6] != curves["clean"][6]
    weights = torch.load(tmp_path / "inf" / "o" / "ckpt.pt", weights_only=False)["drafter"]
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_eval_under_no_grad(tmp_path):
    """A fork that evaluates under torch.no_grad() (the habit) runs train.py's one compiled graph: no
    recompile (an error once warm), the same records as the unedited trainer."""
    fork = fork_trainer(tmp_path / "fork")
    src = (fork / "train.py").read_text()
    habit = ('        out, wanted = step_fn(feats, unpack_row(packed))\n',
             '        with torch.no_grad():\n            out, wanted = step_fn(feats, unpack_row(packed))\n')
    assert src.count(habit[0]) == 1 and 'kind == "eval"' in src.split(habit[0])[0][-200:]
    (fork / "train.py").write_text(src.replace(*habit))
    flags = ["--max-steps", 4, "--log-interval", 2, "--eval-interval", 2, "--data", demo_data()]
    for name, script in (("habit", fork / "train.py"), ("plain", os.path.join(HERE, "train.py"))):
        r = subprocess.run([sys.executable, script, "--out", tmp_path / name, *map(str, flags)], cwd=fork,
                           env=clean_env(), capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert curve(tmp_path / "habit") == curve(tmp_path / "plain") and len(train_log(tmp_path / "habit", "eval")) == 3
    assert all(r["graphs"] == 1 for r in train_log(tmp_path / "habit"))


def drafter_pids(out):
    """The pids of the local-rank-1 (drafter) processes of a torchrun job of train.py --out OUT."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().split("\0")
            with open(f"/proc/{pid}/environ") as f:
                env = f.read().split("\0")
        except OSError:
            continue
        worker = "--out" in cmd and out in cmd and "torch.distributed.run" not in " ".join(cmd)
        if worker and "LOCAL_RANK=1" in env:
            pids.append(int(pid))
    return pids


def test_killed_rank_stops_job_and_resume_continues(tmp_path):
    """SIGKILL the drafter mid-run: the whole torchrun job exits within seconds (not a collective
    timeout), the last checkpoint is intact, and --resume continues the same loss curve."""
    flags = ["--data", demo_data(), "--max-steps", "40", "--log-interval", "1",
             "--eval-interval", "1000", "--save-interval", "10"]
    train(tmp_path / "a", *flags)
    b = tmp_path / "b"
    p = start(b, *flags, nproc=2, port=29533)
    for line in p.stdout:
        if line.startswith("step 13/"):
            break
    drafter = drafter_pids(str(b))
    assert len(drafter) == 1, drafter
    t0 = time.time()
    os.kill(drafter[0], signal.SIGKILL)
    rest = p.communicate(timeout=120)[0]
    assert p.returncode != 0 and time.time() - t0 < 60, (p.returncode, time.time() - t0)
    assert "--resume" in rest, rest[-2000:]                   # the survivor says how to continue
    resumed = train(b, *flags, "--resume", nproc=2, port=29534)
    assert printed_steps(resumed) == list(range(11, 41))     # from the step-10 checkpoint
    # the log: the killed run's lines (up to step 13 or later), then the resumed run's
    steps = [r["step"] for r in train_log(b)]
    killed = len(steps) - 30
    assert killed >= 13 and steps == list(range(1, killed + 1)) + list(range(11, 41)), steps
    a_loss, b_loss = losses(tmp_path / "a"), losses(b)
    for s in range(1, 41):
        assert abs(a_loss[s] - b_loss[s]) < 1e-4, (s, a_loss[s], b_loss[s])


def test_sigterm_hint_reaches_stderr_while_an_excepthook_holds_it():
    """The survivor's SIGTERM message above, when the SIGTERM lands while torch.distributed's
    excepthook has swapped sys.stderr for a StringIO (it formats the peer's gloo error there): the
    flaky case, made certain here by holding the swap. Printed to sys.stderr it was lost."""
    code = ("import io, os, signal, sys; import checks; checks.explain_stops(0, 'OUT', ['t', 'i']); "
            "sys.stderr = io.StringIO(); os.kill(os.getpid(), signal.SIGTERM)")
    p = subprocess.run([sys.executable, "-c", code], cwd=HERE, capture_output=True, text=True, timeout=60)
    assert p.returncode == 143 and "stopping on SIGTERM" in p.stderr and "--resume --out OUT" in p.stderr, p


def test_multinode_gloo_and_caches(tmp_path):
    """torchrun --nnodes=2 --nproc_per_node=2 on loopback: each pair stays in its node, both drafters
    end identical; every rank has its own cache dirs; --fresh-cache empties them."""
    cache = tmp_path / "cache"
    marker = cache / "rank0" / "triton" / "stale"
    marker.parent.mkdir(parents=True)
    marker.write_text("x")
    flags = ["--data", demo_data(), "--max-steps", "4", "--log-interval", "2", "--eval-interval", "2",
             "--cache-dir", cache, "--fresh-cache"]
    node = lambda n: start(tmp_path / "o", *flags, nproc=2, nnodes=2, node_rank=n, port=29535)
    procs = [node(0), node(1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs[0][-2000:] + outs[1][-2000:]
    out = outs[0]   # the first drafter, rank 1 on node 0, prints the banner and the end check
    assert "2 pair(s)" in out and max_abs_diff(out) == 0.0
    # the banner's "  rank R: ROLE pair P on DEVICE | caches TRITON INDUCTOR" lines
    ranks = re.findall(r"^  rank (\d): (\w+) +pair (\d) on cpu \| caches (\S+) (\S+)$", out, re.M)
    want = [(str(r), role, str(r // 2), f"{cache}/rank{r}/triton", f"{cache}/rank{r}/inductor")
            for r, role in enumerate(["target", "drafter"] * 2)]
    assert ranks == want, ranks
    assert not marker.exists()
    log = train_log(tmp_path / "o")
    assert [r["step"] for r in log] == [2, 4] and all(len(r["mem_gib"]) == 4 for r in log)


def test_crash_while_writing_checkpoint(tmp_path):
    """A process that dies in the middle of writing ckpt.pt (here: killed by the file-size limit,
    SIGXFSZ, once the file passes 1.5 MB) leaves the previous checkpoint whole: the next --resume
    starts from it."""
    flags = ["--log-interval", "1", "--eval-interval", "1000", "--save-interval", "2"]
    train(tmp_path, "--max-steps", "2", *flags)                       # a good checkpoint at step 2
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 2
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 19, 3 << 19))
    train(tmp_path, "--max-steps", "4", *flags, "--resume", ok=False, popen_kw=dict(preexec_fn=limit))
    assert os.path.getsize(tmp_path / "ckpt.pt") > 3 << 19           # it died writing the step-4 one
    assert torch.load(tmp_path / "ckpt.pt", weights_only=False)["step"] == 2
    resumed = train(tmp_path, "--max-steps", "4", *flags, "--resume")
    assert printed_steps(resumed) == [3, 4]
    assert [r["step"] for r in train_log(tmp_path)][-2:] == [3, 4]


def test_broken_cache_gives_advice_and_fresh_cache_fixes_it(tmp_path):
    """A cache that can't be used (here the inductor cache path is a stray file) stops the run with
    the rank's cache dirs and the --fresh-cache advice; --fresh-cache then runs."""
    cache = tmp_path / "cache"
    (cache / "rank0").mkdir(parents=True)
    (cache / "rank0" / "inductor").write_text("not a directory")
    flags = ["--max-steps", "2", "--log-interval", "1", "--cache-dir", cache]
    msg = train(tmp_path / "o", *flags, ok=False)
    assert "rerun with --fresh-cache" in msg and str(cache / "rank0" / "inductor") in msg, msg[-3000:]
    train(tmp_path / "o", *flags, "--fresh-cache")


# ==================================================================================================
# drafter layouts: the published z-lab config in and out through train.py --init-drafter, errors at start

NOT_WRITTEN = {"auto_map", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version"}  # informational


def test_published_config_trains_and_exports_unchanged(tmp_path):
    src = tmp_path / "published"
    cfg = write_published_tiny(src, YARN)
    r = run_apart(train_cmd(tmp_path / "out", "--init-drafter", src, "--max-steps", "2", "--log-interval", "1",
                            "--eval-interval", "1000", "--budget", "128"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "drafter layout: 1 x full_attention + 4 x sliding_attention (window 48)" in r.stdout, r.stdout
    assert "self-check: skipped (CPU" in r.stdout
    with open(tmp_path / "out" / "drafter" / "config.json") as f:
        out = json.load(f)
    assert set(cfg) - set(out) == NOT_WRITTEN and set(out) - set(cfg) == {"torch_dtype"}
    for k in set(cfg) - NOT_WRITTEN:
        if k != "dflash_config":
            assert out[k] == cfg[k], k
    assert {**out["dflash_config"], "block_size": 16} == {**cfg["dflash_config"], "block_size": 16}
    keys = []
    for p in (src, tmp_path / "out" / "drafter"):
        with safe_open(str(p / "model.safetensors"), "pt") as f:
            keys.append(set(f.keys()))
    assert keys[0] == keys[1]
    # trained (weights moved), and the export loads as the same layout, in transformers too
    a, b = Drafter.from_pretrained(str(src)), Drafter.from_pretrained(str(tmp_path / "out" / "drafter"))
    assert a.config == b.config and any(not torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    hf = Qwen3Config.from_pretrained(str(tmp_path / "out" / "drafter"))
    assert hf.layer_types == cfg["layer_types"] and hf.sliding_window == 48
    assert hf.rope_parameters["rope_type"] == "yarn" and hf.rope_parameters["factor"] == 4.0


def test_init_drafter_errors_at_start(tmp_path):
    # train.py: one line, naming the file and the field, before anything runs
    for i, (fields, msg) in enumerate(BAD_LAYOUTS[:2]):
        path = tmp_path / f"d{i}"
        write_published_tiny(path, None)
        edit_config(path, lambda j: j.update(fields))
        r = run_apart(train_cmd(tmp_path / f"o{i}", "--init-drafter", path, "--max-steps", "1"))
        line = one_line_error(r)
        assert line.startswith(f"error: --init-drafter {path}: {path / 'config.json'}: ") and msg in line
    good = tmp_path / "good"
    write_published_tiny(good, None)
    r = run_apart(train_cmd(tmp_path / "o3", "--init-drafter", good, "--sliding-window", "0"))
    assert r.returncode != 0 and "drop --sliding-window" in r.stderr.strip().splitlines()[-1], r.stderr
    r = run_apart(train_cmd(tmp_path / "o4", "--sliding-window", "-3"))
    assert r.returncode != 0 and r.stderr.strip() == "error: --sliding-window -3: sliding window -3: tokens, or 0 " \
                                                       "for all full attention", r.stderr


# ==================================================================================================
# generate.py's command line on a short train.py run's export

@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """A short train.py run; its exported drafter is what the CLI test loads."""
    out = tmp_path_factory.mktemp("generated")
    train(out, "--max-steps", 4, "--no-compile", "--eval-interval", 1000)
    return out


def test_generate_cli(generated, tmp_path):
    drafter = generated / "drafter"
    r = run_apart(generate_cmd("--drafter", drafter, "--num-prompts", 2, "--max-new-tokens", 16))
    assert r.returncode == 0, r.stderr
    assert "speculative == greedy on 2/2 prompts" in r.stdout and r.stdout.count("identical to greedy") == 2
    r = run_apart(generate_cmd("--drafter", tmp_path))
    assert r.returncode != 0 and "error: --drafter" in r.stderr and "no config.json" in r.stderr
    r = run_apart(generate_cmd("--drafter", drafter, "--prompts", tmp_path / "x.jsonl"))
    assert r.returncode != 0 and "--prompts needs --tokenizer" in r.stderr
    r = run_apart(generate_cmd("--drafter", drafter, "--data", tmp_path))
    assert r.returncode != 0 and "has no val/ split" in r.stderr
    r = run_apart(generate_cmd("--drafter", drafter, "--target", "qwen3.6-27b"))
    assert r.returncode != 0 and "does not fit --target qwen3.6-27b: hidden size 64" in r.stderr

def test_bad_target_checkpoint_is_one_line(tmp_path):
    """A --target checkpoint whose config.json asks for math the target does not implement, or whose
    tensors do not fit it, stops the run at start with one line naming the file and the field/tensor."""
    demo = demo_data()
    sd = tiny_target().state_dict()
    del sd["layers.1.mlp.up_proj.weight"]
    ckpt = tmp_path / "ckpt"
    write_text_only(str(ckpt), TargetConfig.preset("tiny"), sd)      # its config.json: attention_bias false
    missing = "tensor model.layers.1.mlp.up_proj.weight (for layers.1.mlp.up_proj.weight) is missing"
    for bias, expected in [(True, f"{ckpt / 'config.json'}: attention_bias = True is not supported"),
                           (False, f"{ckpt}: {missing}")]:
        edit_config(ckpt, lambda j: j.update(attention_bias=bias))
        msg = train(tmp_path / "o", "--data", demo, "--target", ckpt, ok=False)
        assert "Traceback" not in msg, msg[-3000:]
        assert msg.strip().splitlines()[-1].startswith(f"error: --target {ckpt}: {expected}"), msg[-3000:]


# ==================================================================================================
# the road from prompts to a drafter: regenerate -> prepare -> train.py

class TinyThinker:
    """The tiny target as a thinking model behind an OpenAI-compatible server: its greedy continuation
    of the prompt the checkpoint's template renders (add_generation_prompt=True, as the engine feeds
    it), `think` tokens of thinking, then "\\n</think>\\n\\n" (how a Qwen thinking model closes its
    thoughts), then `answer` tokens. Only tokens that decode to printable ASCII on their own are
    picked (special tokens would end the turn, byte fragments would not survive the round trip
    through text), and no part starts or ends with whitespace (the template trims both). Answers are computed for all prompts at once (one packed forward per token);
    a call returns (reasoning, content) as the engine's reasoning parser splits them."""

    def __init__(self, ckpt, prompts, think=12, answer=20):
        import prepare
        self.chat, target = prepare.Chat(ckpt), tiny_target()
        tok = self.chat.tok
        text = [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]
        banned = torch.tensor([not (t.isascii() and t.isprintable()) or t.startswith("<") for t in text])
        # the template trims reasoning and content: no whitespace at either end of a part
        lead, trail = (torch.tensor([t[:1].isspace() for t in text]),
                       torch.tensor([t[-1:].isspace() for t in text]))
        close = tok.encode("\n</think>\n\n", add_special_tokens=False).ids
        docs = [self.chat.prompt({"messages": m}).tolist() for m in prompts]
        start = [len(d) for d in docs]
        for step in range(think + answer):
            if step == think:
                docs = [d + close for d in docs]
            cu = torch.tensor([0] + [len(d) for d in docs]).cumsum(0)
            logits = target.logits(torch.tensor(sum(docs, [])), cu, at=cu[1:] - 1).clone()
            logits[:, banned | (lead if step in (0, think) else False)
                   | (trail if step in (think - 1, think + answer - 1) else False)] = -float("inf")
            docs = [d + [t] for d, t in zip(docs, logits.argmax(-1).tolist())]
        # per user message: (the generated ids, reasoning, content)
        self.answers = {}
        for m, d, s in zip(prompts, docs, start):
            new = d[s:]
            self.answers[m[-1]["content"]] = (new, tok.decode(new[:think]),
                                              tok.decode(new[think + len(close):]))

    def __call__(self, msgs):
        return self.answers[msgs[-1]["content"]][1:]


def test_regenerate_prepare_train(tmp_path):
    """Prompts -> the tiny target's own thinking answers through a real HTTP server that fails 1 request
    in 5 (regenerate, killed mid-run and resumed; reasoning returned as vLLM's `reasoning` field, and
    in a second run as SGLang's `reasoning_content`: the same output) ->
    prepare with the checkpoint's Qwen3.6 template -> train.py. Every prompt is answered exactly once,
    with what the server said for it; each sample's prompt is what the engine renders and its
    supervised tokens are the answer the target generated, thinking included, plus <|im_end|>; the
    trained drafter's held-out accept beats the untrained one's."""
    import prepare
    from test_smoke import CORPUS_WORDS, QWEN36, FakeOpenAI, by_line, chat_checkpoint, write_jsonl
    ckpt = tmp_path / "ckpt"
    tok = chat_checkpoint(ckpt, QWEN36)
    rng = np.random.default_rng(0)
    prompts = [{"id": f"p{i}", "source": "test",
                "conversations": [{"from": "human", "value": " ".join(rng.choice(CORPUS_WORDS, 6))}]}
               for i in range(96)]
    thinker = TinyThinker(str(ckpt), [prepare.conversation(p) for p in prompts])
    srv = FakeOpenAI(reasoning="reasoning", fail_every=5, answer=thinker, delay=0.02)
    write_jsonl(tmp_path / "prompts.jsonl", prompts)
    out = tmp_path / "answers.jsonl"
    cmd = [sys.executable, os.path.join(HERE, "regenerate.py"), "--input", tmp_path / "prompts.jsonl",
           "--out", out, "--server", srv.urls[0], "--model", srv.model, "--concurrency", "4", "--backoff", "0.01",
           "--retries", "8", "--max-tokens", "64"]
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.time()
        while not (out.exists() and out.read_text().count("\n") >= 20) and time.time() - t0 < 120:
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
        first = by_line(out) if out.exists() else {}
        r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=600)
    finally:
        srv.close()
    assert r.returncode == 0, r.stdout + r.stderr
    # killed mid-run: the resumed run kept what the first one wrote
    assert 20 <= len(first) < 96 and f"resuming: {len(first)} lines already in" in r.stdout, r.stdout
    # the same answers when the server returns the thinking as SGLang does, in reasoning_content
    srv = FakeOpenAI(reasoning="reasoning_content", answer=thinker)
    try:
        r2 = subprocess.run(cmd[:4] + ["--out", tmp_path / "again.jsonl", "--server", srv.urls[0]] + cmd[8:]
                            + ["--limit", "8"],
                            capture_output=True, text=True, timeout=600)
    finally:
        srv.close()
    assert r2.returncode == 0, r2.stdout + r2.stderr
    print(f"regenerate: killed after {len(first)} lines, resumed: {time.time() - t0:.0f} s")
    rows = by_line(out)
    assert sorted(rows) == list(range(1, 97))                      # every prompt, exactly once
    again = by_line(tmp_path / "again.jsonl")
    assert sorted(again) == list(range(1, 9)) and all(again[i] == rows[i] for i in again)
    for i, row in rows.items():
        user, answer = row["messages"]
        assert (row["id"], row["source"], user["content"]) == (f"p{i - 1}", "test",
                                                              prompts[i - 1]["conversations"][0]["value"])
        thought, said = thinker(row["messages"][:1])               # what the server says to that prompt
        assert (answer["reasoning_content"], answer["content"]) == (thought, said)
    r = subprocess.run([sys.executable, os.path.join(HERE, "prepare.py"), "--input", out,
                        "--out", tmp_path / "data", "--tokenizer", ckpt, "--val", "16"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    chat, end = thinker.chat, tok.token_to_id("<|im_end|>")
    exact = 0
    order = [json.loads(line)["input_line"] for line in open(out)]   # prepare's --val: every 6th line
    for split, lines in (("train", [i for k, i in enumerate(order) if k % 6 != 5]),
                         ("val", [i for k, i in enumerate(order) if k % 6 == 5])):
        ds = open_dataset(tmp_path / "data" / split)
        assert len(ds) == len(lines)
        for k, i in enumerate(lines):
            ids, mask = (a.astype(np.int64) for a in ds.sample(k))
            first = int(mask.argmax())
            prompt = chat.prompt({"messages": rows[i]["messages"][:1]})
            assert ids[:first].tolist() == prompt.tolist()           # what the engine fed the target
            got = ids[first:][mask[first:] == 1].tolist()
            assert mask[first:first + len(got)].all() and got[-1] == end   # one span, closed by <|im_end|>
            text = tok.decode(got, skip_special_tokens=False)
            assert text == "{}\n</think>\n\n{}<|im_end|>".format(*thinker(rows[i]["messages"][:1]))
            # the text survives; the ids need not: a random target's greedy tokens are rarely the
            # tokenizer's own split of their text (a trained model's mostly are)
            exact += got[:-1] == thinker.answers[rows[i]["messages"][0]["content"]][0]
    train(tmp_path / "run", "--data", tmp_path / "data", "--budget", "256", "--epochs", "5",
          "--eval-interval", "50", "--log-interval", "25")
    evals = train_log(tmp_path / "run", "eval")
    print(f"regenerate -> prepare -> train: {len(rows)} prompts, answers token-exact {exact}, "
          f"held-out accept {evals[0]['accept']:.3f} -> {evals[-1]['accept']:.3f}")
    assert evals[-1]["accept"] > evals[0]["accept"] + 0.05, [e["accept"] for e in evals]


# ==================================================================================================
# nothing silently wrong: resume under changed flags, runs that learn nothing, output dirs, one-line errors

FAST = ["--no-compile", "--eval-interval", "1000", "--log-interval", "1"]


def one_line_error(r):
    """A run_apart result that failed with one line on stderr, "error: ...", and no traceback."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr[-3000:]
    assert "Traceback" not in r.stdout + r.stderr
    return lines[0]


def read_log(out):
    """OUT/log.jsonl read by README's rule: a start record of step r supersedes the earlier records of
    steps past r (a resumed run redid them); of records of one kind and step, the last one counts.
    Returns {kind: [records in step order]}."""
    latest = {}
    with open(os.path.join(out, "log.jsonl")) as f:
        for r in map(json.loads, f):
            if r["kind"] == "start":
                latest = {k: v for k, v in latest.items() if k[1] <= r["step"]}
            latest[r["kind"], r["step"]] = r
    kinds = {}
    for (kind, step), r in sorted(latest.items(), key=lambda kv: kv[0][1]):
        kinds.setdefault(kind, []).append(r)
    return kinds


def export_weights(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-step run (one process, one pair): what the resume refusals are tried on."""
    out = tmp_path_factory.mktemp("finished")
    train(out, "--max-steps", 2, *FAST)
    return out


@pytest.mark.parametrize("flags,msg", [
    (["--resume", "--budget", 256], "error: --resume: --budget 256 differs from the checkpoint's 128; "
                                    "resume with --budget 128, or start a new --out"),
    (["--resume", "--block-size", 8], "error: --resume: --block-size 8 differs from the checkpoint's 16"),
    (["--resume", "--sliding-window", 8], "error: --resume: --sliding-window 8 differs from the checkpoint's 0"),
    (["--resume", "--gamma", 5], "error: --resume: --gamma 5.0 differs from the checkpoint's 7.0"),
    (["--resume", "--data", "OTHER"], "error: --resume: the --data differs from the checkpoint's: n_samples 3 "
                                      "(checkpoint: 384)"),
    (["--resume", "--max-steps", 1], "error: --resume: the checkpoint is at step 2, past this run's 1 steps"),
    (["--resume", "--objective", "dspark"], "error: --resume: --objective dspark differs from the checkpoint's ce; "
                                            "resume with --objective ce"),
    (["--resume", "--loss", "dflash"], "error: --resume: --loss dflash differs from the checkpoint's dpace; "
                                       "resume with --loss dpace"),     # a key the new run drops
    ([], "error: --out OUT holds a run (OUT/ckpt.pt); continue it with --resume, start over with --overwrite"),
], ids=["budget", "block-size", "sliding-window", "gamma", "data", "max-steps", "objective", "loss", "no-resume"])
def test_resume_refuses_what_changes_the_run(finished, tmp_path, flags, msg):
    """A resume that would train another drafter or other rows, or a new run over a finished one:
    one line naming the flag and both values; the run's files untouched."""
    other = tmp_path / "other"
    write_dataset(str(other / "train"), [(np.arange(1, 60), np.ones(59, np.uint8))] * 3, vocab_size=512)
    flags = [other if f == "OTHER" else f for f in flags]
    before = {p: p.read_bytes() for p in (finished / "ckpt.pt", finished / "log.jsonl")}
    r = run_apart(train_cmd(finished, "--max-steps", 2, *FAST, *flags))
    assert one_line_error(r).startswith(msg.replace("OUT", str(finished)))
    assert all(p.read_bytes() == b for p, b in before.items())


def test_resume_refuses_another_pair_count(finished):
    """The data is dealt to pairs row by row: a 1-pair checkpoint resumed on 2 pairs is refused."""
    text = train(finished, "--max-steps", 4, *FAST, "--resume", nproc=4, port=29551, ok=False)
    assert ("error: --resume: 2 pair(s) differ from the checkpoint's 1: rows are dealt to pairs; resume "
            "with 1 pair(s), or start a new --out") in text, text[-3000:]
    assert torch.load(finished / "ckpt.pt", weights_only=False)["step"] == 2


def test_resume_with_safe_changes_trains_the_planned_rows(tmp_path):
    """Killed after its step-10 checkpoint, resumed with another --lr, --log-interval and process
    count (2 processes: still one pair): every step trains the row of the data plan (data.Packer
    replayed here), across an epoch boundary; the log read by README's rule is one clean run."""
    # rows of 1024 tokens: 25 per epoch; one anchor per document keeps the steps cheap
    flags = ["--budget", 1024, "--anchors", 1, "--max-steps", 30, "--save-interval", 10, *FAST]
    p = start(tmp_path, *flags)
    for line in p.stdout:
        if line.startswith("step 13/"):
            break
    p.kill()
    p.wait()
    text = train(tmp_path, *flags, "--resume", "--lr", "3e-4", "--log-interval", 2, nproc=2, port=29553)
    assert (f"resume: step 10 of {tmp_path / 'ckpt.pt'}; changed: --lr 0.0006 -> 0.0003, --log-interval "
            "1 -> 2, processes 1 -> 2") in text, text[-3000:]
    log = read_log(tmp_path)
    assert [r["step"] for r in log["start"]] == [0, 10] and log["start"][1]["changed"]["--lr"] == [6e-4, 3e-4]
    assert [r["step"] for r in log["train"]] == list(range(1, 11)) + list(range(12, 31, 2))
    packer = Packer(open_dataset(demo_data()), 1024, seed=0)
    plan = [[row.epoch, row.index] for row in (packer.next_row() for _ in range(30))]
    assert plan[-1][0] == 1                                     # the plan crosses into epoch 1
    assert [w for r in log["train"] for w in r["rows"]] == plan


def test_learns_nothing_stops_at_start(tmp_path):
    """No supervised token, or none inside --budget: one line at start. Truncation that loses more
    than 5% of the supervised tokens: a warning, and the counts in the start record."""
    tokens = np.arange(600) % 500 + 1
    past = np.zeros(600, np.uint8)
    past[300:] = 1
    cases = {"zero": ([(tokens[:99], np.zeros(99, np.uint8))] * 4, "its loss mask is all zero"),
             "past": ([(tokens, past)] * 4, "all its supervised tokens lie past --budget 128 in their samples "
                                            "(truncated); raise --budget (longest sample: 600 tokens)")}
    for name, (samples, why) in cases.items():
        write_dataset(str(tmp_path / name / "train"), samples, vocab_size=512)
        r = run_apart(train_cmd(tmp_path / f"o-{name}", "--data", tmp_path / name, *FAST))
        assert one_line_error(r).startswith(f"error: --data {tmp_path / name}: nothing to learn: {why}")
    long = [(tokens, np.ones(600, np.uint8))] + [(tokens[:50], np.ones(50, np.uint8))] * 4
    write_dataset(str(tmp_path / "long" / "train"), long, vocab_size=512)
    text = train(tmp_path / "o-long", "--data", tmp_path / "long", "--max-steps", 1, *FAST)
    assert "truncated samples per epoch: 1 (472 tokens, 472 of 800 supervised)" in text
    assert "warning: --budget 128 truncates 59.0% of the supervised tokens away" in text
    assert train_log(tmp_path / "o-long", "start")[0]["truncated"] == dict(samples=1, tokens=472, supervised=472)


def test_out_in_use_and_overwrite(finished, tmp_path):
    """A second run on an --out in use is refused, naming the lock and its holder; --overwrite starts
    over in a finished one (its old checkpoint, export and log gone first), but not with --resume."""
    out = tmp_path / "busy"
    p = start(out, "--max-steps", 100000, *FAST)
    try:
        for line in p.stdout:
            if line.startswith("start: logging to"):
                break
        r = run_apart(train_cmd(out, "--max-steps", 2, *FAST))
        assert one_line_error(r) == (f"error: --out {out} is in use: pid {p.pid} holds {out / 'lock'}; "
                                     "wait for that run to end, or pick another --out")
    finally:
        p.kill()
        p.wait()
    r = run_apart(train_cmd(finished, "--resume", "--overwrite"))      # refused before --out is touched
    assert one_line_error(r) == "error: --overwrite: not allowed with argument --resume"
    shutil.copytree(finished, tmp_path / "again")
    train(tmp_path / "again", "--max-steps", 1, *FAST, "--overwrite")
    assert [r["kind"] for r in map(json.loads, open(tmp_path / "again" / "log.jsonl"))][0] == "start"
    assert len(train_log(tmp_path / "again", "start")) == 1
    assert torch.load(tmp_path / "again" / "ckpt.pt", weights_only=False)["step"] == 1


def test_kill_during_final_export_then_resume(tmp_path):
    """SIGTERM while the final export is being written (here: its config.json blocks on a FIFO), then
    --resume: the half-written files are removed and the export equals the checkpoint's weights, at the
    same step, readable by all (0644)."""
    flags = ["--max-steps", 8, "--save-interval", 4, *FAST]
    p = start(tmp_path, *flags)
    for line in p.stdout:
        if line.startswith("step 4: saved"):
            os.mkfifo(tmp_path / "drafter" / f".tmp-{p.pid}.json")     # the step-8 export's config.json
        if line.startswith("step 8/8"):
            break
    t0 = time.time()
    while not (tmp_path / "drafter" / f".tmp-{p.pid}.safetensors").exists():
        assert time.time() - t0 < 120, "the step-8 export never started"
        time.sleep(0.05)
    time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    assert "stopping on SIGTERM" in p.communicate(timeout=60)[0] and p.returncode == 143
    resumed = train(tmp_path, *flags, "--resume")
    assert "removed 2 file(s) a stopped run left half-written" in resumed and printed_steps(resumed) == [5, 6, 7, 8]
    assert [f for f in os.listdir(tmp_path / "drafter") if f.startswith(".")] == []
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    weights, meta = export_weights(tmp_path / "drafter")
    assert ck["step"] == 8 and meta["step"] == "8"
    assert weights.keys() == ck["drafter"].keys()
    assert all(torch.equal(weights[k], v.to(torch.bfloat16)) for k, v in ck["drafter"].items())
    for f in ("model.safetensors", "config.json"):
        assert os.stat(tmp_path / "drafter" / f).st_mode & 0o777 == 0o644, f


def test_full_out_is_one_line(tmp_path):
    """A write that fails (a full disk; here the file-size limit with SIGXFSZ ignored: EFBIG) names
    the file and the errno, and leaves no half-written checkpoint."""
    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 << 19, 3 << 19))     # the export fits, ckpt.pt not
    r = subprocess.run(train_cmd(tmp_path, "--max-steps", 1, *FAST), cwd=HERE, env=clean_env(),
                       capture_output=True, text=True, timeout=900, preexec_fn=limit)
    line = one_line_error(r)
    assert line.startswith(f"error: --out {tmp_path}: cannot write {tmp_path / 'ckpt.pt'}.tmp-") and \
        "(step 1): [Errno 27] File too large; free space or fix permissions, then continue with --resume" in line
    assert sorted(os.listdir(tmp_path)) == ["drafter", "lock", "log.jsonl"]


def bad_init_drafter(tmp_path, broken):
    d = tmp_path / "d"
    Drafter(DrafterConfig.from_target(TargetConfig.preset("tiny"))).save_pretrained(str(d))
    broken(d)
    return ["--init-drafter", d]


ONE_LINE = {   # name: (flags, or a function of tmp_path giving them; what the line says)
    **{f"{flag} {v}": ([flag, v], f"error: {flag}: {v} must be {op}") for flag, v, op in [
        ("--max-steps", 0, ">= 1"), ("--epochs", 0, ">= 1"), ("--drafter-layers", 0, ">= 1"),
        ("--log-interval", 0, ">= 1"), ("--save-interval", 0, ">= 1"), ("--eval-interval", 0, ">= 1"),
        ("--block-size", 0, ">= 2"), ("--block-size", 1, ">= 2"), ("--seed", -1, ">= 0"),
        ("--lr", -1, "> 0"), ("--gamma", 0, "> 0"), ("--warmup", 2, ">= 0 and <= 1"), ("--anchors", 0, ">= 1"),
        ("--objective-temperature", 0, "> 0")]},
    "objective-temperature-ce": (["--objective-temperature", 0.6],
                                 "error: --objective-temperature: for --objective tv, accept or dspark only"),
    "n-feat": (["--n-feat", 20], "error: --n-feat 20: the target's 8 layers give taps [1, 1, 1, 2,"),
    "init-missing": (lambda t: ["--init-drafter", t / "nope"], "config.json not found"),
    "init-no-weights": (lambda t: bad_init_drafter(t, lambda d: os.remove(d / "model.safetensors")),
                        "model.safetensors not found"),
    "init-shapes": (lambda t: bad_init_drafter(
        t, lambda d: edit_config(d, lambda j: j.update(intermediate_size=99))), "does not fit"),
    "init-no-dflash": (lambda t: bad_init_drafter(t, lambda d: edit_config(d, lambda j: j.pop("dflash_config"))),
                       "no dflash_config with mask_token_id and target_layer_ids"),
    "truncated-tokens": (lambda t: ["--data", copy_demo(t, lambda d: os.truncate(d / "train" / "tokens.bin", 40))],
                         "train/tokens.bin is 40 bytes, but meta.json says"),
    "no-train-meta": (lambda t: ["--data", copy_demo(t, lambda d: os.remove(d / "train" / "meta.json"))],
                      "train/meta.json not found"),
    "out-not-a-dir": (lambda t: ["--out", (t / "file").write_text("") or t / "file" / "o"],
                      "[Errno 20] Not a directory"),
    "target-not-a-checkpoint": (lambda t: ["--target", (t / "empty").mkdir() or t / "empty"],
                                "/empty/config.json: a Hugging Face checkpoint dir holds config.json"),
}


def copy_demo(tmp_path, broken):
    shutil.copytree(demo_data(), tmp_path / "data")
    broken(tmp_path / "data")
    return tmp_path / "data"


@pytest.mark.parametrize("name", ONE_LINE)
def test_one_line_errors(tmp_path, name):
    """Each bad flag or file: exit code != 0, one line on stderr starting with "error:" and saying
    what is wrong, no traceback (and no --resume advice); checked before --out is claimed, so
    nothing is left behind."""
    flags, msg = ONE_LINE[name]
    flags = flags(tmp_path) if callable(flags) else flags
    line = one_line_error(run_apart(train_cmd(tmp_path / "out", "--max-steps", 1, *FAST, *flags)))
    assert msg in line and "--resume" not in line, line
    assert not (tmp_path / "out").exists()


def test_bad_input_reported_before_out_in_use(finished, tmp_path):
    """An --out that holds a run does not mask a bad --data: the data's error comes first."""
    line = one_line_error(run_apart(train_cmd(finished, *FAST, "--data", tmp_path / "nope")))
    assert line.startswith(f"error: --data {tmp_path / 'nope'}: ") and "meta.json" in line, line


@pytest.mark.parametrize("flags,msg", [
    (["--max-new-tokens", 0], "error: --max-new-tokens: 0 must be >= 1"),
    (["--num-prompts", 0], "error: --num-prompts: 0 must be >= 1"),
    (["--eos", "x"], "error: --eos x: comma-separated token ids"),
    (["--top-p", 0], "error: --top-p: 0 must be > 0 and <= 1"),
    (["--top-p", 1.5, "--temperature", 1], "error: --top-p: 1.5 must be > 0 and <= 1"),
    (["--top-k", -1], "error: --top-k: -1 must be >= 0"),
    (["--top-k", 20], "error: --top-p/--top-k shape speculative sampling: give --temperature > 0 too"),
])
def test_generate_one_line_errors(flags, msg):
    assert one_line_error(run_apart(generate_cmd("--drafter", "out/drafter", *flags))).startswith(msg)


# ==================================================================================================
# watching a run: --wandb, plot.py, --help

def test_wandb_and_plot(tmp_path):
    """--wandb PROJECT (offline) writes a W&B run holding every train and eval record's numbers; plot.py
    draws the run's curves from its log.jsonl into a PNG; the first compile is announced before it."""
    pytest.importorskip("wandb")   # .ci/run installs it
    env = {**clean_env(), "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"}
    cmd = train_cmd(tmp_path / "o", "--max-steps", 4, "--log-interval", 2, "--eval-interval", 2, "--wandb",
                    "dflash-test")
    r = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert lines.index(next(ln for ln in lines if ln.startswith("compiling the drafter step"))) < lines.index(
        next(ln for ln in lines if "first step done" in ln))
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    from wandb.proto import wandb_internal_pb2
    # the run file: a 7-byte header, then protobuf Records in LevelDB's log format (32 KiB blocks, a
    # 7-byte header per fragment: crc, length, type 1 full / 2 first / 3 middle / 4 last)
    buf, pos, part, history = next(run.glob("*.wandb")).read_bytes(), 7, b"", []
    while pos + 7 <= len(buf):
        if 32768 - pos % 32768 < 7:
            pos += 32768 - pos % 32768
            continue
        n, kind = int.from_bytes(buf[pos + 4:pos + 6], "little"), buf[pos + 6]
        part, pos = part + buf[pos + 7:pos + 7 + n], pos + 7 + n
        if kind not in (1, 4):
            continue
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(part)
        part = b""
        if rec.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    log = [r for r in map(json.loads, open(tmp_path / "o" / "log.jsonl")) if r["kind"] in ("train", "eval")]
    assert len(history) == 3 and [h["_step"] for h in history] == [0, 2, 4]    # evals 0, 2, 4; trains 2, 4
    for rec in log:
        h = next(h for h in history if h["_step"] == rec["step"])
        assert h[f"{rec['kind']}/loss"] == pytest.approx(rec["loss"]) and h[f"{rec['kind']}/accept"] == pytest.approx(
            rec["accept"])
    pytest.importorskip("matplotlib")
    r = subprocess.run([sys.executable, os.path.join(HERE, "plot.py"), tmp_path / "o"], capture_output=True,
                       text=True, timeout=300)
    png = tmp_path / "o" / "curves.png"
    assert r.returncode == 0 and f"wrote {png}" in r.stdout, r.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


@pytest.mark.parametrize("cmd", ["train.py", "generate.py", "prepare.py", "regenerate.py", "quality.py", "plot.py"])
def test_help_shows_defaults(cmd):
    """Every command's --help gives each flag's default (those that have one)."""
    r = subprocess.run([sys.executable, os.path.join(HERE, cmd), "--help"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    expect = {"train.py": ["tokens per packed row, fixed (default: 128)", "(default: dpace)", "(default: 0.0006)"],
              "quality.py": ["dev and test prompts, each", "(default: 512)", "(default: test)"],
              "generate.py": ["(default: "], "prepare.py": ["(default: "], "regenerate.py": ["(default: "],
              "plot.py": ["(default: OUT/curves.png"]}[cmd]
    assert all(e in text for e in expect), text
