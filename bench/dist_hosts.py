#!/usr/bin/env python3
"""kt.dist expert parallel across two "hosts": two network namespaces joined
by a link with a fixed one-way delay (kt_delay_link, a TUN pair forwarded in
user space, since this kernel has no tc netem).

    sudo python3 bench/dist_hosts.py [--model qwen3-30b-a3b] [--tokens 1,32,512]
        [--delays 0,50,200] [--json out.json]

Per token count T (tokens per rank), it runs one LoRA layer (E experts,
top-k) forward and forward+backward:
  - one process over both ranks' 2T tokens (the oracle and the one-host time),
  - 2 ranks over Gloo on loopback in this namespace,
  - 2 ranks across the namespaces at each delay (rank r's Gloo listens on its
    namespace's address; rendezvous through a file store both reach),
checks that every rank's y, dx, routing-weight gradients and LoRA gradients
have the one process's bits, measures the link (TCP ping-pong round trip and
bulk rate) and prints a markdown table with an estimate: bytes crossing the
link over its rate plus the collectives' round trips times the delay.

Runs as root (ip netns, /dev/net/tun). Only numpy is needed beside kt.
"""
import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEVICE = "kt0"
# Each collective of kt.dist's expert parallel is one Gloo step between the
# two ranks: the receiver's ready notice, then the data (one round trip).
ROUNDS = {"forward": 3, "forward_backward": 6}


# ---------------------------------------------------------------- the layer

def bf16_bits(a):
    import numpy as np
    u = a.astype(np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def expert_weights(cfg, e):
    """Expert e's gate, up [I, H] and down [H, I] as bf16 bits: random signs
    and mantissas, magnitudes 2^-7..2^-6 (cheap to make; any rank makes the
    same bits for the same expert)."""
    import numpy as np
    rng = np.random.default_rng([cfg["seed"], 1, e])
    H, I = cfg["hidden"], cfg["intermediate"]

    def one(shape):
        return (rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & 0x80FF) | 0x3C00
    return one((I, H)), one((I, H)), one((H, I))


LORA = ("GATE", "UP", "DOWN")


def lora_factors(cfg, e):
    import numpy as np
    rng = np.random.default_rng([cfg["seed"], 2, e])
    H, I, r = cfg["hidden"], cfg["intermediate"], cfg["lora_rank"]
    shapes = {"GATE": ((r, H), (I, r)), "UP": ((r, H), (I, r)), "DOWN": ((r, I), (H, r))}
    out = {}
    for p in LORA:
        a, b = shapes[p]
        out["LORA_A_" + p] = (rng.standard_normal(a) * 0.02).astype(np.float32)
        out["LORA_B_" + p] = (rng.standard_normal(b) * 0.02).astype(np.float32)
    return out


def tokens_for(cfg, T, world):
    """world*T tokens: x, dy (bf16 bits), distinct top-k ids, fp32 weights."""
    import numpy as np
    rng = np.random.default_rng([cfg["seed"], 3, T])
    n, E, K, H = world * T, cfg["experts"], cfg["top_k"], cfg["hidden"]
    x = bf16_bits(rng.standard_normal((n, H)))
    dy = bf16_bits(rng.standard_normal((n, H)) * 0.1)
    ids = np.argsort(rng.random((n, E)), axis=1)[:, :K].astype(np.int32)
    w = rng.random((n, K)).astype(np.float32)
    return x, dy, ids, w / w.sum(axis=1, keepdims=True)


def digest(a):
    import numpy as np
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:24]


def reps_for(cfg, T):
    return max(3, int(cfg["reps"] / max(1.0, T ** 0.5)))


def run_layer(cfg, role, rank, world, store, host, out):
    """One process's part: role "one" (every expert, all tokens) or "rank"."""
    import numpy as np
    import kt
    from kt.dist import Communicator, DistMoE

    E, K, H, I, r = cfg["experts"], cfg["top_k"], cfg["hidden"], cfg["intermediate"], cfg["lora_rank"]
    Tmax = max(cfg["tokens"])
    engine = kt.Engine(num_threads=cfg["threads"] * (world if role == "one" else 1), pin_threads=False)
    lora = dict(mode="lora", lora_rank=r, lora_alpha=2.0 * r)
    comm = None
    if role == "one":
        layer = kt.MoE(E, K, H, I, max_tokens=world * Tmax, engine=engine, **lora)
        local, experts = layer, list(range(E))
    else:
        comm = Communicator(rank, world, store_path=store, hostname=host, prefix=cfg["prefix"],
                            timeout=cfg["timeout"])
        layer = DistMoE(comm, E, K, H, I, max_tokens=Tmax, mode="expert_parallel", layer_mode="lora",
                        lora_rank=r, lora_alpha=2.0 * r, engine=engine)
        local, experts = layer.layer, layer.local_experts()
    bound = {}
    for i, e in enumerate(experts):
        g, u, d = expert_weights(cfg, e)
        local.load_expert(i, gate=kt.RawTensor(g.ctypes.data, "bfloat16", g.shape, owner=g),
                          up=kt.RawTensor(u.ctypes.data, "bfloat16", u.shape, owner=u),
                          down=kt.RawTensor(d.ctypes.data, "bfloat16", d.shape, owner=d))
        for k, v in lora_factors(cfg, e).items():
            bound.setdefault(k, []).append(v)
    params = {k: np.ascontiguousarray(np.stack(v)) for k, v in bound.items()}
    grads = {"GRAD_" + k: np.zeros_like(v) for k, v in params.items()}
    local.bind(**params, **grads)

    def raw(a):
        return kt.RawTensor(a.ctypes.data, "bfloat16", a.shape, owner=a)

    result = {"role": role, "rank": rank, "experts": experts, "by_tokens": {}}
    for T in cfg["tokens"]:
        x, dy, ids, w = tokens_for(cfg, T, world)
        rows = slice(0, world * T) if role == "one" else slice(rank * T, (rank + 1) * T)
        x, dy, ids, w = (np.ascontiguousarray(a[rows]) for a in (x, dy, ids, w))
        y, dx, dw = np.empty_like(x), np.empty_like(x), np.empty_like(w)

        def fwd(save=False):
            return layer.forward(raw(x), ids, w, raw(y), save=save)

        def fwd_bwd():
            ctx = fwd(save=True)
            layer.backward(ctx, raw(dy), raw(dx), dw)
            ctx.release()

        for g in grads.values():
            g.fill(0)
        fwd_bwd()
        # The bits of the checked call: rows per rank's share, gradients per expert.
        parts = [slice(q * T, (q + 1) * T) for q in range(world)] if role == "one" else [slice(0, T)]
        owners = range(world) if role == "one" else [rank]
        bits = {"rows": {str(q): {n: digest(a[s]) for n, a in (("y", y), ("dx", dx), ("dw", dw))}
                         for q, s in zip(owners, parts)},
                "grads": {str(e): digest(np.concatenate([g[i].ravel() for g in grads.values()]))
                          for i, e in enumerate(experts)}}
        times = {"forward": [], "forward_backward": []}
        n = reps_for(cfg, T)
        for name, call in (("forward", fwd), ("forward_backward", fwd_bwd)):
            call()  # warm
            for _ in range(n):
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
        result["by_tokens"][str(T)] = {"bits": bits, "times_s": times}
    if comm is not None:
        layer.close()
        comm.close()
    with open(out, "w") as f:
        json.dump(result, f)


# ---------------------------------------------------------------- link probe

def probe_server(host, port, ready):
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(1)
    open(ready, "w").close()
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        head = c.recv(9, socket.MSG_WAITALL)
        if len(head) < 9:
            return
        kind, size = struct.unpack("!cQ", head)
        left = size
        while left:
            chunk = c.recv(min(left, 1 << 20))
            if not chunk:
                return
            left -= len(chunk)
        c.sendall(b"k")


def probe_client(host, port, pings, bulk_bytes):
    c = socket.create_connection((host, port))
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def exchange(size, payload=b""):
        c.sendall(struct.pack("!cQ", b"p", size) + payload)
        assert c.recv(1) == b"k"

    rtts = []
    for i in range(pings + 20):
        t0 = time.perf_counter()
        exchange(1, b"x")
        if i >= 20:  # the first exchanges grow TCP's window and warm the path
            rtts.append(time.perf_counter() - t0)
    block = b"\0" * (1 << 20)
    exchange(len(block), block)
    t0 = time.perf_counter()
    c.sendall(struct.pack("!cQ", b"b", bulk_bytes))
    for _ in range(bulk_bytes // len(block)):
        c.sendall(block)
    assert c.recv(1) == b"k"
    bulk_s = time.perf_counter() - t0
    c.close()
    rtts.sort()
    us = [v * 1e6 for v in rtts]
    return {"rtt_us_median": statistics.median(us), "rtt_us_p10": us[len(us) // 10],
            "rtt_us_p90": us[(9 * len(us)) // 10], "pings": len(us),
            "bulk_bytes": bulk_bytes, "bulk_gbit_s": bulk_bytes * 8 / bulk_s / 1e9}


# ---------------------------------------------------------------- hosts

class Hosts:
    """Two namespaces "a" and "b" joined by kt_delay_link; removed on exit
    (also on an error or a signal: the caller turns SIGTERM into SystemExit)."""

    def __init__(self, link_program, delay_us, tag):
        self.link_program, self.delay_us = link_program, delay_us
        self.ns = ["kth%s%s" % (tag, s) for s in "ab"]
        net = 16 + os.getpid() % 200
        self.addr = ["10.%d.0.1" % net, "10.%d.0.2" % net]
        self.link = None

    def __enter__(self):
        try:
            for ns in self.ns:
                subprocess.run(["ip", "netns", "add", ns], check=True)
            self.link = subprocess.Popen([self.link_program] + ["/var/run/netns/" + ns for ns in self.ns]
                                         + [DEVICE, str(self.delay_us)], stdout=subprocess.PIPE)
            if self.link.stdout.readline().strip() != b"ready":
                raise RuntimeError("kt_delay_link did not start (exit %s)" % self.link.poll())
            for ns, me, peer in ((self.ns[0], self.addr[0], self.addr[1]), (self.ns[1], self.addr[1], self.addr[0])):
                for cmd in (["link", "set", "lo", "up"], ["addr", "add", me, "peer", peer, "dev", DEVICE],
                            ["link", "set", DEVICE, "mtu", "9000", "up"]):
                    subprocess.run(["ip", "-n", ns] + cmd, check=True)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        if self.link is not None and self.link.poll() is None:
            self.link.terminate()
            self.link.wait()
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)

    def exec(self, i, argv):
        return ["ip", "netns", "exec", self.ns[i]] + argv


def me(*args):
    return [sys.executable, os.path.abspath(__file__)] + [str(a) for a in args]


def wait_all(procs, what, timeout):
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
            if rc != 0:
                raise RuntimeError("%s: a process exited with %d" % (what, rc))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def measure_link(hosts, work, pings, bulk_bytes):
    ready = os.path.join(work, "probe-ready")
    port = 29000 + os.getpid() % 1000
    srv = subprocess.Popen(hosts.exec(1, me("_probe_server", hosts.addr[1], port, ready)))
    try:
        while not os.path.exists(ready):
            if srv.poll() is not None:
                raise RuntimeError("the probe server exited with %d" % srv.returncode)
            time.sleep(0.01)
        out = subprocess.run(hosts.exec(0, me("_probe_client", hosts.addr[1], port, pings, bulk_bytes)),
                             check=True, stdout=subprocess.PIPE, timeout=300).stdout
    finally:
        wait_all([srv], "probe server", 30)
        os.unlink(ready)
    return json.loads(out)


def run_ranks(cfg, work, name, launch, hosts_addr, timeout):
    """Both ranks of one configuration; launch(rank, argv) wraps the command."""
    store = os.path.join(work, "store-" + name)
    os.makedirs(store)
    c = dict(cfg, prefix="kt-" + name)
    cfg_path = os.path.join(work, "cfg-%s.json" % name)
    with open(cfg_path, "w") as f:
        json.dump(c, f)
    outs = [os.path.join(work, "%s-rank%d.json" % (name, r)) for r in range(2)]
    procs = [subprocess.Popen(launch(r, me("_rank", cfg_path, r, store, hosts_addr[r], outs[r])))
             for r in range(2)]
    wait_all(procs, name, timeout)
    return [json.load(open(o)) for o in outs]


def run_one(cfg, work, timeout):
    cfg_path = os.path.join(work, "cfg-one.json")
    with open(cfg_path, "w") as f:
        json.dump(dict(cfg, prefix="one"), f)
    out = os.path.join(work, "one.json")
    wait_all([subprocess.Popen(me("_one", cfg_path, out))], "one process", timeout)
    return json.load(open(out))


def compare_bits(one, ranks):
    """Mismatches of the ranks' bits against the one process's, as text."""
    bad = []
    for T, ref in one["by_tokens"].items():
        for res in ranks:
            got = res["by_tokens"][T]["bits"]
            r = str(res["rank"])
            for q, d in got["rows"][r].items():
                if ref["bits"]["rows"][r][q] != d:
                    bad.append("T=%s rank %s: %s differs" % (T, r, q))
            for e, d in got["grads"].items():
                if ref["bits"]["grads"][e] != d:
                    bad.append("T=%s rank %s: LoRA gradients of expert %s differ" % (T, r, e))
    return bad


def crossing_bytes(cfg, T, rank_experts):
    """Bytes each way over the link per layer call, from the routes that
    cross: forward x rows (bf16) + expert id + weight out, fp32 y rows back;
    backward dy rows (bf16) out, fp32 dx rows + weight gradient back
    (src/dist/dist_moe.cpp's wire format)."""
    import numpy as np
    _, _, ids, _ = tokens_for(cfg, T, 2)
    H = cfg["hidden"]
    owner = np.zeros(cfg["experts"], np.int64)
    for r, experts in enumerate(rank_experts):
        owner[experts] = r
    cross = [int((owner[ids[r * T:(r + 1) * T]] != r).sum()) for r in range(2)]
    head = 2 * 1024  # the outcome records of the agreement and the combine
    fwd = [head + cross[r] * (2 * H + 8) + cross[1 - r] * 4 * H for r in range(2)]
    bwd = [head + cross[r] * 2 * H + cross[1 - r] * (4 * H + 4) for r in range(2)]
    return {"routes_crossing": cross, "forward": fwd, "forward_backward": [f + b for f, b in zip(fwd, bwd)]}


def median_ms(res_list, T, what, stat=statistics.median):
    # A collective ends on both ranks together: the slower rank's median.
    return max(stat(r["by_tokens"][str(T)]["times_s"][what]) for r in res_list) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-30b-a3b", help="a bench/models/models.json entry")
    ap.add_argument("--experts", type=int, help="fewer experts than the model's (memory, time)")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--tokens", default="1,32,512", help="tokens per rank")
    ap.add_argument("--delays", default="0,50,200", help="one-way link delays, microseconds")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="kt workers per rank (one process: 2x)")
    ap.add_argument("--reps", type=int, default=40, help="timed calls at T=1 (fewer as T grows)")
    ap.add_argument("--pings", type=int, default=500)
    ap.add_argument("--bulk-mib", type=int, default=64)
    ap.add_argument("--link", default=None, help="the kt_delay_link program (default: build/bench)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--table-from", help="print the table of an earlier --json file (no run)")
    args = ap.parse_args()
    if args.table_from:
        old = json.load(open(args.table_from))
        delays = [float(n[len("netns-"):-2]) for n in old["link"]]
        old["table"] = table(old["config"], old, delays)
        print(old["table"]["markdown"])
        if args.json:
            with open(args.json, "w") as f:
                json.dump(old, f, indent=1)
        return

    model = json.load(open(os.path.join(HERE, "models", "models.json")))[args.model]
    cfg = {"model": args.model, "experts": args.experts or model["experts"], "top_k": args.top_k or model["top_k"],
           "hidden": args.hidden or model["hidden"], "intermediate": args.intermediate or model["moe_intermediate"],
           "tokens": [int(t) for t in args.tokens.split(",")], "lora_rank": args.lora_rank,
           "threads": args.threads, "reps": args.reps, "seed": 7, "timeout": 300.0}
    delays = [float(d) for d in args.delays.split(",")]
    link = args.link or os.environ.get("KT_DELAY_LINK") or os.path.join(ROOT, "build", "bench", "kt_delay_link")
    if not os.access(link, os.X_OK):
        sys.exit("dist_hosts: %s is not there (cmake --build build --target kt_delay_link)" % link)

    def on_signal(signum, frame):
        raise SystemExit("dist_hosts: stopped by signal %d" % signum)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)

    tag = "%d%s" % (os.getpid(), os.urandom(2).hex())
    work = tempfile.mkdtemp(prefix="kt-dist-hosts-")
    results = {"config": cfg, "cpu": cpu_name(), "link": {}, "runs": {}}
    try:
        results["runs"]["one"] = run_one(cfg, work, args.timeout)
        results["runs"]["loopback"] = run_ranks(cfg, work, "loopback", lambda r, argv: argv,
                                                ["127.0.0.1", "127.0.0.1"], args.timeout)
        for d in delays:
            name = "netns-%gus" % d
            with Hosts(link, d, tag) as hosts:
                results["link"][name] = measure_link(hosts, work, args.pings, args.bulk_mib << 20)
                results["runs"][name] = run_ranks(cfg, work, name, hosts.exec, hosts.addr, args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    one = results["runs"]["one"]
    mismatches = {n: compare_bits(one, r) for n, r in results["runs"].items() if n != "one"}
    results["bit_identical"] = {n: not m for n, m in mismatches.items()}
    results["mismatches"] = {n: m[:20] for n, m in mismatches.items() if m}
    results["table"] = table(cfg, results, delays)
    print(results["table"]["markdown"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if any(mismatches.values()):
        sys.exit("dist_hosts: the ranks' bits differ from one process's: %s" % results["mismatches"])


def table(cfg, results, delays):
    """Per-layer times (ms) and the estimate of each delay's configuration:
    loopback's time + bytes over the link rate (the busier direction; the
    forwarder serves both with one thread, so both directions' sum is the
    upper bound) + round trips x 2 x delay."""
    rate = {n: v["bulk_gbit_s"] * 1e9 / 8 for n, v in results["link"].items()}
    rows, lines = [], []
    head = ["T", "pass", "one process", "2 ranks loopback"]
    for d in delays:
        head += ["netns %g µs" % d, "estimate %g µs" % d]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    experts = [r["experts"] for r in sorted(results["runs"]["loopback"], key=lambda r: r["rank"])]
    for T in cfg["tokens"]:
        b = crossing_bytes(cfg, T, experts)
        for what in ("forward", "forward_backward"):
            one = median_ms([results["runs"]["one"]], T, what)
            loop = median_ms(results["runs"]["loopback"], T, what)
            row = {"tokens_per_rank": T, "pass": what, "one_process_ms": one, "loopback_ms": loop,
                   "one_process_min_ms": median_ms([results["runs"]["one"]], T, what, min),
                   "loopback_min_ms": median_ms(results["runs"]["loopback"], T, what, min),
                   "bytes_each_way": b[what], "routes_crossing": b["routes_crossing"], "netns": {}}
            cells = [str(T), what.replace("_", "+"), "%.3f" % one, "%.3f" % loop]
            for d in delays:
                name = "netns-%gus" % d
                t = median_ms(results["runs"][name], T, what)
                wire = max(b[what]) / rate[name] * 1e3
                est = loop + wire + ROUNDS[what] * 2 * d * 1e-3
                row["netns"][name] = {"ms": t, "min_ms": median_ms(results["runs"][name], T, what, min),
                                      "estimate_ms": est, "wire_ms": wire,
                                      "rounds": ROUNDS[what], "added_over_loopback_ms": t - loop,
                                      "effective_round_trips": (t - loop - wire) / (2 * d * 1e-3) if d else None}
                cells += ["%.3f" % t, "%.3f" % est]
            rows.append(row)
            lines.append("| " + " | ".join(cells) + " |")
    return {"rows": rows, "markdown": "\n".join(lines)}


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + " (%d CPUs)" % os.cpu_count()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sys.path.insert(0, os.path.join(ROOT, "plugins", "python"))
        cmd, rest = sys.argv[1], sys.argv[2:]
        if cmd == "_probe_server":
            probe_server(rest[0], int(rest[1]), rest[2])
        elif cmd == "_probe_client":
            print(json.dumps(probe_client(rest[0], int(rest[1]), int(rest[2]), int(rest[3]))))
        elif cmd == "_one":
            run_layer(json.load(open(rest[0])), "one", 0, 2, None, None, rest[1])
        elif cmd == "_rank":
            run_layer(json.load(open(rest[0])), "rank", int(rest[1]), 2, rest[2], rest[3], rest[4])
        else:
            sys.exit("dist_hosts: unknown %s" % cmd)
    else:
        main()
