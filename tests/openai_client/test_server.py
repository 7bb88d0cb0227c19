"""`smoe serve` driven by the official `openai` Python package.

Starts the server on a free port with the demo model (or SMOE_MODEL), then: chat (whole and
streamed), text completions, a tool round trip, bad requests, a cancelled stream, and 8
concurrent seeded clients that must get exactly the tokens of the same 8 requests sent one by
one. Usage: python3 tests/openai_client/test_server.py [path/to/smoe]  (default:
target/release/smoe). Prints 'N passed, N failed' and exits non-zero on any failure.
"""

import json
import os
import re
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SMOE = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, "target", "release", "smoe")
MODEL_FILE = os.environ.get("SMOE_MODEL", os.path.join(ROOT, "models", "demo-qwen3-moe.smoe"))
MODEL = os.path.splitext(os.path.basename(MODEL_FILE))[0]
KEY = "sk-test"
MSG = [{"role": "user", "content": "What does the json module do?"}]


def start_server():
    proc = subprocess.Popen(
        [SMOE, "serve", "-m", MODEL_FILE, "--port", "0", "--max-concurrent", "8",
         "--ctx", "1024", "--api-key", KEY, "--no-profile"],
        stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    m = re.search(r"http://(\S+)", line)
    if not m:
        proc.kill()
        raise RuntimeError(f"smoe serve did not start: {line!r}")
    return proc, f"http://{m.group(1)}"


def metrics(base):
    req = urllib.request.Request(base + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    text = urllib.request.urlopen(req, timeout=10).read().decode()
    return {k: float(v) for k, v in re.findall(r"^(smoe_[a-z_]+) (\S+)$", text, re.M)}


class Ctx:
    def __init__(self, base):
        self.base = base
        self.client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def test_models(c):
    ids = [m.id for m in c.client.models.list().data]
    check(ids == [MODEL], ids)


def test_chat_whole_and_streamed(c):
    kw = dict(model=MODEL, messages=MSG, max_tokens=24, seed=11, temperature=0.8)
    r = c.client.chat.completions.create(**kw)
    ch = r.choices[0]
    check(ch.message.role == "assistant" and isinstance(ch.message.content, str), r)
    check(ch.finish_reason in ("stop", "length"), ch.finish_reason)
    u = r.usage
    check(u.total_tokens == u.prompt_tokens + u.completion_tokens and u.completion_tokens > 0, u)
    text, finish, usage = "", None, None
    stream = c.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    check(text == ch.message.content, (text, ch.message.content))
    check(finish == ch.finish_reason, finish)
    check(usage.completion_tokens == u.completion_tokens, usage)


def test_logprobs(c):
    # Greedy without the demo model's default repetition penalty, so the choice is the argmax.
    r = c.client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3,
                                         extra_body={"repetition_penalty": 1.0})
    lp = r.choices[0].logprobs.content
    check(len(lp) == r.usage.completion_tokens or r.choices[0].finish_reason == "stop", lp)
    for e in lp:
        check(len(e.top_logprobs) == 3 and e.logprob <= 0, e)
        # Greedy: the chosen token is the most likely one.
        check(e.top_logprobs[0].token == e.token, e)
    check("".join(e.token for e in lp) == r.choices[0].message.content, lp)


def test_completions(c):
    kw = dict(model=MODEL, prompt="In Python, a dictionary", max_tokens=16, temperature=0)
    r = c.client.completions.create(**kw)
    check(r.object == "text_completion" and r.usage.completion_tokens == 16, r)
    streamed = "".join(ch.choices[0].text for ch in c.client.completions.create(stream=True, **kw) if ch.choices)
    check(streamed == r.choices[0].text, (streamed, r.choices[0].text))
    r2 = c.client.completions.create(echo=True, **kw)
    check(r2.choices[0].text == kw["prompt"] + r.choices[0].text, r2)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def test_tool_round_trip(c):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    plain = c.client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    r = c.client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, max_tokens=8)
    # The tool schema went into the prompt.
    check(r.usage.prompt_tokens > plain.usage.prompt_tokens + 20, (r.usage, plain.usage))
    # The demo model does not call tools by itself; answer with a call and its result as a
    # client would, and the server must render both into the next prompt.
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    msgs2 = msgs + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    r2 = c.client.chat.completions.create(model=MODEL, messages=msgs2, tools=TOOLS, max_tokens=8)
    check(r2.usage.prompt_tokens > r.usage.prompt_tokens + 10, (r2.usage, r.usage))
    check(r2.choices[0].finish_reason in ("stop", "length", "tool_calls"), r2)
    # tool_choice "none": tools are not offered.
    r3 = c.client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS, tool_choice="none", max_tokens=1)
    check(r3.usage.prompt_tokens == plain.usage.prompt_tokens, r3.usage)


def test_bad_requests(c):
    for kw, exc in [
        (dict(n=2), openai.BadRequestError),
        (dict(temperature=7), openai.BadRequestError),
        (dict(max_tokens=100000), openai.BadRequestError),
        (dict(model="no-such-model"), openai.NotFoundError),
    ]:
        args = dict(model=MODEL, messages=MSG, max_tokens=4)
        args.update(kw)
        try:
            c.client.chat.completions.create(**args)
        except exc as e:
            check(e.body and e.body.get("message"), e.body)
            continue
        raise AssertionError(f"{kw}: no {exc.__name__}")
    bad = openai.OpenAI(base_url=c.base + "/v1", api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("wrong key accepted")
    except openai.AuthenticationError:
        pass


def test_cancelled_stream(c):
    before = metrics(c.base)
    stream = c.client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=900, stream=True,
                                              extra_body={"ignore_eos": True})
    got = 0
    for chunk in stream:
        got += 1
        if got == 5:
            break
    stream.close()
    deadline = time.time() + 10
    while time.time() < deadline:
        m = metrics(c.base)
        if m["smoe_requests_cancelled_total"] > before["smoe_requests_cancelled_total"] and m["smoe_active_requests"] == 0:
            break
        time.sleep(0.05)
    check(m["smoe_requests_cancelled_total"] == before["smoe_requests_cancelled_total"] + 1, m)
    generated = m["smoe_generation_tokens_total"] - before["smoe_generation_tokens_total"]
    check(generated < 900, f"the cancelled request kept generating: {generated} tokens")
    # The freed session serves the next request.
    r = c.client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    check(r.usage.completion_tokens > 0, r)


def run_one(c, i):
    r = c.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Question {i}: what is a {['list', 'set', 'class', 'module'][i % 4]}?"}],
        max_tokens=48, seed=1000 + i, temperature=0.9, logprobs=True, extra_body={"ignore_eos": True})
    return [e.token for e in r.choices[0].logprobs.content], r.choices[0].message.content


def test_concurrent_equals_sequential(c):
    t0 = time.time()
    sequential = [run_one(c, i) for i in range(8)]
    t_seq = time.time() - t0
    before = metrics(c.base)
    t0 = time.time()
    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(lambda i: run_one(c, i), range(8)))
    t_con = time.time() - t0
    after = metrics(c.base)
    for i, (s, k) in enumerate(zip(sequential, concurrent)):
        check(s == k, f"client {i}: concurrent output differs from sequential:\n{s}\n{k}")
    tokens = sum(len(t) for t, _ in sequential)
    passes = after["smoe_forward_passes_total"] - before["smoe_forward_passes_total"]
    # Batching: far fewer forward passes than generated tokens.
    check(passes < tokens * 0.6, f"{passes} passes for {tokens} tokens: requests were not batched")
    print(f"  8 clients x 48 tokens: sequential {tokens / t_seq:.0f} tok/s, "
          f"concurrent {tokens / t_con:.0f} tok/s ({t_seq / t_con:.2f}x), {passes:.0f} forward passes")


TESTS = [test_models, test_chat_whole_and_streamed, test_logprobs, test_completions,
         test_tool_round_trip, test_bad_requests, test_cancelled_stream,
         test_concurrent_equals_sequential]


def main():
    proc, base = start_server()
    passed = failed = 0
    try:
        c = Ctx(base)
        for t in TESTS:
            try:
                t(c)
                passed += 1
                print(f"ok     {t.__name__}")
            except Exception:
                failed += 1
                print(f"FAILED {t.__name__}")
                traceback.print_exc()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
