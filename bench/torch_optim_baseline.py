#!/usr/bin/python3
"""Torch baseline for kt_bench --cases optimizer: torch.optim.AdamW steps.

Holds the fp32 expert weights of a layer (gate and up [E,I,H], down [E,H,I])
with fp32 gradients, as a trainer with fp32 masters does, and times
optimizer.step() for the for-loop (foreach=False) and multi-tensor
(foreach=True) implementations; torch 1.13 has no fused CPU AdamW. Prints
one JSON object per line: {"torch": ...} with the settings, then one
{"case", "experts", "ms"} per measurement (or "error" instead of "ms").
"""
import argparse
import json
import statistics
import sys
import time

import torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, required=True)
    p.add_argument("--intermediate", type=int, required=True)
    p.add_argument("--experts", required=True, help="comma-separated expert counts, one measurement each")
    p.add_argument("--threads", type=int, default=0, help="0 = torch's default")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    return p.parse_args()


def emit(obj):
    print(json.dumps(obj), flush=True)


def time_step(params, foreach, warmup, reps):
    # kt_bench's kt side uses the same hyperparameters (kt's defaults).
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=1e-2, foreach=foreach)
    times = []
    for call in range(warmup + reps):
        start = time.perf_counter()
        opt.step()
        if call >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    args = parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    H, I = args.hidden, args.intermediate
    emit({"torch": torch.__version__, "threads": torch.get_num_threads(), "python": sys.version.split()[0]})
    g = torch.Generator().manual_seed(5)
    for E in [int(e) for e in args.experts.split(",") if e]:
        params = []
        try:
            for shape in ((E, I, H), (E, I, H), (E, H, I)):
                p = torch.nn.Parameter(torch.randn(shape, generator=g) * 0.02)
                p.grad = torch.randn(shape, generator=g) * 1e-3
                params.append(p)
            for case, foreach in (("adamw_forloop", False), ("adamw_foreach", True)):
                emit({"case": case, "experts": E, "ms": time_step(params, foreach, args.warmup, args.reps) * 1e3})
        except (RuntimeError, MemoryError) as e:
            emit({"case": "adamw_forloop", "experts": E, "error": str(e).splitlines()[0]})
        del params


if __name__ == "__main__":
    main()
