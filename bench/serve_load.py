#!/usr/bin/env python3
"""vLLM's OpenAI-compatible server with kt's experts under sustained load.

A small random-weight Qwen3-MoE checkpoint (tests/python/helpers/
serve_models.py, fp32; written once and reused) is served on loopback by
vLLM's API server with the kt plugin (helpers/vllm_server.py). For each
concurrency, that many clients send requests back to back for --seconds,
then the load stops by itself; the server is stopped (SIGTERM) at the end.

The mix, drawn per request with a fixed seed: completions and chat
completions (chat only where the checkpoint has a chat template), each
streamed or not, prompts of 1-8, 9-64 and 65-400 tokens, ignore_eos so that
every answer has max_tokens tokens; streams cancelled after 3 chunks (the
client closes the connection); prompts over the model's max length (a 400
refusal is expected); malformed requests (bad JSON, wrong types, an unknown
model: a 4xx refusal is expected).

Reported per concurrency: requests done, refused (by reason and status),
cancelled; errors: anything that is not an intended refusal or a
cancellation (a 5xx, an unexpected status, a reset or timeout, an answer of
the wrong length or with text outside the vocabulary, the server gone);
p50 and p99 latency of the completed requests and their tokens/s; RSS (and
PSS from /proc/PID/smaps_rollup) of every process of the server (the API
process, its engine-core child and the worker that holds the model),
sampled every --sample-every seconds, and their growth from the end of the
warm-up (--warmup seconds of load) to the end of the load. Greedy answers (temperature 0, 16 tokens) of a fixed
set of prompts are taken from one client before the load, again every
--greedy-every seconds during it (interleaved with the load) and after it,
and must be identical.

The server runs with ONEDNN_PRIMITIVE_CACHE_CAPACITY=16 (--onednn-cache):
with oneDNN's default of 1024 generated GEMM kernels, one per shape, vLLM's
worker grows for minutes (with vLLM's own experts as with kt's) until the
cache is full, which the memory criterion would take for a leak.

Fails (exit status 1) if there is any error, if the RSS of the server's
processes together, or of one of its processes of at least 256 MiB, grows
by more than --rss-growth % after the warm-up, if a greedy answer differs,
or if the server does not stop within a minute of SIGTERM.

  bench/serve_load.py [--concurrency 8,32] [--seconds 600] [--warmup S]
                      [--threads N] [--onednn-cache 16] [--seeded] [--without-kt] [--model-dir DIR]
                      [--json] [--log FILE]

Run it with the serving venv's Python (tools/python_env.sh serve makes it:
build-serve/bin/python bench/serve_load.py). Only the standard library
speaks HTTP here (http.client, one connection per request).
"""
import argparse
import http.client
import json
import os
import random
import re
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests", "python")
sys.path.insert(0, TESTS)
sys.path.insert(0, HERE)

import whole_model  # noqa: E402  (the memory of a process tree)
from helpers import serve_models, vllm_server  # noqa: E402

MODEL = vllm_server.SERVED_NAME
GREEDY_PROMPTS = [[5, 6, 7, 8], list(range(9, 20)), [100], list(range(20, 60)), list(range(200, 330))]
GREEDY_TOKENS = 16
CANCEL_AFTER = 3
# A stream to cancel asks for many tokens; the server may still send them in
# fewer than CANCEL_AFTER chunks (it merges the tokens of a request that its
# client has not read yet), and such a stream is checked as a whole.
CANCEL_TOKENS = 256
# (kind, weight) of the request mix.
MIX = [("completion", 28), ("stream", 24), ("chat", 10), ("chat_stream", 8), ("cancel", 10),
       ("too_long", 6), ("bad_json", 4), ("wrong_types", 5), ("unknown_model", 5)]
# The refusals each kind is meant to get; any other answer is an error.
EXPECTED = {"too_long": {400}, "bad_json": set(range(400, 500)), "wrong_types": set(range(400, 500)),
            "unknown_model": set(range(400, 500))}
BIG_PROCESS = 256 << 20
WORD = re.compile(r"^w\d+$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", default="8,32", help="clients at once, one load phase per value")
    p.add_argument("--seconds", default="600",
                   help="load per concurrency: one value, or one per --concurrency value")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of load before the memory baseline (default: a quarter of --seconds, at most 60)")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS of the server and kt's threads (default: vLLM's own CPU binding, "
                        "kt on every CPU its worker may use)")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=24, help="the most tokens a load request asks for")
    p.add_argument("--greedy-every", type=float, default=10.0)
    p.add_argument("--sample-every", type=float, default=2.0)
    p.add_argument("--rss-growth", type=float, default=2.0, help="the most RSS growth after the warm-up, %%")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None,
                   help="the checkpoint (written there if absent); default a directory under the temporary one")
    p.add_argument("--log", default=None, help="the server's log (default a temporary file)")
    p.add_argument("--onednn-cache", type=int, default=16,
                   help="ONEDNN_PRIMITIVE_CACHE_CAPACITY of the server; 0: oneDNN's default (1024)")
    p.add_argument("--seeded", action="store_true",
                   help="sampled requests carry a seed of their own (vLLM 0.32's CPU engine dies on one whose "
                        "prompt is prefilled in chunks: 'CPU Generator does not use offset')")
    p.add_argument("--without-kt", action="store_true",
                   help="vLLM's own experts, for comparison (the plugin is not asked for)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",")]
    seconds = [float(s) for s in str(args.seconds).split(",")]
    if len(seconds) not in (1, len(args.concurrency)):
        p.error("--seconds takes one value or one per --concurrency value")
    args.seconds = seconds * len(args.concurrency) if len(seconds) == 1 else seconds
    if args.warmup is None:
        args.warmup = min(60.0, min(args.seconds) / 4)
    return args


def build_model(directory):
    if not os.path.exists(os.path.join(directory, "config.json")):
        serve_models.build(directory, "qwen3_moe", "float32")
    with open(os.path.join(directory, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return vocab - len(serve_models.SPECIAL)


def has_chat_template(directory):
    if os.path.exists(os.path.join(directory, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            return bool(json.load(f).get("chat_template"))
    except OSError:
        return False


# ---------------------------------------------------------------- requests

class Outcome:
    """One request: kind, status ("done", "refused", "cancelled", "error"),
    the HTTP status code, seconds, tokens, and the reason of an error."""
    __slots__ = ("kind", "status", "code", "seconds", "tokens", "reason", "text")

    def __init__(self, kind):
        self.kind, self.status, self.code, self.seconds, self.tokens, self.reason, self.text = \
            kind, None, None, 0.0, 0, None, None


class Client:
    def __init__(self, port, words, max_model_len, timeout, seeded=False):
        self.port, self.words, self.max_model_len, self.timeout = port, words, max_model_len, timeout
        self.seeded = seeded

    def _send(self, path, body):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()

    def prompt(self, rng, n=None):
        if n is None:
            lo, hi = rng.choice([(1, 8), (9, 64), (65, 400)])
            n = rng.randint(lo, hi)
        return serve_models.prompt_text([rng.randrange(self.words) for _ in range(n)])

    def _check_text(self, out, text, tokens, max_tokens):
        # Every token decodes to one "wN" word, or to nothing (a special
        # token, skipped): at most max_tokens words, all of the vocabulary.
        words = text.split()
        if tokens != max_tokens:
            out.status, out.reason = "error", "%d tokens where %d were asked for" % (tokens, max_tokens)
        elif len(words) > max_tokens or not all(WORD.match(w) for w in words):
            out.status, out.reason = "error", "text outside the vocabulary: %r" % text[:200]
        else:
            out.status, out.tokens, out.text = "done", tokens, text

    def run(self, kind, rng, max_tokens):
        out = Outcome(kind)
        t = time.perf_counter()
        try:
            self._run(out, kind, rng, max_tokens)
        except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError, TypeError) as e:
            out.status, out.reason = "error", "%s: %s" % (type(e).__name__, e)
        out.seconds = time.perf_counter() - t
        return out

    def _run(self, out, kind, rng, max_tokens):
        chat = kind.startswith("chat")
        path = "/v1/chat/completions" if chat else "/v1/completions"
        body = {"model": MODEL, "max_tokens": max_tokens, "temperature": rng.choice([0.0, 0.8]),
                "ignore_eos": True}
        if self.seeded and body["temperature"]:
            body["seed"] = rng.randrange(1 << 30)
        n = (self.max_model_len + rng.randint(1, 64) if kind == "too_long"
             else rng.randint(1, 64) if kind == "cancel" else None)
        prompt = self.prompt(rng, n)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        stream = kind in ("stream", "chat_stream", "cancel")
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        if kind == "cancel":
            body["max_tokens"] = CANCEL_TOKENS
        if kind == "bad_json":
            body = json.dumps(body).encode()[:-7]
        elif kind == "wrong_types":
            body["max_tokens"] = rng.choice(["many", [4], {"n": 4}])
        elif kind == "unknown_model":
            body["model"] = "no-such-model"
        conn, r = self._send(path, body)
        try:
            out.code = r.status
            if kind in EXPECTED:
                payload = r.read()
                if r.status in EXPECTED[kind]:
                    out.status = "refused"
                else:
                    out.status, out.reason = "error", "HTTP %d where %s was expected: %s" % (
                        r.status, _codes(EXPECTED[kind]), payload[:300].decode(errors="replace"))
                return
            if r.status != 200:
                out.status, out.reason = "error", "HTTP %d: %s" % (r.status, r.read()[:300].decode(errors="replace"))
                return
            if not stream:
                answer = json.loads(r.read())
                choice = answer["choices"][0]
                text = choice["message"]["content"] if chat else choice["text"]
                self._check_text(out, text or "", answer["usage"]["completion_tokens"], max_tokens)
                return
            self._stream(out, r, chat, kind == "cancel", body["max_tokens"])
        finally:
            conn.close()  # for a cancellation: the connection is closed mid-stream

    def _stream(self, out, r, chat, cancel, max_tokens):
        chunks, text, tokens, done = 0, [], None, False
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or []:
                piece = choice["delta"].get("content") if chat else choice.get("text")
                if piece:
                    text.append(piece)
                    chunks += 1
            if cancel and chunks >= CANCEL_AFTER:
                out.status, out.tokens = "cancelled", chunks
                return
        if not done or tokens is None:
            out.status, out.reason = "error", "the stream ended without its usage and [DONE] (%d chunks)" % chunks
        else:
            self._check_text(out, "".join(text), tokens, max_tokens)

    def greedy(self, prompts):
        """The greedy answers (token texts) of prompts, one request at a time."""
        answers = []
        for ids in prompts:
            conn, r = self._send("/v1/completions", {"model": MODEL, "prompt": serve_models.prompt_text(ids),
                                                     "max_tokens": GREEDY_TOKENS, "temperature": 0.0,
                                                     "ignore_eos": True})
            try:
                if r.status != 200:
                    raise RuntimeError("greedy request: HTTP %d: %s" % (r.status, r.read()[:300]))
                answers.append(json.loads(r.read())["choices"][0]["text"])
            finally:
                conn.close()
        return answers


def _codes(codes):
    return "4xx" if len(codes) > 1 else str(next(iter(codes)))


# ---------------------------------------------------------------- memory

class Memory:
    """RSS and PSS of every process of the server's tree, sampled in a
    thread; the samples are (seconds, {pid: (name, rss, pss)})."""

    def __init__(self, pid, every):
        self.pid, self.every, self.samples = pid, every, []
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self):
        procs = {}
        for p in whole_model._tree(self.pid):
            st = whole_model._status(p)
            if st is not None:
                procs[p] = (st[0], st[1], whole_model._pss(p))
        self.samples.append((time.perf_counter() - self.t0, procs))
        return procs

    def _run(self):
        while not self._stop.wait(self.every):
            self.sample()

    def now(self):
        return time.perf_counter() - self.t0

    def stop(self):
        self._stop.set()
        self._thread.join()


def _at(samples, t):
    """The last sample at or before t (the first one if none)."""
    best = samples[0]
    for s in samples:
        if s[0] <= t:
            best = s
    return best


def memory_report(samples, start, warm, end, limit):
    """Per process and in total: RSS (PSS) at the start of the load, at the
    end of the warm-up, at the end and their peak after the warm-up; growth
    from the warm-up's end to the end, %."""
    inside = [s for s in samples if warm <= s[0] <= end] or [_at(samples, end)]
    s0, sw, se = _at(samples, start), _at(samples, warm), _at(samples, end)
    procs = []
    for pid in sorted(se[1]):
        name = se[1][pid][0]

        def val(s, i, pid=pid):
            v = s[1].get(pid)
            return v[i] if v else None
        rss_w, rss_e = val(sw, 1), val(se, 1)
        pss_w, pss_e = val(sw, 2), val(se, 2)
        procs.append({"pid": pid, "name": name, "rss_start": val(s0, 1), "rss_warm": rss_w, "rss_end": rss_e,
                      "rss_peak": max((val(s, 1) or 0) for s in inside),
                      "pss_warm": pss_w, "pss_end": pss_e,
                      "rss_growth_pct": _growth(rss_w, rss_e), "pss_growth_pct": _growth(pss_w, pss_e)})
    total = lambda s, i: sum(v[i] or 0 for v in s[1].values())  # noqa: E731
    pss_readable = all(v[2] is not None for s in (sw, se) for v in s[1].values())
    out = {"processes": procs, "samples": len(samples),
           "rss_total_warm": total(sw, 1), "rss_total_end": total(se, 1),
           "rss_total_peak": max(total(s, 1) for s in inside),
           "rss_total_growth_pct": _growth(total(sw, 1), total(se, 1)),
           "pss_total_warm": total(sw, 2) if pss_readable else None,
           "pss_total_end": total(se, 2) if pss_readable else None,
           "pss_total_growth_pct": _growth(total(sw, 2), total(se, 2)) if pss_readable else None}
    # Held to the limit: the total, and each process big enough that a
    # percentage of it means something (not a helper of a few MiB).
    checked = [out["rss_total_growth_pct"]] + [p["rss_growth_pct"] for p in procs
                                               if (p["rss_warm"] or 0) >= BIG_PROCESS]
    checked = [g for g in checked if g is not None]
    # Nothing to check (the server gone) fails too.
    out["rss_growth_max_pct"] = max(checked) if checked else None
    out["rss_growth_ok"] = bool(checked) and out["rss_growth_max_pct"] <= limit
    return out


def mappings(pid):
    """Where the PSS of each big process of the tree lies (MiB by mapping)."""
    out = {}
    for p in whole_model._tree(pid):
        st = whole_model._status(p)
        if st is not None and st[1] >= BIG_PROCESS:
            out[p] = {k: round(v / 2 ** 20, 1) for k, v in (whole_model.pss_by_mapping(p, top=4) or {}).items()}
    return out


def _growth(a, b):
    return None if not a or b is None else 100.0 * (b - a) / a


# ---------------------------------------------------------------- load

def _percentile(values, q):
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100.0 * (len(v) - 1))))]


def run_phase(args, server, client, memory, clients, seconds, kinds, reference):
    """clients at once for seconds, the greedy prompts interleaved; returns
    the phase's report."""
    outcomes, lock = [], threading.Lock()
    greedy = {"checks": 0, "mismatches": []}
    start = memory.now()
    t0 = time.perf_counter()
    deadline = t0 + seconds
    server_gone = []
    where = {}

    def worker(i):
        rng = random.Random("%d-%d-%d" % (args.seed, clients, i))
        names, weights = zip(*kinds)
        while time.perf_counter() < deadline and not server_gone:
            kind = rng.choices(names, weights)[0]
            o = client.run(kind, rng, rng.randint(4, args.max_tokens))
            with lock:
                outcomes.append(o)

    def interleaved():
        while not stop.wait(args.greedy_every) and not server_gone:
            try:
                got = client.greedy(GREEDY_PROMPTS)
            except (OSError, http.client.HTTPException, RuntimeError, ValueError) as e:
                got = ["%s: %s" % (type(e).__name__, e)]
            greedy["checks"] += 1
            if got != reference:
                greedy["mismatches"].append({"at_s": round(time.perf_counter() - t0, 1), "got": got})

    def watch():
        warm = None
        while not stop.wait(1.0):
            if server.proc.poll() is not None:
                server_gone.append(server.proc.returncode)
                return
            if warm is None and time.perf_counter() - t0 >= args.warmup:
                warm = mappings(server.proc.pid)
                where["warm"] = warm

    stop = threading.Event()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    side = [threading.Thread(target=interleaved), threading.Thread(target=watch)]
    for th in threads + side:
        th.start()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - t0
    stop.set()
    for th in side:
        th.join()
    end = memory.now()
    memory.sample()
    where["end"] = mappings(server.proc.pid)

    done = [o for o in outcomes if o.status == "done"]
    refused, codes = {}, {}
    for o in outcomes:
        if o.status == "refused":
            refused[o.kind] = refused.get(o.kind, 0) + 1
            codes.setdefault(o.kind, {})
            codes[o.kind][str(o.code)] = codes[o.kind].get(str(o.code), 0) + 1
    errors = [o for o in outcomes if o.status == "error"]
    reasons = {}
    for o in errors:
        key = "%s: %s" % (o.kind, re.sub(r"\d+", "N", o.reason or "?")[:160])
        reasons[key] = reasons.get(key, 0) + 1
    if server_gone:
        reasons["the server exited with %s during the load" % server_gone[0]] = 1
    tokens = sum(o.tokens for o in done)
    return {"clients": clients, "seconds": round(elapsed, 1), "requests": len(outcomes), "done": len(done),
            "done_by_kind": _count(done), "refused": sum(refused.values()), "refused_by_reason": refused,
            "refusal_codes": codes, "cancelled": sum(1 for o in outcomes if o.status == "cancelled"),
            "errors": len(errors) + len(server_gone), "error_reasons": reasons,
            "latency_p50_s": _percentile([o.seconds for o in done], 50),
            "latency_p99_s": _percentile([o.seconds for o in done], 99),
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0, "tokens": tokens,
            "greedy_checks": greedy["checks"], "greedy_mismatches": greedy["mismatches"],
            "memory": dict(memory_report(memory.samples, start, start + args.warmup, end, args.rss_growth),
                           pss_by_mapping=where,
                           series=[[round(t - start, 1), {p: v[1] >> 20 for p, v in procs.items()}]
                                   for t, procs in memory.samples if start <= t <= end])}


def _count(outcomes):
    out = {}
    for o in outcomes:
        out[o.kind] = out.get(o.kind, 0) + 1
    return out


def run(args):
    model_dir = args.model_dir or os.path.join(tempfile.gettempdir(), "kt-serve-load-qwen3_moe")
    words = build_model(model_dir)
    kinds = MIX if has_chat_template(model_dir) else [(k, w) for k, w in MIX if not k.startswith("chat")]
    log = args.log or tempfile.NamedTemporaryFile(prefix="kt-serve-load-", suffix=".log", delete=False).name
    extra = ["--seed", "0"]
    if not args.without_kt:
        kt_options = {"threads": args.threads} if args.threads else {}
        extra += ["--additional-config", json.dumps({"kt": kt_options})]
    # oneDNN keeps the kernels it generates for each GEMM shape (vLLM's
    # linear layers: one per batch size seen) in a cache of 1024 by default,
    # which fills for minutes under a varied load (~300 MiB here) and would
    # pass for a leak; a small cache leaves the growth that is not its.
    server_env = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(args.onednn_cache)} if args.onednn_cache else {}
    if args.threads:
        server_env["OMP_NUM_THREADS"] = str(args.threads)
    server = vllm_server.Server(log, model_dir, extra, max_model_len=args.max_model_len, extra_env=server_env)
    report = {"model": model_dir, "log": log, "command": " ".join(server.command), "cpu": cpu_name(),
              "args": {k: v for k, v in vars(args).items() if k != "json"}, "chat": len(kinds) == len(MIX),
              "phases": []}
    t = time.perf_counter()
    memory = None
    try:
        server.wait_ready()
        report["start_to_ready_s"] = round(time.perf_counter() - t, 1)
        memory = Memory(server.proc.pid, args.sample_every)
        client = Client(server.port, words, args.max_model_len, args.request_timeout, args.seeded)
        reference = client.greedy(GREEDY_PROMPTS)
        report["greedy_before"] = reference
        for clients, seconds in zip(args.concurrency, args.seconds):
            report["phases"].append(run_phase(args, server, client, memory, clients, seconds, kinds, reference))
            if server.proc.poll() is not None:
                break
        if server.proc.poll() is None:
            after = client.greedy(GREEDY_PROMPTS)
            report["greedy_after_identical"] = after == reference
            if after != reference:
                report["greedy_after"] = after
        report["processes"] = sorted({v[0] for s in memory.samples for v in s[1].values()})
    finally:
        pids = whole_model._tree(server.proc.pid)
        if memory is not None:
            memory.stop()
        code, clean = server.stop()
        # A helper (multiprocessing's resource tracker) exits once the
        # server's pipes close: a few seconds are allowed.
        waited = time.perf_counter() + 10
        left = pids
        while left and time.perf_counter() < waited:
            time.sleep(0.5)
            left = [p for p in pids if whole_model._status(p) is not None]
        report["server_stop"] = {"returncode": code, "by_sigterm": clean, "processes_left": left}
    text = server.text()
    report["kt_layers_logged"] = len(set(re.findall(r"kt: (model\.layers\.\d+\.mlp\.experts): \d+ experts", text)))
    report["log_tracebacks"] = text.count("Traceback (most recent call last)")
    report["failures"] = failures(report)
    return report


def failures(report):
    out = []
    for ph in report["phases"]:
        c = ph["clients"]
        if ph["errors"]:
            out.append("%d clients: %d errors: %s" % (c, ph["errors"], ph["error_reasons"]))
        if not ph["memory"]["rss_growth_ok"]:
            out.append("%d clients: RSS grew %s after the warm-up" % (c, _pct(ph["memory"]["rss_growth_max_pct"])))
        if ph["greedy_mismatches"]:
            out.append("%d clients: %d of %d greedy checks differ" % (c, len(ph["greedy_mismatches"]),
                                                                      ph["greedy_checks"]))
        if not ph["done"]:
            out.append("%d clients: no request completed" % c)
    if "greedy_after_identical" not in report:
        out.append("no greedy answers after the load (the server is gone)")
    elif not report["greedy_after_identical"]:
        out.append("the greedy answers after the load differ")
    stop = report["server_stop"]
    if not stop["by_sigterm"] or stop["processes_left"]:
        out.append("the server did not stop cleanly: %s" % stop)
    if not report["kt_layers_logged"] and not report["args"]["without_kt"]:
        out.append("the server's log names no layer computed by kt")
    return out


def cpu_name():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return os.uname().machine


def _mib(b):
    return "-" if b is None else "%.0f" % (b / 2 ** 20)


def _pct(g):
    return "-" if g is None else "%+.2f %%" % g


def table(report):
    lines = ["| clients | s | requests | done | refused (reason: status) | cancelled | errors | p50 s | p99 s "
             "| tokens/s | server RSS MiB warm → end | RSS growth | PSS growth | greedy checks |",
             "|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for ph in report["phases"]:
        m = ph["memory"]
        reasons = ", ".join("%s %d: %s" % (k, n, "/".join(sorted(ph["refusal_codes"][k])))
                            for k, n in sorted(ph["refused_by_reason"].items()))
        greedy = "%d, %s" % (ph["greedy_checks"], "identical" if not ph["greedy_mismatches"]
                             else "%d differ" % len(ph["greedy_mismatches"]))
        lines.append("| %d | %.0f | %d | %d | %d (%s) | %d | %d | %.2f | %.2f | %.1f | %s → %s | %s | %s | %s |" % (
            ph["clients"], ph["seconds"], ph["requests"], ph["done"], ph["refused"], reasons, ph["cancelled"],
            ph["errors"], ph["latency_p50_s"] or 0, ph["latency_p99_s"] or 0, ph["tokens_per_s"],
            _mib(m["rss_total_warm"]), _mib(m["rss_total_end"]), _pct(m["rss_total_growth_pct"]),
            _pct(m["pss_total_growth_pct"]), greedy))
    lines += ["", "| clients | process | pid | RSS MiB start / warm / end / peak | RSS growth | PSS MiB warm / end "
              "| PSS growth |", "|---:|---|---:|---|---:|---|---:|"]
    for ph in report["phases"]:
        for p in ph["memory"]["processes"]:
            lines.append("| %d | %s | %d | %s / %s / %s / %s | %s | %s / %s | %s |" % (
                ph["clients"], p["name"], p["pid"], _mib(p["rss_start"]), _mib(p["rss_warm"]), _mib(p["rss_end"]),
                _mib(p["rss_peak"]), _pct(p["rss_growth_pct"]), _mib(p["pss_warm"]), _mib(p["pss_end"]),
                _pct(p["pss_growth_pct"])))
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report))
    else:
        experts = "vLLM's own" if args.without_kt else "kt's"
        greedy = "identical" if report.get("greedy_after_identical") else "DIFFERENT or missing"
        seconds = "/".join("%g" % s for s in args.seconds)
        print("vLLM's API server with %s experts on %s, threads %s; %s s of load (warm-up %s s); "
              "greedy answers after the load %s" % (experts, report["cpu"], args.threads or "vLLM's", seconds,
                                                   args.warmup, greedy))
        print()
        print(table(report))
        print()
        print("server: ready in %s s; stopped: %s" % (report.get("start_to_ready_s"), report["server_stop"]))
        for f in report["failures"]:
            print("FAILED: " + f)
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
