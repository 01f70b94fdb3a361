"""The package without torch: numpy arrays, raw buffers, bf16 held as uint16."""
import os
import subprocess
import sys
import textwrap

from helpers import tolerances

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(os.path.dirname(os.path.dirname(HERE)), "plugins", "python")

SCRIPT = textwrap.dedent("""
    import sys
    sys.modules["torch"] = None  # any import of torch now fails
    import numpy as np
    import kt

    FP32, BF16 = {fp32!r}, {bf16!r}
    E, K, H, I, T = 3, 2, 24, 16, 5
    rng = np.random.default_rng(0)

    def bf16(a):  # round to nearest even, as uint16 bit patterns
        u = a.astype(np.float32).view(np.uint32)
        u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return u.astype(np.uint16)

    def from_bf16(b):
        return (b.astype(np.uint32) << 16).view(np.float32)

    wg = from_bf16(bf16(rng.standard_normal((E, I, H)) / 5))
    wu = from_bf16(bf16(rng.standard_normal((E, I, H)) / 5))
    wd = from_bf16(bf16(rng.standard_normal((E, H, I)) / 4))
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.array([[0, 1], [2, 0], [1, -1], [2, 1], [0, 2]], np.int32)
    w = rng.random((T, K)).astype(np.float32)

    def silu(v):
        return v / (1 + np.exp(-v))

    def dsilu(v):  # d silu / dv = sigmoid(v) (1 + v (1 - sigmoid(v)))
        s = 1 / (1 + np.exp(-v))
        return s * (1 + v * (1 - s))

    ref = np.zeros((T, H))
    for t in range(T):
        for j in range(K):
            e = ids[t, j]
            if e >= 0:
                a = silu(wg[e] @ x[t]) * (wu[e] @ x[t])
                ref[t] += w[t, j] * (wd[e] @ a)

    # The GEMM backend is chosen at engine creation; the oneDNN one needs
    # bf16 activations, so the avx2 kernels refuse it, saying why.
    assert kt.Engine(max_isa="avx2", gemm_backend="native").info()["gemm_backend"] == "native"
    try:
        kt.Engine(max_isa="avx2", gemm_backend="onednn")
        raise AssertionError("the oneDNN backend was accepted on the avx2 kernels")
    except kt.KtError as e:
        assert "KT_GEMM_ONEDNN needs" in str(e), str(e)

    m = kt.MoE(E, K, H, I, engine=kt.Engine(max_isa="avx2"))
    # gate/up given transposed ([E, H, I]) as a non-contiguous numpy view
    m.load_weights(gate=wg.transpose(0, 2, 1).copy().transpose(0, 2, 1), up=wu, down=wd)
    y = np.empty_like(x)
    m.forward(x, ids, w, y)
    err = np.abs(y - ref).max() / np.abs(ref).max()
    assert err < FP32, err

    # bf16 activations through kt.RawTensor over uint16 storage
    xb = bf16(x)
    yb = np.empty_like(xb)
    m.forward(kt.RawTensor(xb.ctypes.data, "bfloat16", xb.shape, owner=xb), ids, w,
              kt.RawTensor(yb.ctypes.data, "bfloat16", yb.shape, owner=yb))
    errb = np.abs(from_bf16(yb) - ref).max() / np.abs(ref).max()
    assert errb < BF16, errb

    # a training forward + backward with numpy buffers
    ctx = m.forward(x, ids, w, y, save=True)
    dy = rng.standard_normal((T, H)).astype(np.float32)
    dx = np.empty_like(x)
    dw = np.empty_like(w)
    m.backward(ctx, dy, dx, dw)
    # dx and the routing-weight gradients by hand, in float64: per route,
    # da = w Wd^T dy, dx += Wg^T (da u silu'(g)) + Wu^T (da silu(g)), dw = <dy, Wd a>.
    ref_dx = np.zeros((T, H))
    ref_dw = np.zeros((T, K))
    for t in range(T):
        xt, dyt = x[t].astype(np.float64), dy[t].astype(np.float64)
        for j in range(K):
            e = ids[t, j]
            if e >= 0:
                g, u = wg[e] @ xt, wu[e] @ xt
                ref_dw[t, j] = dyt @ (wd[e] @ (silu(g) * u))
                da = w[t, j] * (wd[e].T @ dyt)
                ref_dx[t] += wg[e].T @ (da * u * dsilu(g)) + wu[e].T @ (da * silu(g))
    errdx = np.abs(dx - ref_dx).max() / np.abs(ref_dx).max()
    assert errdx < FP32, errdx
    errdw = np.abs(dw - ref_dw).max() / np.abs(ref_dw).max()
    assert errdw < FP32, errdw
    assert dw[2, 1] == 0.0  # the route -1
    assert abs(dw[0, 0] - dy[0] @ (wd[0] @ (silu(wg[0] @ x[0]) * (wu[0] @ x[0])))) < 1e-3
    try:
        m.backward(ctx, dy, dx, dw)
    except kt.ContextError as e:
        assert "spent" in str(e), e
    else:
        raise AssertionError("a second backward on a spent context succeeded")
    ctx.release()
    print("numpy-ok", kt.version())
""").format(fp32=tolerances.FP32, bf16=tolerances.BF16)


def test_without_torch():
    env = dict(os.environ, PYTHONPATH=PKG)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "numpy-ok" in out.stdout


def test_numa_option_reports_nodes_and_keeps_the_bits():
    import numpy as np
    import kt

    rng = np.random.default_rng(1)
    E, K, H, I, T = 6, 2, 32, 16, 9
    wg, wu = (rng.standard_normal((E, I, H)).astype(np.float32) / 5 for _ in range(2))
    wd = rng.standard_normal((E, H, I)).astype(np.float32) / 4
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = rng.integers(0, E, (T, K)).astype(np.int32)
    w = rng.random((T, K)).astype(np.float32)
    nodes = len([d for d in os.listdir("/sys/devices/system/node") if d.startswith("node")]) \
        if os.path.isdir("/sys/devices/system/node") else 1
    outs = {}
    for numa in ("off", "auto"):
        engine = kt.Engine(num_threads=2, numa=numa)
        workers = engine.info()["numa_node_workers"]
        assert sum(workers) == 2, workers
        assert (len(workers) == 1) if numa == "off" else (1 <= len(workers) <= nodes), (numa, workers)
        m = kt.MoE(E, K, H, I, engine=engine)
        m.load_weights(gate=wg, up=wu, down=wd)
        outs[numa] = np.empty_like(x)
        m.forward(x, ids, w, outs[numa])
        m.close()
        engine.close()
    assert outs["auto"].tobytes() == outs["off"].tobytes()
    try:
        kt.Engine(numa="on")
    except ValueError as e:
        assert "numa must be one of off, auto" in str(e), e
    else:
        raise AssertionError("numa='on' was accepted")
