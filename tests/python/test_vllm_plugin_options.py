"""The vLLM plugin's options and its stats line, without vLLM: what
settings_of accepts and refuses (also fuzzed briefly: helpers/option_fuzz.py
runs for minutes), and what one burst of forwards logs."""
import logging
import re
import time

import pytest

import kt.integrations.vllm as ktv
from helpers import option_fuzz


def config(options):
    return type("VllmConfig", (), {"additional_config": {"kt": options}})()


def test_stats_is_off_by_default_and_a_bool():
    assert ktv.settings_of(config({}))["stats"] is False
    assert ktv.settings_of(config({"stats": True}))["stats"] is True
    with pytest.raises(ktv.KtVllmError, match="stats must be true or false, not 'yes'"):
        ktv.settings_of(config({"stats": "yes"}))
    with pytest.raises(ktv.KtVllmError, match="unknown option"):
        ktv.settings_of(config({"stat": True}))


def test_numa_is_off_by_default_and_needs_kts_own_workers():
    assert ktv.settings_of(config({}))["numa"] == "off"
    s = ktv.settings_of(config({"numa": "auto", "host_openmp": False}))
    assert (s["numa"], s["host_openmp"]) == ("auto", False)
    with pytest.raises(ktv.KtVllmError, match="numa 'auto' places kt's own workers"):
        ktv.settings_of(config({"numa": "auto"}))
    with pytest.raises(ktv.KtVllmError, match="numa must be 'off' or 'auto', not 'on'"):
        ktv.settings_of(config({"numa": "on", "host_openmp": False}))
    engine = ktv._engine(2, False, "default", "auto")
    assert sum(engine.info()["numa_node_workers"]) == 2
    assert ktv._engine(2, False, "default", "auto") is engine


@pytest.mark.parametrize("name, value, expected", [
    ("threads", "4", "a whole number from 0 to 4096"),
    ("threads", True, "a whole number from 0 to 4096"),
    ("threads", 4097, "a whole number from 0 to 4096"),
    ("threads", (1 << 32) + 2, "a whole number from 0 to 4096"),
    ("max_tokens", 0, "null or a whole number from 1 to 65536"),
    ("max_tokens", 2.0, "null or a whole number from 1 to 65536"),
    ("dequantize", "no", "true or false"),
    ("strict", 1, "true or false"),
    ("weight_format", "int4", "null or one of 'bf16', "),
    ("compute", "fp16", "'bf16' or 'int8'"),
    ("precision", ["fp32"], "'auto', 'default' or 'fp32'"),
])
def test_every_option_is_checked_before_any_layer_is_made(name, value, expected):
    # Found by the fuzzer: these reached kt.Engine/kt.MoE as they were (a
    # thread count past 2**31 wrapped in ctypes, a string raised ValueError
    # outside the plugin's refusals).
    with pytest.raises(ktv.KtVllmError, match="kt: %s must be %s" % (name, re.escape(expected))):
        ktv.settings_of(config({name: value}))


def test_unknown_keys_of_any_type_are_named():
    # Found by the fuzzer: keys of mixed types made sorting them raise TypeError.
    with pytest.raises(ktv.KtVllmError, match=r"unknown option\(s\) \(1, 2\), 1, None, thread in"):
        ktv.settings_of(config({1: 0, None: 0, (1, 2): 0, "thread": 2, "threads": 1}))


def test_fuzzed_options_give_settings_or_a_kt_refusal():
    counts = option_fuzz.fuzz(seconds=120, seed=1, cases=3000)
    assert counts["cases"] == 3000, counts
    # The cases reach every outcome: refused, accepted and planned, accepted and refused by plan_layer.
    assert min(counts.get(k, 0) for k in ("refused", "planned", "not planned")) > 0, counts


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def stats_lines():
    logger = logging.getLogger("vllm.kt")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def wait_for(lines, n, seconds=5.0):
    end = time.monotonic() + seconds
    while len(lines) < n and time.monotonic() < end:
        time.sleep(0.02)
    return lines


def test_one_line_per_burst_with_kt_seconds_of_its_wall(stats_lines):
    bursts = ktv._Bursts(gap=0.2)
    t = time.perf_counter()
    bursts.add(3, t, t + 0.010)
    bursts.add(5, t + 0.020, t + 0.050)
    assert wait_for(stats_lines, 1) == ["kt: stats: 2 forwards, 8 tokens, 0.0400 s in kt's layers of 0.0500 s wall"]
    # The next burst starts from zero.
    t = time.perf_counter()
    bursts.add(7, t, t + 0.005)
    assert wait_for(stats_lines, 2)[1] == "kt: stats: 1 forwards, 7 tokens, 0.0050 s in kt's layers of 0.0050 s wall"
    time.sleep(0.5)
    assert len(stats_lines) == 2  # nothing more without forwards


def test_forwards_longer_than_the_gap_stay_one_burst(stats_lines):
    bursts = ktv._Bursts(gap=0.1)
    for _ in range(3):  # three layers of a long prefill, each longer than the gap
        bursts.begin()
        t0 = time.perf_counter()
        time.sleep(0.25)
        bursts.add(512, t0, time.perf_counter())
    lines = wait_for(stats_lines, 1)
    time.sleep(0.3)
    assert len(stats_lines) == 1, stats_lines
    assert lines[0].startswith("kt: stats: 3 forwards, 1536 tokens, "), lines


def test_fewer_threads_than_cpus_is_said_once(stats_lines, monkeypatch):
    monkeypatch.setattr(ktv, "_thread_note", [])
    monkeypatch.setattr(ktv.os, "cpu_count", lambda: 4)
    ktv._note_thread_count(4, {"host_openmp": True})
    assert stats_lines == []
    ktv._note_thread_count(1, {"host_openmp": True})
    ktv._note_thread_count(1, {"host_openmp": True})
    assert stats_lines == ["kt: kt computes on 1 of the machine's 4 CPUs (vLLM binds its worker's OpenMP threads, "
                           "which kt computes on: VLLM_CPU_OMP_THREADS_BIND sets them)"]


# ------------------------------------------------- a rank's share of a layer

def _moe_config(tp=1, tp_rank=0, ep=1, ep_rank=0, dp=1, use_ep=False, eplb=False, E=16, logical=16, local=16,
                I=64):
    par = type("Par", (), dict(tp_size=tp, tp_rank=tp_rank, ep_size=ep, ep_rank=ep_rank, dp_size=dp, pcp_size=1,
                               sp_size=1, use_ep=use_ep, enable_eplb=eplb))()
    return type("MoeConfig", (), dict(moe_parallel_config=par, num_experts=E, num_logical_experts=logical,
                                      num_local_experts=local, intermediate_size=I,
                                      intermediate_size_per_partition=I // tp))()


def _manager(expert_map):
    torch = pytest.importorskip("torch")
    return type("Manager", (), {"expert_map": torch.tensor(expert_map, dtype=torch.int32)})()


def _refuse(why):
    raise ktv.KtVllmError(why)


def test_tensor_parallel_ranks_take_their_slice_and_rank_0_the_down_biases():
    for rank in (0, 1):
        share = ktv._share_of(_moe_config(tp=2, tp_rank=rank), None, True, _refuse)
        assert (share.experts, share.expert_map) == (None, None)
        assert share.intermediate == (32 * rank, 32 * rank + 32)
        assert share.zero_down_bias == (rank == 1)
        assert share.describe() == "intermediate %d-%d" % (32 * rank, 32 * rank + 31)
    assert not ktv._share_of(_moe_config(tp=2, tp_rank=1), None, False, _refuse).zero_down_bias
    whole = ktv._share_of(_moe_config(), None, True, _refuse)
    assert (whole.experts, whole.intermediate, whole.zero_down_bias) == (None, None, False)
    assert whole.describe() == "the whole layer"


def test_expert_parallel_ranks_take_the_experts_of_vllms_map():
    # Round-robin placement: rank 1 of 2 holds the odd experts, slot j
    # holding expert 2j + 1.
    emap = [(e // 2 if e % 2 else -1) for e in range(16)]
    share = ktv._share_of(_moe_config(ep=2, ep_rank=1, use_ep=True, local=8), _manager(emap), True, _refuse)
    assert share.experts == list(range(1, 16, 2))
    assert share.expert_map.tolist() == emap
    assert share.intermediate is None and not share.zero_down_bias
    linear = [e - 8 if e >= 8 else -1 for e in range(16)]
    share = ktv._share_of(_moe_config(ep=2, ep_rank=1, use_ep=True, local=8), _manager(linear), True, _refuse)
    assert share.experts == list(range(8, 16)) and share.describe() == "experts 8-15"


@pytest.mark.parametrize("config, emap, message", [
    (dict(dp=2), None, "data or context parallel experts (dp 2, pcp 1)"),
    (dict(eplb=True, E=18, logical=16), None, "18 physical experts for 16 logical ones (EPLB"),
    (dict(ep=2, use_ep=True, local=8), None, "expert parallel (ep 2) without vLLM's expert map"),
    (dict(ep=2, use_ep=True, local=8), [0] * 2 + [-1] * 14, "is not one expert per local slot"),
    (dict(ep=2, use_ep=True, local=8), list(range(7)) + [-1] * 9, "leaves local slots empty"),
    (dict(local=8), None, "8 local experts of 16 without expert parallel"),
])
def test_shares_kt_cannot_hold_are_refused_saying_why(config, emap, message):
    manager = _manager(emap) if emap is not None else None
    with pytest.raises(ktv.KtVllmError, match=re.escape(message)):
        ktv._share_of(_moe_config(**config), manager, False, _refuse)
    padded = _moe_config(tp=2)
    padded.intermediate_size_per_partition = 40
    with pytest.raises(ktv.KtVllmError, match=re.escape("tensor parallel 2 with 40 intermediate rows a rank")):
        ktv._share_of(padded, None, False, _refuse)


def test_an_expert_parallel_rank_maps_vllms_routes_to_its_experts():
    # A rank with experts 5 and 2 of 6 (fewer than the 4 routes a token):
    # its kt layer takes top-2 of its own ids; routes to other ranks'
    # experts are dropped, and the output is kt's on the routes it holds.
    torch = pytest.importorskip("torch")
    import kt
    H, I, T = 32, 16, 5
    g = torch.Generator().manual_seed(3)
    layer = kt.MoE(2, 2, H, I, max_tokens=T)
    weights = dict(gate=torch.randn(2, I, H, generator=g), up=torch.randn(2, I, H, generator=g),
                   down=torch.randn(2, H, I, generator=g))
    layer.load_weights(**weights)
    emap = torch.tensor([-1, -1, 1, -1, -1, 0], dtype=torch.int32)
    share = ktv._Share(experts=[5, 2], expert_map=emap)
    plan = type("Plan", (), dict(kt_layer=layer, layer_name="model.layers.0.mlp.experts", share=share,
                                 settings={"stats": False}))()
    experts = ktv._KtExperts(plan)
    experts.loaded = True
    x = torch.randn(T, H, generator=g)
    topk = torch.tensor([[5, 0, 2, 1], [3, 4, 1, 0], [2, 3, 4, 5], [0, 1, 3, 2], [1, 5, 0, 3]], dtype=torch.int64)
    w = torch.rand(T, 4, generator=g)
    got = experts.run(x, topk, w)
    local = torch.tensor([[0, 1], [-1, -1], [1, 0], [1, -1], [0, -1]], dtype=torch.int32)
    lw = torch.stack([w[0, [0, 2]], w[1, [0, 1]], w[2, [0, 3]], w[3, [3, 0]], w[4, [1, 0]]])
    want = torch.empty_like(x)
    layer.forward(x, local, lw, want)
    assert torch.equal(got, want)
    assert torch.equal(got[1], torch.zeros(H)) and got.abs().sum() > 0
