#!/usr/bin/env python3
"""kt's fused CPU AdamW beside its peers, on the same fp32 tensors.

Peers, each an optional import (a line says which were skipped and why):
  kt         kt.optim.AdamW (one kt optimizer per parameter, as the torch
             optimizer makes them), and, where a case has several tensors,
             kt's C ABI with one kt_optimizer over all of them (what
             kt.torch.MoEExperts gets for a layer's parameters); and in
             every case that optimizer with assume_finite = 1 (a host that
             has checked the gradients itself: one pass over them, where
             kt's default first reads them all for inf/NaN)
  deepspeed  deepspeed.ops.adam.DeepSpeedCPUAdam (adamw_mode, fp32 states;
             its C++ op is JIT-built on first use)
  torch      torch.optim.AdamW: the default (for-loop on CPU), foreach=True
             and fused=True

Cases: "lora" — the LoRA r16 factors of one Qwen3-30B-A3B layer (128 experts x
gate, up, down x A [r, in] and B [out, r], H=2048, I=768: 768 tensors, 17.3 M
parameters); "flat" — one tensor of --flat-mparams million parameters.

Every step is timed on the same thread count (torch.set_num_threads,
OMP_NUM_THREADS for DeepSpeed's OpenMP loop, kt's engine threads). After a
warm-up, --rounds interleaved rounds each time --steps steps of every peer,
in an order that rotates per round; the median of all timed steps is
reported. The memory floor is the time to move the 28 bytes an fp32 AdamW
step must (read p, g, m, v; write p, m, v) at the DRAM rate measured in the
same run, on the same threads, by a stream of exactly that shape (4 reads
and 3 in-place writes over 4 x 256 MiB, no arithmetic to speak of, compiled
at run time with cc -O3 -march=native -fopenmp; the best pass of 3 at the
start and one in every round). A plain copy
or sum reads slower on small machines (fewer streams in flight per core)
and is printed beside it only for reference.

Correctness: before timing, every peer makes two steps (two different
gradients) from the same parameters; each result is compared with a float64
AdamW reference: max |p - p_ref| must be <= --tol x lr (default 2e-3 x lr;
fp32 rounding of |p| < 8 is about 5e-4 x lr a step, a missing weight decay or
bias correction is > 0.05 x lr with these values). A peer outside the
tolerance is reported as FAILED and the run exits 1.

  build-venv/bin/python bench/optim_peers.py [--threads 2] [--cases lora,flat] [--json]
"""
import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2, help="threads of every peer (default 2)")
    p.add_argument("--cases", default="lora,flat", help="comma-separated: lora, flat (default both)")
    p.add_argument("--flat-mparams", type=float, default=64, help="size of the flat tensor, millions (default 64)")
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per peer before the rounds")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per peer per round (default 2)")
    p.add_argument("--peers", default="kt,deepspeed,torch", help="comma-separated subset of kt, deepspeed, torch")
    p.add_argument("--tol", type=float, default=2e-3, help="largest |p - p_ref64| after two steps, in units of lr")
    p.add_argument("--json", action="store_true", help="one JSON document on stdout (the table goes to stderr)")
    return p.parse_args()


ARGS = parse_args()
# Before torch loads its OpenMP runtime: DeepSpeed's op is built with
# -fopenmp and may bind a runtime of its own, which reads this.
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
# torch's JIT loader (DeepSpeed's CPU Adam op) runs ninja on every load, even
# of an op already built: pip puts ninja beside this interpreter, which
# need not be on PATH.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

import torch  # noqa: E402

torch.set_num_threads(ARGS.threads)

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 0.1
BYTES_PER_PARAM = 28  # fp32: read p, g, m, v; write p, m, v


def log(msg):
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def stdout_to_stderr():
    """Routes file descriptor 1 to 2 (the JIT build and DeepSpeed's logger
    print there), so --json keeps stdout to the document."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


# ---------------------------------------------------------------- tensors

def case_shapes(case):
    if case == "lora":
        H, I, r = ARGS.hidden, ARGS.intermediate, ARGS.rank
        shapes = []
        for _ in range(ARGS.experts):
            for n_in, n_out in ((H, I), (H, I), (I, H)):  # gate, up, down
                shapes += [(r, n_in), (n_out, r)]
        return shapes
    if case == "flat":
        return [(int(ARGS.flat_mparams * 1e6),)]
    raise SystemExit("optim_peers: unknown case %r" % case)


def make_tensors(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


# ---------------------------------------------------------------- peers
# Each peer: name, variant; setup(params, grads), set_grads(grads), step(), values().


class Peer:
    def __init__(self, peer, variant, note=""):
        self.peer, self.variant, self.note = peer, variant, note

    @property
    def label(self):
        return "%s %s" % (self.peer, self.variant)


class ParamsPeer(Peer):
    """A peer that steps a torch.optim-style optimizer (self.opt) over
    torch Parameters (self.params) holding the case's tensors."""

    def setup(self, params, grads):
        self.params = [torch.nn.Parameter(p) for p in params]
        self.set_grads(grads)
        self.opt = self.make_optimizer(self.params)

    def set_grads(self, grads):
        for p, g in zip(self.params, grads):
            p.grad = g

    def step(self):
        self.opt.step()

    def values(self):
        return [p.detach() for p in self.params]


class TorchPeer(ParamsPeer):
    def __init__(self, variant, kwargs):
        super().__init__("torch", variant, "torch " + torch.__version__)
        self.kwargs = kwargs

    def make_optimizer(self, params):
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **self.kwargs)



class DeepSpeedPeer(ParamsPeer):
    def __init__(self, cls, version, build_flags):
        super().__init__("deepspeed", "DeepSpeedCPUAdam", "deepspeed %s, op built with %s" % (version, build_flags))
        self.cls = cls

    def make_optimizer(self, params):
        with stdout_to_stderr():
            return self.cls(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True,
                            bias_correction=True, fp32_optimizer_states=True)



class KtTorchPeer(ParamsPeer):
    def __init__(self, kt, engine):
        super().__init__("kt", "kt.optim.AdamW", "kt %s, engine %s" % (kt.__version__, engine.info()["kernel_name"]))
        self.kt, self.engine = kt, engine

    def make_optimizer(self, params):
        return self.kt.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, engine=self.engine)


    def close(self):
        for entry in self.opt._kt.values():
            entry.close()


class KtHandlePeer(Peer):
    """One kt_optimizer over every tensor of the case, through the C ABI;
    with assume_finite, the step of a host that has checked the gradients
    itself (one pass, no skip on inf/NaN)."""

    def __init__(self, kt, engine, assume_finite=False):
        super().__init__("kt", "C ABI, assume_finite" if assume_finite else "C ABI, one optimizer",
                         "kt_optimizer_create over all tensors" + (", assume_finite = 1" if assume_finite else ""))
        self.kt, self.engine, self.assume_finite = kt, engine, assume_finite
        from kt import _capi
        from kt._tensor import DLView
        from kt.core import check, lib
        self._capi, self.DLView, self.check, self.lib = _capi, DLView, check, lib()

    def setup(self, params, grads):
        capi = self._capi
        self.params = params
        # kt retains the grads it is given; each pair has its own buffers,
        # filled from the case's gradients.
        self.grads = [g.clone() for g in grads]
        self.views = [(self.DLView(p), self.DLView(g)) for p, g in zip(self.params, self.grads)]
        pairs = (capi.OptimizerParam * len(self.views))(*[capi.OptimizerParam(pv.ptr, gv.ptr)
                                                          for pv, gv in self.views])
        o = capi.OptimizerOptions()
        self.lib.kt_optimizer_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
        o.algorithm = capi.OPTIM_ADAMW
        o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.amsgrad = LR, BETAS[0], BETAS[1], EPS, WD, 0
        o.assume_finite = 1 if self.assume_finite else 0
        handle = ctypes.c_void_p()
        self.check(self.lib.kt_optimizer_create(self.engine.handle, ctypes.byref(o), pairs, len(self.views),
                                                ctypes.byref(handle)))
        self.handle = handle

    def set_grads(self, grads):
        for dst, src in zip(self.grads, grads):
            dst.copy_(src)

    def step(self):
        self.check(self.lib.kt_optimizer_step(self.handle, None))

    def values(self):
        return self.params

    def close(self):
        if self.handle:
            self.lib.kt_optimizer_destroy(self.handle)
            self.handle = None


def deepspeed_build_flags():
    """The flags DeepSpeed's JIT build compiled cpu_adam with, from the
    build.ninja torch's extension loader left (empty when not found)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    for root, _, files in os.walk(base):
        if os.path.basename(root) == "cpu_adam" and "build.ninja" in files:
            text = open(os.path.join(root, "build.ninja")).read()
            flags = [f for f in ("-march=native", "-D__AVX512__", "-D__AVX256__", "-fopenmp", "-O3")
                     if f in text]
            return " ".join(flags)
    return "unknown flags"


def load_peers(wanted, skipped):
    peers = []
    if "kt" in wanted:
        try:
            import kt
            import kt.optim  # noqa: F401
            engine = kt.Engine(num_threads=ARGS.threads)
            peers.append(KtTorchPeer(kt, engine))
            peers.append(KtHandlePeer(kt, engine))
            if any(name == "assume_finite" for name, _ in kt._capi.OptimizerOptions._fields_):
                peers.append(KtHandlePeer(kt, engine, assume_finite=True))
            else:
                skipped.append({"peer": "kt C ABI, assume_finite", "reason": "this kt has no "
                                "kt_optimizer_options.assume_finite"})
        except Exception as e:  # ImportError, or a library that does not load
            skipped.append({"peer": "kt", "reason": "%s: %s" % (type(e).__name__, str(e).splitlines()[0])})
    if "deepspeed" in wanted:
        try:
            with stdout_to_stderr():
                import deepspeed
                from deepspeed.ops.adam import DeepSpeedCPUAdam
                # Builds (or loads) the op now, outside any timing; a
                # machine that cannot build it skips the peer here.
                probe = [torch.nn.Parameter(torch.zeros(64))]
                probe[0].grad = torch.zeros(64)
                DeepSpeedCPUAdam(probe, lr=LR).step()
            peers.append(DeepSpeedPeer(DeepSpeedCPUAdam, deepspeed.__version__, deepspeed_build_flags()))
        except Exception as e:
            skipped.append({"peer": "deepspeed", "reason": "%s: %s" % (type(e).__name__,
                                                                       (str(e).splitlines() or [""])[0])})
    if "torch" in wanted:
        peers.append(TorchPeer("default (for-loop)", {}))
        peers.append(TorchPeer("foreach", {"foreach": True}))
        try:
            torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
            peers.append(TorchPeer("fused", {"fused": True}))
        except (RuntimeError, TypeError, ValueError) as e:
            skipped.append({"peer": "torch fused", "reason": str(e).splitlines()[0]})
    for name in ("kt", "deepspeed", "torch"):
        if name not in wanted:
            skipped.append({"peer": name, "reason": "not in --peers"})
    return peers


# ---------------------------------------------------------------- reference

def reference_error(p0, g1, g2, values):
    """max |v - p_ref| / lr over every tensor, for each peer's values, with
    p_ref two float64 AdamW steps (gradients g1 then g2) from p0."""
    errors = [0.0] * len(values)
    b1, b2 = BETAS
    for i in range(len(p0)):
        flat = p0[i].reshape(-1)
        chunk = 1 << 22
        for lo in range(0, flat.numel(), chunk):
            sl = slice(lo, lo + chunk)
            p = flat[sl].double()
            m = torch.zeros_like(p)
            v = torch.zeros_like(p)
            for t, g in ((1, g1[i].reshape(-1)[sl].double()), (2, g2[i].reshape(-1)[sl].double())):
                p.mul_(1 - LR * WD)
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = v.sqrt() / (1 - b2 ** t) ** 0.5 + EPS
                p.addcdiv_(m, denom, value=-LR / (1 - b1 ** t))
            for k, vals in enumerate(values):
                if vals is None:
                    continue
                err = (vals[i].reshape(-1)[sl].double() - p).abs().max().item() / LR
                errors[k] = max(errors[k], err)
    return errors


# ---------------------------------------------------------------- machine

STREAM_C = r"""
#include <stddef.h>
/* The traffic of an fp32 AdamW step with none of its arithmetic: reads p, g,
   m, v and writes p, m, v in place, 28 bytes per element. */
void adamw_shaped_stream(float* p, const float* g, float* m, float* v, size_t n, int threads) {
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (size_t i = 0; i < n; ++i) {
    float gi = g[i];
    m[i] = 0.5f * m[i] + gi;
    v[i] = 0.5f * v[i] + gi;
    p[i] = 0.5f * p[i] + gi;
  }
}
"""


def stream_kernel():
    """adamw_shaped_stream compiled with the system C compiler (cc -O3
    -march=native -fopenmp) into a temporary directory, or None."""
    import shutil
    import subprocess
    import tempfile
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if not cc:
        return None, "no C compiler"
    d = tempfile.mkdtemp(prefix="optim_peers_")
    src, so = os.path.join(d, "stream.c"), os.path.join(d, "stream.so")
    with open(src, "w") as f:
        f.write(STREAM_C)
    r = subprocess.run([cc, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", src, "-o", so],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return None, "cc failed: " + (r.stderr.strip().splitlines() or ["?"])[0]
    lib = ctypes.CDLL(so)
    lib.adamw_shaped_stream.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_size_t, ctypes.c_int]
    return lib, ""


class Bandwidth:
    """In-run DRAM rates (GB/s) on the benchmark's threads. "floor": the
    AdamW-shaped stream (4 reads, 3 in-place writes over 4 x 256 MiB; the
    rate the floor is taken at), or where no C compiler is found torch's
    in-place a.addcmul_(b, c) (16 B/element); best of 3 after a warm pass at
    the start and then of one more pass in every round of every case (a peak:
    noise only lowers it, and the rounds spread it over the run). "copy":
    dst.copy_(src) of 512 MiB counted as read + write; "read": src.sum() of
    512 MiB; best of 3 at the start, for reference."""

    def __init__(self):
        n = 64 << 20
        self.n = n
        self.bufs = [torch.full((n,), 0.5) for _ in range(4)]
        lib, why = stream_kernel()
        if lib is not None:
            ptrs = [b.data_ptr() for b in self.bufs]
            self.stream = lambda: lib.adamw_shaped_stream(*ptrs, n, ARGS.threads)
            self.stream_bytes = BYTES_PER_PARAM * n
            self.kind = "AdamW-shaped stream (C, 4R+3W in place)"
        else:
            self.stream = lambda: self.bufs[0].addcmul_(self.bufs[1], self.bufs[2])
            self.stream_bytes = 16 * n
            self.kind = "torch addcmul_ in place (%s)" % why
        self.floor = 0.0
        self.stream()
        for _ in range(3):
            self.once()
        src, dst = torch.empty(2 * n), torch.empty(2 * n)
        src.fill_(0.5)
        self.copy = self.best(lambda: dst.copy_(src), 2 * 4 * 2 * n)
        self.read = self.best(lambda: src.sum(), 4 * 2 * n)
        self.samples = 3

    @staticmethod
    def best(fn, nbytes):
        fn()
        rate = 0.0
        for _ in range(3):
            t = time.perf_counter()
            fn()
            rate = max(rate, nbytes / (time.perf_counter() - t) / 1e9)
        return rate

    def once(self):
        t = time.perf_counter()
        self.stream()
        self.floor = max(self.floor, self.stream_bytes / (time.perf_counter() - t) / 1e9)
        self.samples = getattr(self, "samples", 0) + 1

    def doc(self):
        return {"floor_gb_s": self.floor, "floor_kind": self.kind, "floor_samples": self.samples,
                "copy_gb_s": self.copy, "read_gb_s": self.read}


def cpu_description():
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return model, isa


# ---------------------------------------------------------------- main

def run_case(case, peers, bw, failures):
    shapes = case_shapes(case)
    nparams = sum(int(torch.Size(s).numel()) for s in shapes)
    p0 = make_tensors(shapes, 1)
    g1 = [g.mul_(1e-3) for g in make_tensors(shapes, 2)]
    g2 = [g.mul_(1e-3) for g in make_tensors(shapes, 3)]
    # One tensor: kt.optim.AdamW is already one kt optimizer over it.
    active = [pr for pr in peers
              if not (isinstance(pr, KtHandlePeer) and not pr.assume_finite and len(shapes) == 1)]
    log("optim_peers: case %s: %d tensors, %.2f M params; checking %d peers" % (
        case, len(shapes), nparams / 1e6, len(active)))

    # Two checked steps per peer, from p0, with g1 then g2.
    for pr in active:
        pr.setup([p.clone() for p in p0], g1)
        pr.step()
        pr.set_grads(g2)
        pr.step()
    errors = reference_error(p0, g1, g2, [pr.values() for pr in active])
    del g2
    for pr in active:
        pr.set_grads(g1)
        for _ in range(ARGS.warmup):
            pr.step()

    times = {pr.label: [] for pr in active}
    for r in range(ARGS.rounds):
        order = active[r % len(active):] + active[:r % len(active)]
        bw.once()
        for pr in order:
            for _ in range(ARGS.steps):
                t = time.perf_counter()
                pr.step()
                times[pr.label].append(time.perf_counter() - t)

    rows = []
    for pr, err in zip(active, errors):
        ms = statistics.median(times[pr.label]) * 1e3
        ok = err <= ARGS.tol
        if not ok:
            failures.append("%s %s: max |p - p_ref64| = %.3g lr > %.3g lr" % (case, pr.label, err, ARGS.tol))
        rows.append({"peer": pr.peer, "variant": pr.variant, "note": pr.note, "ms": ms,
                     "ms_min": min(times[pr.label]) * 1e3, "samples": len(times[pr.label]),
                     "gparam_s": nparams / (ms * 1e-3) / 1e9,
                     "gb_s": BYTES_PER_PARAM * nparams / (ms * 1e-3) / 1e9,
                     "max_err_lr": err, "check_ok": ok})
    for pr in active:
        if hasattr(pr, "close"):
            pr.close()
        for attr in ("opt", "params", "grads", "views"):
            if hasattr(pr, attr):
                delattr(pr, attr)
    ds = [r["ms"] for r in rows if r["peer"] == "deepspeed"]
    for r in rows:
        r["x_deepspeed"] = ds[0] / r["ms"] if ds else None
    return {"case": case, "tensors": len(shapes), "params": nparams, "peers": rows}


def add_floor(case, floor_gb_s):
    """The floor of a case at the run's best stream rate, and each peer's share of it."""
    floor_s = BYTES_PER_PARAM * case["params"] / (floor_gb_s * 1e9)
    case["floor_ms"] = floor_s * 1e3
    for r in case["peers"]:
        r["floor_share"] = floor_s / (r["ms"] * 1e-3)


def print_table(doc, out):
    m = doc["machine"]
    print("optim_peers: %s, ISA %s, %d threads; DRAM in-run: %s %.1f GB/s (best of %d), copy %.1f GB/s, "
          "read %.1f GB/s" % (m["cpu"], "+".join(m["isa"]) or "-", m["threads"], m["floor_kind"], m["floor_gb_s"],
                              m["floor_samples"], m["copy_gb_s"], m["read_gb_s"]), file=out)
    print("AdamW lr=%g betas=%s eps=%g wd=%g; median of %d rounds x %d steps; floor = %d B/param at the %.1f GB/s"
          " of the stream" % (LR, BETAS, EPS, WD, ARGS.rounds, ARGS.steps, BYTES_PER_PARAM, m["floor_gb_s"]),
          file=out)
    for c in doc["cases"]:
        print("", file=out)
        print("case %s: %d tensors, %.2f M params, floor %.2f ms" % (c["case"], c["tensors"], c["params"] / 1e6,
                                                                   c["floor_ms"]), file=out)
        print("  %-34s %9s %9s %8s %7s %8s %11s" % ("peer", "ms", "Gparam/s", "GB/s", "%floor", "x DS",
                                                   "err (lr)"), file=out)
        for r in c["peers"]:
            xds = "%.2f" % r["x_deepspeed"] if r["x_deepspeed"] else "-"
            print("  %-34s %9.2f %9.3f %8.1f %6.0f%% %8s %9.1e %s" % (
                r["peer"] + " " + r["variant"], r["ms"], r["gparam_s"], r["gb_s"], 100 * r["floor_share"], xds,
                r["max_err_lr"], "ok" if r["check_ok"] else "FAILED"), file=out)
    print("", file=out)
    if doc["skipped"]:
        print("skipped: " + "; ".join("%s (%s)" % (s["peer"], s["reason"]) for s in doc["skipped"]), file=out)
    else:
        print("skipped: none", file=out)
    for t in doc["targets"]:
        print("target %s: %s" % (t["what"], t["verdict"]), file=out)


def targets(cases):
    out = []
    for c in cases:
        by = {(r["peer"], r["variant"]): r for r in c["peers"]}
        kt_rows = [r for r in c["peers"] if r["peer"] == "kt"]
        if not kt_rows:
            continue
        ds = by.get(("deepspeed", "DeepSpeedCPUAdam"))
        for k in kt_rows:
            if ds:
                x = ds["ms"] / k["ms"]
                out.append({"case": c["case"], "variant": k["variant"], "target": "x_deepspeed >= 1.5",
                            "what": "%s: kt %s >= 1.5x DeepSpeedCPUAdam" % (c["case"], k["variant"]),
                            "value": x, "met": x >= 1.5, "verdict": "%.2fx, %s" % (x, "met" if x >= 1.5 else "MISSED")})
            share = k["floor_share"]
            out.append({"case": c["case"], "variant": k["variant"], "target": "floor_share >= 0.85",
                        "what": "%s: kt %s >= 85%% of the memory floor" % (c["case"], k["variant"]),
                        "value": share, "met": share >= 0.85,
                        "verdict": "%.0f%%, %s" % (100 * share, "met" if share >= 0.85 else "MISSED")})
    return out


def main():
    wanted = [p.strip() for p in ARGS.peers.split(",") if p.strip()]
    skipped = []
    peers = load_peers(wanted, skipped)
    model, isa = cpu_description()
    bw = Bandwidth()
    failures = []
    cases = [run_case(c.strip(), peers, bw, failures) for c in ARGS.cases.split(",") if c.strip()]
    for c in cases:
        add_floor(c, bw.floor)
    machine = {"cpu": model, "isa": isa, "threads": ARGS.threads, "torch": torch.__version__,
               "python": platform.python_version()}
    machine.update(bw.doc())
    doc = {"benchmark": "optim_peers", "machine": machine,
           "settings": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD, "rounds": ARGS.rounds,
                        "steps": ARGS.steps, "warmup": ARGS.warmup, "bytes_per_param": BYTES_PER_PARAM,
                        "tol_lr": ARGS.tol},
           "cases": cases, "skipped": skipped, "targets": targets(cases), "failures": failures}
    print_table(doc, sys.stderr if ARGS.json else sys.stdout)
    if ARGS.json:
        print(json.dumps(doc, indent=1))
    for f in failures:
        log("optim_peers: FAILED: " + f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
