"""
Training data for the drafter: the on-disk format, the commands that write it, and the packer that
turns samples into fixed-size rows for train.py.

A dataset is a directory of flat arrays, memory-mapped on open so a 100 GB corpus costs no RAM:
    tokens.bin     uint32 [n_tokens]       all samples back to back (uint32: vocabs exceed 65535)
    loss_mask.bin  uint8  [n_tokens]       1 where the drafter is trained to predict that token
    offsets.bin    int64  [n_samples + 1]  sample i is tokens[offsets[i]:offsets[i+1]]
    meta.json      version, vocab bound and counts. Written last and renamed into place with the
                   rest, so a directory that has it is complete.

Commands (python data.py <cmd> -h lists every flag):
    python data.py regenerate --input prompts.jsonl --out answers.jsonl --server localhost:30000 \\
        --model NAME     # the target's own answers, through its SGLang / vLLM server
    python data.py prepare --input answers.jsonl --tokenizer /ckpt/Qwen3.6-27B --out data/mine \\
        --chat-template-kwargs '{"enable_thinking": true}' --val 1000 --workers 16
    python data.py stats data/mine --budget 8192
    python data.py demo --out data/demo
prepare and demo write DIR/train and (with a held-out split) DIR/val. open_dataset(DIR) picks
DIR/train. A JSONL line is {"input_ids": [...], "loss_mask": [...]} (mask optional, default all
ones), or a chat: {"messages": [...], "tools": [...]} (OpenAI format; ShareGPT "conversations"
too), rendered by the checkpoint's own chat template as the serving engine renders it (class Chat),
with the loss mask on exactly the tokens the target generated.
"""
import argparse
import hashlib
import importlib
import itertools
import json
import os
import shutil
import sys
import time
from collections import Counter, deque
from datetime import datetime
from typing import NamedTuple

import numpy as np

VERSION = 1
REBUILD = ("rebuild it with `python data.py prepare --input FILE.jsonl --out DIR --force` "
           "(or `python data.py demo --out DIR --force`)")

class DataError(ValueError):
    """Bad data on disk or in the input. The message names the file and the fix."""

# the command lines of data.py, train.py and generate.py: a bad flag is one line, as every error

class ArgParser(argparse.ArgumentParser):
    """argparse whose errors are one line (its usage block would bury them); exit status 2."""
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

# -----------------------------------------------------------------------------
# writing: stream samples into DIR.tmp-<pid>, then rename to DIR in one step

class _Writer:
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
        self.n = self.n_tokens = self.n_supervised = 0
        self.max_id = -1

    def add(self, ids, mask):
        ids, mask = np.asarray(ids), np.asarray(mask)
        bound = self.vocab_size or 2**32
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
        if os.path.exists(self.out):
            old = f"{os.path.normpath(self.out)}.old-{os.getpid()}"
            os.rename(self.out, old)
            os.rename(self.tmp, self.out)
            shutil.rmtree(old)
        else:
            os.rename(self.tmp, self.out)
        return meta

    def abort(self):
        for f in self.f.values():
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

def write_dataset(out_dir, samples, vocab_size=None, force=False):
    """Write an iterable of (ids, mask) arrays to out_dir atomically; returns meta. vocab_size, when
    given, is checked against every id and recorded; otherwise the vocab bound is max id + 1."""
    w = _Writer(out_dir, vocab_size, force)
    try:
        for ids, mask in samples:
            w.add(ids, mask)
    except BaseException:  # includes KeyboardInterrupt: never leave a half-written directory behind
        w.abort()
        raise
    return w.commit()

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

class Packer:
    """Per epoch: a seeded shuffle of the samples, packed next-fit in that order into rows; row r
    goes to shard r % n_shards. The plan needs only lengths, so every shard computes the same one
    on its own and all agree on steps_per_epoch (which can differ by a row or so between epochs,
    as the order changes). A sample longer than budget keeps its first `budget` tokens:
    `truncated` and `truncated_tokens` count them per epoch, over the whole dataset, and
    truncated_supervised() the supervised tokens lost, so the trainer can warn once at start."""

    def __init__(self, dataset, budget, n_shards=1, shard=0, seed=0, shuffle=True):
        assert 0 <= shard < n_shards, f"shard {shard} must be in [0, n_shards={n_shards})"
        assert budget > 0, f"budget must be a positive number of tokens, got {budget}"
        self.ds, self.budget, self.n_shards, self.shard = dataset, budget, n_shards, shard
        self.seed, self.shuffle = seed, shuffle
        self.epoch = self.step = 0
        self._len = np.minimum(dataset.lengths, budget)
        self.truncated = int((dataset.lengths > budget).sum())
        self.truncated_tokens = int((dataset.lengths - self._len).sum())
        self._planned = None
        self._plan()

    def _plan(self):
        if self._planned == (self.epoch, self.seed):
            return
        n = len(self.ds)
        order = (np.random.default_rng((self.seed, self.epoch)).permutation(n) if self.shuffle
                 else np.arange(n))
        lens, starts, used = self._len[order], [0], 0
        # chunked, so tolist() never holds millions of Python ints at once
        for c in range(0, n, 1 << 16):
            for i, l in enumerate(lens[c:c + (1 << 16)].tolist(), c):
                if used + l > self.budget:  # next-fit: the sample does not fit, so close this row
                    starts.append(i)
                    used = 0
                used += l
        starts.append(n)
        self._order, self._starts = order, np.array(starts, np.int64)
        # ceil: short shards get a filler row
        self.steps_per_epoch = -(-(len(starts) - 1) // self.n_shards)
        self._planned = (self.epoch, self.seed)

    def truncated_supervised(self):
        """Supervised tokens past `budget` in their sample, per epoch: what truncation costs the
        loss (reads only the truncated samples' tails)."""
        ds, lost = self.ds, 0
        for i in np.flatnonzero(ds.lengths > self.budget).tolist():
            lost += int(ds.loss_mask[ds.offsets[i] + self.budget:ds.offsets[i + 1]].sum())
        return lost

    def next_row(self):
        if self.step >= self.steps_per_epoch:
            self.epoch, self.step = self.epoch + 1, 0
            self._plan()
        r = self.shard + self.step * self.n_shards
        self.step += 1
        idx = (self._order[self._starts[r]:self._starts[r + 1]] if r + 1 < len(self._starts)
               else self._order[:0])
        budget = self.budget
        tokens, mask = np.zeros(budget, np.int64), np.zeros(budget, np.uint8)
        doc, pos = np.empty(budget, np.int32), np.empty(budget, np.int64)
        cu, p = [0], 0
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
        """Go to the position after `steps` rows of this shard since the start of epoch 0 (epochs
        differ in length, so this walks the epoch plans; lengths only, no token is read)."""
        self.epoch = 0
        self._plan()
        while steps > self.steps_per_epoch:
            steps -= self.steps_per_epoch
            self.epoch += 1
            self._plan()
        self.step = steps

    def total_steps(self, epochs):
        """Rows per shard in `epochs` whole epochs (what --epochs means in steps)."""
        here, n = (self.epoch, self.step), 0
        for self.epoch in range(epochs):
            self._plan()
            n += self.steps_per_epoch
        self.epoch, self.step = here
        self._plan()
        return n

# -----------------------------------------------------------------------------
# prepare: JSONL -> DIR/train (+ DIR/val), streaming, with every bad line reported by number

class _Bad(Exception):
    """A skipped input line: args = (kind, detail)."""

def _load(line):
    try:
        return json.loads(line)
    except ValueError as e:
        raise _Bad("malformed JSON", str(e))

ROLES = ("system", "developer", "user", "assistant", "tool")
# ShareGPT speaker names -> OpenAI roles (FastChat's and SpecForge's readers accept these)
SHAREGPT_ROLES = dict(human="user", user="user", gpt="assistant", assistant="assistant",
                      chatgpt="assistant", bing="assistant", bard="assistant", model="assistant",
                      system="system", tool="tool", function="tool", observation="tool")

def conversation(obj):
    """A JSONL object -> its messages (OpenAI chat format: dicts with a role and the rest passed
    through whole: content, reasoning_content, tool_calls, ...). Accepts {"messages": [...]},
    ShareGPT {"conversations": [{"from": .., "value": ..}]} and {"prompt": str}; raises _Bad."""
    if not isinstance(obj, dict):
        raise _Bad("not a JSON object", f"got {type(obj).__name__}")
    if "messages" in obj:
        msgs = obj["messages"]
    elif "conversations" in obj:
        turns = obj["conversations"]
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise _Bad("bad conversations", 'need a list of {"from": str, "value": str}')
        unknown = {t.get("from") for t in turns} - set(SHAREGPT_ROLES)
        if unknown:
            raise _Bad("unknown role", f"ShareGPT \"from\" {sorted(map(str, unknown))}, expected "
                       f"one of {sorted(SHAREGPT_ROLES)}")
        msgs = [{"role": SHAREGPT_ROLES[t["from"]], "content": t.get("value")} for t in turns]
    elif "prompt" in obj:
        if not isinstance(obj["prompt"], str):
            raise _Bad("bad prompt", "\"prompt\" must be a string")
        msgs = [{"role": "user", "content": obj["prompt"]}]
    else:
        raise _Bad("no conversation", 'need "messages", "conversations" or "prompt"')
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs)):
        raise _Bad("bad messages", "need a non-empty list of message objects")
    for i, m in enumerate(msgs):
        if m.get("role") not in ROLES:
            raise _Bad("unknown role", f"message {i} has role {m.get('role')!r}, expected one of "
                       f"{', '.join(ROLES)}")
    # transformers' apply_chat_template drops keys whose value is None before rendering
    return [{k: v for k, v in m.items() if v is not None} for m in msgs]

# -----------------------------------------------------------------------------
# chat lines: the checkpoint's own template, rendered the way the serving engine renders it, and a
# loss mask on exactly what the target generated

def _package(name, cmd):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise DataError(f"{cmd} needs the {name} package: pip install {name}")

def _jinja_env():
    """The environment of transformers' apply_chat_template (v5.24,
    transformers/utils/chat_template_utils.py), which SGLang and vLLM render templates with."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # {% generation %}...{% endgeneration %} marks assistant text for transformers' own masks;
        # it renders its body unchanged
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            call = jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body)
            return call.set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # not jinja's own tojson, which escapes HTML characters
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env

def _template_messages(msgs):
    """Messages as the engine hands them to the template. Tool-call arguments arrive as a JSON
    string (OpenAI wire format) and templates iterate them as a mapping, so they are parsed first,
    as vLLM does (vllm/entrypoints/chat_utils.py, _postprocess_messages: an empty list of calls is
    dropped, missing or empty arguments become {}) and SGLang (serving_chat.py) does. Then the
    reasoning aliases of transformers 5.24 (_alias_reasoning_fields): the first of
    reasoning_content, thinking, reasoning is passed under reasoning_content and thinking."""
    out = []
    for i, m in enumerate(msgs):
        m = dict(m)
        calls = m.get("tool_calls")
        if m["role"] == "assistant" and isinstance(calls, list):
            m["tool_calls"] = [_parsed_call(c, i, j) for j, c in enumerate(calls)]
            if not calls:
                del m["tool_calls"]
        r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning")
                  if m.get(k) is not None), None)
        if r is not None:
            m = {"thinking": r, **m, "reasoning_content": r}
        out.append(m)
    return out

def _parsed_call(call, i, j):
    if not isinstance(call, dict):
        raise _Bad("bad tool call", f"message {i} tool call {j} is not an object")
    call = dict(call)
    fn = call  # {"function": {"name", "arguments"}}, or flat {"name", "arguments"}: both render
    if isinstance(call.get("function"), dict):
        fn = call["function"] = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str) and args.strip():
        try:
            args = json.loads(args)
        except ValueError as e:
            raise _Bad("bad tool arguments", f"message {i} tool call {j}: arguments are not "
                       f"JSON ({e})")
    fn["arguments"] = {} if args is None or args == "" else args
    return call

def _split_think(content):
    """Inline thinking (what the engines return without a reasoning parser) -> (reasoning,
    answer), split as the Qwen3 / Qwen3.5 chat templates split it: both forms render alike."""
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")

def _answer_parts(m):
    """(reasoning, [text pieces]) a rendered assistant turn must contain."""
    c = m.get("content")
    pieces = [c] if isinstance(c, str) else [p["text"] for p in c or () if isinstance(p, dict)
                                            and isinstance(p.get("text"), str)]
    r = m.get("reasoning_content")
    if not isinstance(r, str):
        r = ""
        for k, p in enumerate(pieces):
            if "</think>" in p:
                r, pieces[k] = _split_think(p)
    return r.strip(), [p.strip() for p in pieces if p.strip()]

class Chat:
    """A checkpoint's chat template and tokenizer.json, applied as a serving engine applies them:
    the template rendered in transformers' jinja environment with the tokenizer's special-token
    strings (tokenizer_config.json) and the user's --chat-template-kwargs as variables, the text
    tokenized with tokenizer.json adding no special tokens (transformers' apply_chat_template does
    tokenizer(text, add_special_tokens=False))."""

    def __init__(self, path, kwargs=None, cmd="data.py prepare --tokenizer"):
        jinja2 = _package("jinja2", cmd)
        tokenizers = _package("tokenizers", cmd)
        if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
            # older versions have sandbox escapes, and templates are code from the Hub
            raise DataError(f"{cmd} needs jinja2>=3.1.6 (have {jinja2.__version__}): "
                            "pip install -U jinja2")
        if not os.path.isdir(path):
            raise DataError(f"--tokenizer {path} is not a directory: pass the checkpoint (or "
                            "tokenizer) directory that holds tokenizer.json and the chat template")
        cfg_path = os.path.join(path, "tokenizer_config.json")
        gen_path = os.path.join(path, "generation_config.json")
        cfg, gen = ({}, {})
        for name, into in ((cfg_path, cfg), (gen_path, gen)):
            if os.path.isfile(name):
                try:
                    with open(name) as f:
                        into.update(json.load(f))
                except ValueError as e:
                    raise DataError(f"{name} is not valid JSON ({e})")
        # chat_template.jinja wins over tokenizer_config.json, as in transformers' loader
        self.source = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(self.source):
            with open(self.source) as f:
                text = f.read()
        else:
            text, self.source = cfg.get("chat_template"), cfg_path
            if isinstance(text, list):  # [{"name", "template"}, ...]: transformers uses "default"
                text = {t.get("name"): t.get("template") for t in text}.get("default")
        if not isinstance(text, str):
            raise DataError(f"{path} has no chat template: neither chat_template.jinja nor a "
                            "\"chat_template\" in tokenizer_config.json")
        tok_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise DataError(f"{path} has no tokenizer.json (the fast tokenizer file that the "
                            "chat lines are tokenized with)")
        self.path, self.kwargs = os.path.abspath(path), dict(kwargs or {})
        self.sha256 = hashlib.sha256(text.encode()).hexdigest()
        try:
            self.template = _jinja_env().from_string(text)
        except jinja2.TemplateError as e:
            raise DataError(f"{self.source}: the chat template does not compile: {e}")
        self.tok = tokenizers.Tokenizer.from_file(tok_file)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        # template variables: the named special tokens (an AddedToken is a dict with a "content"),
        # as transformers' special_tokens_map, then the user's kwargs over them
        extra = cfg.get("extra_special_tokens")
        named = {**(extra if isinstance(extra, dict) else {}),
                 **{k: v for k, v in cfg.items() if k.endswith("_token")}}
        named = {k: v["content"] if isinstance(v, dict) else v for k, v in named.items()
                 if isinstance(v, str) or isinstance(v, dict) and isinstance(v.get("content"), str)}
        self.variables = {**named, **self.kwargs}
        # end of a turn: generation_config.json's eos ids (what the engine stops at) and the
        # tokenizer's eos_token
        eos = gen.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        eos.append(self.tok.token_to_id(named.get("eos_token", "")))
        self.eos = np.array(sorted({e for e in eos if isinstance(e, int)}), np.int64)

    def render(self, msgs, tools=None, add_generation_prompt=False):
        try:
            return self.template.render(messages=msgs, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.variables)
        except Exception as e:  # raise_exception, or the template tripping over this sample
            detail = str(e).splitlines()[0] if str(e) else ""
            raise _Bad("template error", f"rendering messages[:{len(msgs)}]: "
                       f"{type(e).__name__}: {detail}")

    def encode(self, text):
        """ids [T] int64, and each token's character span [T] start, [T] end in text."""
        enc = self.tok.encode(text, add_special_tokens=False)
        off = np.asarray(enc.offsets, np.int64).reshape(-1, 2)  # [T, 2]
        return np.asarray(enc.ids, np.int64), off[:, 0], off[:, 1]

    def prompt(self, obj):
        """A JSONL object's prompt ids as the engine feeds them to the target: a trailing
        assistant message (a reference answer) dropped, the generation prompt added."""
        msgs = conversation(obj)
        if msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs:
            raise _Bad("no prompt", "the only message is an assistant answer")
        return self.encode(self.render(_template_messages(msgs), _tools(obj), True))[0]

    def samples(self, obj, turns="all"):
        """A JSONL conversation -> ([(ids, mask), ...], counts, notes). Assistant turn i is
        supervised from the end of P = render(messages[:i], add_generation_prompt=True), the
        prompt the engine gave the target, through the first end-of-turn token of
        U = render(messages[:i+1]). P must be a prefix of U, else the turn is not what serving
        produces (counted, skipped). A turn rides in the sample of the whole conversation when U is
        a prefix of it; a turn the template renders differently once later turns exist (Qwen drops
        earlier thinking) gets a sample of its own, U. turns="last": only the final assistant turn.
        Raises _Bad."""
        msgs, tools = _template_messages(conversation(obj)), _tools(obj)
        idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not idx:
            raise _Bad("no assistant turn", "nothing to train on")
        if turns == "last":
            idx = idx[-1:]
        n, notes = Counter(assistant_turns=len(idx)), []
        last = self.render(msgs[:idx[-1] + 1], tools)
        spans = {last: []}  # sample text -> [(answer start, its text's end, message index)]
        for i in reversed(idx):
            prompt = self.render(msgs[:i], tools, True)
            turn = last if i == idx[-1] else self.render(msgs[:i + 1], tools)
            if not turn.startswith(prompt):
                n["not_as_served"] += 1
                k = len(os.path.commonprefix([prompt, turn]))
                notes.append(("not as served", f"turn {i}: the generation prompt goes on "
                              f"{prompt[k:k + 20]!r} where the turn has {turn[k:k + 20]!r} (e.g. "
                              "reasoning with thinking off: check --chat-template-kwargs)"))
                continue
            text = next((t for t in spans if t.startswith(turn)), None)
            if text is None:
                text, spans[turn] = turn, []
                n["own_sample"] += 1
            spans[text].append((len(prompt), len(turn), i))
        if not any(spans.values()):
            raise _Bad("not as served", notes[0][1])
        out = [self._mask(text, sp, msgs, n, notes) for text, sp in reversed(spans.items()) if sp]
        return out, n, notes  # in conversation order

    def _mask(self, text, spans, msgs, n, notes):
        ids, a, b = self.encode(text)
        mask, eos = np.zeros(len(ids), bool), np.isin(ids, self.eos)
        for s, lim, i in spans:
            stop = np.flatnonzero((a >= s) & (b <= lim) & eos)
            e = int(b[stop[0]]) if len(stop) else lim
            inside = (a >= s) & (b <= e)
            mask |= inside
            # a token the BPE merged across the prompt's end belongs to neither: unsupervised
            n["straddle"] += int(((a < s) & (b > s)).sum())
            answer, m = text[s:e], msgs[i]
            r, pieces = _answer_parts(m)
            lost = [x for x in [r] * bool(r) + pieces if x not in answer]
            if lost:
                n["not_intact"] += 1
                notes.append(("not intact", f"turn {i}: {lost[0][:40]!r} is not in the "
                              "supervised text"))
            p = answer.find(r) if r else -1
            think = int((inside & (a >= s + p) & (a < s + p + len(r))).sum()) if p >= 0 else 0
            n["thinking_tokens"] += think
            n["answer_tokens"] += int(inside.sum()) - think
            n["length"] += m.get("finish_reason") == "length"
            n["trained"] += 1
        return ids, mask.astype(np.uint8)

def _tools(obj):
    tools = obj.get("tools")
    if tools is not None and not (isinstance(tools, list)
                                  and all(isinstance(t, dict) for t in tools)):
        raise _Bad("bad tools", '"tools" must be a list of JSON schema objects')
    return tools

def _parse(line, bound, chat, where, turns):
    """One JSONL line -> ([(ids, mask), ...], counts, notes), or _Bad(kind, detail)."""
    obj, counts, notes = _load(line), {}, []
    if isinstance(obj, dict) and "input_ids" in obj:
        # ragged or huge values make numpy raise; strings, floats and nesting are caught just below
        try:
            ids = np.asarray(obj["input_ids"])
            mask = np.asarray(obj.get("loss_mask", np.ones(ids.shape, np.uint8)))
        except (ValueError, TypeError, OverflowError) as e:
            raise _Bad("bad input_ids", str(e))
        if ids.ndim != 1 or len(ids) == 0 or ids.dtype.kind not in "iu":
            raise _Bad("bad input_ids", "must be a non-empty list of integers")
        if mask.shape != ids.shape:
            raise _Bad("loss_mask length mismatch",
                       f"{mask.size} mask values for {len(ids)} input_ids")
        if not np.isin(mask, (0, 1)).all():
            raise _Bad("bad loss_mask", "values must be 0 or 1")
        samples = [(ids, mask)]
    elif isinstance(obj, dict) and any(k in obj for k in ("messages", "conversations", "prompt")):
        if chat is None:  # a setup error, not a bad line: stop at once rather than skip every line
            raise DataError(f"{where}: a chat line needs --tokenizer DIR (the checkpoint "
                            "directory with tokenizer.json and the chat template)")
        samples, counts, notes = chat.samples(obj, turns)
    else:
        raise _Bad("neither input_ids nor messages",
                   "a line must be an object with \"input_ids\" or \"messages\"")
    for ids, mask in samples:
        if ids.min() < 0 or ids.max() >= bound:
            bad = ids[(ids < 0) | (ids >= bound)][0]
            raise _Bad("token id out of range", f"id {bad} not in [0, {bound})")
        if not mask.any():
            raise _Bad("no supervised token", "loss mask is all zero (no assistant turn?)")
    return samples, counts, notes

# --workers: each process renders with a Chat of its own, built once; the parent reads and writes
_worker = {}

def _init_worker(tokenizer, kwargs, *args):
    _worker["args"] = (Chat(tokenizer, kwargs) if tokenizer else None, *args)

def _work(chunk):
    """[(lineno, line)] -> [(lineno, _parse's result, its _Bad, or None for a blank line)]"""
    chat, bound, where, turns = _worker["args"]
    out = []
    for lineno, line in chunk:
        try:
            out.append((lineno, _parse(line, bound, chat, f"{where}:{lineno}", turns)
                        if line.strip() else None))
        except _Bad as e:
            out.append((lineno, e))
    return out

def _processed(f, workers, chat, *args):
    """_work over the lines of f, in order: one line at a time in this process, or chunks of 64 in
    a pool of `workers` holding at most 2 chunks per worker in flight, so memory stays flat."""
    lines = enumerate(f, 1)
    if workers <= 1:
        _worker["args"] = (chat, *args)
        for line in lines:
            yield from _work([line])
        return
    import multiprocessing
    chunks = iter(lambda: list(itertools.islice(lines, 64)), [])
    init = (chat and chat.path, chat and chat.kwargs, *args)
    with multiprocessing.Pool(workers, _init_worker, init) as pool:
        pending = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_work, (chunk,)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()

CHAT_COUNTS = ("assistant_turns", "trained", "own_sample", "not_as_served", "not_intact", "length",
               "straddle", "thinking_tokens", "answer_tokens")

def prepare(input, out, tokenizer=None, val=None, vocab_size=None, force=False, max_bad=0.01,
            log=print, chat_template_kwargs=None, turns="all", workers=1):
    """JSONL -> out/train and, if val (a count >= 1 or a fraction in (0, 1)) is given, out/val.
    tokenizer: a checkpoint directory (tokenizer.json + chat template) for chat lines."""
    if not os.path.isfile(input):
        raise DataError(f"input file {input} not found")
    chat = Chat(tokenizer, chat_template_kwargs) if tokenizer else None
    bound = min(v for v in (vocab_size, chat and chat.vocab_size, 2**32) if v)
    n_lines = n_val = 0
    # held-out split: spread n_val lines evenly over the file, which needs its line count first
    if val:
        with open(input, "rb") as f:
            n_lines = sum(1 for _ in f)
        n_val = round(val * n_lines) if isinstance(val, float) else val
        if not 0 < n_val < n_lines:
            raise DataError(f"--val {val} selects {n_val} of the {n_lines} lines of {input}; "
                            "need at least 1 and fewer than all")
    bad, noted, counts = Counter(), Counter(), [Counter(), Counter()]
    total = blank = 0
    t0 = last = time.time()
    writers = []
    try:
        for s in ("train", "val")[:1 + bool(n_val)]:
            writers.append(_Writer(os.path.join(out, s), vocab_size or (chat and chat.vocab_size),
                                   force))
        with open(input, "rb") as f:
            for lineno, res in _processed(f, workers, chat, bound, input, turns):
                if res is None:
                    blank += 1
                    continue
                total += 1
                if isinstance(res, _Bad):
                    kind = res.args[0]
                    bad[kind] += 1
                    if bad[kind] <= 10:
                        log(f"{input}:{lineno}: {kind}: {res.args[1]}")
                    continue
                samples, c, notes = res
                for kind, note in notes:  # turns skipped or not intact: reported, counted below
                    noted[kind] += 1
                    if noted[kind] <= 10:
                        log(f"{input}:{lineno}: {kind}: {note}")
                # line i is held out when floor(i * n_val / n_lines) steps up: exactly n_val lines
                i = lineno - 1
                held_out = n_val and (i + 1) * n_val // n_lines > i * n_val // n_lines
                counts[bool(held_out)].update(c)
                for ids, mask in samples:
                    writers[1 if held_out else 0].add(ids, mask)
                if time.time() - last > 5:
                    last, n_tok = time.time(), sum(w.n_tokens for w in writers)
                    log(f"prepare: {total - bad.total()} lines | "
                        f"{n_tok / 1e6:.2f}M tokens | {n_tok / (last - t0) / 1e6:.2f}M tokens/s")
        n_bad = bad.total()
        if blank:
            log(f"ignored {blank} blank lines")
        if n_bad:
            log(f"skipped {n_bad} of {total} lines: "
                + ", ".join(f"{c} {k}" for k, c in bad.items()))
        if total == 0:
            raise DataError(f"{input} is empty")
        if n_bad == total:
            raise DataError(f"{input}: none of its {total} lines is a valid sample (see above)")
        if n_bad > max_bad * total:
            raise DataError(f"{input}: {n_bad} of {total} lines ({n_bad / total:.1%}) are bad, "
                            f"more than --max-bad {max_bad:g}; "
                            "fix the input, or raise --max-bad to accept the loss")
        # checked before either split is committed: a lone train/ would train with no eval
        for w, s in zip(writers, ("train", "val")):
            if w.n == 0:
                raise DataError(f"{input}: every line of the {s} split is bad (see above), so "
                                f"{w.out} would be empty; fix those lines or change --val")
        metas = []
        for w, s, c in zip(writers, ("train", "val"), counts):
            extra = {}
            if chat:  # what made these tokens, so stats (and a reader) can tell
                extra["chat"] = dict(tokenizer=chat.path, template=chat.source,
                                     template_sha256=chat.sha256, kwargs=chat.kwargs, turns=turns,
                                     **{k: c[k] for k in CHAT_COUNTS})
            metas.append(w.commit(source=input, split=s, **extra))
    except BaseException:
        for w in writers:
            w.abort()
        raise
    if force and not n_val and os.path.exists(os.path.join(out, "val")):
        # a stale split from an earlier run would silently mismatch
        shutil.rmtree(os.path.join(out, "val"))
        log(f"removed the old {os.path.join(out, 'val')}")
    _summary(out, metas, t0, log)
    if chat:
        c = counts[0] + counts[1]
        log(f"chat: {c['trained']} of {c['assistant_turns']} assistant turns trained "
            f"({c['own_sample']} in a sample of their own, rendered as served), "
            f"{c['not_as_served']} not as served (skipped), {c['not_intact']} not intact, "
            f"{c['straddle']} tokens straddling a prompt's end (unsupervised)")
    stats(os.path.join(out, "train"), log=log, show=None)
    return metas

def _summary(out, metas, t0, log):
    for m, s in zip(metas, ("train", "val")):
        log(f"wrote {os.path.join(out, s)}: {m['n_samples']} samples, {m['n_tokens']} tokens "
            f"({m['n_supervised']} supervised), vocab bound {m['vocab_size']}")
    log(f"done in {time.time() - t0:.1f}s")

# -----------------------------------------------------------------------------
# stats: what the drafter will learn, before a GPU hour is spent on it

def stats(path, budget=8192, tokenizer=None, show=0, log=print):
    """Counts, length percentiles, what --budget cuts, thinking vs answer tokens; then sample `show`
    printed back as text with the supervised spans between « and » (None: no sample)."""
    ds = open_dataset(path)
    L, sup, n_tok = ds.lengths, ds.n_supervised, int(ds.meta["n_tokens"])
    log(f"{ds.path}: {len(ds)} samples, {n_tok} tokens, {sup} supervised ({sup / n_tok:.1%})")
    srt = np.sort(L)  # (np.percentile would do, but its import alone costs 2 MB of RSS)
    p50, p90, p99 = (int(srt[int(q * (len(srt) - 1))]) for q in (0.5, 0.9, 0.99))
    log(f"tokens per sample: p50 {p50}, p90 {p90}, p99 {p99}, max {srt[-1]}")
    p = Packer(ds, budget, shuffle=False)  # what train.py's --budget cuts
    cut = p.truncated_supervised()
    log(f"--budget {budget}: {p.truncated} samples ({p.truncated / len(ds):.1%}) are longer; the "
        f"cut drops {cut} supervised tokens ({cut / max(sup, 1):.1%})")
    chat = ds.meta.get("chat")
    if chat:
        t, a = chat["thinking_tokens"], chat["answer_tokens"]
        log(f"supervised: {t} thinking tokens ({t / max(t + a, 1):.1%}), {a} answer tokens; "
            f"{chat['length']} of {chat['trained']} turns cut by max tokens (finish_reason "
            f"length) | rendered with {chat['template']} (sha256 {chat['template_sha256'][:12]}), "
            f"kwargs {json.dumps(chat['kwargs'])}")
    if show is None:
        return
    if not 0 <= show < len(ds):
        raise DataError(f"--sample {show}: {ds.path} has samples 0..{len(ds) - 1}")
    ids, mask = ds.sample(show)
    tokenizer = tokenizer or (chat or {}).get("tokenizer")
    tok = None
    if tokenizer and os.path.isfile(os.path.join(tokenizer, "tokenizer.json")):
        tok = _package("tokenizers", "data.py stats").Tokenizer.from_file(
            os.path.join(tokenizer, "tokenizer.json"))
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    text = ""
    for run in np.split(np.arange(len(ids)), edges):
        piece = (tok.decode(ids[run].tolist(), skip_special_tokens=False) if tok
                 else " ".join(map(str, ids[run].tolist())))
        text += f"«{piece}»" if mask[run[0]] else piece
    log(f"sample {show}: {len(ids)} tokens, {int(mask.sum())} supervised, between « and »"
        f"{'' if tok else ' (token ids: no tokenizer; pass --tokenizer DIR)'}:\n{text}")

# -----------------------------------------------------------------------------
# demo: the default dataset, made the DFlash way at toy scale

def make_demo(out_dir, samples=384, val_samples=32, new_tokens=48, seed=0, force=False, log=print):
    """Random prompts of 8-24 tokens, each continued greedily for new_tokens by the `tiny` target
    of target.py, loss mask on the continuation: the data is the very target's own output, as
    DFlash trains, so the acceptance proxy is real acceptance against that target. The weights
    come from Target.build, which seeds each tensor by its name, so they match train.py's tiny
    target whatever the seed; `seed` picks the prompts. A directory that already holds this
    exact demo is reused, not remade."""
    want = dict(demo="tiny", samples=samples, val_samples=val_samples, new_tokens=new_tokens,
                seed=seed)
    try:
        if not force and all(open_dataset(os.path.join(out_dir, s)).meta.get("source") == want
                             for s in ("train", "val")):
            log(f"reusing the demo in {out_dir}")
            return out_dir
    except (OSError, ValueError):
        pass  # not there, or not this demo: make it (_Writer refuses to overwrite without force)
    import torch
    from target import Target, TargetConfig
    cfg = TargetConfig.preset("tiny")
    target = Target.build(cfg).eval()
    rng, n, t0 = np.random.default_rng(seed), samples + val_samples, time.time()
    prompts = [torch.from_numpy(rng.integers(1, cfg.vocab_size, rng.integers(8, 25)))
               for _ in range(n)]
    # all documents of a chunk decoded in lockstep with the target's caches (Target.greedy), on
    # the CPU in fp32 whatever device trains: the same demo everywhere, in seconds (rerunning the
    # prefix for every token took ~40 s on 2 cores, 61 s on a GPU host's CPU)
    chunk = 4096    # bounds the attention caches: ~1 KB per document and token
    # one thread: the tiny target's ops are so small that a second thread only adds sync overhead
    # (measured 2-8x slower with 2 threads on a 2-core box that has anything else running)
    writers, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for s in ("train", "val"):
            writers.append(_Writer(os.path.join(out_dir, s), cfg.vocab_size, force))
        for c in range(0, n, chunk):
            seqs = target.greedy(prompts[c:c + chunk], new_tokens)
            for j, d in enumerate(seqs, c):
                d = d[:len(prompts[j]) + new_tokens]
                writers[j >= samples].add(d.numpy(), np.arange(len(d)) >= len(prompts[j]))
            log(f"demo: {min(c + chunk, n)}/{n} samples, {time.time() - t0:.1f}s")
        _summary(out_dir, [w.commit(source=want) for w in writers], t0, log)
    except BaseException:
        for w in writers:
            w.abort()
        raise
    finally:
        torch.set_num_threads(threads)
    return out_dir

# -----------------------------------------------------------------------------
# regenerate: the target's own answers, through the serving engine that will serve it

THINK_CHECK = 8  # finished answers per server with no reasoning at all before we stop
POOL = 16        # concurrent requests per HTTP connection pool (see regenerate's client())

def _server_url(s):  # --server: host:port, http://host:port or http://host:port/v1
    s = s.rstrip("/")
    s = s if "://" in s else "http://" + s
    return s if s.endswith("/v1") else s + "/v1"

def _wire(m):
    """A message as sent back in a later request: the target's reasoning under both names
    (SGLang reads reasoning_content, vLLM >= 0.11 reads reasoning); the chat template decides
    whether it renders (Qwen3.5/3.6 drop earlier turns' thinking unless preserve_thinking)."""
    r = m.get("reasoning_content", m.get("reasoning"))
    m = {k: v for k, v in m.items() if k not in ("finish_reason", "usage")}
    return {**m, "reasoning_content": r, "reasoning": r} if r is not None else m

def _turns(obj, last):
    """A prompt line -> (the history before the first answer, the messages after it: each
    assistant one is answered again, tools); which turns: REGENERATE_DOC."""
    msgs, tools = conversation(obj), _tools(obj)
    if last or any(m["role"] == "tool" or m.get("tool_calls") for m in msgs):
        i = len(msgs) - (msgs[-1]["role"] == "assistant")
    else:
        i = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    if not any(m["role"] == "user" for m in msgs[:i]):
        raise _Bad("no user turn", "the first answer to regenerate has no user message before it")
    rest = msgs[i:] + [{"role": "assistant"}] * (msgs[-1]["role"] != "assistant")
    return msgs[:i], rest, tools

def _done_lines(out, resume, log):
    """Input line numbers already in `out`; a half-written last line (a killed run) is cut off."""
    if not os.path.exists(out) or os.path.getsize(out) == 0:
        return set()
    if not resume:
        raise DataError(f"{out} already exists; pass --resume to continue it "
                        "(or remove it to start over)")
    import re
    done, good = set(), 0
    with open(out, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break  # one write per line, so only the last can be partial
            m = re.match(rb'\{"input_line": (\d+),', line)
            if not m:
                raise DataError(f"{out}:{i}: not a line regenerate wrote (no leading "
                                '"input_line"); give another --out')
            done.add(int(m[1]))
            good += len(line)
    if good < os.path.getsize(out):
        log(f"{out}: dropped a half-written last line; its prompt is asked again")
        with open(out, "r+b") as f:
            f.truncate(good)
    return done

class _Failed(Exception):
    """A request that failed for good: args = (one line naming the server and why,)"""

def regenerate(input, out, servers, model, concurrency=64, max_tokens=4096, temperature=0.7,
               top_p=None, top_k=None, chat_template_kwargs=None, timeout=3600.0, retries=5,
               backoff=1.0, resume=False, limit=None, turns="all", log=print):
    """Prompts JSONL -> `out`: each line with its answers replaced by the target's (see main's
    help). Returns the counts; raises DataError when lines failed (then --resume retries them)."""
    openai = _package("openai", "data.py regenerate")
    tqdm = _package("tqdm", "data.py regenerate").tqdm
    import asyncio
    import httpx  # openai's own HTTP client
    import random
    import ssl
    if not os.path.isfile(input):
        raise DataError(f"input file {input} not found")
    failed_path = (out[:-len(".jsonl")] if out.endswith(".jsonl") else out) + ".failed.jsonl"
    done = _done_lines(out, resume, log)
    thinking = (chat_template_kwargs or {}).get("enable_thinking", True) is not False
    servers = list(dict.fromkeys(map(_server_url, servers)))
    n = dict(lines=0, answers=0, truncated=0, failed=0, bad=0, retries=0, tokens=0)
    # top_k and chat_template_kwargs are SGLang's / vLLM's extensions of the OpenAI request
    sampling = {k: v for k, v in dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, chat_template_kwargs=chat_template_kwargs
                                      ).items() if v is not None}

    def pending():  # (line number, line) of the input lines still to answer
        with open(input, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if limit and lineno > limit:
                    break
                if line.strip() and lineno not in done:
                    yield lineno, line
    todo = sum(1 for _ in pending())

    def jobs():  # one generator shared by all workers: the event loop runs one next() at a time
        for lineno, line in pending():
            try:
                obj = _load(line)
                job = (lineno, obj, *_turns(obj, turns == "last"))
            except _Bad as e:
                fail(lineno, f"{e.args[0]}: {e.args[1]}", "bad")
                continue
            yield job

    def fail(lineno, why, kind="failed"):
        n[kind] += 1
        if n["failed"] + n["bad"] <= 20:
            tqdm.write(f"{input}:{lineno}: {why}")
        fails.write(json.dumps({"input_line": lineno, "error": why}, ensure_ascii=False) + "\n")
        fails.flush()
        tick()

    def tick():
        bar.update(1)
        t = max(time.time() - t0, 1e-9)
        bar.set_postfix_str(f"{n['answers'] / t:.1f} req/s, {n['tokens'] / t:.0f} tok/s, "
                            f"written {n['lines']}, truncated {n['truncated']}, "
                            f"failed {n['failed'] + n['bad']}", refresh=False)

    async def ask(client, url, history, tools):
        req = dict(model=model, messages=[_wire(m) for m in history], **sampling)
        if tools is not None:
            req["tools"] = tools
        for attempt in range(retries + 1):
            if attempt:
                n["retries"] += 1
                await asyncio.sleep(backoff * 2 ** (attempt - 1) * (0.5 + random.random()))
            try:
                # the client's plain POST: the body as we built it and the reply as text (any
                # server's reasoning field), without openai's per-request transform and parse
                text = await client.post("/chat/completions", body=req, cast_to=str)
            except openai.APITimeoutError:
                why = f"no reply within --timeout {timeout:g}s"
            except openai.APIConnectionError as e:
                why = f"connection failed ({e.__cause__ or e})"
            except openai.APIStatusError as e:
                why = f"HTTP {e.status_code}: {e.response.text[:200]!r}"
                if e.status_code < 500 and e.status_code not in (408, 429):
                    raise _Failed(f"{url}: {why}")  # the request itself is wrong: retry is futile
            else:
                try:
                    body = json.loads(text)
                    choice = body["choices"][0]
                    msg, usage = choice["message"], body.get("usage") or {}
                    if isinstance(msg, dict) and isinstance(usage, dict):
                        break
                    raise TypeError
                except ValueError:
                    why = f"non-JSON reply {text[:200]!r}"
                except (KeyError, IndexError, TypeError):
                    why = f"reply without choices[0].message: {text[:200]!r}"
        else:
            raise _Failed(f"{url}: {why} (after {retries} retries)")
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if not reasoning and "</think>" in content:
            reasoning, content = _split_think(content)
        ans = dict(role="assistant", content=content)
        if reasoning:
            ans["reasoning_content"] = reasoning
        if msg.get("tool_calls"):
            ans["tool_calls"] = msg["tool_calls"]
        ans["finish_reason"] = choice.get("finish_reason")
        ans["usage"] = {k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")}
        n["answers"] += 1
        n["truncated"] += ans["finish_reason"] == "length"
        n["tokens"] += usage.get("completion_tokens") or 0
        # a server without a reasoning parser puts thinking nowhere we can see: stop early
        # (a cut answer may have stopped before its </think>, so only finished ones count)
        if url not in verified and ans["finish_reason"] != "length":
            if reasoning:
                verified.add(url)
            else:
                unthinking[url] += 1
                if unthinking[url] >= THINK_CHECK:
                    raise DataError(no_thinking(url))
        return ans

    def no_thinking(url):
        return (f"{url} returned no reasoning in {unthinking[url]} finished answers (no "
                "reasoning_content / reasoning field, no </think> in the content) with thinking "
                "on: start the server with --reasoning-parser qwen3 (SGLang and vLLM), or pass "
                "--chat-template-kwargs '{\"enable_thinking\": false}' if you serve without "
                f"thinking; nothing from {url} was written")

    async def worker(client, url):
        for lineno, obj, head, rest, tools in it:
            msgs = list(head)
            try:
                for m in rest:  # each answer asked with the target's own earlier answers
                    msgs.append(await ask(client, url, msgs, tools) if m["role"] == "assistant"
                                else m)
            except _Failed as e:
                fail(lineno, e.args[0])
                streak[url] += 1
                if streak[url] < 2 * concurrency:
                    continue
                # every line failing: the server is down; its lines go to the others
                if streak[url] == 2 * concurrency:
                    tqdm.write(f"{url}: the last {streak[url]} lines all failed; no more "
                               "requests go there")
                if all(streak[u] >= 2 * concurrency for u in servers):
                    raise DataError(f"every server fails every request (last: {e.args[0]}); "
                                    "fix them, then rerun with --resume")
                return
            streak[url] = 0
            keep = {k: v for k, v in obj.items()
                    if k not in ("input_line", "messages", "conversations", "prompt")}
            held[url].append(json.dumps({"input_line": lineno, **keep, "messages": msgs},
                                        ensure_ascii=False) + "\n")
            if url in verified:  # lines wait until their server has shown its reasoning
                outf.writelines(held[url])
                outf.flush()
                held[url].clear()
            n["lines"] += 1
            tick()

    tls = ssl.create_default_context()  # one for all pools: building one costs 0.15 s

    def client(url):
        # a pool per POOL workers: httpx's pool does work linear in its connections per request
        # (measured 1.5x the CPU per request at 256 connections in one pool)
        limits = httpx.Limits(max_connections=POOL, max_keepalive_connections=POOL)
        key = os.environ.get("OPENAI_API_KEY", "none")  # for a server started with --api-key
        return openai.AsyncOpenAI(base_url=url, api_key=key, timeout=timeout, max_retries=0,
                                  http_client=openai.DefaultAsyncHttpxClient(limits=limits,
                                                                             verify=tls))

    async def check(url):  # once at start: the server is up and serves --model
        async with client(url) as c:
            try:
                served = [m.id for m in (await c.models.list(timeout=10)).data]
            except Exception as e:  # refused, HTTP error, not JSON: none of it is usable
                raise DataError(f"server {url} is unreachable: GET {url}/models failed "
                                f"({e.__cause__ or e}); start it (README: regenerate) or fix "
                                "--server")
        if model not in served:
            raise DataError(f"{url} does not serve --model {model}; it serves "
                            f"{', '.join(served) or 'nothing'}")

    async def run():
        clients, tasks = [], []
        try:
            for url in servers:
                for i in range(concurrency):
                    if i % POOL == 0:
                        clients.append(client(url))
                    tasks.append(asyncio.ensure_future(worker(clients[-1], url)))
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in clients:
                await c.close()

    for url in servers:
        asyncio.run(check(url))
    if done:
        log(f"resuming: {len(done)} lines already in {out}, {todo} to go")
    verified, unthinking = set(servers) if not thinking else set(), Counter()
    streak = Counter()  # lines failed in a row, per server
    held = {url: [] for url in servers}
    it = jobs()
    with open(out, "a", encoding="utf-8") as outf, \
            open(failed_path, "w", encoding="utf-8") as fails, \
            tqdm(total=todo, unit="line", dynamic_ncols=True,
                 mininterval=0.1 if sys.stderr.isatty() else 10) as bar:  # a log: every 10 s
        t0, cpu0 = time.time(), time.process_time()
        try:
            asyncio.run(run())
        except KeyboardInterrupt:
            raise DataError(f"interrupted; the {n['lines']} lines written are kept: rerun with "
                            "--resume to continue")
        for url, lines in held.items():  # servers that never finished an answer: nothing to judge
            if lines and unthinking.get(url):
                raise DataError(no_thinking(url))
            outf.writelines(lines)
    t, cpu = time.time() - t0, time.process_time() - cpu0
    # near 100% of a core, this client is what limits the servers
    log(f"regenerate: wrote {n['lines']} lines to {out} ({n['answers']} answers, "
        f"{n['truncated']} cut at --max-tokens {max_tokens}); {n['failed']} failed, "
        f"{n['bad']} bad input lines; {n['retries']} retries; {n['tokens']} tokens in {t:.1f}s "
        f"({n['answers'] / t:.1f} requests/s, {n['tokens'] / t:.0f} tokens/s; this client "
        f"used {cpu / t:.0%} of a CPU core, {cpu / max(n['answers'], 1) * 1e3:.2f} ms a request)")
    if n["failed"] + n["bad"]:
        log(f"the {n['failed'] + n['bad']} lines not written are listed in {failed_path}")
    if n["failed"]:
        raise DataError(f"{n['failed']} lines failed on the server (see above); "
                        "rerun with --resume to retry them")
    if n["bad"] and not n["lines"] and not done:
        raise DataError(f"{input}: none of its lines is a conversation to answer (see above)")
    return n

def _val_arg(s):  # --val: a number of lines (>= 1) or a fraction of them in (0, 1)
    v = float(s)
    if not (0 < v < 1 or (v >= 1 and v == int(v))):
        raise argparse.ArgumentTypeError(f"{s}: give a number of samples >= 1 "
                                         "or a fraction in (0, 1)")
    return v if v < 1 else int(v)

def _kwargs_arg(s):  # --chat-template-kwargs: a JSON object
    try:
        v = json.loads(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})")
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. "
                                         "'{\"enable_thinking\": false}'")
    return v

REGENERATE_DOC = """\
Each line of --input is sent to the target's OpenAI-compatible chat endpoint and written to
--out with its answers replaced by the target's; the rest of the line is kept. Defaults follow
SpecForge's scripts/regenerate_train_data.py (temperature 0.7, max tokens 4096, 64 requests in
flight per server; top_p / top_k unset, so the server's apply).

Which turns: every assistant turn is answered again in order, each request holding the
target's own earlier answers, and a conversation ending on a user turn gets a final answer.
A conversation with tool calls or tool results gets only its final answer regenerated: the
tool results in the data answer the original calls, not the ones the target would make.
"tools" of the line are sent with the request.

Output line: {"input_line": N, <the input's other fields>, "messages": [...]}; each answer is
{"role": "assistant", "content", "reasoning_content" (the thinking, whichever field the server
used; an inline <think>...</think> is split out), "tool_calls" (if any), "finish_reason"
("length": cut at --max-tokens), "usage": {"prompt_tokens", "completion_tokens"}}.
Lines are written as they finish (in that order, not the input's).

Thinking: with thinking on (no "enable_thinking": false in --chat-template-kwargs), a server
whose first 8 finished answers carry no reasoning is stopped: it runs without a reasoning
parser, so the thinking would be lost (start it with --reasoning-parser qwen3).

Safe to stop at any time: --resume skips the lines OUT holds and drops a half-written last
one. A request failing after --retries goes to OUT.failed.jsonl (input_line, error) with the
input's bad lines; the exit status is 1 when requests failed, and --resume retries them.
"""

def main(argv=None):
    ap = ArgParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="JSONL -> DIR/train (+ DIR/val)")
    p.add_argument("--input", required=True,
                   help="JSONL file, one sample per line (input_ids or messages)")
    p.add_argument("--out", required=True,
                   help="output directory; gets train/ and, with --val, val/")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint (or tokenizer) directory: its tokenizer.json and chat template "
                   "(chat_template.jinja or tokenizer_config.json) render the chat lines, as the "
                   "serving engine does; needed for chat lines")
    p.add_argument("--chat-template-kwargs", type=_kwargs_arg, default={},
                   help="JSON object of template variables, as the engine's chat_template_kwargs: "
                   "e.g. '{\"enable_thinking\": false}' or '{\"preserve_thinking\": true}'; "
                   "use what you serve (and regenerated) with")
    p.add_argument("--turns", choices=("all", "last"), default="all",
                   help="assistant turns to train: all (default; each in the context serving gave "
                   "it, turns the template renders the same later share one sample, a turn it "
                   "re-renders gets its own) or last (the final turn only)")
    p.add_argument("--workers", type=number(int, 1), default=1,
                   help="processes rendering and tokenizing (the parent reads and writes, in "
                   "order); default 1")
    p.add_argument("--val", type=_val_arg, default=None,
                   help="held-out lines: a count (e.g. 1000) or a fraction (e.g. 0.01), "
                   "spread evenly over the file; default none")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="reject token ids >= this and record it as the vocab bound; "
                   "default: tokenizer size, else max id + 1")
    p.add_argument("--max-bad", type=float, default=0.01,
                   help="fail if more than this fraction of lines is bad (default 0.01 = 1%%)")
    p.add_argument("--force", action="store_true", help="overwrite existing DIR/train and DIR/val")
    d = sub.add_parser("demo", help="the tiny target's greedy continuations of random prompts "
                       "-> DIR/train, DIR/val")
    d.add_argument("--out", default="data/demo", help="output directory (default data/demo)")
    # the same demo train.py builds on first use, into the same data/demo
    dflt = make_demo.__defaults__
    d.add_argument("--samples", type=int, default=dflt[0],
                   help=f"training samples (default {dflt[0]})")
    d.add_argument("--val-samples", type=int, default=dflt[1],
                   help=f"held-out samples (default {dflt[1]})")
    d.add_argument("--new-tokens", type=int, default=dflt[2],
                   help=f"greedy tokens per sample, all supervised (default {dflt[2]})")
    d.add_argument("--seed", type=int, default=0, help="seed of the random prompts")
    d.add_argument("--force", action="store_true", help="overwrite an existing demo")
    st = sub.add_parser("stats", help="what a prepared dataset will teach: counts, lengths, "
                        "the --budget cut, thinking vs answer tokens, one sample marked")
    st.add_argument("dir", help="dataset directory (prepare's OUT, or OUT/train, OUT/val)")
    st.add_argument("--budget", type=number(int, 1), default=8192,
                    help="tokens per row you will train with (default 8192)")
    st.add_argument("--tokenizer", default=None,
                    help="checkpoint dir to decode the sample with (default: the one prepare used)")
    st.add_argument("--sample", type=int, default=0, help="which sample to print (default 0)")
    r = sub.add_parser("regenerate", help="prompts JSONL -> the target's own answers, through "
                       "its OpenAI-compatible server(s) (SGLang, vLLM)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description=REGENERATE_DOC)
    r.add_argument("--input", required=True, help="JSONL: messages, ShareGPT conversations "
                   "or prompt lines; other fields (id, source, tools, ...) are kept")
    r.add_argument("--out", required=True, help="output JSONL, appended to as answers arrive; "
                   "failures go to OUT.failed.jsonl (OUT without .jsonl)")
    r.add_argument("--server", required=True, action="append",
                   help="http://host:port[/v1] of an SGLang/vLLM server; repeat for several "
                   "(one started with --api-key: set OPENAI_API_KEY)")
    r.add_argument("--model", required=True, help="the model name the servers serve")
    r.add_argument("--concurrency", type=number(int, 1), default=64, help="requests in flight "
                   "per server (default 64, SpecForge's; the engine batches them)")
    r.add_argument("--max-tokens", type=number(int, 1), default=4096,
                   help="max generated tokens per answer, thinking included (default 4096)")
    r.add_argument("--temperature", type=float, default=0.7, help="default 0.7")
    r.add_argument("--top-p", type=float, default=None, help="default: not sent (server's)")
    r.add_argument("--top-k", type=int, default=None, help="default: not sent (server's)")
    r.add_argument("--chat-template-kwargs", type=_kwargs_arg, default=None,
                   help="JSON object for the server's chat template, e.g. "
                   "'{\"enable_thinking\": false}' (default: none, the template's defaults)")
    r.add_argument("--turns", choices=("all", "last"), default="all",
                   help="all: answer every assistant turn in order (default); last: only the "
                   "final answer")
    r.add_argument("--timeout", type=number(float, 0, above=True), default=3600,
                   help="seconds one request may take (default 3600)")
    r.add_argument("--retries", type=number(int, 0), default=5, help="retries of a failed "
                   "request: HTTP 5xx/408/429, timeout, no connection, bad reply (default 5)")
    r.add_argument("--backoff", type=number(float, 0), default=1.0, help="seconds before the "
                   "first retry, doubling each time, +-50%% jitter (default 1)")
    r.add_argument("--resume", action="store_true", help="continue OUT: skip the lines it "
                   "holds, ask again for the rest (failed ones included)")
    r.add_argument("--limit", type=number(int, 1), default=None,
                   help="only the first N lines of --input (default all)")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "prepare":
            prepare(args.input, args.out, args.tokenizer, args.val, args.vocab_size, args.force,
                    args.max_bad, chat_template_kwargs=args.chat_template_kwargs,
                    turns=args.turns, workers=args.workers)
        elif args.cmd == "stats":
            stats(args.dir, args.budget, args.tokenizer, args.sample)
        elif args.cmd == "regenerate":
            regenerate(args.input, args.out, args.server, args.model, args.concurrency,
                       args.max_tokens, args.temperature, args.top_p, args.top_k,
                       args.chat_template_kwargs, args.timeout, args.retries, args.backoff,
                       args.resume, args.limit, args.turns)
        else:
            make_demo(args.out, args.samples, args.val_samples, args.new_tokens, args.seed,
                      args.force)
    except DataError as e:
        sys.exit(f"error: {e}")

if __name__ == "__main__":
    main()

# What to expect (2-core CPU, torch 2.13, Nov 2026):
#   python data.py demo --out data/demo   ~4 s, vocab bound 512
#                                         train: 384 samples, 24559 tokens (18432 supervised)
#                                         val:    32 samples,  2037 tokens  (1536 supervised)
#   python data.py prepare ...            ~5M tokens/s for pretokenized lines; peak RSS stays
#                                         ~3 MB over the bare imports at 1M-16M tokens
#                                         (test_smoke.py measures it)
#   sizes on disk: tokens.bin 4 B/token, loss_mask.bin 1 B/token, offsets.bin 8 B/sample, so a
#   1B-token corpus of 1M samples is 4 GB + 1 GB + 8 MB, memory-mapped, never read whole
