"""
The target's own answers through its OpenAI-compatible server(s) (SGLang, vLLM), for prepare.py
(pip install openai tqdm; a server started with --api-key: set OPENAI_API_KEY):

    python regenerate.py --input prompts.jsonl --out answers.jsonl --server localhost:30000 \\
        --model /ckpt/Qwen3.6-27B

Each input line (messages, ShareGPT conversations or a prompt; "tools" sent) goes to OUT as it
finishes, {"input_line": N, <its other fields>, "messages": [...]}: every assistant turn answered
again in order, and a last user turn too (with tool calls or results, only the final answer);
answers keep "reasoning_content", "finish_reason" and "usage". Defaults are SpecForge's. With
thinking on, a server whose first 8 finished answers carry no reasoning stops the run before any
of its lines is written. Failed requests are retried unless refused (HTTP 4xx but 408, 429); lines
still failing go to OUT.failed.jsonl, exit status 1. Safe to kill: --resume asks only for the rest.
"""
import asyncio
import itertools
import json
import os
import random
import re
import ssl
import sys
import time
from collections import Counter, defaultdict

from data import ArgParser, Bad, DataError, kwargs_arg, load_line, number, package
from prepare import conversation, split_think, tools_of

def _server_url(s):  # --server: host:port, http://host:port or http://host:port/v1
    s = ("" if "://" in s else "http://") + s.rstrip("/")
    return s if s.endswith("/v1") else s + "/v1"

def _wire(m):
    """A message as sent back in a later request: the reasoning under SGLang's and vLLM's names
    (the chat template decides whether it renders: Qwen drops earlier turns' thinking)."""
    r = m.get("reasoning_content", m.get("reasoning"))
    m = {k: v for k, v in m.items() if k not in ("finish_reason", "usage")}
    return {**m, "reasoning_content": r, "reasoning": r} if r is not None else m

def _turns(obj, last):
    """A prompt line -> (the history before the first answer to regenerate, the rest, tools)."""
    msgs, tools = conversation(obj), tools_of(obj)
    if last or any(m["role"] == "tool" or m.get("tool_calls") for m in msgs):
        i = len(msgs) - (msgs[-1]["role"] == "assistant")
    else:
        i = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), len(msgs))
    if not any(m["role"] == "user" for m in msgs[:i]):
        raise Bad("no user turn", "the first answer to regenerate has no user message before it")
    return msgs[:i], msgs[i:] + [{"role": "assistant"}] * (msgs[-1]["role"] != "assistant"), tools

def _done_lines(out, resume, log):
    """Input line numbers already in `out`; a half-written last line (a killed run) is cut off."""
    if not os.path.exists(out) or os.path.getsize(out) == 0:
        return set()
    if not resume:
        raise DataError(f"{out} already exists; pass --resume to continue it "
                        "(or remove it to start over)")
    done = set()
    with open(out, "r+b") as f:
        for i, line in enumerate(iter(f.readline, b""), 1):
            if not line.endswith(b"\n"):  # one write per line, so only the last can be partial
                log(f"{out}: dropped a half-written last line; its prompt is asked again")
                f.truncate(f.tell() - len(line))
                break
            m = re.match(rb'\{"input_line": (\d+),', line)
            if not m:
                raise DataError(f"{out}:{i}: not a line regenerate wrote (no leading "
                                '"input_line"); give another --out')
            done.add(int(m[1]))
    return done

def regenerate(input, out, servers, model, concurrency=64, max_tokens=4096, temperature=0.7,
               top_p=None, top_k=None, chat_template_kwargs=None, timeout=3600.0, retries=5,
               backoff=1.0, resume=False, limit=None, turns="all", log=print):
    """Prompts JSONL -> `out` (the module's docstring). Returns the counts; raises DataError."""
    openai, tqdm = package("openai", "regenerate.py"), package("tqdm", "regenerate.py").tqdm
    if not os.path.isfile(input):
        raise DataError(f"input file {input} not found")
    failed_path = out.removesuffix(".jsonl") + ".failed.jsonl"
    done = _done_lines(out, resume, log)
    servers = list(dict.fromkeys(map(_server_url, servers)))
    key = os.environ.get("OPENAI_API_KEY", "none")  # for a server started with --api-key
    for url in servers:  # first: each server is up and serves --model
        try:
            with openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=10) as c:
                served = [m.id for m in c.models.list().data]
        except Exception as e:  # refused, HTTP error, not JSON: none of it is usable
            raise DataError(f"server {url} is unreachable: GET {url}/models failed "
                            f"({e.__cause__ or e}); start it (README: regenerate) or fix --server")
        if model not in served:
            raise DataError(f"{url} does not serve --model {model}; it serves "
                            f"{', '.join(served) or 'nothing'}")
    # top_k and chat_template_kwargs are SGLang's / vLLM's extensions of the OpenAI request
    sampling = {k: v for k, v in dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                      top_k=top_k, chat_template_kwargs=chat_template_kwargs
                                      ).items() if v is not None}
    # counts; per server: lines held until it shows reasoning, finished answers without, failed
    # lines in a row; the servers that showed reasoning (with thinking off: all)
    n, held, unthinking, streak = Counter(), defaultdict(list), Counter(), Counter()
    verified = set(servers if (chat_template_kwargs or {}).get("enable_thinking") is False else ())

    def pending():  # (line number, line) of the input lines still to answer
        with open(input, "rb") as f:
            yield from ((i, line) for i, line in itertools.islice(enumerate(f, 1), limit)
                        if line.strip() and i not in done)

    def jobs():  # one generator shared by all workers: the event loop runs one next() at a time
        for lineno, line in pending():
            try:
                obj = load_line(line)
                yield (lineno, obj, *_turns(obj, turns == "last"))
            except Bad as e:
                fail(lineno, e, "bad")

    def fail(lineno, e, kind):  # e: Bad(what is bad in the line, or the server; why)
        n[kind] += 1
        if n["failed"] + n["bad"] <= 20:
            tqdm.write(f"{input}:{lineno}: {e}")
        fails.write(json.dumps({"input_line": lineno, "error": str(e)}, ensure_ascii=False) + "\n")
        bar.update(1)

    async def ask(client, url, history, tools):
        req = dict(model=model, messages=[_wire(m) for m in history], **sampling,
                   **({} if tools is None else {"tools": tools}))
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
                    raise Bad(url, why)  # the request itself is wrong: retrying is futile
            else:
                try:  # `why` is what failed if the next line raises
                    why = f"non-JSON reply {text[:200]!r}"
                    body = json.loads(text)
                    why = f"reply without choices[0].message: {text[:200]!r}"
                    choice = body["choices"][0]
                    msg, usage = choice["message"], body.get("usage") or {}
                    if isinstance(msg, dict) and isinstance(usage, dict):
                        break
                except (ValueError, LookupError, TypeError):
                    pass
        else:
            raise Bad(url, f"{why} (after {retries} retries)")
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning")
        if not reasoning and "</think>" in content:
            reasoning, content = split_think(content)
        ans = dict(role="assistant", content=content, reasoning_content=reasoning,
                   tool_calls=msg.get("tool_calls"))
        ans = {k: v for k, v in ans.items() if v or k == "content"}
        ans.update(finish_reason=choice.get("finish_reason"),
                   usage={k: usage.get(k) for k in ("prompt_tokens", "completion_tokens")})
        n.update(answers=1, truncated=ans["finish_reason"] == "length",
                 tokens=usage.get("completion_tokens") or 0)
        # a server without a reasoning parser puts thinking nowhere we can see: stop early
        # (a cut answer may have stopped before its </think>, so only finished ones count)
        if url not in verified and ans["finish_reason"] != "length":
            unthinking[url] += not reasoning
            if reasoning:
                verified.add(url)
            elif unthinking[url] >= 8:  # finished answers, none with any reasoning
                raise DataError(no_thinking(url))
        return ans

    def no_thinking(url):
        return (f"{url} returned no reasoning in {unthinking[url]} finished answers with thinking "
                "on: start the server with --reasoning-parser qwen3 (SGLang, vLLM), or pass "
                "--chat-template-kwargs '{\"enable_thinking\": false}' if you serve without "
                f"thinking; nothing from {url} was written")

    async def worker(client, url):
        for lineno, obj, head, rest, tools in it:
            msgs = list(head)
            try:
                for m in rest:  # each answer asked with the target's own earlier answers
                    msgs.append(await ask(client, url, msgs, tools) if m["role"] == "assistant"
                                else m)
            except Bad as e:  # the request failed for good: (server, why)
                fail(lineno, e, "failed")
                streak[url] += 1
                if streak[url] >= 2 * concurrency:  # every line failing: the server is down
                    raise DataError(f"{url} fails every request: the last {streak[url]} lines all "
                                    f"failed (last: {e.args[1]}); fix it, then rerun with --resume")
                continue
            streak[url] = 0
            keep = {k: v for k, v in obj.items()
                    if k not in ("input_line", "messages", "conversations", "prompt")}
            held[url] += [json.dumps({"input_line": lineno, **keep, "messages": msgs},
                                     ensure_ascii=False) + "\n"]
            if url in verified:  # lines wait until their server has shown its reasoning
                outf.writelines(held.pop(url))
            n["lines"] += 1
            bar.update(1)

    tls = ssl.create_default_context()  # one for all pools: each build reads the CA store

    async def run():
        clients, tasks = [], []
        try:
            for url, i in itertools.product(servers, range(concurrency)):
                # a client, so a connection pool, per 16 workers: a pool's work per request grows
                # with its connections, and 16 workers open at most 16 (openai's default limits)
                if i % 16 == 0:
                    clients.append(openai.AsyncOpenAI(
                        base_url=url, api_key=key, timeout=timeout, max_retries=0,
                        http_client=openai.DefaultAsyncHttpxClient(verify=tls)))
                tasks.append(asyncio.ensure_future(worker(clients[-1], url)))
            await asyncio.gather(*tasks)
        finally:  # a worker's error: cancel the others before their clients close
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in clients:
                await c.close()

    todo, it = sum(1 for _ in pending()), jobs()
    if done:
        log(f"resuming: {len(done)} lines already in {out}, {todo} to go")
    # line-buffered: each line is flushed as it is written, so a kill can cut only the last
    with open(out, "a", encoding="utf-8", buffering=1) as outf, \
            open(failed_path, "w", encoding="utf-8", buffering=1) as fails, \
            tqdm(total=todo, unit="line", dynamic_ncols=True,
                 mininterval=0.1 if sys.stderr.isatty() else 10) as bar:  # a log: every 10 s
        t0, cpu0 = time.time(), time.process_time()
        asyncio.run(run())
        for url, lines in held.items():  # servers that never finished an answer: nothing to judge
            if lines and unthinking[url]:
                raise DataError(no_thinking(url))
            outf.writelines(lines)
    t, cpu = time.time() - t0, time.process_time() - cpu0
    # near 100% of a core, this client is what limits the servers
    log(f"regenerate: wrote {n['lines']} lines to {out} ({n['answers']} answers, {n['truncated']} "
        f"cut at --max-tokens {max_tokens}); {n['failed']} failed, {n['bad']} bad input lines "
        f"(listed in {failed_path}); {n['retries']} retries; {n['tokens']} tokens in {t:.1f}s "
        f"({n['answers'] / t:.1f} requests/s; this client used {cpu / t:.0%} of a CPU core, "
        f"{cpu / max(n['answers'], 1) * 1e3:.2f} ms a request)")
    if n["failed"]:
        raise DataError(f"{n['failed']} lines failed on the server (see above); "
                        "rerun with --resume to retry them")
    if n["bad"] and not n["lines"] and not done:
        raise DataError(f"{input}: none of its lines is a conversation to answer (see above)")
    return n

def main(argv=None):
    ap = ArgParser(description=__doc__)
    arg = ap.add_argument
    arg("--input", required=True, help="JSONL of messages, ShareGPT conversations or prompts")
    arg("--out", required=True, help="output JSONL, appended to; failures: OUT.failed.jsonl")
    arg("--server", dest="servers", metavar="URL", required=True, action="append",
        help="http://host:port[/v1] of an SGLang/vLLM server; repeat for several")
    arg("--model", required=True, help="the model name the servers serve")
    arg("--concurrency", type=number(int, 1), default=64, help="requests in flight per server (64)")
    arg("--max-tokens", type=number(int, 1), default=4096, help="per answer, thinking too (4096)")
    arg("--temperature", type=float, default=0.7, help="default 0.7")
    arg("--top-p", type=float, help="default: not sent (server's)")
    arg("--top-k", type=int, help="default: not sent (server's)")
    arg("--chat-template-kwargs", type=kwargs_arg, help="JSON for the servers' chat template")
    arg("--turns", choices=("all", "last"), default="all", help="assistant turns to answer")
    arg("--timeout", type=number(float, 0, above=True), default=3600,
        help="seconds one request may take (default 3600)")
    arg("--retries", type=number(int, 0), default=5, help="retries of a failed request (default 5)")
    arg("--backoff", type=number(float, 0), default=1.0, help="seconds to the 1st retry, doubling")
    arg("--resume", action="store_true", help="continue OUT: ask only for the lines it lacks")
    arg("--limit", type=number(int, 1), help="only the first N lines of --input (default all)")
    try:
        regenerate(**vars(ap.parse_args(argv)))
    except DataError as e:
        sys.exit(f"error: {e}")

if __name__ == "__main__":
    main()
