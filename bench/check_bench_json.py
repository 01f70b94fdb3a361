#!/usr/bin/env python3
"""Runs kt_bench with the given arguments and checks that its JSON output
parses and holds every expected key (the benchmark's smoke test; it judges
the structure, never the timings).

Peers: with --peers-python PY among the arguments, the check asks PY itself
which peers import (torch, kt_kernel, deepspeed) and requires each one that
does to have run, named with its version, and each one that does not to be
reported as skipped with a reason; with --no-peers, kt-kernel and DeepSpeed
must be skipped with a reason. kt-kernel's rows: its forward on every T, and
where its bf16 SFT classes import (AMX builds) its train_dx and train_lora on
every T as well; without them those cases must be skipped with a reason.

vLLM: with --vllm-python PY, the check asks PY whether vLLM's CPU build and
its torch.ops._C.cpu_fused_moe import; where they do, vLLM must have run with
that version and have a forward row at every T whose y is as close to the
reference as kt-kernel's must be; where they do not, and without
--vllm-python or with --no-peers, vLLM must be skipped with a reason."""
import json
import subprocess
import sys

# Asked of the peers' interpreter: what of each peer imports, and its version.
PROBE = r"""
import json, os, sys
sys.stdout = sys.stderr
found = {}
try:
    import torch
    found["torch"] = torch.__version__
    import kt_kernel
    found["kt-kernel"] = kt_kernel.__version__
    # Its bf16 SFT classes (AMX builds): kt_bench drives them in the training cases.
    moe = kt_kernel.kt_kernel_ext.moe
    if getattr(moe, "AMXBF16_SFT_MOE", None) and getattr(moe, "AMXBF16_SFT_MOE_SkipLoRA", None):
        found["kt-kernel-sft"] = "AMXBF16_SFT_MOE"
except Exception:
    pass
try:
    import deepspeed
    found["deepspeed"] = deepspeed.__version__
except Exception:
    pass
os.write(1, (json.dumps(found) + "\n").encode())
"""

# Asked of --vllm-python's interpreter: vLLM's version where its CPU build
# and fused-MoE op import.
VLLM_PROBE = r"""
import json, os, sys
sys.stdout = sys.stderr
found = {}
try:
    import torch
    import vllm
    from vllm import _custom_ops
    from vllm.platforms import current_platform
    if current_platform.is_cpu() and hasattr(torch.ops._C, "cpu_fused_moe"):
        found["vllm"] = vllm.__version__
except Exception:
    pass
os.write(1, (json.dumps(found) + "\n").encode())
"""

CASES = {"forward", "train_dx", "train_lora", "train_full"}

# Per format: (code bits, inputs per scale or None for one per row, K
# alignment, scale bytes, zero-point bytes), as kt_c_api.h and
# formats/packed_quant.h describe the stored layout; and the largest
# relative L2 error of W' against the benchmark's bf16 weights (Gaussian
# rows) each format may show.
FORMATS = {
    "int8_channel": ((8, None, 32, 2, 0), 0.02),
    "int4_g32": ((4, 32, 32, 2, 0), 0.15),
    "int4_g128": ((4, 128, 128, 2, 0), 0.15),
    "fp8_b128": ((8, 128, 128, 4, 0), 0.05),
    "mxfp4": ((4, 32, 32, 2, 0), 0.15),
    "int4_g32_zp": ((4, 32, 32, 2, 1), 0.15),
    "int4_g128_zp": ((4, 128, 128, 2, 1), 0.15),
}
# The formats the benchmark loads from a synthetic checkpoint it writes.
FROM_CHECKPOINT = ("fp8_b128", "mxfp4", "int4_g32_zp", "int4_g128_zp")


def align(v, a):
    return (v + a - 1) // a * a


def stored_bytes_per_weight(fmt, hidden, inter):
    """Bytes kt stores per weight of one expert: 16-row panels of codes, K
    padded, then the scales, then the zero points where the format has them,
    each 64-byte aligned."""
    bits, group, k_align, scale_bytes, zero_bytes = FORMATS[fmt][0]
    total = 0
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        rows, kq = align(n, 16), align(k, k_align)
        groups = 1 if group is None else kq // group
        total += align(align(align(rows * kq * bits // 8, 64) + rows * groups * scale_bytes, 64) +
                       rows * groups * zero_bytes, 64)
    return total / (3 * hidden * inter)


def check_profile(row, what):
    """--profile: the row's per-stage times, with the weight GEMMs' stages:
    gate_up and down, or (decode on a quantized base, whole experts per item;
    a call's routing decides) experts, the one pass, and down, its combine."""
    stages = row.get("stage_ms")
    if not stages:
        fail(f"{what}: --profile given but no stage_ms")
    first = "experts" if stages.get("experts", 0) > 0 else "gate_up"
    for name in (first, "down"):
        if not stages.get(name, 0) > 0:
            fail(f"{what}: stage {name!r} has no time in {stages}")
    if any(v < 0 for v in stages.values()):
        fail(f"{what}: a negative stage time in {stages}")


def check_kernels(row, what, tables, case, flops):
    """The kernels a case ran (always reported): each named entry__table
    with a table the engine may run, calls per call, GFLOP per call; their
    FLOPs per call are the case's, counted over the same batches. The
    full-weight gradient kernels step over tokens in pairs, so an expert
    with an odd token count computes one zero token more: train_full counts
    up to a third more (every gradient K doubled) and never less."""
    kernels = row.get("kernels")
    if not kernels:
        fail(f"{what}: no kernels")
    for k in kernels:
        require(k, ["stage", "kernel", "calls", "gflop"], what + " kernels")
        if k["kernel"].rsplit("__", 1)[-1] not in tables:
            fail(f"{what}: kernel {k['kernel']} is from none of the tables {sorted(tables)}")
        if not k["calls"] > 0 or k["gflop"] < 0:
            fail(f"{what}: kernel {k['kernel']} has {k['calls']} calls, {k['gflop']} GFLOP")
    total = sum(k["gflop"] for k in kernels) * 1e9
    if not total > 0:
        fail(f"{what}: the kernels computed no flops")
    high = flops * (4 / 3 if case == "train_full" else 1)
    if not flops * (1 - 1e-4) <= total <= high * (1 + 1e-4):
        fail(f"{what}: the kernels computed {total:.6g} flops per call, the case {flops:.6g}")


def check_read_beside(r, what):
    """The plain read timed beside a format's calls: its GB/s and the
    format's GB/s against it (null only where it could not run)."""
    for suffix in ("", "_best"):
        read, pct = "read_gbs_alternating" + suffix, "pct_read_bandwidth" + suffix
        require(r, [read, pct], what)
        if r[read] is None:
            if r[pct] is not None:
                fail(f"{what}: {pct} {r[pct]} without {read}")
            continue
        if not r[read] > 0 or not r[pct] > 0:
            fail(f"{what}: {read} {r[read]}, {pct} {r[pct]}: not positive")
    # Medians with medians: the same bytes, so the ratio of the rates.
    if r["read_gbs_alternating"] is not None:
        want = 100 * r["gbs"] / r["read_gbs_alternating"]
        if abs(r["pct_read_bandwidth"] - want) > 1e-3 * want:
            fail(f"{what}: pct_read_bandwidth {r['pct_read_bandwidth']} is not gbs / read_gbs_alternating ({want:.2f})")


def check_read_beside_case(r, what):
    """A memory-bound case has kt timed again beside a plain read of its
    bytes: kt's ms in those rounds, the read's GB/s, and kt's GB/s against
    it; a compute-bound one has none of them."""
    kt = r["kt"]
    keys = ["ms_beside_read", "read_gbs_alternating", "pct_read_bandwidth"]
    require(kt, keys, what + " kt")
    if kt["bound"] != "memory":
        if any(kt[k] is not None for k in keys):
            fail(f"{what}: a compute-bound case with a read beside it")
        return
    if not kt["ms_beside_read"] or kt["ms_beside_read"] <= 0 or not kt["read_gbs_alternating"]:
        fail(f"{what}: a memory-bound case without kt's time or the read beside it")
    want = 100 * (r["bytes"] / kt["ms_beside_read"] / 1e6) / kt["read_gbs_alternating"]
    if abs(kt["pct_read_bandwidth"] - want) > 1e-3 * want:
        fail(f"{what}: pct_read_bandwidth {kt['pct_read_bandwidth']} is not kt's GB/s beside the read "
             f"over read_gbs_alternating ({want:.2f})")


def check_formats(model, formats, where, profile, tables):
    """--format: every listed format has a row per (case, T) of the bf16
    results but train_full, with the stored bytes per weight, a time, GB/s
    and %bw that agree with each other, and a plausible quantization error."""
    require(model, ["weight_formats", "format_weight_error", "format_activation_error", "format_checkpoints"], where)
    rows = {}
    for r in model["weight_formats"]:
        require(r, ["format", "compute"], where + " weight_formats")
        rows[(r["format"] + ("/int8" if r["compute"] == "int8" else ""), r["case"], r["tokens"])] = r
    # int8 activations (name/int8): forward only.
    expected = {(f, r["case"], r["tokens"]) for f in formats for r in model["results"]
                if r["case"] != "train_full" and (not f.endswith("/int8") or r["case"] == "forward")}
    if set(rows) != expected:
        fail(f"{where}: weight_formats rows {sorted(rows)}, expected {sorted(expected)}")
    for key, r in rows.items():
        label, case, tokens = key
        fmt = r["format"]
        what = f"{where} {label} {case} T={tokens}"
        require(r, ["source", "bytes_per_weight", "ms", "gbs", "pct_bandwidth", "time_vs_bf16", "bf16_ms_alternating",
                    "time_vs_bf16_paired"], what)
        if "error" in r:
            fail(f"{what}: kt failed: {r['error']}")
        want = stored_bytes_per_weight(fmt, model["hidden"], model["intermediate"])
        if abs(r["bytes_per_weight"] - want) > 1e-4 * want:
            fail(f"{what}: bytes_per_weight {r['bytes_per_weight']}, the layout stores {want:.6f}")
        if not r["ms"] or r["ms"] <= 0:
            fail(f"{what}: no time")
        base = next(b for b in model["results"] if b["case"] == case and b["tokens"] == tokens)
        bytes_read = base["bytes"] * r["bytes_per_weight"] / 2.0
        if abs(r["gbs"] - bytes_read / r["ms"] / 1e6) > 1e-3 * r["gbs"]:
            fail(f"{what}: gbs {r['gbs']} is not the format's {bytes_read:.0f} bytes in {r['ms']} ms")
        if not r["bf16_ms_alternating"] or r["bf16_ms_alternating"] <= 0:
            fail(f"{what}: no bf16 time taken in alternation")
        if abs(r["time_vs_bf16"] - r["ms"] / r["bf16_ms_alternating"]) > 1e-4 * r["time_vs_bf16"]:
            fail(f"{what}: time_vs_bf16 {r['time_vs_bf16']} is not ms / bf16_ms_alternating")
        if not r["time_vs_bf16_paired"] or not 0 < r["time_vs_bf16_paired"] < 1e3:
            fail(f"{what}: time_vs_bf16_paired {r['time_vs_bf16_paired']} is not a ratio of two times")
        check_read_beside(r, what)
        if profile:
            check_profile(r, what)
        check_kernels(r, what, tables, case, base["flops"])
        want_source = "checkpoint" if fmt in FROM_CHECKPOINT else "quantized_at_load"
        if r["source"] != want_source:
            fail(f"{what}: source {r['source']!r}, expected {want_source!r}")
    for label in formats:
        fmt = label.split("/")[0]
        err = model["format_weight_error"].get(label)
        if err is None or not 0 < err <= FORMATS[fmt][1]:
            fail(f"{where} {label}: W' against the bf16 weights has relative L2 {err}, expected in (0, {FORMATS[fmt][1]}]")
        # int8 activations against bf16 ones on the same base: about 1-2 %
        # (kt_c_api.h); more would be a fault, none a layer not computing in int8.
        act = model["format_activation_error"].get(label)
        if label.endswith("/int8") and (act is None or not 1e-3 < act <= 0.05):
            fail(f"{where} {label}: y against bf16 activations has relative L2 {act}, expected in (1e-3, 0.05]")
        if not label.endswith("/int8") and act is not None:
            fail(f"{where} {label}: an activation error for a bf16-activation layer")
    written = {c["format"] for c in model["format_checkpoints"]}
    if written != {f for f in formats if f in FROM_CHECKPOINT}:
        fail(f"{where}: synthetic checkpoints written for {sorted(written)}")


def probe_peers(python, probe=PROBE):
    """{peer name: version} of the peers `python` imports ({} when it does not run)."""
    try:
        proc = subprocess.run([python, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              timeout=300)
    except OSError:
        return {}
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if proc.returncode == 0 and lines else {}


def check_peer_rows(m, peer, case):
    """A peer's bf16 rows of `case`: every T of the model, beside kt, with both
    errors (y for the forward, dx for training) against the double-precision
    reference."""
    rows = {r["tokens"]: r for r in m.get("peer_results", [])
            if r["peer"] == peer and r["variant"] == "bf16" and r["case"] == case}
    want = {r["tokens"] for r in m["results"] if r["case"] == case}
    if set(rows) != want:
        fail(f"model {m['name']}: {peer} bf16 {case} rows for T {sorted(rows)}, expected {sorted(want)}")
    for T, r in rows.items():
        what = f"model {m['name']} {peer} {case} T={T}"
        require(r, ["ms", "kt_ms", "speedup_of_kt", "speedup_of_kt_paired", "rel_l2_vs_f64",
                    "kt_rel_l2_vs_f64", "rows_compared", "timing", "class"], what)
        if case != "forward":
            require(r, ["note"], what)
        if "error" in r:
            fail(f"{what}: {r['error']}")
        if not (r["ms"] or 0) > 0 or not (r["kt_ms"] or 0) > 0:
            fail(f"{what}: no time ({r['ms']}, kt {r['kt_ms']})")
        if abs(r["speedup_of_kt"] - r["ms"] / r["kt_ms"]) > 1e-3 * r["speedup_of_kt"]:
            fail(f"{what}: speedup_of_kt {r['speedup_of_kt']} is not ms / kt_ms")
        if not (r["speedup_of_kt_paired"] or 0) > 0:
            fail(f"{what}: no paired ratio ({r['speedup_of_kt_paired']})")
        if not r["rows_compared"] > 0:
            fail(f"{what}: no rows compared")
        # bf16 rounding of y (dx) and of the intermediates: about 1e-3 to 1e-2.
        for key in ("rel_l2_vs_f64", "kt_rel_l2_vs_f64"):
            if r[key] is None or not 0 < r[key] < 0.05:
                fail(f"{what}: {key} {r[key]} is not in (0, 0.05)")


def check_vllm(doc, args, cases, ran, must_skip):
    """vLLM, from --vllm-python's interpreter: where its CPU fused MoE
    imports, a forward row at every T of each model (check_peer_rows), and no
    other case; else a skip with a reason."""
    if "--no-peers" in args or "--vllm-python" not in args:
        must_skip("vllm")
        return "vLLM skipped"
    python = args[args.index("--vllm-python") + 1]
    version = probe_peers(python, VLLM_PROBE).get("vllm")
    if version is None or "forward" not in cases:
        must_skip("vllm")
        return f"vLLM skipped ({python})"
    if ran.get(("vllm", python)) != version:
        fail(f"vLLM {version} imports in {python} with its cpu_fused_moe but is not among the peers that ran "
             f"with that version: {doc['peers']}")
    for m in doc["models"]:
        check_peer_rows(m, "vllm", "forward")
        if any(r["peer"] == "vllm" and r["case"] != "forward" for r in m.get("peer_results", [])):
            fail(f"model {m['name']}: vLLM rows of a case other than the forward")
    return f"vLLM {version} in {python}"


def check_peers(doc, args):
    """The peers that import ran and are named with their versions; those
    that do not are skipped with a reason; kt-kernel's rows and DeepSpeed's
    optimizer figures are there and consistent."""
    require(doc, ["peers", "peers_skipped"], "the document")
    for p in doc["peers"]:
        require(p, ["name", "version", "python", "role"], "peers[]")
        if not p["version"]:
            fail(f"peer {p['name']} ran without a version")
    for sk in doc["peers_skipped"]:
        require(sk, ["name", "what", "reason"], "peers_skipped[]")
        if not sk["reason"] or not sk["reason"].strip():
            fail(f"peer {sk['name']} {sk['what']} skipped without a reason")
    ran = {(p["name"], p["python"]): p["version"] for p in doc["peers"]}
    skipped = {sk["name"]: sk for sk in doc["peers_skipped"] if sk["what"] == "all" or sk["what"].startswith("--")}
    cases = {r["case"] for m in doc["models"] for r in m["results"]}
    optimizer = doc.get("optimizer")

    def must_skip(name):
        if name not in skipped:
            fail(f"peer {name} neither ran nor is reported as skipped with a reason "
                 f"(peers {sorted(ran)}, skipped {sorted(skipped)})")
        if any(n == name for n, _ in ran):
            fail(f"peer {name} both ran and is reported as skipped")

    vllm = check_vllm(doc, args, cases, ran, must_skip)
    if "--no-peers" in args:
        for name in ("kt-kernel", "deepspeed"):
            must_skip(name)
        return "no peers (--no-peers)"
    if "--peers-python" not in args:
        return f"peers not checked (no --peers-python); {vllm}"
    python = args[args.index("--peers-python") + 1]
    present = probe_peers(python)
    sft = present.pop("kt-kernel-sft", None)

    # kt-kernel: every forward T of each model, beside kt; with its SFT
    # classes, every train_dx and train_lora T too.
    if "kt-kernel" in present and cases & {"forward", "train_dx", "train_lora"}:
        if ran.get(("kt-kernel", python)) != present["kt-kernel"]:
            fail(f"kt-kernel {present['kt-kernel']} imports in {python} but is not among the peers that ran "
                 f"with that version: {doc['peers']}")
        for m in doc["models"]:
            for case in ("forward", "train_dx", "train_lora"):
                if case in cases and (case == "forward" or sft):
                    check_peer_rows(m, "kt-kernel", case)
            if "forward" not in cases:
                continue
            for variant in ("int8", "int4"):
                has_rows = any(r["peer"] == "kt-kernel" and r["variant"] == variant for r in m.get("peer_results", []))
                if not has_rows and not any(sk["name"] == "kt-kernel" and sk["what"] == "forward " + variant
                                            for sk in doc["peers_skipped"]):
                    fail(f"model {m['name']}: kt-kernel {variant}: neither rows nor a skip with a reason")
        for case in ("train_dx", "train_lora", "train_full"):
            if case not in cases or (sft and case != "train_full"):
                continue
            if not any(sk["name"] == "kt-kernel" and sk["what"] == case for sk in doc["peers_skipped"]):
                fail(f"kt-kernel {case}: not run and not reported as skipped")
            if any(r["peer"] == "kt-kernel" and r["case"] == case for m in doc["models"]
                   for r in m.get("peer_results", [])):
                fail(f"kt-kernel {case}: both rows and a skip")
    elif cases & {"forward", "train_dx", "train_lora"}:
        must_skip("kt-kernel")
    # DeepSpeed: the optimizer case, beside kt.
    if optimizer is not None:
        require(optimizer, ["deepspeed"], "optimizer")
        ds = optimizer["deepspeed"]
        if "deepspeed" in present:
            if ran.get(("deepspeed", python)) != present["deepspeed"] or not ds.get("ran"):
                fail(f"deepspeed {present['deepspeed']} imports in {python} but did not run: "
                     f"{ds.get('reason', doc['peers'])}")
            if ds.get("version") != present["deepspeed"]:
                fail(f"optimizer deepspeed version {ds.get('version')}, {python} has {present['deepspeed']}")
            for r in optimizer["results"]:
                for key in ("deepspeed_ms", "kt_beside_deepspeed_ms", "deepspeed_gparams_per_s",
                            "deepspeed_pct_floor", "kt_beside_deepspeed_pct_floor", "deepspeed_speedup_of_kt",
                            "deepspeed_speedup_of_kt_paired", "floor_beside_ms", "deepspeed_pct_floor_beside",
                            "kt_beside_deepspeed_pct_floor_beside", "kt_assume_finite_beside_deepspeed_ms",
                            "kt_assume_finite_pct_floor_beside", "deepspeed_speedup_of_kt_assume_finite",
                            "deepspeed_speedup_of_kt_assume_finite_paired"):
                    if not (r.get(key) or 0) > 0:
                        fail(f"optimizer {r['experts']} experts: {key} is {r.get(key)!r}")
                want = r["deepspeed_ms"] / r["kt_beside_deepspeed_ms"]
                if abs(r["deepspeed_speedup_of_kt"] - want) > 1e-3 * want:
                    fail(f"optimizer: deepspeed_speedup_of_kt {r['deepspeed_speedup_of_kt']} is not "
                         f"deepspeed_ms / kt_beside_deepspeed_ms")
                want = r["deepspeed_ms"] / r["kt_assume_finite_beside_deepspeed_ms"]
                if abs(r["deepspeed_speedup_of_kt_assume_finite"] - want) > 1e-3 * want:
                    fail(f"optimizer: deepspeed_speedup_of_kt_assume_finite "
                         f"{r['deepspeed_speedup_of_kt_assume_finite']} is not deepspeed_ms / "
                         f"kt_assume_finite_beside_deepspeed_ms")
        else:
            must_skip("deepspeed")
            if ds.get("ran") or not ds.get("reason"):
                fail(f"optimizer deepspeed: {ds}, expected ran false with a reason")
    # torch: the peers' interpreter's, where it differs from --python's.
    baseline = [p for p in doc["peers"] if p["name"] == "torch" and p["role"] == "baseline"]
    if "--no-torch" not in args:
        if "torch" not in present:
            if not any(sk["name"] == "torch" and python in sk["what"] for sk in doc["peers_skipped"]):
                fail(f"{python} has no torch, and no skip says so")
        elif not baseline or baseline[0]["version"] != present["torch"]:
            if ran.get(("torch", python)) != present["torch"]:
                fail(f"torch {present['torch']} imports in {python} but did not run: {doc['peers']}")
            for m in doc["models"]:
                rows = {(r["case"], r["tokens"]) for r in m.get("peer_results", []) if r["peer"] == "torch"}
                want = {(r["case"], r["tokens"]) for r in m["results"]}
                if rows != want:
                    fail(f"model {m['name']}: torch {present['torch']} rows {sorted(rows)}, expected {sorted(want)}")
    return (f"peers in {python}: {', '.join(f'{k} {v}' for k, v in sorted(present.items())) or 'none'}"
            f"{' (with its SFT classes)' if sft else ''}; {vllm}; "
            f"skipped: {', '.join(sk['name'] + ' ' + sk['what'] for sk in doc['peers_skipped']) or 'none'}")


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
    args = sys.argv[1:]
    formats = [f for f in args[args.index("--format") + 1].split(",") if f != "bf16"] if "--format" in args else []
    unknown = [f for f in formats if f.split("/")[0] not in FORMATS or
               ("/" in f and f.split("/")[1] != "int8")]
    if unknown:
        fail(f"no expected layout for format(s) {unknown}")
    # The MoE cases run: all by default, else those of --cases.
    cases = CASES if "--cases" not in args else \
        {c for c in args[args.index("--cases") + 1].split(",") if c and c != "optimizer"}
    with_optimizer = "--cases" not in args or "optimizer" in args[args.index("--cases") + 1].split(",")
    proc = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    if proc.returncode != 0:
        fail(f"kt_bench exited with {proc.returncode}\n{proc.stderr}")
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        fail(f"output is not JSON: {e}\n{proc.stdout[:2000]}")

    require(doc, ["kt", "machine", "settings", "models"], "the document")
    require(doc["kt"], ["version", "abi", "isa", "threads", "call_overhead_us", "call_overhead_paused_us",
                        "call_pause_us"], "kt")
    for key in ("call_overhead_us", "call_overhead_paused_us", "call_pause_us"):
        if not doc["kt"][key] or not doc["kt"][key] > 0:
            fail(f"kt: {key} is {doc['kt'][key]!r}")
    machine = doc["machine"]
    require(machine, ["threads", "peak_gflops", "peak_kind", "dram_read_gbs", "bf16_dot_peak_gflops",
                      "fp32_fma_avx2_peak_gflops", "avx512_vnni", "int8_dot_peak_gops", "int16_dot_peak_gops",
                      "amx_int8", "amx_int8_peak_gops"], "machine")
    # A CPU that reports a feature has its peak measured.
    for feature, peak in (("avx512_vnni", "int8_dot_peak_gops"), ("avx512_vnni", "int16_dot_peak_gops"),
                          ("amx_int8", "amx_int8_peak_gops")):
        if machine[feature] and not (machine[peak] or 0) > 0:
            fail(f"machine: {feature} but {peak} is {machine[peak]!r}")
    if not machine["peak_gflops"] or machine["peak_gflops"] <= 0:
        fail("no compute peak measured")
    if not machine["dram_read_gbs"] or machine["dram_read_gbs"] <= 0:
        fail("no DRAM bandwidth measured")
    if not doc["models"] and cases:
        fail("no model was benchmarked")
    # The tables kt's kernels come from: the engine's, the AVX-512 BF16 one
    # that the amx table leaves few rows to, oneDNN's with --backend onednn
    # or, on the amx table, by the default backend (KT_GEMM_AUTO times kt's
    # tiles against oneDNN and takes the faster).
    amx = doc["kt"]["isa"] == "amx"
    tables = {doc["kt"]["isa"]} | ({"avx512bf16"} if amx else set()) | \
        ({"onednn"} if "onednn" in args or (amx and "native" not in args) else set())
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
            check_read_beside_case(r, f"{where} {r['case']} T={r['tokens']}")
            for b in ("onednn", "torch"):
                require(r[b], ["ms", "speedup_of_kt"], f"{where} {r['case']} {b}")
            if "--profile" in args:
                check_profile(r["kt"], f"{where} {r['case']} T={r['tokens']} kt")
            check_kernels(r["kt"], f"{where} {r['case']} T={r['tokens']} kt", tables, r["case"], r["flops"])
            seen.add(r["case"])
        if seen != cases:
            fail(f"{where}: cases {sorted(seen)}, expected {sorted(cases)}")
        require(model["linearity"], ["touched_experts_sweep"] + sorted(cases), where + " linearity")
        if formats:
            check_formats(model, formats, where, "--profile" in args, tables)
    if not with_optimizer:
        peers = check_peers(doc, args)
        print(f"check_bench_json: OK ({len(doc['models'])} model(s), "
              f"{sum(len(m['results']) for m in doc['models'])} results; {peers})")
        return
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
    peers = check_peers(doc, args)
    print(f"check_bench_json: OK ({len(doc['models'])} model(s), "
          f"{sum(len(m['results']) for m in doc['models'])} results; {peers})")


if __name__ == "__main__":
    main()
