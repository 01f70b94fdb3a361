"""Processes forked from a Python process that holds kt objects (DataLoader
workers, multiprocessing with the "fork" start method): calls on inherited
engines and layers raise kt.InvalidHandleError at once, saying so (before,
save_packed waited forever for worker threads that do not exist in the
child), while layers made in the child, on the child's own default engine,
compute the same result as the parent. No torch needed."""
import os
import subprocess
import sys
import textwrap

from helpers import tolerances

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(os.path.dirname(os.path.dirname(HERE)), "plugins", "python")

SCRIPT = textwrap.dedent("""
    import multiprocessing as mp
    import os
    import queue
    import sys
    import tempfile
    import time
    sys.modules["torch"] = None  # any import of torch now fails
    import numpy as np
    import kt

    FP32 = {fp32!r}
    E, K, H, I, T = 4, 2, 32, 16, 6
    rng = np.random.default_rng(1)

    def bf16_rounded(a):  # kt stores the weights as bf16: round to nearest even
        u = a.astype(np.float32).view(np.uint32)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        return u.astype(np.uint32).view(np.float32)

    wg = bf16_rounded(rng.standard_normal((E, I, H)) / 5)
    wu = bf16_rounded(rng.standard_normal((E, I, H)) / 5)
    wd = bf16_rounded(rng.standard_normal((E, H, I)) / 4)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(0, E, (T, K)).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)

    def silu(v):
        return v / (1 + np.exp(-v))

    ref = np.zeros((T, H))
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            a = silu(wg[e].astype(np.float64) @ x[t]) * (wu[e].astype(np.float64) @ x[t])
            ref[t] += w[t, j] * (wd[e] @ a)

    def layer():
        # avx2 kernels: fp32 operands, so parent and child agree with the
        # float64 reference within the fp32 bound on any CPU.
        m = kt.MoE(E, K, H, I, engine=kt.Engine(max_isa="avx2"))
        m.load_weights(gate=wg, up=wu, down=wd)
        return m

    parent_engine = kt.default_engine()
    parent_layer = kt.MoE(E, K, H, I)  # on the default engine
    parent_layer.load_weights(gate=wg, up=wu, down=wd)
    own = layer()
    y_parent = np.empty_like(x)
    own.forward(x, ids, w, y_parent)
    err = np.abs(y_parent - ref).max() / np.abs(ref).max()
    assert err < FP32, err
    tmp = tempfile.mkdtemp()

    def timed(name, out, fn):
        t0 = time.monotonic()
        try:
            fn()
            out[name] = "no error"
        except kt.InvalidHandleError as e:
            out[name] = str(e)
        except Exception as e:
            out[name] = "%s: %s" % (type(e).__name__, e)
        out[name + "_s"] = time.monotonic() - t0

    def child(q):
        out = {{"pid": os.getpid()}}
        y = np.empty_like(x)
        timed("save_packed", out, lambda: parent_layer.save_packed(os.path.join(tmp, "child.ktpack")))
        timed("forward", out, lambda: own.forward(x, ids, w, y))
        timed("info", out, lambda: parent_engine.info())
        timed("moe_on_inherited_engine", out, lambda: kt.MoE(E, K, H, I, engine=parent_engine))
        timed("engine_close", out, lambda: parent_engine.close())
        # The child's own engine: kt.default_engine() is a new one here.
        out["new_default_engine"] = kt.default_engine() is not parent_engine
        mine = kt.MoE(E, K, H, I)
        mine.load_weights(gate=wg, up=wu, down=wd)
        mine.save_packed(os.path.join(tmp, "child.ktpack"))
        y_default = np.empty_like(x)
        mine.forward(x, ids, w, y_default)
        out["y_default_err"] = float(np.abs(y_default - ref).max() / np.abs(ref).max())
        y_own = np.empty_like(x)
        layer().forward(x, ids, w, y_own)
        out["y_own"] = y_own.tobytes()
        q.put(out)

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    try:
        out = q.get(timeout=120)
    except queue.Empty:
        p.kill()
        raise AssertionError("the forked child hung (no answer in 120 s)")
    p.join(60)
    assert p.exitcode == 0, p.exitcode

    forked = "made before this process was forked from process %d" % os.getpid()
    for name, call, arg in [("save_packed", "kt_moe_save_packed", "moe"),
                            ("forward", "kt_moe_forward", "moe"),
                            ("info", "kt_engine_get_info", "engine"),
                            ("moe_on_inherited_engine", "kt_moe_create", "engine"),
                            ("engine_close", "kt_engine_destroy", "engine")]:
        msg = out[name]
        assert msg.startswith("KT_ERR_INVALID_HANDLE") or call in msg, (name, msg)
        assert (call + ": " + arg + " is a ") in msg, (name, msg)
        assert forked in msg, (name, msg)
        assert "create a new engine in this process" in msg, (name, msg)
        assert out[name + "_s"] < 1.0, (name, out[name + "_s"])
    assert out["new_default_engine"]
    assert out["y_default_err"] < {bf16!r}, out["y_default_err"]
    assert out["y_own"] == y_parent.tobytes(), "the child's result differs from the parent's"

    # The parent's objects are untouched by what the child did.
    y2 = np.empty_like(x)
    own.forward(x, ids, w, y2)
    assert y2.tobytes() == y_parent.tobytes()
    parent_layer.save_packed(os.path.join(tmp, "parent.ktpack"))
    assert kt.default_engine() is parent_engine
    assert parent_engine.info()["num_threads"] >= 1

    # A pool of forked workers (as DataLoader workers are): each refuses the
    # parent's layer and computes with its own.
    def work(i):
        try:
            parent_layer.forward(x, ids, w, np.empty_like(x))
            refused = "no error"
        except kt.InvalidHandleError as e:
            refused = str(e)
        y = np.empty_like(x)
        layer().forward(x, ids, w, y)
        return refused, y.tobytes()

    with ctx.Pool(2) as pool:
        results = pool.map_async(work, range(4)).get(timeout=120)
    for refused, y in results:
        assert "kt_moe_forward: moe is a kt_moe made before this process was forked" in refused, refused
        assert y == y_parent.tobytes()
    print("fork-ok", out["pid"])
""").format(fp32=tolerances.FP32, bf16=tolerances.BF16)


def test_forked_child_refuses_inherited_handles_and_computes_with_its_own():
    env = dict(os.environ, PYTHONPATH=PKG)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fork-ok" in out.stdout
