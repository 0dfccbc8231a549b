"""
train.py --out: one run at a time (OUT/lock), none replaced by accident, atomic saves (OUT/ckpt.pt,
the z-lab export OUT/drafter/), --resume where the run stopped, or refused in one line naming why.
"""
import argparse
import errno
import fcntl
import glob
import os
import shutil
import sys

import torch
from safetensors import SafetensorError

def claim(out, resume, overwrite, log=print):
    ckpt_path = os.path.join(out, "ckpt.pt")
    try:
        os.makedirs(out, exist_ok=True)
        claim.lock = lock = open(os.path.join(out, "lock"), "a+")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)   # the OS drops it when the process dies
    except BlockingIOError:
        lock.seek(0)
        sys.exit(f"error: --out {out} is in use: pid {lock.read().strip() or '?'} holds "
                 f"{lock.name}; wait for that run to end, or pick another --out")
    except OSError as e:    # a file system without locks (Lustre without -o flock): unguarded
        if e.errno not in (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP):
            sys.exit(f"error: --out {out}: {e}")
    lock.truncate(0), lock.write(f"{os.getpid()}\n"), lock.flush()
    if overwrite:
        for p in filter(os.path.exists, (ckpt_path, os.path.join(out, "log.jsonl"))):
            os.remove(p)
        shutil.rmtree(os.path.join(out, "drafter"), ignore_errors=True)
    elif not resume and os.path.exists(ckpt_path):
        sys.exit(f"error: --out {out} holds a run ({ckpt_path}); continue it with --resume, "
                 "start over with --overwrite, or pick another --out")
    # what a stopped run was writing (ours: .tmp-PID; safetensors' own: .tmpXXXXXX)
    stale = [p for pattern in ("ckpt.pt.tmp-*", os.path.join("drafter", ".tmp*"))
             for p in glob.glob(os.path.join(glob.escape(out), pattern))]
    for p in stale:
        os.remove(p)
    if stale:
        log(f"removed {len(stale)} file(s) a stopped run left half-written: {' '.join(stale)}")

def save(out, step, drafter, state):
    """The z-lab export, then ckpt.pt: a run stopped between the two has an export as new or newer;
    --resume redoes both. A failed write (a full disk) stops in one line, leaving no file."""
    tmp, where = os.path.join(out, f"ckpt.pt.tmp-{os.getpid()}"), os.path.join(out, "drafter")
    try:
        drafter.save_pretrained(where, step=step)
        where = tmp
        # a Python file: a failed write carries its errno (torch.save(path) says "unexpected pos")
        with open(tmp, "wb") as f:
            torch.save(dict(drafter=drafter.state_dict(), step=step, **state), f)
        os.replace(tmp, os.path.join(out, "ckpt.pt"))  # atomic: a crash mid-write keeps the old
    except (OSError, RuntimeError, SafetensorError) as e:
        err = e.__context__ if isinstance(e, RuntimeError) else e
        if not isinstance(err, (OSError, SafetensorError)):
            raise
        if os.path.exists(tmp):
            os.remove(tmp)
        sys.exit(f"error: --out {out}: cannot write {where} (step {step}): {err}; free space "
                 f"or fix permissions, then continue with --resume --out {out}")

# identity's keys an older checkpoint (or a dflash run: --loss) lacks, and the value they stand for
ABSENT = {"--loss": "dflash", "--objective": "ce"}

def identity(args, pairs, data_meta, row_anchors, dcfg, tcfg):
    """What defines a run: another value trains another drafter or other rows (rows are dealt to
    pairs), so --resume refuses it; the rest may change, reported (--max-steps: a new schedule)."""
    run = {"pairs": pairs, "--data": {k: data_meta.get(k) for k in
                                      ("n_samples", "n_tokens", "n_supervised", "vocab_size")},
           "--seed": args.seed, "--budget": args.budget, "--anchors": args.anchors,
           "--row-anchors": row_anchors, "--block-size": args.block_size, "--gamma": args.gamma,
           "--drafter-layers": dcfg.num_hidden_layers, "--n-feat": len(dcfg.target_layer_ids),
           "--sliding-window": max(dcfg.windows().values()), "--mask-token-id": dcfg.mask_token_id,
           "--objective": args.objective, "--objective-temperature": args.objective_temperature,
           "drafter config": vars(dcfg), "target config": vars(tcfg)}
    if args.loss != "dflash":      # (absent from dflash runs: their older checkpoints still resume)
        run.update({"--loss": args.loss, "--dpace-alpha": args.dpace_alpha})
    return run

def run_flags(parser, args, argv=None):
    """--resume continues the run: its checkpoint's flags, but those this command line gives."""
    try:     # mmap: reads the args, not the tensors; an unreadable file is load()'s to report
        saved = torch.load(os.path.join(args.out, "ckpt.pt"), map_location="cpu", mmap=True,
                           weights_only=False)["args"]
    except Exception:
        return
    unset = object()
    given = {k for k, v in vars(parser.parse_args(argv, argparse.Namespace(
        **dict.fromkeys(vars(args), unset)))).items() if v is not unset}
    if given & {"epochs", "max_steps"}:      # one sets the length of the run: the other goes
        given |= {"epochs", "max_steps"}
    for k in vars(args).keys() - given - {"resume", "overwrite", "out"}:
        setattr(args, k, saved.get(k, getattr(args, k)))
    if "max_steps" not in given and args.max_steps:
        args.epochs = None

def load(ckpt_path, run, device, max_steps, drafter, opt, args, world):
    """--resume from ckpt_path if this run saved it: returns (step, {what changed: [then, now]})."""
    unreadable = (f"error: {ckpt_path} is not a readable checkpoint of this run; delete it to "
                  "start over, or point --out at the right run")
    if not os.path.exists(ckpt_path):
        sys.exit(f"error: --resume but {ckpt_path} does not exist")
    try:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        was, step = ckpt["run"], ckpt["step"]
    except Exception as e:
        sys.exit(f"{unreadable} ({type(e).__name__}: {e})")
    for key in [*run, *(k for k in was if k not in run)]:   # a flag the run dropped too
        now, then = (r.get(key, ABSENT.get(key)) for r in (run, was))
        why = f"{key} {now} differs from the checkpoint's {then}; resume with {key} {then}"
        if key == "pairs":
            why = (f"{now} pair(s) differ from the checkpoint's {then}: rows are dealt to pairs; "
                   f"resume with {then} pair(s)")
        elif isinstance(now, dict):
            why = (f"the {key} differs from the checkpoint's: " + ", ".join(
                f"{k} {v} (checkpoint: {(then or {}).get(k)})" for k, v in now.items()
                if v != (then or {}).get(k)) + "; resume with the flags of its start record in "
                f"{os.path.dirname(ckpt_path)}/log.jsonl")
        if now != then:
            sys.exit(f"error: --resume: {why}, or start a new --out")
    if max_steps < step:
        sys.exit(f"error: --resume: the checkpoint is at step {step}, past this run's "
                 f"{max_steps} steps; raise --max-steps (or --epochs), or start a new --out")
    try:
        drafter.load_state_dict(ckpt["drafter"]), opt.load_state_dict(ckpt["optimizer"])
    except Exception as e:
        sys.exit(f"{unreadable} ({type(e).__name__}: {e})")
    changed = {f"--{k.replace('_', '-')}": [v, args.get(k)] for k, v in ckpt["args"].items()
               if k not in ("resume", "overwrite") and v != args.get(k)}
    if ckpt["processes"] != world:     # the same pairs: the same rows and anchors
        changed["processes"] = [ckpt["processes"], world]
    return step, changed
