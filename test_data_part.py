"""
Tests of data.py: format round trips, packer invariants, bad input, atomic writes, flat memory.
Run: python -m pytest -q -s test_data_part.py  (CPU only, 10-25 s; needs `tokenizers`; -s shows the memory figures)
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import data
from data import DataError, Packer, open_dataset, write_dataset

HERE = os.path.dirname(os.path.abspath(__file__))


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, os.path.join(HERE, "data.py"), *map(str, args)],
                          capture_output=True, text=True, cwd=cwd)


def write_jsonl(path, objs):
    with open(path, "w") as f:
        for o in objs:
            f.write((o if isinstance(o, str) else json.dumps(o)) + "\n")


def random_samples(n, lo, hi, seed=0, vocab=1000):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L = int(rng.integers(lo, hi + 1))
        out.append((rng.integers(0, vocab, L), (rng.random(L) < 0.7).astype(np.uint8)))
    return out


# -----------------------------------------------------------------------------
# round trips

def test_prepare_pretokenized_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    objs = []
    for i in range(50):
        L = int(rng.integers(1, 30))
        o = {"input_ids": rng.integers(0, 70000, L).tolist()}  # ids above 65535 must survive (uint32)
        if i % 3:
            o["loss_mask"] = [1] + rng.integers(0, 2, L - 1).tolist()
        objs.append(o)
    write_jsonl(tmp_path / "in.jsonl", objs)
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--val", 5)
    assert r.returncode == 0, r.stderr + r.stdout
    tr, va = open_dataset(tmp_path / "d"), open_dataset(tmp_path / "d" / "val")
    assert tr.path == os.path.join(tmp_path / "d", "train")  # the parent resolves to train/
    assert len(tr) == 45 and len(va) == 5
    # val lines are spread evenly (line i where floor(i*5/50) steps up) and both splits keep file order
    val_lines = [i for i in range(50) if (i + 1) * 5 // 50 > i * 5 // 50]
    assert val_lines == [9, 19, 29, 39, 49]
    got = [tr.sample(k) for k in range(len(tr))]
    got_val = [va.sample(k) for k in range(len(va))]
    want = [o for i, o in enumerate(objs) if i not in val_lines]
    for (ids, mask), o in zip(got + got_val, want + [objs[i] for i in val_lines]):
        assert ids.dtype == np.uint32 and mask.dtype == np.uint8
        assert ids.tolist() == o["input_ids"]
        assert mask.tolist() == o.get("loss_mask", [1] * len(o["input_ids"]))
    all_ids = np.concatenate([o["input_ids"] for o in objs])
    assert tr.meta["n_tokens"] + va.meta["n_tokens"] == len(all_ids)
    assert tr.meta["n_supervised"] == int(sum(m.sum() for _, m in got))
    assert tr.vocab_size == int(max(i.max() for i, _ in got)) + 1
    assert tr.lengths.dtype == np.int64 and tr.lengths.tolist() == [len(o["input_ids"]) for o in want]
    # a declared vocab size is recorded as the bound
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d2", "--vocab-size", 80000)
    assert r.returncode == 0 and open_dataset(tmp_path / "d2").vocab_size == 80000
    assert not os.path.exists(tmp_path / "d2" / "val")


def make_tokenizer(path, special=True):
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    words = ["<unk>", "system", "user", "assistant", "you", "are", "helpful", "hi", "hello", "there",
             "what", "is", "two", "plus", "four", "it", "thanks", "bye"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens([AddedToken("\n", normalized=False)])  # so the newlines become tokens we can check
    if special:
        tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path))
    return tok


def test_prepare_chat_roundtrip(tmp_path):
    tok = make_tokenizer(tmp_path / "tokenizer.json")
    convs = [
        [{"role": "system", "content": "you are helpful"}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": "hello there"}, {"role": "user", "content": "what is two plus two"},
         {"role": "assistant", "content": "it is four"}],
        [{"role": "user", "content": "thanks"}, {"role": "assistant", "content": "bye"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}],  # only <|im_end|> supervised
    ]
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
    r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d", "--tokenizer", tmp_path / "tokenizer.json")
    assert r.returncode == 0, r.stderr + r.stdout
    ds = open_dataset(tmp_path / "d")
    assert len(ds) == 3 and ds.vocab_size == tok.get_vocab_size(with_added_tokens=True)
    S, E, NL = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>"), tok.token_to_id("\n")
    A = tok.token_to_id("assistant")
    for k, conv in enumerate(convs):
        ids, mask = (a.tolist() for a in ds.sample(k))
        # ids: the whole rendered conversation tokenized in one go (the tokenizer's own view)
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)
        assert ids == tok.encode(text, add_special_tokens=False).ids
        # mask, recomputed by walking the ids: inside an assistant turn, from after "assistant\n"
        # through <|im_end|> inclusive; the header and the trailing "\n" are not supervised
        want, state = [], None
        for j, t in enumerate(ids):
            if t == S:
                state = "header"
            if state == "body":
                want.append(1 if role == A else 0)
                state = "tail" if t == E else "body"
            else:
                want.append(0)
                if state == "header" and t == NL:
                    state, role = "body", ids[j - 1]
        assert mask == want
        answers = [m["content"] for m in conv if m["role"] == "assistant"]
        assert sum(mask) == sum(len(a.split()) + 1 for a in answers)
        assert ids[-1] == NL and mask[-1] == 0


def test_chat_needs_tokenizer_with_special_tokens(tmp_path):
    write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "assistant", "content": "hi"}]}])
    r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d")
    assert r.returncode == 1 and "chat.jsonl:1" in r.stderr and "--tokenizer" in r.stderr
    make_tokenizer(tmp_path / "plain.json", special=False)
    r = cli("prepare", "--input", tmp_path / "chat.jsonl", "--out", tmp_path / "d", "--tokenizer", tmp_path / "plain.json")
    assert r.returncode == 1 and "plain.json" in r.stderr and "<|im_start|>" in r.stderr
    assert not os.path.exists(tmp_path / "d" / "train")


# -----------------------------------------------------------------------------
# packer

def ref_next_fit(lengths, order, budget):
    rows, cur, used = [], [], 0
    for i in order:
        l = min(lengths[i], budget)
        if used + l > budget:
            rows.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += l
    return rows + [cur]


def check_row(row, ds, budget):
    assert all(len(a) == budget for a in (row.tokens, row.loss_mask, row.doc, row.pos))
    assert row.tokens.dtype == np.int64 and row.loss_mask.dtype == np.uint8
    assert row.doc.dtype == np.int32 and row.pos.dtype == np.int64 and row.cu_seqlens.dtype == np.int64
    p = 0
    for d, i in enumerate(row.samples):
        ids, mask = ds.sample(i)
        l = min(len(ids), budget)
        assert row.cu_seqlens[d] == p
        assert (row.tokens[p:p + l] == ids[:l]).all() and (row.loss_mask[p:p + l] == mask[:l]).all()
        assert (row.doc[p:p + l] == d).all() and (row.pos[p:p + l] == np.arange(l)).all()
        p += l
    n = len(row.samples)
    if p < budget:  # padding tail: its own document, id 0, never supervised
        assert row.cu_seqlens.tolist()[n:] == [p, budget]
        assert (row.doc[p:] == n).all() and (row.pos[p:] == np.arange(budget - p)).all()
        assert (row.tokens[p:] == 0).all() and (row.loss_mask[p:] == 0).all()
    else:
        assert row.cu_seqlens.tolist()[n:] == [budget]


@pytest.fixture
def ds(tmp_path):
    write_dataset(tmp_path / "ds", random_samples(157, 1, 40, seed=3))
    return open_dataset(tmp_path / "ds")


@pytest.mark.parametrize("n_shards", [1, 2, 3])
def test_packer_epoch_invariants(ds, n_shards):
    budget = 64
    packers = [Packer(ds, budget, n_shards, s, seed=7) for s in range(n_shards)]
    steps = {p.steps_per_epoch for p in packers}
    assert len(steps) == 1  # every shard does the same number of steps
    rows = [[p.next_row() for _ in range(p.steps_per_epoch)] for p in packers]
    order = np.random.default_rng((7, 0)).permutation(len(ds))
    ref = ref_next_fit(ds.lengths.tolist(), order.tolist(), budget)
    assert packers[0].steps_per_epoch == -(-len(ref) // n_shards)
    seen = []
    for s in range(n_shards):
        for k, row in enumerate(rows[s]):
            check_row(row, ds, budget)
            assert row.epoch == 0 and row.index == s + k * n_shards
            want = ref[row.index] if row.index < len(ref) else []  # filler row for a short shard
            assert row.samples.tolist() == want
            seen += want
    assert sorted(seen) == list(range(len(ds)))  # each sample exactly once per epoch, across shards
    nxt = packers[0].next_row()  # rolls over into epoch 1, with a new order
    assert nxt.epoch == 1 and packers[0].epoch == 1 and nxt.index == 0
    assert nxt.samples.tolist() == ref_next_fit(ds.lengths.tolist(), np.random.default_rng((7, 1)).permutation(len(ds)).tolist(), budget)[0]


def test_packer_filler_row(tmp_path):
    # 5 samples of 10 tokens, budget 20: 3 rows (2+2+1); with 2 shards shard 1 gets row 1 and a filler
    write_dataset(tmp_path / "d", [(np.arange(1, 11), np.ones(10)) for _ in range(5)])
    d = open_dataset(tmp_path / "d")
    p = Packer(d, 20, n_shards=2, shard=1, shuffle=False)
    assert p.steps_per_epoch == 2
    r1, r2 = p.next_row(), p.next_row()
    assert r1.samples.tolist() == [2, 3] and r1.index == 1
    assert r2.samples.tolist() == [] and r2.index == 3 and r2.cu_seqlens.tolist() == [0, 20]
    assert (r2.loss_mask == 0).all() and (r2.doc == 0).all() and (r2.pos == np.arange(20)).all()
    p0 = Packer(d, 20, n_shards=2, shard=0, shuffle=False)
    assert [p0.next_row().samples.tolist() for _ in range(2)] == [[0, 1], [4]]


def test_packer_seed_and_shuffle(ds):
    rows = lambda p, n: [p.next_row().samples.tolist() for _ in range(n)]
    a, b, c = rows(Packer(ds, 64, seed=1), 20), rows(Packer(ds, 64, seed=1), 20), rows(Packer(ds, 64, seed=2), 20)
    assert a == b and a != c
    p = Packer(ds, 64, shuffle=False)
    flat = sum(rows(p, p.steps_per_epoch), [])
    assert flat == list(range(len(ds)))  # eval mode: same packing, file order, every sample once


def test_packer_resume(ds):
    for n_shards, shard in [(1, 0), (3, 2)]:
        ref = Packer(ds, 64, n_shards, shard, seed=5)
        spe = ref.steps_per_epoch
        stream = [ref.next_row() for _ in range(3 * spe + 2)]
        for k in [0, 1, spe - 1, spe, spe + 1, 2 * spe + 3]:  # incl. right at and across epoch boundaries
            p = Packer(ds, 64, n_shards, shard, seed=5)
            for _ in range(k):
                p.next_row()
            state = json.loads(json.dumps(p.state_dict()))  # as it would go through a checkpoint
            q = Packer(ds, 64, n_shards, shard, seed=999)  # the saved seed must win
            q.load_state_dict(state)
            for j in range(k, min(k + spe + 1, len(stream))):
                r, want = q.next_row(), stream[j]
                assert (r.epoch, r.index) == (want.epoch, want.index)
                for a, b in zip(r[:6], want[:6]):
                    assert np.array_equal(a, b)
    with pytest.raises(DataError, match="steps"):
        Packer(ds, 64).load_state_dict({"epoch": 0, "step": 10**6, "seed": 0})


def test_packer_truncation(tmp_path):
    lens = [100, 10, 64, 65, 3]
    write_dataset(tmp_path / "d", [(np.arange(L) + 1, np.ones(L, np.uint8)) for L in lens])
    d = open_dataset(tmp_path / "d")
    p = Packer(d, 64, shuffle=False)
    assert p.truncated == 2 and p.truncated_tokens == 36 + 1
    rows = [p.next_row() for _ in range(p.steps_per_epoch)]
    assert [r.samples.tolist() for r in rows] == [[0], [1], [2], [3], [4]]
    for r in rows:
        check_row(r, d, 64)
    assert rows[0].tokens.tolist() == list(range(1, 65))


# -----------------------------------------------------------------------------
# bad input, bad files, atomic writes

def good(i):
    return {"input_ids": [1, 2, 3, i % 50 + 1], "loss_mask": [0, 1, 1, 1]}


def test_bad_lines_reported(tmp_path):
    lines = [good(i) for i in range(200)]
    bad = {3: "{not json", 10: {"text": "hello"}, 20: {"input_ids": [1, -4, 2]},
           30: {"input_ids": [1, 500, 2]}, 40: {"input_ids": [1, 2], "loss_mask": [1]},
           50: {"input_ids": [1, 2], "loss_mask": [0, 0]}, 60: {"input_ids": []}, 70: [1, 2, 3]}
    for i, b in bad.items():
        lines[i - 1] = b
    lines.insert(99, "   ")  # a blank line is ignored, not counted as bad; later line numbers shift by one
    write_jsonl(tmp_path / "in.jsonl", lines)
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--vocab-size", 100, "--max-bad", 0.05)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for line, kind in [(3, "malformed JSON"), (10, "neither input_ids nor messages"), (20, "token id out of range"),
                       (30, "token id out of range"), (40, "loss_mask length mismatch"), (50, "no supervised token"),
                       (60, "bad input_ids"), (70, "neither input_ids nor messages")]:
        assert f"in.jsonl:{line}: {kind}" in out, kind
    assert "id -4" in out and "id 500 not in [0, 100)" in out
    assert "skipped 8 of 200 lines" in out and "2 token id out of range" in out and "ignored 1 blank lines" in out
    assert len(open_dataset(tmp_path / "d")) == 192
    # the same file with the default --max-bad (1%) fails loudly and writes nothing
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "e", "--vocab-size", 100)
    assert r.returncode == 1 and "8 of 200 lines (4.0%) are bad" in r.stderr and "--max-bad" in r.stderr
    assert not os.path.exists(tmp_path / "e" / "train") and os.listdir(tmp_path / "e") == []


def test_bad_lines_first_ten_then_counts(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", ["{broken"] * 15 + [good(i) for i in range(5)])
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--max-bad", 0.9)
    assert r.returncode == 0
    assert "in.jsonl:10: malformed JSON" in r.stdout and "in.jsonl:11:" not in r.stdout
    assert "skipped 15 of 20 lines: 15 malformed JSON" in r.stdout


@pytest.mark.parametrize("content,msg", [("", "is empty"), ("\n\n", "is empty"),
                                         ("{bad\n[1]\n", "none of its 2 lines is a valid sample")])
def test_nothing_valid_fails(tmp_path, content, msg):
    (tmp_path / "in.jsonl").write_text(content)
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d")
    assert r.returncode == 1 and msg in r.stderr and "in.jsonl" in r.stderr
    assert not os.path.exists(tmp_path / "d" / "train")


def test_cli_errors(tmp_path):
    r = cli("prepare", "--input", tmp_path / "nope.jsonl", "--out", tmp_path / "d")
    assert r.returncode == 1 and "nope.jsonl not found" in r.stderr
    write_jsonl(tmp_path / "in.jsonl", [good(i) for i in range(10)])
    assert cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d").returncode == 0
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d")
    assert r.returncode == 1 and "already exists" in r.stderr and "--force" in r.stderr
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--force", "--val", 0.2)
    assert r.returncode == 0 and len(open_dataset(tmp_path / "d")) == 8 and len(open_dataset(tmp_path / "d" / "val")) == 2
    r = cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--force", "--val", 10)
    assert r.returncode == 1 and "fewer than all" in r.stderr
    assert cli("prepare", "--input", tmp_path / "in.jsonl", "--out", tmp_path / "d", "--val", 1.5).returncode == 2
    assert sorted(os.listdir(tmp_path / "d")) == ["train", "val"]  # no temp directories left behind


def test_corrupt_dataset_named(tmp_path):
    write_dataset(tmp_path / "d", random_samples(20, 5, 10))
    open_dataset(tmp_path / "d")
    with open(tmp_path / "d" / "tokens.bin", "r+b") as f:
        f.truncate(40)
    with pytest.raises(DataError, match=r"tokens\.bin is 40 bytes.*python data\.py prepare"):
        open_dataset(tmp_path / "d")
    os.remove(tmp_path / "d" / "meta.json")
    with pytest.raises(DataError, match=r"meta\.json not found.*python data\.py prepare"):
        open_dataset(tmp_path / "d")
    write_dataset(tmp_path / "v", random_samples(3, 5, 10))
    meta = json.loads((tmp_path / "v" / "meta.json").read_text())
    (tmp_path / "v" / "meta.json").write_text(json.dumps({**meta, "version": 99}))
    with pytest.raises(DataError, match="version 99"):
        open_dataset(tmp_path / "v")
    write_dataset(tmp_path / "o", random_samples(3, 5, 10))
    off = np.fromfile(tmp_path / "o" / "offsets.bin", "<i8")
    off[[1, 2]] = off[[2, 1]]
    off.tofile(tmp_path / "o" / "offsets.bin")
    with pytest.raises(DataError, match=r"offsets\.bin must .*increase"):
        open_dataset(tmp_path / "o")


def test_write_is_atomic(tmp_path):
    def crashing():
        yield from random_samples(10, 1, 5)
        raise RuntimeError("simulated crash")
    with pytest.raises(RuntimeError):
        write_dataset(tmp_path / "d", crashing())
    assert os.listdir(tmp_path) == []  # neither d nor d.tmp-<pid>
    write_dataset(tmp_path / "d", random_samples(4, 1, 5))
    with pytest.raises(DataError, match="already exists"):
        write_dataset(tmp_path / "d", random_samples(4, 1, 5))
    with pytest.raises(RuntimeError):  # a crash during --force leaves the old dataset intact
        write_dataset(tmp_path / "d", crashing(), force=True)
    assert len(open_dataset(tmp_path / "d")) == 4 and os.listdir(tmp_path) == ["d"]
    write_dataset(tmp_path / "d", random_samples(7, 1, 5), force=True)
    assert len(open_dataset(tmp_path / "d")) == 7 and os.listdir(tmp_path) == ["d"]
    with pytest.raises(DataError, match="ids must be integers in"):
        write_dataset(tmp_path / "e", [(np.array([1, 5]), np.array([1, 1]))], vocab_size=5)
    assert os.listdir(tmp_path) == ["d"]


# -----------------------------------------------------------------------------
# scale: a few million tokens in flat memory

def rss_kb(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(field + ":"))


def test_large_dataset_flat_memory(tmp_path):
    rng = np.random.default_rng(0)
    n_tok = 0
    with open(tmp_path / "big.jsonl", "w") as f:
        while n_tok < 4_000_000:
            L = int(rng.integers(200, 3000))
            f.write(json.dumps({"input_ids": rng.integers(0, 200_000, L).tolist()}) + "\n")
            n_tok += L
    token_bytes = 4 * n_tok
    # prepare in a child process, whose peak RSS we compare with a child that only imports the same things
    # (VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork+exec, so it would report pytest's own size)
    peak = "import sys; sys.path.insert(0, {!r}); import data, json; {}; print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])"
    base = int(subprocess.run([sys.executable, "-c", peak.format(HERE, "pass")], capture_output=True, text=True, check=True).stdout)
    r = subprocess.run([sys.executable, "-c", peak.format(HERE, f"data.main(['prepare', '--input', {str(tmp_path / 'big.jsonl')!r}, '--out', {str(tmp_path / 'big')!r}, '--val', '0.01'])")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    prep = int(r.stdout.split()[-1])
    # open and iterate a full epoch. Anonymous memory is what must stay flat: pages of the memory-mapped
    # files count in VmRSS too, but they are the kernel's page cache, shared and evictable
    anon0, rss0, anon_peak, seen = rss_kb("RssAnon"), rss_kb("VmRSS"), 0, 0
    ds = open_dataset(tmp_path / "big")
    assert ds.meta["n_tokens"] + open_dataset(tmp_path / "big" / "val").meta["n_tokens"] == n_tok
    p = Packer(ds, 8192, n_shards=2, shard=0, seed=0)
    for _ in range(p.steps_per_epoch):
        row = p.next_row()
        seen += int((row.doc < len(row.samples)).sum())
        anon_peak = max(anon_peak, rss_kb("RssAnon"))
    rss1 = rss_kb("VmRSS")
    grow = anon_peak - anon0
    print(f"\n[memory] {n_tok / 1e6:.2f}M tokens = {token_bytes / 2**20:.1f} MiB of tokens.bin; "
          f"prepare peak RSS {prep} KiB vs {base} KiB for the bare imports (+{(prep - base) / 1024:.2f} MiB); "
          f"epoch of {p.steps_per_epoch} rows of 8192 on shard 0/2: anonymous RSS +{grow / 1024:.2f} MiB peak, "
          f"VmRSS +{(rss1 - rss0) / 1024:.1f} MiB (incl. mapped page cache)")
    assert seen > 0.4 * ds.meta["n_tokens"]  # shard 0 of 2 saw about half the tokens
    assert grow * 1024 < 0.25 * token_bytes
    assert (prep - base) * 1024 < 0.25 * token_bytes


# -----------------------------------------------------------------------------
# demo (needs model.py with the Target API; skipped until it exists)

def test_demo_is_the_targets_greedy_output(tmp_path):
    model = pytest.importorskip("model")
    if not hasattr(model, "Target") or not hasattr(model.Target, "build"):
        pytest.skip("model.py has no Target.build yet")
    import torch
    out = data.make_demo(tmp_path / "demo", samples=10, val_samples=3, new_tokens=20, seed=0, log=print)
    tr, va = open_dataset(out), open_dataset(os.path.join(out, "val"))
    assert len(tr) == 10 and len(va) == 3 and tr.vocab_size == model.TargetConfig.preset("tiny").vocab_size
    target = model.Target.build(model.TargetConfig.preset("tiny")).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds overhead (see make_demo)
    prompts = set()
    for d in (tr, va):
        for k in range(len(d)):
            ids, mask = (torch.from_numpy(a.astype(np.int64)) for a in d.sample(k))
            p = int((mask == 0).sum())
            assert 8 <= p <= 24 and len(ids) == p + 20 and mask[:p].sum() == 0 and mask[p:].all()
            prompts.add(tuple(ids[:p].tolist()))
            # independent of the packed step-by-step generation: one teacher-forced forward over the
            # sample alone; a causal model's argmax at every continuation position must be the next token
            logits = target.logits(ids, torch.tensor([0, len(ids)]))
            assert torch.equal(logits[p - 1:-1].argmax(-1), ids[p:])
    torch.set_num_threads(threads)
    assert len(prompts) == 13
    mtime = os.path.getmtime(os.path.join(out, "train", "meta.json"))
    assert data.make_demo(tmp_path / "demo", samples=10, val_samples=3, new_tokens=20, seed=0) == out  # reused
    assert os.path.getmtime(os.path.join(out, "train", "meta.json")) == mtime
    with pytest.raises(DataError, match="already exists"):  # a different demo is not silently overwritten
        data.make_demo(tmp_path / "demo", samples=11, val_samples=3, new_tokens=20, seed=0)
