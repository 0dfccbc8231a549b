"""
The drafter's training data on disk, the packer of its samples into train.py's fixed-size rows, the
demo dataset (train.py builds it on first use) and the commands' argparse helpers. The real data:
regenerate.py (the target's own answers), then prepare.py (chat template, loss mask, tokenized).

A dataset is a directory of flat arrays, memory-mapped on open so a 100 GB corpus costs no RAM:
    tokens.bin     uint32 [n_tokens]       all samples back to back (uint32: vocabs exceed 65535)
    loss_mask.bin  uint8  [n_tokens]       1 where the drafter is trained to predict that token
    offsets.bin    int64  [n_samples + 1]  sample i is tokens[offsets[i]:offsets[i+1]]
    meta.json      version, vocab bound and counts; written last: a directory with it is complete
prepare.py and the demo write DIR/train and (with a held-out split) DIR/val.
"""
import argparse
import fcntl
import importlib
import json
import os
import shutil
import time
from typing import NamedTuple

import numpy as np

VERSION = 1
REBUILD = ("rebuild it with `python prepare.py --input FILE.jsonl --out DIR --force` (the demo: "
           "delete DIR; train.py builds it again)")

class DataError(ValueError):
    """Bad data on disk or in the input. The message names the file and the fix."""

class Bad(Exception):
    """A skipped input line or a failed request: args = (kind or server, detail)."""
    def __str__(self):
        return ": ".join(self.args)

def load_line(line):
    try:
        return json.loads(line)
    except ValueError as e:
        raise Bad("malformed JSON", str(e))

def package(name, cmd):  # an optional package, imported only where needed, or how to install it
    try:
        return importlib.import_module(name)
    except ImportError:
        raise DataError(f"{cmd} needs the {name} package: pip install {name}")

class Help(argparse.RawDescriptionHelpFormatter):  # --help: docstring as written, flags' defaults
    def _get_help_string(self, action):
        d, h = action.default, action.help or ""
        unset = d is None or d is False or d == [] or d == argparse.SUPPRESS
        return h if unset or "default" in h else h + " (default: %(default)s)"

class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one line (its usage block would bury them); exit status 2."""
    def __init__(self, **kw):
        super().__init__(formatter_class=Help, **kw)

    def error(self, message):
        self.exit(2, f"error: {message.removeprefix('argument ')}\n")

def number(kind, lo, hi=float("inf"), above=False):
    """An argparse type: a `kind` (int or float) in [lo, hi], or (lo, hi] when `above`."""
    def parse(s):
        v = kind(s)
        if not ((v > lo if above else v >= lo) and v <= hi):    # NaN fails too
            raise argparse.ArgumentTypeError(f"{s} must be {'>' if above else '>='} {lo}"
                                             + (f" and <= {hi}" if hi < float("inf") else ""))
        return v
    parse.__name__ = kind.__name__      # argparse's "invalid int value: 'x'"
    return parse

def kwargs_arg(s):
    """An argparse type: --chat-template-kwargs, a JSON object."""
    try:
        v = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})")
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. "
                                         "'{\"enable_thinking\": false}'")
    return v

# -----------------------------------------------------------------------------
# writing: stream samples into DIR.tmp-<pid>, then rename to DIR in one step

class Writer:
    """A dataset being written: add(ids, mask) per sample, then commit(**meta) or abort()."""
    def __init__(self, out_dir, vocab_size=None, force=False):
        if os.path.exists(out_dir) and not force:
            raise DataError(f"{out_dir} already exists; pass --force (force=True) to overwrite it")
        self.out, self.vocab_size = out_dir, vocab_size
        self.tmp = f"{os.path.normpath(out_dir)}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)  # left by a crashed run that had our pid
        os.makedirs(self.tmp)
        # plain appends in constant memory: nothing is accumulated, whatever the dataset size
        self.f = {k: open(os.path.join(self.tmp, k), "wb")
                  for k in ("tokens.bin", "loss_mask.bin", "offsets.bin")}
        self.f["offsets.bin"].write(np.zeros(1, "<i8").tobytes())
        self.n, self.n_tokens, self.n_supervised, self.max_id = 0, 0, 0, -1

    def add(self, ids, mask):
        ids, mask, bound = np.asarray(ids), np.asarray(mask), self.vocab_size or 2**32
        if ids.ndim != 1 or ids.shape != mask.shape or len(ids) == 0:
            raise DataError(f"sample {self.n}: ids and mask must be 1-D, non-empty, "
                            f"of equal length; got shapes {ids.shape}, {mask.shape}")
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= bound:
            raise DataError(f"sample {self.n}: ids must be integers in [0, {bound}); "
                            f"got {ids.dtype} in [{ids.min()}, {ids.max()}]")
        if not ((mask == 0) | (mask == 1)).all():
            raise DataError(f"sample {self.n}: loss mask values must be 0 or 1")
        self.f["tokens.bin"].write(ids.astype("<u4").tobytes())
        self.f["loss_mask.bin"].write(mask.astype(np.uint8).tobytes())
        self.n, self.n_tokens = self.n + 1, self.n_tokens + len(ids)
        self.n_supervised += int(mask.sum())
        self.max_id = max(self.max_id, int(ids.max()))
        self.f["offsets.bin"].write(np.int64(self.n_tokens).astype("<i8").tobytes())

    def commit(self, **extra):
        for f in self.f.values():
            f.flush(), os.fsync(f.fileno()), f.close()
        if self.n == 0:
            self.abort()
            raise DataError(f"{self.out}: no samples to write")
        meta = dict(version=VERSION, vocab_size=int(self.vocab_size or self.max_id + 1),
                    n_samples=self.n, n_tokens=self.n_tokens, n_supervised=self.n_supervised,
                    max_id=self.max_id, **extra)
        with open(os.path.join(self.tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
        # --force: move the old one aside first, so there is never a half state
        old = os.path.exists(self.out) and f"{os.path.normpath(self.out)}.old-{os.getpid()}"
        if old:
            os.rename(self.out, old)
        os.rename(self.tmp, self.out)
        if old:
            shutil.rmtree(old)
        return meta

    def abort(self):
        for f in self.f.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

def write_dataset(out_dir, samples, vocab_size=None, force=False, **extra):
    """(ids, mask) arrays -> out_dir, atomically (Writer's checks, its bound); returns meta."""
    w = Writer(out_dir, vocab_size, force)
    try:
        for ids, mask in samples:
            w.add(ids, mask)
    except BaseException:  # includes KeyboardInterrupt: never leave a half-written directory behind
        w.abort()
        raise
    return w.commit(**extra)

# -----------------------------------------------------------------------------
# reading: memory-mapped and checked on open

class Dataset:
    def __init__(self, path):
        meta_path = os.path.join(path, "meta.json")
        if not os.path.isfile(meta_path):
            raise DataError(f"{meta_path} not found, so {path} is not a complete dataset; "
                            f"{REBUILD}")
        try:
            with open(meta_path) as f:
                meta = json.load(f)
            n, n_tokens, version = int(meta["n_samples"]), int(meta["n_tokens"]), meta["version"]
            self.vocab_size, self.n_supervised = int(meta["vocab_size"]), int(meta["n_supervised"])
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{meta_path} is unreadable ({e!r}); {REBUILD}")
        if version != VERSION:
            raise DataError(f"{meta_path} has format version {version}, this data.py reads "
                            f"version {VERSION}; {REBUILD}")
        if n < 1:
            raise DataError(f"{meta_path} says the dataset is empty; {REBUILD}")
        arrays = []
        for name, dtype, count in (("tokens.bin", "<u4", n_tokens),
                                   ("loss_mask.bin", "u1", n_tokens),
                                   ("offsets.bin", "<i8", n + 1)):
            p, want = os.path.join(path, name), count * np.dtype(dtype).itemsize
            size = os.path.getsize(p) if os.path.isfile(p) else None
            if size != want:
                raise DataError(f"{p} is {'missing' if size is None else f'{size} bytes'}, "
                                f"but meta.json says {count} x {dtype} = {want} bytes "
                                f"(truncated, or from another dataset); {REBUILD}")
            arrays.append(np.memmap(p, dtype, mode="r", shape=(count,)))
        self.tokens, self.loss_mask, self.offsets = arrays
        # per-sample lengths live in RAM (8 bytes a sample): the packer plans whole epochs from them
        self.lengths = np.diff(np.asarray(self.offsets))
        if self.offsets[0] != 0 or self.offsets[-1] != n_tokens or not np.all(self.lengths > 0):
            raise DataError(f"{os.path.join(path, 'offsets.bin')} must start at 0, increase "
                            f"strictly and end at n_tokens={n_tokens}; {REBUILD}")
        self.path, self.meta = path, meta

    def __len__(self):
        return len(self.lengths)

    def sample(self, i):
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.tokens[a:b], self.loss_mask[a:b]

def open_dataset(path):
    """Open a dataset directory, or the parent that prepare/demo wrote (then its train/ split)."""
    # a train/ whose meta.json is missing is named as such, not as DIR/meta.json
    if (not os.path.exists(os.path.join(path, "meta.json"))
            and os.path.isdir(os.path.join(path, "train"))):
        path = os.path.join(path, "train")
    return Dataset(path)

# -----------------------------------------------------------------------------
# packing: samples -> rows of exactly `budget` tokens, so every training step has the same shapes

class Row(NamedTuple):
    tokens: np.ndarray      # int64 [budget], padding id 0
    loss_mask: np.ndarray   # uint8 [budget], 0 on padding
    doc: np.ndarray         # int32 [budget], 0,1,2,... per packed sample; padding tail: next index
    pos: np.ndarray         # int64 [budget], position in its document (from 0; padding tail too)
    cu_seqlens: np.ndarray  # int64 [n_docs + 1], document bounds incl. padding tail; ends at budget
    samples: np.ndarray     # int64 dataset indices of the packed samples, in row order
    epoch: int
    index: int              # row in the epoch (>= the epoch's row count for a shard's filler row)

    def packed(self):
        """One int64 [5, budget] array, one upload: tokens, loss_mask, doc, pos, and where: the
        (epoch, index) of the row in its first two slots (the non-finite log names rows)."""
        where = np.zeros(len(self.tokens), np.int64)
        where[:2] = self.epoch, self.index
        return np.stack([self.tokens, self.loss_mask.astype(np.int64), self.doc.astype(np.int64),
                         self.pos, where])

class Packer:
    """Per epoch: a seeded shuffle of the samples, packed next-fit in that order into rows; row r
    goes to shard r % n_shards. The plan needs only lengths: every shard makes the same one and
    agrees on steps_per_epoch (which can differ by a row between epochs). A sample past budget keeps
    its first `budget` tokens (per epoch: truncated, truncated_tokens, truncated_supervised())."""

    def __init__(self, dataset, budget, n_shards=1, shard=0, seed=0, shuffle=True):
        assert 0 <= shard < n_shards and budget > 0, (shard, n_shards, budget)
        self.ds, self.budget, self.n_shards, self.shard = dataset, budget, n_shards, shard
        self.seed, self.shuffle, self.step, self._planned = seed, shuffle, 0, None
        self._len = np.minimum(dataset.lengths, budget)
        self.truncated = int((dataset.lengths > budget).sum())
        self.truncated_tokens = int((dataset.lengths - self._len).sum())
        self._plan(0)

    def _plan(self, epoch):  # go to `epoch` (planned unless it was the last): its rows per shard
        self.epoch = epoch
        if self._planned == epoch:
            return self.steps_per_epoch
        n = len(self.ds)
        order = (np.random.default_rng((self.seed, epoch)).permutation(n) if self.shuffle
                 else np.arange(n))
        lens, starts, used = self._len[order], [0], 0
        for c in range(0, n, 1 << 16):  # chunked: tolist() never holds millions of ints at once
            for i, l in enumerate(lens[c:c + (1 << 16)].tolist(), c):
                if used + l > self.budget:  # next-fit: the sample does not fit, so close this row
                    starts.append(i)
                    used = 0
                used += l
        starts.append(n)
        self._order, self._starts = order, np.array(starts, np.int64)
        # ceil: short shards get a filler row
        self.steps_per_epoch = -(-(len(starts) - 1) // self.n_shards)
        self._planned = epoch
        return self.steps_per_epoch

    def truncated_supervised(self):
        """Supervised tokens past `budget` in their sample, per epoch (reads only those tails)."""
        ds = self.ds
        return sum(int(ds.loss_mask[ds.offsets[i] + self.budget:ds.offsets[i + 1]].sum())
                   for i in np.flatnonzero(ds.lengths > self.budget).tolist())

    def next_row(self):
        if self.step >= self.steps_per_epoch:
            self.step = 0
            self._plan(self.epoch + 1)
        r, self.step = self.shard + self.step * self.n_shards, self.step + 1
        idx = (self._order[self._starts[r]:self._starts[r + 1]] if r + 1 < len(self._starts)
               else self._order[:0])
        budget = self.budget
        tokens, mask = np.zeros(budget, np.int64), np.zeros(budget, np.uint8)
        doc, pos, cu, p = np.empty(budget, np.int32), np.empty(budget, np.int64), [0], 0
        for d, i in enumerate(idx.tolist()):
            a, l = int(self.ds.offsets[i]), int(self._len[i])
            tokens[p:p + l], mask[p:p + l] = self.ds.tokens[a:a + l], self.ds.loss_mask[a:a + l]
            doc[p:p + l], pos[p:p + l] = d, np.arange(l)
            p += l
            cu.append(p)
        if p < budget:  # the padding tail is its own document, so no real token can attend to it
            doc[p:], pos[p:] = len(idx), np.arange(budget - p)
            cu.append(budget)
        return Row(tokens, mask, doc, pos, np.array(cu, np.int64), idx.astype(np.int64),
                   self.epoch, r)

    def seek(self, steps):
        """Go to `steps` rows from epoch 0's start (epoch lengths differ: walks each one's plan)."""
        epoch = 0
        while steps > self._plan(epoch):
            steps, epoch = steps - self.steps_per_epoch, epoch + 1
        self.step = steps

    def total_steps(self, epochs):
        """Rows per shard in `epochs` whole epochs (what --epochs means in steps)."""
        epoch, n = self.epoch, sum(self._plan(e) for e in range(epochs))
        self._plan(epoch)
        return n

# -----------------------------------------------------------------------------
# demo: the default dataset, made the DFlash way at toy scale

def make_demo(out_dir, samples=384, val_samples=32, new_tokens=48, seed=0, log=print):
    """Random prompts of 8-24 tokens (`seed`) continued greedily for new_tokens by target.py's
    `tiny` preset (every target has one), loss mask on the continuation: the target's own output,
    as DFlash trains, so the acceptance proxy is real acceptance against it. Reused if made."""
    import torch
    from target import Target, TargetConfig
    cfg = TargetConfig.preset("tiny")   # its config in the demo's identity: a swapped target.py
    want = dict(demo="tiny", samples=samples, val_samples=val_samples, new_tokens=new_tokens,
                seed=seed, target=json.loads(json.dumps(vars(cfg), default=str)))   # remakes it
    os.makedirs(os.path.dirname(os.path.abspath(out_dir)), exist_ok=True)
    with open(os.path.abspath(out_dir) + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)     # processes side by side: one builds, the rest reuse
        old = {}    # split: the demo settings that made it (not a demo's: Writer won't overwrite)
        for s in ("train", "val"):
            try:
                old[s] = open_dataset(os.path.join(out_dir, s)).meta.get("source") or {}
            except (OSError, ValueError):
                pass    # not there
        if old == {"train": want, "val": want}:
            log(f"reusing the demo in {out_dir}")
            return out_dir
        if any("demo" in v for v in old.values()):
            log(f"demo: {out_dir} was made by another target.py or other settings: making it anew")
        rng, t0 = np.random.default_rng(seed), time.time()
        model = Target.build(cfg)
        prompts = [torch.from_numpy(rng.integers(1, cfg.vocab_size, rng.integers(8, 25)))
                   for _ in range(samples + val_samples)]
        # decoded (Target.greedy) on the CPU in fp32 whatever device trains: the same demo
        # everywhere; in one thread: this small a target's ops only pay a second thread's sync
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            seqs = model.eval().greedy(prompts, new_tokens)
        finally:
            torch.set_num_threads(threads)
        rows = [(s[:len(p) + new_tokens].numpy(), np.arange(len(p) + new_tokens) >= len(p))
                for s, p in zip(seqs, prompts)]
        for split, part in (("train", rows[:samples]), ("val", rows[samples:])):
            m = write_dataset(os.path.join(out_dir, split), part, cfg.vocab_size, source=want,
                              force="demo" in old.get(split, {}))
            log(f"demo: wrote {out_dir}/{split}: {m['n_samples']} samples, {time.time() - t0:.1f}s")
        return out_dir
