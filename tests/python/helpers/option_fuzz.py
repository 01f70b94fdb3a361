"""A structured random fuzzer of the vLLM plugin's options (the dict under
additional_config["kt"]), without vLLM.

Each case is a random additional_config: mostly a dict of options with
known, misspelt and non-string keys, and values of every JSON type and
beyond (huge and negative numbers, NaN, bools where numbers go, known
names in other cases, lists, bytes). It checks:
- settings_of returns None or the settings, or raises KtVllmError whose
  message starts "kt: "; any other exception is a finding;
- accepted settings hold only the documented values (checked here again,
  independently of the plugin's own checks);
- with accepted settings, plan_layer over a small bf16 checkpoint and a
  random layer description (dtype, activation, top-k, bias, shapes) makes a
  plan or raises KtVllmError, never anything else. Settings asking for more
  than 4 threads are only parsed: engines of thousands of threads are not
  what this measures.

    python3 tests/python/helpers/option_fuzz.py --seconds 600 [--seed N]

prints the cases run, accepted and planned, and exits 1 at the first finding
(the case is printed so it can be replayed with --seed and --case)."""
import argparse
import math
import os
import random
import sys
import tempfile
import time
import traceback
import types

import numpy as np

import kt.integrations.vllm as ktv
from kt import _capi
from kt import checkpoint as ktckpt

E, TOP_K, H, I = 4, 2, 32, 16
LAYER_NAME = "model.layers.0.mlp.experts"
NAMES = ("auto", "default", "fp32", "off", "on", "bf16", "int8", "int8_channel", "int4_g32", "int4_g128",
         "fp8_b128", "mxfp4", "int4_g32_zp", "", "AUTO", "Auto ", "true", "null", "0")


def _value(rng, depth=0):
    kind = rng.randrange(12 if depth < 2 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randrange(-3, 10)
    if kind == 3:
        return rng.choice((-1, 1)) * (1 << rng.randrange(70)) + rng.randrange(-2, 3)
    if kind == 4:
        return rng.choice((0.0, 1.0, 2.5, -1.0, math.nan, math.inf, -math.inf, 1e300, 4096.0))
    if kind in (5, 6):
        return rng.choice(NAMES)
    if kind == 7:
        return "".join(chr(rng.randrange(1, 0x250)) for _ in range(rng.randrange(0, 12)))
    if kind == 8:
        return rng.choice((b"bf16", bytearray(b"auto"), (1, 2), frozenset()))
    if kind == 9:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(0, 3))]
    return {rng.choice(ktv._OPTIONS): _value(rng, depth + 1) for _ in range(rng.randrange(0, 3))}


def _key(rng):
    kind = rng.randrange(10)
    if kind < 7:
        return rng.choice(ktv._OPTIONS)
    if kind == 7:
        k = rng.choice(ktv._OPTIONS)
        return rng.choice((k.upper(), k + "s", k[:-1], " " + k, k.replace("_", "-")))
    return rng.choice((1, None, 2.5, (1, 2), True, ""))


def additional_config(rng):
    kind = rng.randrange(20)
    if kind == 0:
        return rng.choice((None, [], "kt", 3))
    if kind == 1:
        return {"other": _value(rng)}
    if kind == 2:
        return {"kt": _value(rng)}
    return {"kt": {_key(rng): _value(rng) for _ in range(rng.randrange(0, 7))}}


def _whole(v, low, high):
    return type(v) is int and low <= v <= high


def check_settings(s):
    """The documented values of every option (kt/integrations/vllm.py)."""
    assert set(s) == set(ktv._OPTIONS), s
    assert _whole(s["threads"], 0, 4096), s
    for name in ("host_openmp", "dequantize", "strict", "stats"):
        assert type(s[name]) is bool, (name, s)
    assert s["precision"] in ("auto", "default", "fp32") and type(s["precision"]) is str, s
    assert s["weight_format"] is None or (type(s["weight_format"]) is str and s["weight_format"] in
                                          _capi.WEIGHT_FORMATS), s
    assert type(s["compute"]) is str and s["compute"] in _capi.COMPUTES, s
    assert s["max_tokens"] is None or _whole(s["max_tokens"], 1, 65536), s
    assert s["progress"] in (None, True, False) and type(s["progress"]) in (type(None), bool), s
    assert s["numa"] in ("off", "auto") and not (s["numa"] == "auto" and s["host_openmp"]), s


def write_checkpoint(directory):
    rng = np.random.default_rng(5)
    layer = {"gate": rng.standard_normal((E, I, H), dtype=np.float32) * 0.1,
             "up": rng.standard_normal((E, I, H), dtype=np.float32) * 0.1,
             "down": rng.standard_normal((E, H, I), dtype=np.float32) * 0.1}
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
              "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": TOP_K}
    ktckpt.write_experts(directory, {0: layer}, config=config)


def moe_config(rng):
    """vLLM's FusedMoEConfig of one rank, and its expert map manager: mostly
    one rank, sometimes a tensor- or expert-parallel rank (or data
    parallel, EPLB, or no map: refused)."""
    import torch
    tp = 1 if rng.random() < 0.8 else 2
    ep = 2 if rng.random() < 0.1 else 1
    experts = E if rng.random() < 0.9 else E + 1
    intermediate = I if rng.random() < 0.9 else 8
    rank = rng.randrange(max(tp, ep))
    local = experts // ep
    manager = None
    if ep > 1 and rng.random() < 0.9:
        emap = [g - rank * local if rank * local <= g < (rank + 1) * local else -1 for g in range(experts)]
        manager = types.SimpleNamespace(expert_map=torch.tensor(emap, dtype=torch.int32))
    par = types.SimpleNamespace(tp_size=tp if ep == 1 else 1, tp_rank=rank if ep == 1 else 0, ep_size=ep,
                                ep_rank=rank if ep > 1 else 0, dp_size=2 if rng.random() < 0.03 else 1, pcp_size=1,
                                sp_size=1, use_ep=ep > 1, enable_eplb=rng.random() < 0.03)
    return types.SimpleNamespace(
        moe_parallel_config=par, intermediate_size_per_partition=intermediate // par.tp_size,
        num_local_experts=local, num_experts=experts, num_logical_experts=experts,
        activation=rng.choice(("silu", "silu", "swigluoai", "gelu")),
        swiglu_limit=rng.choice((None, 7.0)), swiglu_alpha=None, swiglu_beta=rng.choice((None, 1.0, 2.0)),
        hidden_dim=H, hidden_dim_unpadded=rng.choice((H, H, None)), intermediate_size=intermediate,
        has_bias=rng.random() < 0.1, experts_per_token=rng.choice((1, TOP_K, E, E + 1)),
        in_dtype=rng.choice((torch.float32, torch.bfloat16, torch.float16)),
        max_num_tokens=rng.choice((None, 64, 8192))), manager


def run_case(rng, directory):
    """One case; returns 'refused', 'parsed' (settings only) or 'planned'/'not planned'."""
    vllm_config = types.SimpleNamespace(additional_config=additional_config(rng),
                                        model_config=types.SimpleNamespace(model=directory))
    try:
        settings = ktv.settings_of(vllm_config)
    except ktv.KtVllmError as e:
        assert str(e).startswith("kt: "), e
        return "refused"
    if settings is None:
        return "not asked"
    check_settings(settings)
    if settings["threads"] > 4:
        return "parsed"
    try:
        config, manager = moe_config(rng)
        plan = ktv.plan_layer(LAYER_NAME, config, None, rng.random() < 0.05, vllm_config, settings, manager)
    except ktv.KtVllmError as e:
        assert str(e).startswith("kt: "), e
        return "not planned"
    finally:
        ktv._engines.clear()  # engines of many settings are not kept for the whole run
    assert plan.kt_layer is not None
    return "planned"


def fuzz(seconds, seed=0, first_case=0, cases=None, out=sys.stdout):
    counts = {}
    t_end = time.monotonic() + seconds
    with tempfile.TemporaryDirectory() as tmp:
        directory = os.path.join(tmp, "ckpt")
        write_checkpoint(directory)
        case = first_case
        while time.monotonic() < t_end and (cases is None or case < first_case + cases):
            rng = random.Random("%d:%d" % (seed, case))
            try:
                what = run_case(rng, directory)
            except Exception:
                print("option_fuzz: finding at --seed %d --case %d:\n%s" % (seed, case, traceback.format_exc()),
                      file=out)
                raise
            counts[what] = counts.get(what, 0) + 1
            case += 1
    counts["cases"] = case - first_case
    return counts


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, default=0, help="replay from this case")
    p.add_argument("--cases", type=int, default=None, help="at most this many cases")
    a = p.parse_args()
    t0 = time.monotonic()
    try:
        counts = fuzz(a.seconds, a.seed, a.case, a.cases)
    except Exception:  # noqa: BLE001 - printed by fuzz()
        return 1
    print("option_fuzz: %d cases in %.0f s: %s" % (counts.pop("cases"), time.monotonic() - t0,
                                                  ", ".join("%s %d" % kv for kv in sorted(counts.items()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
