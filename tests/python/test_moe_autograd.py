"""kt.torch.MoEExperts against torch autograd of the plain reference."""
import contextlib

import pytest
import torch

import kt

from helpers import measured
from helpers import tolerances
from helpers.cases import build_module, make_case
from helpers.reference import checked_lora_scale, reference_grads, rel_l2

ACTIVATIONS = {
    "silu": dict(kind="silu", limit=0.0, x_scale=1.0),
    "silu_limit": dict(kind="silu", limit=1.5, x_scale=2.0),
    "swiglu_oai": dict(kind="swiglu_oai", limit=7.0, x_scale=5.0),
}
# (E, k, H, I, T): Qwen3-30B-A3B's H and I with 4 of its 128 experts (top-2), and
# shapes off every kernel tile (odd, prime, below one panel).
QWEN_LIKE = (4, 2, 2048, 768, 12)
AWKWARD = [(5, 3, 72, 40, 17), (3, 2, 33, 19, 5), (6, 1, 130, 70, 1)]


def run_case(shape, mode, act, precision, engine, bias=False, max_tokens=1024, seed=0,
             rank=4, alpha=8.0, use_rslora=False):
    E, k, H, I, T = shape
    a = ACTIVATIONS[act]
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    case = make_case(E, k, H, I, T, dtype=dtype, mode=mode, bias=bias, x_scale=a["x_scale"],
                     rank=rank, seed=seed)
    module = build_module(case, E, k, H, I, mode=mode, kind=a["kind"], limit=a["limit"],
                          bias=bias, rank=rank, alpha=alpha, use_rslora=use_rslora, engine=engine,
                          param_dtype=dtype, max_tokens=max_tokens)
    x = case["x"].clone().requires_grad_(True)
    weights = case["weights"].clone().requires_grad_(True)
    y = module(x, case["ids"], weights)
    y.backward(case["dy"])

    lora_ref = case["lora"]
    scale = checked_lora_scale(module.lora_scale, rank, alpha, use_rslora) if mode == "lora" else 0.0
    ref_y, ref = reference_grads(case["x"], case["ids"], case["weights"], case["w"], case["dy"],
                                 lora=lora_ref, weight_grads=(mode == "full"), kind=a["kind"], limit=a["limit"],
                                 lora_scale=scale)
    tol = tolerances.FP32 if precision == "fp32" else tolerances.BF16
    assert y.dtype == dtype and x.grad.dtype == dtype
    got = {"forward": (y, ref_y), "dx": (x.grad, ref["x"]),
           "routing grad": (weights.grad, ref["weights"])}
    if mode == "lora":
        for p in ("gate", "up", "down"):
            got["lora A grad"] = got.get("lora A grad", []) + [(getattr(module, "lora_A_" + p).grad,
                                                                 ref["A_" + p])]
            got["lora B grad"] = got.get("lora B grad", []) + [(getattr(module, "lora_B_" + p).grad,
                                                                 ref["B_" + p])]
    if mode == "full":
        for p in ("gate", "up", "down"):
            got.setdefault("weight grad", []).append((getattr(module, "w_" + p).grad, ref[p]))
            if bias:
                got.setdefault("bias grad", []).append((getattr(module, "b_" + p).grad,
                                                        ref["b_" + p]))
    errors = {}
    for quantity, pairs in got.items():
        if isinstance(pairs, tuple):
            pairs = [pairs]
        for g, r in pairs:
            assert g is not None, quantity + " was not written"
            assert g.shape == r.shape
            err = rel_l2(g, r)
            errors[quantity] = max(errors.get(quantity, 0.0), err)
            measured.record(precision, quantity, err)
    bad = {q: e for q, e in errors.items() if not e <= tol}
    assert not bad, "errors above %.1e: %s" % (tol, bad)
    return module, errors


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("mode", ["inference", "lora", "full"])
@pytest.mark.parametrize("shape", AWKWARD[:2], ids=lambda s: "E%d_k%d_H%d_I%d_T%d" % s)
def test_awkward_shapes(shape, mode, act, precision, fp32_engine):
    engine = fp32_engine if precision == "fp32" else None
    run_case(shape, mode, act, precision, engine, bias=(mode == "full" and act == "swiglu_oai"))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("mode", ["lora", "full"])
def test_qwen3_30b_a3b_like(mode, precision, fp32_engine):
    engine = fp32_engine if precision == "fp32" else None
    run_case(QWEN_LIKE, mode, "silu", precision, engine)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_single_token_single_route(precision, fp32_engine):
    engine = fp32_engine if precision == "fp32" else None
    run_case(AWKWARD[2], "lora", "silu", precision, engine)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("use_rslora", [False, True], ids=["lora", "rslora"])
def test_lora_scale_from_the_options(use_rslora, precision, fp32_engine):
    # r = 16, alpha = 8: alpha / r = 0.5 and rsLoRA's alpha / sqrt(r) = 2, so
    # either formula in place of the other is 4x off in every LoRA term (the
    # other cases' r = 4, alpha = 8 also tell them apart, by 2x).
    engine = fp32_engine if precision == "fp32" else None
    run_case(AWKWARD[0], "lora", "silu", precision, engine, rank=16, alpha=8.0, use_rslora=use_rslora)


def test_tokens_beyond_max_tokens_are_chunked(fp32_engine):
    # 17 tokens through a layer sized for 8 per call: three kt calls, one graph.
    run_case(AWKWARD[0], "lora", "silu", "fp32", fp32_engine, max_tokens=8)


def test_biases_in_full_mode_with_silu(fp32_engine):
    run_case(AWKWARD[0], "full", "silu", "fp32", fp32_engine, bias=True)


@contextlib.contextmanager
def torch_threads(n):
    """torch's intra-op threads (the calling thread's OpenMP setting) at n
    for the block, then as they were."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def random_experts(E, H, I, g):
    return dict(gate=torch.randn(E, I, H, generator=g) * 0.1, up=torch.randn(E, I, H, generator=g) * 0.1,
                down=torch.randn(E, H, I, generator=g) * 0.1)


@pytest.mark.parametrize("backend", ["auto", "onednn"])
def test_kt_leaves_the_hosts_torch_threads(backend):
    """kt shares the process's OpenMP runtime with torch (and oneDNN runs
    on it): creating an engine and calling a layer, whose items run on the
    calling thread in a one-thread engine, must leave that thread's OpenMP
    setting, i.e. torch's intra-op threads, as the host set it."""
    with torch_threads(3):
        try:
            engine = kt.Engine(num_threads=1, gemm_backend=backend)
        except kt.KtError as e:
            if "KT_GEMM_ONEDNN needs" in str(e):
                pytest.skip("no oneDNN backend on this CPU's kernels: %s" % e)
            raise
        assert torch.get_num_threads() == 3, "kt.Engine changed torch's threads"
        E, K, H, I = 4, 2, 64, 32
        layer = kt.MoE(E, K, H, I, max_tokens=64, engine=engine)
        g = torch.Generator().manual_seed(0)
        layer.load_weights(**random_experts(E, H, I, g))
        for T in (1, 64):
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
            y = torch.empty(T, H, dtype=torch.bfloat16)
            layer.forward(x, ids, torch.rand(T, K, generator=g), y)
            assert torch.get_num_threads() == 3, "a forward of %d tokens changed torch's threads" % T
        if backend == "onednn":
            assert engine.info()["gemm_backend"] == "onednn", engine.info()


def test_host_openmp_engine_gives_the_same_bits():
    """An engine on the host's OpenMP threads (host_openmp: torch's
    intra-op threads here) computes what an engine with kt's own workers
    computes, bit for bit (every item writes only its own outputs), and
    leaves torch's thread count as it was."""
    with torch_threads(2):
        try:
            on_openmp = kt.Engine(num_threads=0, host_openmp=True)
        except kt.UnsupportedError as e:
            pytest.skip("kt built without OpenMP: %s" % e)
        assert on_openmp.info()["num_threads"] == 2  # the caller's omp_get_max_threads()
        own = kt.Engine(num_threads=2)
        E, K, H, I, T = 8, 2, 128, 64, 96
        g = torch.Generator().manual_seed(1)
        w = random_experts(E, H, I, g)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.randint(0, E, (T, K), generator=g, dtype=torch.int32)
        rw = torch.rand(T, K, generator=g)
        outs = []
        for engine in (own, on_openmp):
            layer = kt.MoE(E, K, H, I, max_tokens=T, engine=engine)
            layer.load_weights(**w)
            y = torch.empty(T, H, dtype=torch.bfloat16)
            layer.forward(x, ids, rw, y)
            outs.append(y)
            assert torch.get_num_threads() == 2
        assert torch.equal(outs[0], outs[1])
        assert outs[0].abs().max() > 0
