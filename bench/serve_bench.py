#!/usr/bin/env python3
"""vLLM serving throughput with its own CPU experts and with kt's, side by side.

A random-weight Qwen3-MoE checkpoint with the routed-expert shapes of
Qwen3-30B-A3B (hidden 2048, moe_intermediate 768, 128 experts, top-8; read
from bench/models/models.json) and few layers (default 2), so that the experts
dominate, is written once (bf16, ~2.4 GB for 2 layers) and served by vLLM's
offline engine twice, each in its own process: without kt, and with the
kt plugin (kt.integrations.vllm). Measured: decode tokens/s at batch 1, 8
and 32 (short prompts, the prefill of those prompts subtracted) and a
512-token prefill (tokens/s), best of --repeats, and the seconds from
starting the engine to ready (the weights loaded: by vLLM, or the experts
by kt and the rest by vLLM). Prints a markdown table.

  bench/serve_bench.py [--layers 2] [--dtype bfloat16] [--threads N] [--kt-own-workers]
                       [--decode-tokens 16] [--prefill 512] [--repeats 2] [--ranks R]
                       [--model-dir DIR] [--json OUT]

--ranks R (R > 1) adds runs of R ranks of N/R threads each, every rank's
threads bound to its own CPUs (VLLM_CPU_OMP_THREADS_BIND): vLLM alone with
tensor_parallel_size=R, and kt under tensor parallel and under expert
parallel (--enable-expert-parallel; vLLM 0.32's own CPU experts crash
there, so that row is kt's only), beside the one rank of N threads.

Run it with a Python that has vLLM (tools/python_env.sh serve makes one:
build-serve/bin/python bench/serve_bench.py). Both runs use the same
number of threads: OMP_NUM_THREADS for vLLM's torch, "threads" for kt
(default: every CPU of the process); kt computes on torch's OpenMP threads
(the plugin's default), or with --kt-own-workers on its own pinned workers.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TESTS = os.path.join(ROOT, "tests", "python")
sys.path.insert(0, TESTS)

with open(os.path.join(HERE, "models", "models.json")) as _models:
    _qwen3 = json.load(_models)["qwen3-30b-a3b"]
SHAPE = {key: _qwen3[key] for key in ("hidden", "moe_intermediate", "experts", "top_k")}
ATTENTION = dict(heads=32, intermediate=6144, vocab=2048)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kt-own-workers", action="store_true",
                   help="kt on workers of its own (host_openmp false) instead of torch's OpenMP threads")
    p.add_argument("--ranks", type=int, default=1,
                   help="also run R tensor-parallel and expert-parallel ranks of threads/R threads each")
    p.add_argument("--model-dir", default=None,
                   help="where the checkpoint is written (kept and reused); default a temporary directory")
    p.add_argument("--json", default=None, help="also write the numbers here")
    return p.parse_args()


def build_model(args):
    from helpers import serve_models
    directory = args.model_dir or os.path.join(tempfile.gettempdir(), "kt-serve-bench-%s-%dl" % (args.dtype, args.layers))
    if os.path.exists(os.path.join(directory, "config.json")):
        return directory
    t = time.time()
    # Qwen3-30B-A3B's attention too: 32 query heads of 128 (hidden 2048 / 16
    # would be Qwen's head_dim 128 with 16 heads; the bench keeps hidden/heads).
    serve_models.build(directory, "qwen3_moe", args.dtype, vocab=ATTENTION["vocab"], hidden=SHAPE["hidden"],
                       intermediate=ATTENTION["intermediate"], moe_intermediate=SHAPE["moe_intermediate"],
                       experts=SHAPE["experts"], top_k=SHAPE["top_k"], layers=args.layers,
                       heads=ATTENTION["heads"])
    print("serve_bench: wrote %s in %.0f s" % (directory, time.time() - t), flush=True)
    return directory


def cpu_binding(threads, ranks):
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` ranks of threads/ranks CPUs
    each, from the CPUs this process may run on: "0,1|2,3"."""
    cpus = sorted(os.sched_getaffinity(0))[:threads]
    per = len(cpus) // ranks
    if per < 1:
        sys.exit("serve_bench: %d ranks need at least %d CPUs, this process has %d" % (ranks, ranks, len(cpus)))
    return "|".join(",".join(str(c) for c in cpus[r * per:(r + 1) * per]) for r in range(ranks))


def run(args, model, kt, ranks=1, parallel="tensor"):
    llm = dict(max_num_seqs=max(int(b) for b in args.batches.split(",")),
               max_num_batched_tokens=max(args.prefill, 2048))
    if ranks > 1:
        llm.update(tensor_parallel_size=ranks, distributed_executor_backend="mp",
                   enable_expert_parallel=parallel == "expert")
    spec = dict(model=model, dtype=args.dtype, kt=kt, max_model_len=args.prefill + 64, llm=llm,
                bench=dict(decode_batches=[int(b) for b in args.batches.split(",")],
                           decode_tokens=args.decode_tokens, prefill_tokens=args.prefill,
                           repeats=args.repeats))
    # Every run binds its ranks' threads to CPUs of their own: vLLM's
    # automatic binding would keep a CPU of a small machine for its other
    # processes.
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(args.threads // ranks),
               VLLM_CPU_OMP_THREADS_BIND=cpu_binding(args.threads, ranks))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "plugins", "python"), TESTS]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        t = time.time()
        proc = subprocess.run([sys.executable, os.path.join(TESTS, "helpers", "serve_vllm_run.py"), spec_path, out_path],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        name = ("kt" if kt is not None else "vLLM") + ("" if ranks == 1 else ", %d %s-parallel ranks" % (ranks, parallel))
        print("serve_bench: %s run took %.0f s" % (name, time.time() - t), flush=True)
        if not os.path.exists(out_path):
            sys.exit("serve_bench: the %s run left no result:\n%s" % (name, proc.stdout.decode(errors="replace")[-4000:]))
        with open(out_path) as f:
            out = json.load(f)
    if "error" in out:
        sys.exit("serve_bench: the %s run failed: %s\n%s" % (name, out["error"], out.get("traceback", "")))
    if kt is not None and any(len(stats) != args.layers for stats in out["kt_stats_ranks"]):
        sys.exit("serve_bench: %s computed %s of %d MoE layers" % (name, [len(x) for x in out["kt_stats_ranks"]],
                                                                    args.layers))
    return dict(out["bench"], start_s=out["start_s"])


def main():
    args = parse_args()
    import torch
    model = build_model(args)
    vllm_out = run(args, model, None)
    kt_options = {"threads": args.threads, "host_openmp": not args.kt_own_workers}
    kt_out = run(args, model, kt_options)
    many = {}
    if args.ranks > 1:
        kt_rank = dict(kt_options, threads=args.threads // args.ranks)
        many["vLLM, tensor parallel"] = run(args, model, None, args.ranks, "tensor")
        many["kt, tensor parallel"] = run(args, model, kt_rank, args.ranks, "tensor")
        many["kt, expert parallel"] = run(args, model, kt_rank, args.ranks, "expert")
    import kt as kt_pkg
    rows = [("decode, batch %s" % b, "decode_%s" % b) for b in args.batches.split(",")]
    rows.append(("prefill, %d tokens" % args.prefill, "prefill_%d" % args.prefill))
    print()
    print("vLLM %s on %d threads (%s), torch %s, kt %s (%s kernels); Qwen3-30B-A3B experts "
          "(H %d, I %d, E %d, top-%d), %d MoE layers, %s; decode %d tokens per sequence; best of %d; kt on %s"
          % (__import__("vllm").__version__, args.threads, os.uname().machine, torch.__version__,
             kt_pkg.__version__, kt_pkg.cpu_isa(), SHAPE["hidden"], SHAPE["moe_intermediate"], SHAPE["experts"],
             SHAPE["top_k"], args.layers, args.dtype, args.decode_tokens, args.repeats,
             "its own workers" if args.kt_own_workers else "torch's OpenMP threads"))
    print()
    print("| tokens/s | vLLM CPU experts | kt experts | kt / vLLM |")
    print("|---|---:|---:|---:|")
    for label, key in rows:
        a, b = vllm_out[key], kt_out[key]
        print("| %s | %.1f | %.1f | %.2fx |" % (label, a, b, b / a))
    # Seconds, lower is better: the ratio is vLLM's time over kt's.
    a, b = vllm_out["start_s"], kt_out["start_s"]
    print("| engine start with weights loaded, s | %.1f | %.1f | %.2fx |" % (a, b, a / b))
    if many:
        # Time ratios (lower is better): R ranks' time over one rank's, for
        # the same tokens; the target is kt at 1.15x or less of kt on one rank.
        names = list(many)
        print()
        print("%d ranks of %d thread%s each, against one rank of %d threads (time ratio: one rank's tokens/s over "
              "the ranks')" % (args.ranks, args.threads // args.ranks, "" if args.threads // args.ranks == 1 else "s",
                               args.threads))
        print()
        print("| tokens/s | " + " | ".join(names) + " | " + " | ".join("time x, " + n for n in names) + " |")
        print("|---|" + "---:|" * (2 * len(names)))
        for label, key in rows:
            one = {n: (vllm_out if n.startswith("vLLM") else kt_out)[key] for n in names}
            print("| %s | " % label + " | ".join("%.1f" % many[n][key] for n in names) + " | "
                  + " | ".join("%.2fx" % (one[n] / many[n][key]) for n in names) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vllm": vllm_out, "kt": kt_out, "ranks": many, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
