"""
CPU tests of generate.py: greedy speculative decoding with the tiny target and a drafter trained here on the demo
prompts. Run: python -m pytest -q test_generate.py   (~1-2 min; builds data/demo first if it is missing)
"""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import data
import generate
from model import Drafter, DrafterConfig, sample_anchors
from target import Target, TargetConfig, positions_from_cu

HERE = os.path.dirname(os.path.abspath(__file__))
MAX_NEW = 32


@pytest.fixture(autouse=True)
def one_thread():
    # tiny tensors: a second intra-op thread only adds overhead on a busy 2-core box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


class Run:
    """The tiny target, 8 demo held-out prompts and, per prompt, the target's greedy continuation of
    MAX_NEW + B - 1 tokens (so every slot of every block of the speculative run has a label)."""
    def __init__(self, tmp):
        torch.set_num_threads(1)
        self.demo = data.make_demo(os.path.join(HERE, "data", "demo"), log=lambda *a: None)
        self.t = Target.build(TargetConfig.preset("tiny"))
        self.prompts = generate.dataset_prompts(self.demo, 8)
        self.B = 16
        self.cont = [generate.greedy(self.t, p, MAX_NEW + self.B - 1) for p in self.prompts]
        self.drafter_dir = os.path.join(tmp, "drafter")
        train_drafter(self, self.drafter_dir)
        self.drafter = Drafter.from_pretrained(self.drafter_dir)      # the export, as a user loads it


def train_drafter(run, out, steps=90):
    """A 2-layer drafter trained with Drafter.forward on the prompts' greedy continuations (the DFlash recipe at
    toy scale, overfit to these prompts so a short run reaches tau well above 1), then exported."""
    t, seqs = run.t, [torch.cat([p, torch.tensor(c)]) for p, c in zip(run.prompts, run.cont)]
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    tokens, pos = torch.cat(seqs), positions_from_cu(cu)
    doc = torch.repeat_interleave(torch.arange(len(seqs)), cu.diff())
    loss_mask = torch.cat([(torch.arange(len(s)) >= len(p)).long() for s, p in zip(seqs, run.prompts)])
    cfg = DrafterConfig.from_target(t.config, n_feat=3, num_hidden_layers=2, block_size=run.B)
    feats = t.features(tokens, cu, cfg.target_layer_ids).clone()
    torch.manual_seed(0)
    d = Drafter(cfg)
    opt = torch.optim.AdamW(d.parameters(), lr=3e-3)
    for _ in range(steps):
        anchors, keep, _ = sample_anchors(loss_mask, doc, 48, 96)
        out_ = d(feats, tokens, loss_mask, doc, pos, anchors, keep, t.embed_tokens.weight, t.lm_head.weight)
        out_["loss"].backward()
        opt.step()
        opt.zero_grad()
    d.save_pretrained(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return Run(str(tmp_path_factory.mktemp("gen")))


def proxy_at(d, t, prompt, cont, anchor):
    """The training-time acceptance proxy (Drafter.forward's accept_sum) at one anchor of the row
    [prompt ; the target's greedy continuation], loss mask on the continuation."""
    tokens = torch.cat([prompt, torch.tensor(cont)])
    S = len(tokens)
    feats = t.features(tokens, torch.tensor([0, S]), d.config.target_layer_ids)
    loss_mask = (torch.arange(S) >= len(prompt)).long()
    with torch.no_grad():
        out = d(feats, tokens, loss_mask, torch.zeros(S, dtype=torch.long), torch.arange(S),
                torch.tensor([anchor]), torch.tensor([True]), t.embed_tokens.weight, t.lm_head.weight)
    return int(out["accept_sum"])


class Scripted:
    """A stand-in drafter with a fixed rule for its proposals (it has the real drafter's config)."""
    def __init__(self, config, rule):
        self.config, self.rule = config, rule

    def propose(self, ctx_feats, ctx_pos, anchor_token, anchor_pos, embed, head):
        assert ctx_feats.shape[0] == len(ctx_pos) == anchor_pos       # context: exactly the positions before
        return torch.tensor(self.rule(anchor_pos)), None

# -----------------------------------------------------------------------------

def test_features_and_logits_is_features_plus_logits():
    t = Target.build(TargetConfig.preset("tiny"))
    ids, cu = torch.randint(0, 512, (37,)), torch.tensor([0, 20, 37])
    at = torch.tensor([5, 19, 36])
    feats, logits = t.features_and_logits(ids, cu, [1, 3, 5], at=at)
    assert torch.equal(feats, t.features(ids, cu, [1, 3, 5]))
    assert torch.equal(logits, t.logits(ids, cu, at=at))


def test_prompts_are_the_unsupervised_prefix(run):
    ds = data.open_dataset(os.path.join(run.demo, "val"))
    for i, p in enumerate(run.prompts):
        tokens, mask = ds.sample(i)
        assert torch.equal(p, torch.from_numpy(tokens[:len(p)].astype("int64")))
        assert mask[:len(p)].sum() == 0 and mask[len(p)] == 1
        # the demo is the target's greedy continuation: the greedy decode must reproduce the sample exactly
        n = min(len(run.cont[i]), len(tokens) - len(p))
        assert n >= MAX_NEW and run.cont[i][:n] == tokens[len(p):len(p) + n].tolist()


def test_speculative_equals_greedy_and_tau_is_the_proxy(run):
    """Exact correspondence: let x = prompt + the target's greedy continuation (long enough that every block has
    labels), a_1 = len(prompt) (the prefill's token), a_{k+1} = a_k + tau_k. Then tau_k (accepted + 1 of cycle
    k) == the teacher-forced proxy of Drafter.forward at anchor a_k on row x: the drafter sees the same inputs
    (features of x[:a_k], the token x[a_k] at position a_k) and, as long as its proposals match, the target's
    verifying argmax at slot i is x[a_k + i + 1]. Equality is exact here (fp32; no argmax near-ties)."""
    d, B = run.drafter, run.B
    all_cycles = []
    for p, cont in zip(run.prompts, run.cont):
        spec, cycles, forwards = generate.speculative(run.t, d, p, MAX_NEW)
        assert spec == cont[:MAX_NEW] and forwards == 1 + len(cycles)
        anchors = [len(p) + sum(cycles[:k]) for k in range(len(cycles))]
        assert [proxy_at(d, run.t, p, cont, a) for a in anchors] == cycles
        assert sum(cycles[:-1]) < MAX_NEW - 1 <= sum(cycles)        # stopped right after max_new was reached
        all_cycles += cycles
    tau = sum(all_cycles) / len(all_cycles)
    print(f"trained drafter: tau {tau:.2f} over {len(all_cycles)} cycles, values {sorted(set(all_cycles))}")
    assert tau > 2 and len(set(all_cycles)) >= 4        # a nontrivial mix of cycle lengths


def test_oracle_drafter_fills_every_block(run):
    """A drafter that proposes the target's own greedy tokens: every cycle accepts all B-1 plus the bonus."""
    B, t = run.B, run.t
    for p, cont in list(zip(run.prompts, run.cont))[:3]:
        oracle = Scripted(run.drafter.config, lambda a: cont[a - len(p) + 1:a - len(p) + B])
        spec, cycles, forwards = generate.speculative(t, oracle, p, MAX_NEW)
        assert spec == cont[:MAX_NEW] and cycles == [B] * -(-(MAX_NEW - 1) // B) and forwards == 1 + len(cycles)


def test_mask_token_drafter_gives_tau_1(run):
    """A drafter that always proposes the mask token (as an untrained or mis-wired one can): nothing is ever
    accepted, so every target forward commits exactly one token, and the output is still the greedy one."""
    c = run.drafter.config
    lazy = Scripted(c, lambda a: [c.mask_token_id] * (c.block_size - 1))
    for p, cont in list(zip(run.prompts, run.cont))[:3]:
        assert c.mask_token_id not in cont          # else accepting it would be right
        spec, cycles, forwards = generate.speculative(run.t, lazy, p, MAX_NEW)
        assert spec == cont[:MAX_NEW] and cycles == [1] * (MAX_NEW - 1) and forwards == MAX_NEW


def test_wrong_mask_token_in_export_is_visibly_worse(run, tmp_path):
    """The most common serving complaint: a config.json with the wrong mask_token_id loads fine and silently
    drafts badly. generate.py shows it: tau collapses towards 1 (the output stays the greedy one: lossless)."""
    broken = tmp_path / "broken"
    shutil.copytree(run.drafter_dir, broken)
    cfg = json.load(open(broken / "config.json"))
    cfg["dflash_config"]["mask_token_id"] = 7
    json.dump(cfg, open(broken / "config.json", "w"))
    logs = []
    good = generate.evaluate(run.t, run.drafter, run.prompts, MAX_NEW, log=logs.append)
    bad = generate.evaluate(run.t, Drafter.from_pretrained(str(broken)), run.prompts, MAX_NEW, log=logs.append)
    print(f"tau: exported {good['tau']:.2f}, mask_token_id 511 -> 7 in config.json {bad['tau']:.2f}")
    assert bad["tau"] - 1 < 0.5 * (good["tau"] - 1)
    assert good["identical"] == bad["identical"] == len(run.prompts)
    assert good["spec_forwards"] < good["greedy_forwards"] and good["hist"][0] < sum(good["hist"])
    assert good["tau"] == pytest.approx(sum((k + 1) * c for k, c in enumerate(good["hist"])) / sum(good["hist"]))


def test_eos_stops_both_decodes(run):
    p, cont = run.prompts[0], run.cont[0]
    eos = cont[6]
    stop = cont.index(eos)                     # its first occurrence
    spec, _, _ = generate.speculative(run.t, run.drafter, p, MAX_NEW, eos={eos})
    assert spec == generate.greedy(run.t, p, MAX_NEW, eos={eos}) == cont[:stop + 1]


def test_divergence_is_reported(run, monkeypatch):
    """A greedy decode that differs (here: forced, at new token 5) is named, with the target's top-2 gap there;
    a large gap is called a bug, not bf16 rounding."""
    real = generate.greedy
    monkeypatch.setattr(generate, "greedy", lambda *a, **k: [x if i != 5 else (x + 1) % 512
                                                             for i, x in enumerate(real(*a, **k))])
    logs = []
    res = generate.evaluate(run.t, run.drafter, run.prompts[:1], 12, log=logs.append)
    assert res["identical"] == 0
    assert "DIVERGES at new token 5" in logs[0] and "NOT a near-tie: a bug" in logs[0], logs[0]


def test_chat_prompt_is_the_prefix_before_the_answer(tmp_path):
    """A chat prompt is exactly what `data.py prepare` writes before the first supervised token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["<unk>", "system", "user", "assistant", "hi", "hello", "there", "be", "brief"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens(["\n"])
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tmp_path / "tok.json"))
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello there"}]
    with open(tmp_path / "chats.jsonl", "w") as f:
        f.write(json.dumps({"messages": conv}) + "\n\n" + json.dumps({"messages": conv[:2]}) + "\n")
    prompts = generate.chat_prompts(tmp_path / "chats.jsonl", str(tmp_path / "tok.json"), 8)
    encode, _ = data._chat_encoder(str(tmp_path / "tok.json"))
    ids, mask = encode(conv)
    first = mask.index(1)
    assert len(prompts) == 2 and prompts[0].tolist() == prompts[1].tolist() == ids[:first]
    text = tok.decode(ids[:first], skip_special_tokens=False)
    assert text.replace(" ", "").endswith("<|im_start|>assistant\n"), text
    with open(tmp_path / "bad.jsonl", "w") as f:
        f.write('{"prompt": "hi"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        generate.chat_prompts(tmp_path / "bad.jsonl", str(tmp_path / "tok.json"), 8)


def cli(script, *flags):
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    return subprocess.run([sys.executable, os.path.join(HERE, script), *map(str, flags)], capture_output=True,
                          text=True, timeout=600, cwd=HERE, env={**env, "OMP_NUM_THREADS": "1"})


def test_cli(run, tmp_path):
    r = cli("generate.py", "--drafter", run.drafter_dir, "--num-prompts", 2, "--max-new-tokens", 16)
    assert r.returncode == 0, r.stderr
    assert "speculative == greedy on 2/2 prompts" in r.stdout and r.stdout.count("identical to greedy") == 2
    r = cli("generate.py", "--drafter", tmp_path)
    assert r.returncode != 0 and "error: --drafter" in r.stderr and "no config.json" in r.stderr
    r = cli("generate.py", "--drafter", "random", "--prompts", tmp_path / "x.jsonl")
    assert r.returncode != 0 and "--prompts needs --tokenizer" in r.stderr
    r = cli("generate.py", "--drafter", "random", "--data", tmp_path)
    assert r.returncode != 0 and "has no val/ split" in r.stderr
    r = cli("generate.py", "--drafter", run.drafter_dir, "--target", "qwen3.6-27b")
    assert r.returncode != 0 and "does not fit --target qwen3.6-27b: hidden size 64" in r.stderr


def test_train_generate_flag(run, tmp_path):
    """train.py --generate-prompts: tau of the exported drafter logged next to the held-out proxy."""
    r = cli("train.py", "--out", tmp_path, "--max-steps", 4, "--no-compile", "--eval-interval", 1000,
            "--generate-prompts", 2, "--generate-tokens", 8)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    recs = [json.loads(l) for l in open(tmp_path / "log.jsonl")]
    gen = [x for x in recs if x["kind"] == "generate"]
    assert len(gen) == 1 and gen[0]["prompts"] == 2 and gen[0]["identical"] == 2 and gen[0]["tau"] >= 1
    assert gen[0]["proxy_accept"] == [x for x in recs if x["kind"] == "eval"][-1]["accept"]
    assert "generate: tau" in r.stdout
