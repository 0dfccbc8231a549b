"""
JSONL -> a dataset for train.py in data.py's format: DIR/train and, with --val, DIR/val.

    python prepare.py --input answers.jsonl --out data/mix --tokenizer /ckpt/Qwen3.6-27B \\
        --chat-template-kwargs '{"enable_thinking": true}' --val 0.005 --workers 16

A line is {"input_ids": [...], "loss_mask": [...]} (mask optional, default all ones) or a chat
({"messages": [...], "tools": [...]}; ShareGPT "conversations" too), rendered with the --tokenizer
checkpoint's template and tokenizer.json as the serving engine renders it, the loss mask on exactly
the tokens the target generated (pip install tokenizers jinja2), shown on the first sample at the
end; --turns: each assistant turn as served (all) or the final one (last). Every bad line is
reported by number and counted; more than --max-bad of them fails the command, nothing written.
"""
import argparse
import hashlib
import itertools
import json
import os
import shutil
import sys
import time
from collections import Counter, deque
from datetime import datetime

import numpy as np

from data import (ArgParser, Bad, DataError, Writer, kwargs_arg, load_line, number,
                  open_dataset, package)

# -----------------------------------------------------------------------------
# a JSONL line's conversation: OpenAI messages, ShareGPT conversations or a prompt

ROLES = ("system", "developer", "user", "assistant", "tool")
# ShareGPT speakers -> OpenAI roles (FastChat's, SpecForge's); the roles themselves pass as is
SHAREGPT_ROLES = dict(human="user", gpt="assistant", chatgpt="assistant", bing="assistant",
                      bard="assistant", model="assistant", function="tool", observation="tool")

def conversation(obj):
    """A JSONL object -> its OpenAI messages, every key passed through; raises Bad."""
    if not isinstance(obj, dict):
        raise Bad("not a JSON object", f"got {type(obj).__name__}")
    if "conversations" in obj and "messages" not in obj:  # ShareGPT: a "from" not in the table
        msgs = obj["conversations"]                          # passes as the role, checked below
        if isinstance(msgs, list) and all(isinstance(t, dict) for t in msgs):
            msgs = [{"role": SHAREGPT_ROLES.get(t.get("from"), t.get("from")),
                     "content": t.get("value")} for t in msgs]
    elif "messages" in obj or not isinstance(obj.get("prompt"), str):
        msgs = obj.get("messages")
    else:
        msgs = [{"role": "user", "content": obj["prompt"]}]
    if not (isinstance(msgs, list) and msgs and all(isinstance(m, dict) for m in msgs)):
        raise Bad("no conversation", 'need "messages" (a non-empty list of objects), '
                  '"conversations" or a "prompt" string')
    for i, m in enumerate(msgs):
        if m.get("role") not in ROLES:
            raise Bad("unknown role", f"message {i} has role {m.get('role')!r}, expected one of "
                      f"{', '.join(ROLES)}")
    # transformers' apply_chat_template drops keys whose value is None before rendering
    return [{k: v for k, v in m.items() if v is not None} for m in msgs]

def tools_of(obj):
    """A JSONL object's "tools" (OpenAI function schemas), or None; raises Bad."""
    tools = obj.get("tools")
    if not (tools is None or isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise Bad("bad tools", '"tools" must be a list of JSON schema objects')
    return tools

# -----------------------------------------------------------------------------
# chat lines: rendered as the serving engine renders them, the loss mask on what the target made

def _jinja_env():
    """transformers' apply_chat_template environment (chat_template_utils.py): SGLang's, vLLM's."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # {% generation %} marks text for transformers' masks; ours compare renderings: body as is
        tags = {"generation"}
        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    # transformers' tojson, not jinja's, which escapes HTML characters
    env.filters["tojson"] = lambda x, ensure_ascii=False, **kw: json.dumps(
        x, ensure_ascii=ensure_ascii, **kw)
    env.globals.update(raise_exception=raise_exception,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env

def _template_messages(msgs):
    """Messages as the engines hand them to the template: tool-call arguments parsed from JSON
    (vLLM's _postprocess_messages, SGLang: no empty list of calls, missing arguments {}), the
    first of reasoning_content, thinking, reasoning under the first two (transformers')."""
    out = []
    for i, m in enumerate(msgs):
        m = dict(m)
        if m["role"] == "assistant" and isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_parsed_call(c, i, j) for j, c in enumerate(m["tool_calls"])]
            if not m["tool_calls"]:
                del m["tool_calls"]
        r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        out.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return out

def _parsed_call(call, i, j):
    if not isinstance(call, dict):
        raise Bad("bad tool call", f"message {i} tool call {j} is not an object")
    call = dict(call)
    fn = call  # {"function": {"name", "arguments"}}, or flat {"name", "arguments"}: both render
    if isinstance(call.get("function"), dict):
        fn = call["function"] = dict(call["function"])
    args = fn.get("arguments")
    if isinstance(args, str) and args.strip():
        try:
            args = json.loads(args)
        except ValueError as e:
            raise Bad("bad tool arguments", f"message {i} tool call {j}: arguments are not "
                      f"JSON ({e})")
    fn["arguments"] = {} if args is None or args == "" else args
    return call

def split_think(content):
    """Inline thinking (what the engines return without a reasoning parser) -> (reasoning,
    answer), split as the Qwen3 / Qwen3.5 chat templates split it: both forms render alike."""
    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
    return reasoning, content.split("</think>")[-1].lstrip("\n")

def _answer_parts(m):
    """The texts a rendered assistant turn must contain: reasoning, content (split_think)."""
    c, r = m.get("content"), m.get("reasoning_content")
    pieces = [c] if isinstance(c, str) else [p["text"] for p in c or () if isinstance(p, dict)
                                            and isinstance(p.get("text"), str)]
    pieces = [x for p in pieces for x in (split_think(p) if "</think>" in p else [p])]
    return [x.strip() for x in [r if isinstance(r, str) else "", *pieces] if x.strip()]

def _json_file(name):  # a checkpoint's optional JSON file: {} when absent
    try:
        with open(name) as f:
            return dict(json.load(f))
    except FileNotFoundError:
        return {}
    except ValueError as e:
        raise DataError(f"{name} is not valid JSON ({e})")

class Chat:
    """A checkpoint's chat template and tokenizer.json applied as transformers' apply_chat_template
    (so SGLang, vLLM) applies them: special tokens, kwargs as variables; no special tokens added."""

    def __init__(self, path, kwargs=None, cmd="prepare.py --tokenizer"):
        jinja2, tokenizers = package("jinja2", cmd), package("tokenizers", cmd)
        if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
            # older versions have sandbox escapes, and templates are code from the Hub
            raise DataError(f"{cmd} needs jinja2>=3.1.6 (have {jinja2.__version__}): "
                            "pip install -U jinja2")
        if not os.path.isdir(path):
            raise DataError(f"--tokenizer {path} is not a directory: pass the checkpoint (or "
                            "tokenizer) directory that holds tokenizer.json and the chat template")
        cfg_path, tok_file = (os.path.join(path, f"tokenizer{s}.json") for s in ("_config", ""))
        cfg = _json_file(cfg_path)
        # chat_template.jinja wins over tokenizer_config.json, as in transformers' loader
        jinja = os.path.join(path, "chat_template.jinja")
        self.source = jinja if os.path.isfile(jinja) else cfg_path
        text = open(jinja).read() if self.source == jinja else cfg.get("chat_template")
        if not isinstance(text, str):  # a list of named ones (older checkpoints) is refused too
            raise DataError(f"{path} has no chat template: neither chat_template.jinja nor a "
                            "\"chat_template\" string in tokenizer_config.json")
        if not os.path.isfile(tok_file):
            raise DataError(f"{path} has no tokenizer.json (the fast tokenizer chat lines need)")
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
        # a turn ends at generation_config.json's eos ids (where the engine stops) or eos_token
        eos = _json_file(os.path.join(path, "generation_config.json")).get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        eos.append(self.tok.token_to_id(named.get("eos_token", "")))
        self.eos = np.array(sorted({e for e in eos if isinstance(e, int)}), np.int64)

    def render(self, msgs, tools=None, add_generation_prompt=False):
        try:
            return self.template.render(messages=msgs, tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt,
                                        **self.variables)
        except Exception as e:  # raise_exception, or the template tripping over this sample
            raise Bad("template error", f"rendering messages[:{len(msgs)}]: "
                      f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}")

    def encode(self, text):
        """ids [T] int64, and each token's character span [T] start, [T] end in text."""
        enc = self.tok.encode(text, add_special_tokens=False)
        off = np.asarray(enc.offsets, np.int64).reshape(-1, 2)  # [T, 2]
        return np.asarray(enc.ids, np.int64), off[:, 0], off[:, 1]

    def prompt(self, obj):
        """The ids the engine feeds the target: a final answer dropped, generation prompt added."""
        msgs = conversation(obj)
        msgs = msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs
        if not msgs:
            raise Bad("no prompt", "the only message is an assistant answer")
        return self.encode(self.render(_template_messages(msgs), tools_of(obj), True))[0]

    def samples(self, obj, turns="all"):
        """A JSONL conversation -> ([(ids, mask), ...], counts, notes); raises Bad. Turn i is
        trained from the end of P = render(messages[:i], add_generation_prompt=True), the engine's
        prompt, through the first end of turn in U = render(messages[:i+1]); a U that does not go
        on from P is not as served (skipped). U rides in a sample it begins, else is its own."""
        msgs, tools = _template_messages(conversation(obj)), tools_of(obj)
        idx = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not idx:
            raise Bad("no assistant turn", "nothing to train on")
        idx = idx[-1:] if turns == "last" else idx
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
            raise Bad("not as served", notes[0][1])
        out = [self._mask(text, sp, msgs, n, notes) for text, sp in reversed(spans.items()) if sp]
        return out, n, notes

    def _mask(self, text, spans, msgs, n, notes):
        ids, a, b = self.encode(text)
        mask, eos = np.zeros(len(ids), bool), np.isin(ids, self.eos)
        for s, lim, i in spans:
            stop = np.flatnonzero((a >= s) & (b <= lim) & eos)
            e = int(b[stop[0]]) if len(stop) else lim
            mask |= (a >= s) & (b <= e)
            # a token the BPE merged across the prompt's end belongs to neither: unsupervised
            n["straddle"] += int(((a < s) & (b > s)).sum())
            lost = [x for x in _answer_parts(msgs[i]) if x not in text[s:e]]
            if lost:
                n["not_intact"] += 1
                notes.append(("not intact", f"turn {i}: {lost[0][:40]!r} is not in the "
                              "supervised text"))
            n.update(trained=1, length=msgs[i].get("finish_reason") == "length")
        return ids, mask.astype(np.uint8)

# -----------------------------------------------------------------------------
# prepare: JSONL -> DIR/train (+ DIR/val), streaming, with every bad line reported by number

def _parse(line, chat, bound, turns, input, lineno):
    """One JSONL line -> ([(ids, mask), ...], counts, notes); raises Bad."""
    obj, counts, notes = load_line(line), {}, []
    if isinstance(obj, dict) and "input_ids" in obj:
        try:  # ragged or huge values make numpy raise; strings, floats, nesting are caught below
            ids = np.asarray(obj["input_ids"])
            mask = np.asarray(obj.get("loss_mask", np.ones(ids.shape, np.uint8)))
        except (ValueError, TypeError, OverflowError) as e:
            raise Bad("bad input_ids", str(e))
        if ids.ndim != 1 or len(ids) == 0 or ids.dtype.kind not in "iu":
            raise Bad("bad input_ids", "must be a non-empty list of integers")
        if mask.shape != ids.shape:
            raise Bad("loss_mask length mismatch", f"{mask.size} mask values for {len(ids)} ids")
        if not np.isin(mask, (0, 1)).all():
            raise Bad("bad loss_mask", "values must be 0 or 1")
        samples = [(ids, mask)]
    elif isinstance(obj, dict) and any(k in obj for k in ("messages", "conversations", "prompt")):
        if chat is None:  # a setup error, not a bad line: stop at once rather than skip every line
            raise DataError(f"{input}:{lineno}: a chat line needs --tokenizer DIR (the checkpoint "
                            "directory with tokenizer.json and the chat template)")
        samples, counts, notes = chat.samples(obj, turns)
    else:
        raise Bad("neither input_ids nor messages", 'need an object with "input_ids" or "messages"')
    for ids, mask in samples:
        if ids.min() < 0 or ids.max() >= bound:
            bad = ids[(ids < 0) | (ids >= bound)][0]
            raise Bad("token id out of range", f"id {bad} not in [0, {bound})")
        if not mask.any():
            raise Bad("no supervised token", "loss mask is all zero (no assistant turn?)")
    return samples, counts, notes

# --workers: each process renders with a Chat of its own, built once; the parent reads and writes
def _init(chat, *args):  # chat: a Chat, None, or (path, kwargs) to build one in this process
    global _args
    _args = (Chat(*chat) if isinstance(chat, tuple) else chat, *args)

def _work(chunk):
    """[(lineno, line)] -> [(lineno, _parse's result, (None, {}, [Bad's args]) or None if blank)]"""
    out = []
    for lineno, line in chunk:
        try:
            out.append((lineno, _parse(line, *_args, lineno) if line.strip() else None))
        except Bad as e:
            out.append((lineno, (None, {}, [e.args])))
    return out

def _processed(f, workers, chat, *args):
    """_work on f's lines in order, here or pooled, 2 chunks a worker in flight: flat memory."""
    lines = enumerate(f, 1)
    chunks = iter(lambda: list(itertools.islice(lines, 64 if workers > 1 else 1)), [])
    if workers <= 1:
        _init(chat, *args)
        yield from itertools.chain.from_iterable(map(_work, chunks))
        return
    import multiprocessing
    with multiprocessing.Pool(workers, _init, (chat and (chat.path, chat.kwargs), *args)) as pool:
        pending = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_work, (chunk,)))
            if len(pending) >= 2 * workers:
                yield from pending.popleft().get()
        while pending:
            yield from pending.popleft().get()

CHAT_COUNTS = ("assistant_turns", "trained", "own_sample", "not_as_served", "not_intact", "length",
               "straddle")

def prepare(input, out, tokenizer=None, val=None, vocab_size=None, force=False, max_bad=0.01,
            log=print, chat_template_kwargs=None, turns="all", workers=1):
    """JSONL -> out/train and, if val (a count >= 1 or a fraction in (0, 1)) is given, out/val."""
    if not os.path.isfile(input):
        raise DataError(f"input file {input} not found")
    chat = Chat(tokenizer, chat_template_kwargs) if tokenizer else None
    vocab_size, n_val = vocab_size or (chat and chat.vocab_size), 0
    if val:  # held-out lines are spread evenly over the file: that needs its line count first
        with open(input, "rb") as f:
            n_lines = sum(1 for _ in f)
        n_val = round(val * n_lines) if isinstance(val, float) else val
        if not 0 < n_val < n_lines:
            raise DataError(f"--val {val} selects {n_val} of the {n_lines} lines of {input}; "
                            "need at least 1 and fewer than all")
    splits = ("train", "val")[:1 + bool(n_val)]
    bad, shown, counts, writers = Counter(), Counter(), [Counter(), Counter()], []
    total = blank = 0
    t0 = last = time.time()
    try:
        writers.extend(Writer(os.path.join(out, s), vocab_size, force) for s in splits)
        with open(input, "rb") as f:
            for lineno, res in _processed(f, workers, chat, vocab_size or 2**32, turns, input):
                if res is None:
                    blank += 1
                    continue
                total += 1
                samples, c, notes = res
                if samples is None:
                    bad[notes[0][0]] += 1
                # why a line is bad, or a turn skipped or not intact: the first 10 of each kind
                for kind, detail in notes:
                    shown[kind] += 1
                    if shown[kind] <= 10:
                        log(f"{input}:{lineno}: {kind}: {detail}")
                i = lineno - 1  # held out where floor(i * n_val / n_lines) steps up: n_val lines
                held_out = bool(n_val) and (i + 1) * n_val // n_lines > i * n_val // n_lines
                counts[held_out].update(c)
                for ids, mask in samples or ():
                    writers[held_out].add(ids, mask)
                if time.time() - last > 5:
                    last, n = time.time(), sum(w.n_tokens for w in writers) / 1e6
                    log(f"prepare: {total} lines, {n:.2f}M tokens, {n / (last - t0):.2f}M/s")
        n_bad = bad.total()
        if blank:
            log(f"ignored {blank} blank lines")
        if n_bad:
            log(f"skipped {n_bad} of {total} lines: "
                + ", ".join(f"{c} {k}" for k, c in bad.items()))
        if n_bad == total:
            raise DataError(f"{input}: none of its {total} lines is a valid sample (see above)"
                            if total else f"{input} is empty")
        if n_bad > max_bad * total:
            raise DataError(f"{input}: {n_bad} of {total} lines ({n_bad / total:.1%}) are bad, "
                            f"more than --max-bad {max_bad:g}; fix the input, or raise it")
        # checked before either split is committed: a lone train/ would train with no eval
        for w, s in zip(writers, splits):
            if w.n == 0:
                raise DataError(f"{input}: every line of the {s} split is bad (see above), so "
                                f"{w.out} would be empty; fix those lines or change --val")
        metas = [w.commit(source=input, split=s, **({} if chat is None else {"chat": dict(
            tokenizer=chat.path, template=chat.source, template_sha256=chat.sha256,
            kwargs=chat.kwargs, turns=turns, **{k: c[k] for k in CHAT_COUNTS})}))
                 for w, s, c in zip(writers, splits, counts)]  # what made the tokens: meta.json
    except BaseException:
        for w in writers:
            w.abort()
        raise
    if force and not n_val and os.path.exists(os.path.join(out, "val")):  # a stale one mismatches
        shutil.rmtree(os.path.join(out, "val"))
        log(f"removed the old {os.path.join(out, 'val')}")
    for m, s in zip(metas, ("train", "val")):
        log(f"wrote {os.path.join(out, s)}: {m['n_samples']} samples, {m['n_tokens']} tokens "
            f"({m['n_supervised']} supervised), vocab bound {m['vocab_size']}")
    log(f"done in {time.time() - t0:.1f}s")
    # what the drafter will learn, before a GPU hour is spent on it (what --budget cuts: train.py)
    ds = open_dataset(os.path.join(out, "train"))
    L, n = np.sort(ds.lengths), len(ds) - 1  # not np.percentile: its import alone grows the process
    log(f"tokens per sample: p50 {L[n // 2]}, p99 {L[int(0.99 * n)]}, max {L[-1]}")
    if chat:
        c = counts[0] + counts[1]
        log(f"chat: {c['trained']} of {c['assistant_turns']} assistant turns trained ("
            f"{c['own_sample']} in a sample of their own), {c['not_as_served']} not as served "
            f"(skipped), {c['not_intact']} not intact, {c['length']} cut at max tokens, "
            f"{c['straddle']} tokens straddling a prompt's end (unsupervised)")
        ids, mask = ds.sample(0)
        runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(mask.astype(np.int8))) + 1)
        text = "".join(("«{}»" if mask[r[0]] else "{}").format(
            chat.tok.decode(ids[r].tolist(), skip_special_tokens=False)) for r in runs)
        log(f"{ds.path}, sample 0, supervised between « and »:\n{text}")
    return metas

def _val_arg(s):  # --val: a number of lines (>= 1) or a fraction of them in (0, 1)
    v = float(s)
    if not (0 < v < 1 or (v >= 1 and v == int(v))):
        raise argparse.ArgumentTypeError(f"{s}: give a number of samples >= 1 or a fraction in "
                                         "(0, 1)")
    return v if v < 1 else int(v)

def main(argv=None):
    ap = ArgParser(description=__doc__)
    arg = ap.add_argument
    arg("--input", required=True, help="JSONL, one sample a line (input_ids or messages)")
    arg("--out", required=True, help="output directory; gets train/ and, with --val, val/")
    arg("--tokenizer", help="checkpoint dir whose chat template and tokenizer render chats")
    arg("--chat-template-kwargs", type=kwargs_arg, default={}, help="JSON: those you serve with")
    arg("--turns", choices=("all", "last"), default="all", help="assistant turns to train")
    arg("--workers", type=number(int, 1), default=1, help="processes rendering (default 1)")
    arg("--val", type=_val_arg, help="held-out lines: a count or a fraction in (0, 1)")
    arg("--vocab-size", type=int, help="ids >= this make a line bad (default: the tokenizer's)")
    arg("--max-bad", type=float, default=0.01, help="fraction of bad lines to fail at (0.01)")
    arg("--force", action="store_true", help="overwrite existing DIR/train and DIR/val")
    try:
        prepare(**vars(ap.parse_args(argv)))
    except DataError as e:
        sys.exit(f"error: {e}")

if __name__ == "__main__":
    main()
