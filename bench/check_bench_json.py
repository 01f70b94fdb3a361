#!/usr/bin/env python3
"""Runs kt_bench with the given arguments and checks that its JSON output
parses and holds every expected key (the benchmark's smoke test; it judges
the structure, never the timings)."""
import json
import subprocess
import sys

CASES = {"forward", "train_dx", "train_lora", "train_full"}


def fail(message):
    print("check_bench_json: " + message, file=sys.stderr)
    sys.exit(1)


def require(obj, keys, where):
    for k in keys:
        if k not in obj:
            fail(f"missing key {k!r} in {where}")


def main():
    if len(sys.argv) < 2:
        fail("usage: check_bench_json.py KT_BENCH [ARGS...]")
    proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    if proc.returncode != 0:
        fail(f"kt_bench exited with {proc.returncode}\n{proc.stderr}")
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        fail(f"output is not JSON: {e}\n{proc.stdout[:2000]}")

    require(doc, ["kt", "machine", "settings", "models"], "the document")
    require(doc["kt"], ["version", "abi", "isa", "threads"], "kt")
    machine = doc["machine"]
    require(machine, ["threads", "peak_gflops", "peak_kind", "dram_read_gbs", "bf16_dot_peak_gflops",
                      "fp32_fma_avx2_peak_gflops"], "machine")
    if not machine["peak_gflops"] or machine["peak_gflops"] <= 0:
        fail("no compute peak measured")
    if not machine["dram_read_gbs"] or machine["dram_read_gbs"] <= 0:
        fail("no DRAM bandwidth measured")
    if not doc["models"]:
        fail("no model was benchmarked")
    for model in doc["models"]:
        where = f"model {model.get('name')}"
        require(model, ["name", "hidden", "intermediate", "experts", "top_k", "experts_held", "slice", "note",
                        "baselines", "results", "linearity"], where)
        require(model["baselines"], ["onednn", "torch"], where + " baselines")
        for b in ("onednn", "torch"):
            require(model["baselines"][b], ["ran"], f"{where} baselines.{b}")
            if not model["baselines"][b]["ran"]:
                require(model["baselines"][b], ["reason"], f"{where} baselines.{b}")
        seen = set()
        for r in model["results"]:
            require(r, ["case", "tokens", "routes", "touched_experts", "flops", "bytes", "kt", "onednn", "torch"],
                    where + " result")
            require(r["kt"], ["ms", "gflops", "pct_peak", "pct_bandwidth", "bound"],
                    f"{where} {r['case']} T={r['tokens']} kt")
            if not r["kt"]["ms"] or r["kt"]["ms"] <= 0:
                fail(f"{where} {r['case']} T={r['tokens']}: kt has no time")
            for b in ("onednn", "torch"):
                require(r[b], ["ms", "speedup_of_kt"], f"{where} {r['case']} {b}")
            seen.add(r["case"])
        if seen != CASES:
            fail(f"{where}: cases {sorted(seen)}, expected {sorted(CASES)}")
        require(model["linearity"], ["touched_experts_sweep"] + sorted(CASES), where + " linearity")
    require(doc, ["optimizer"], "the document (the optimizer case runs by default)")
    optimizer = doc["optimizer"]
    require(optimizer, ["model", "algorithm", "bytes_per_param", "torch", "results"], "optimizer")
    require(optimizer["torch"], ["ran"], "optimizer torch")
    if not optimizer["torch"]["ran"]:
        require(optimizer["torch"], ["reason"], "optimizer torch")
    if not optimizer["results"]:
        fail("optimizer: no result")
    for r in optimizer["results"]:
        require(r, ["experts", "params", "kt_ms", "kt_gparams_per_s", "floor_ms", "pct_floor", "torch_forloop_ms",
                    "torch_foreach_ms", "layer_step_ms", "layer_over_plain", "repack_ms", "fwd_bwd_ms"],
                "optimizer result")
        if "error" in r:
            fail(f"optimizer: kt failed: {r['error']}")
        for k in ("kt_ms", "layer_step_ms", "repack_ms", "fwd_bwd_ms"):
            if not r[k] or r[k] <= 0:
                fail(f"optimizer {r['experts']} experts: no {k}")
    print(f"check_bench_json: OK ({len(doc['models'])} model(s), "
          f"{sum(len(m['results']) for m in doc['models'])} results)")


if __name__ == "__main__":
    main()
