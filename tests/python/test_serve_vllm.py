"""vLLM serving small random-weight MoE models with the routed experts in kt
(kt.integrations.vllm), compared with the same vLLM serving them alone.

Each configuration runs in its own process (helpers/serve_vllm_run.py: vLLM's
offline engine; or `vllm serve`, its OpenAI-compatible HTTP server, for the
HTTP tests). The checkpoints come from transformers' config classes with
bf16-rounded random weights (helpers/serve_models.py), nothing downloaded.

* fp32, greedy: kt (fp32 activations, bf16 weights as stored) and vLLM's own
  CPU experts compute the same numbers up to summation order, so the
  generated tokens are identical (Qwen3-MoE, DeepSeek-V3).
* A quantized checkpoint (INT4 written by compressed-tensors) is served with
  kt holding the experts as stored; fp32 greedy tokens equal vLLM's own on
  the same weights dequantized (Qwen3-MoE).
* bf16: the log-probabilities of every vocabulary entry at every prompt
  position differ by at most tolerances.BF16_TORCH (relative L2): vLLM's
  bf16 experts round their intermediates where kt keeps fp32 (Qwen3-MoE,
  gpt-oss).
* kt computed every MoE layer (its forward counters), so a plugin that is
  not in effect fails; also in vLLM's compiled mode (torch.compile), where
  kt is an opaque op in the graph.
* HTTP: `vllm serve` with the plugin loaded through kt's entry point;
  a batched completion request of mixed prompt lengths and concurrent
  clients get the same tokens as from the server without kt.
* Bad input: a layer kt cannot take (a weight format kt does not make
  from a dense checkpoint; a vLLM model whose checkpoint layout kt does not
  know) stops the server with kt's reason by default, or stays vLLM's with
  a warning under "strict": false (then the tokens are vLLM's).
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (tools/python_env.sh serve makes a venv with it)")
pytest.importorskip("transformers", reason="transformers builds the test checkpoints")

from helpers import serve_models  # noqa: E402
from helpers import tolerances  # noqa: E402
from helpers import vllm_server  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(HERE, "helpers", "serve_vllm_run.py")
TIMEOUT = 900

# Prompts of mixed lengths (token ids of the word-level vocabulary).
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [100],
           list(range(20, 60)), [300, 301, 302, 303, 304, 305, 306]]


def run_engine(tmp_path, name, spec, **env):
    """Runs serve_vllm_run.py on spec (env: variables of its process);
    returns its JSON result."""
    spec_path = tmp_path / ("%s.spec.json" % name)
    out_path = tmp_path / ("%s.out.json" % name)
    spec_path.write_text(json.dumps(spec))
    t = time.time()
    proc = subprocess.run([sys.executable, RUN, str(spec_path), str(out_path)], env=vllm_server.env(**env),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=TIMEOUT)
    log = proc.stdout.decode(errors="replace")
    print("%s: %.1f s, exit %d" % (name, time.time() - t, proc.returncode))
    if not out_path.exists():
        raise AssertionError("%s: no result (exit %d)\n%s" % (name, proc.returncode, log[-6000:]))
    result = json.loads(out_path.read_text())
    result["log"] = log
    return result


def _ok(result, name):
    assert "error" not in result, "%s failed: %s\n%s" % (name, result.get("error"), result.get("traceback"))
    return result


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    base = tmp_path_factory.mktemp("serve_models")
    cache = {}

    def get(kind, dtype, expert_scale=None):
        key = (kind, dtype, expert_scale)
        if key not in cache:
            layers = 3 if kind == "deepseek_v3" else 2
            name = "%s_%s" % (kind, dtype) + ("_experts%g" % expert_scale if expert_scale else "")
            cache[key] = serve_models.build(str(base / name), kind, dtype, layers=layers,
                                            expert_scale=expert_scale)
        return cache[key]
    return get


def _moe_layers(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    first = c.get("first_k_dense_replace", 0)
    return ["model.layers.%d.mlp.experts" % i for i in range(first, c["num_hidden_layers"])]


def _expert_tensors(model_dir):
    """The checkpoint tensors kt reads for the model's MoE layers."""
    import kt
    with kt.Checkpoint(model_dir) as ck:
        return sum(len(ck.layer_tensor_names(layer)) for layer in ck.layers)


def _assert_kt_computed(result, model_dir, prompts):
    stats = result["kt_stats"]
    assert sorted(stats) == sorted(_moe_layers(model_dir)), stats
    tokens = sum(len(p) for p in prompts)
    for layer, (calls, n) in stats.items():
        assert calls > 0 and n >= tokens, (layer, calls, n)
    # vLLM's loader skipped every expert tensor of kt's layers (kt read
    # them); none reached a kt layer through it.
    assert result["kt_loader"] == {"skipped": _expert_tensors(model_dir), "through_vllm": 0}, result["kt_loader"]


def _rel_l2(a, b):
    num = den = 0.0
    for ra, rb in zip(a, b):
        for pa, pb in zip(ra, rb):
            for x, y in zip(pa, pb):
                num += (x - y) ** 2
                den += y * y
    return (num / den) ** 0.5


# ------------------------------------------------------------ offline engine

@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_fp32_greedy_tokens_match_vllm(tmp_path, models, vllm_alone, kind):
    model = models(kind, "float32")
    spec = dict(model=model, dtype="float32", prompts=PROMPTS, max_tokens=16)
    if kind == "deepseek_v3":
        # vLLM picks its AMX MLA attention on CPUs with AMX, which packs
        # weights in bf16, fp16, int8 or fp8 only: fp32 takes its CPU MLA.
        spec["llm"] = {"attention_backend": "CPU_MLA"}
    ref = vllm_alone(spec)
    got = _ok(run_engine(tmp_path, kind + "-kt", dict(spec, kt={})), "kt")
    assert ref["kt_stats"] == {} and ref["kt_loader"] == {"skipped": 0, "through_vllm": 0}
    _assert_kt_computed(got, model, PROMPTS)
    assert re.search(r"on torch's OpenMP threads, \d+ threads?\)", got["log"])  # the plugin's default
    assert all(len(t) == 16 for t in ref["tokens"])
    assert got["tokens"] == ref["tokens"]
    assert got["texts"] == ref["texts"]


@pytest.fixture(scope="module")
def vllm_alone(tmp_path_factory):
    """vLLM alone on a spec, run once per module for the tests that compare
    with it."""
    cache = {}

    def get(spec):
        key = json.dumps(spec, sort_keys=True)
        if key not in cache:
            cache[key] = _ok(run_engine(tmp_path_factory.mktemp("vllm_alone"), "vllm-alone", dict(spec, kt=None)),
                             "vllm")
        return cache[key]
    return get


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="two ranks need two CPUs to bind to")
@pytest.mark.parametrize("parallel", ["tensor", "expert"])
def test_fp32_greedy_tokens_with_two_ranks(tmp_path, models, vllm_alone, parallel):
    """tensor_parallel_size=2 (and --enable-expert-parallel), one thread a
    rank bound to its own CPU: each rank's kt loads only its share (its
    slice of every expert's intermediate dimension, or its experts), vLLM's
    all-reduce sums the ranks, and the fp32 greedy tokens are vLLM's alone
    with one rank (and, for tensor parallel, with the same two ranks; vLLM
    0.32's own CPU experts crash under expert parallel, fp32 and bf16
    alike, in its cpu_fused_moe, so that run is kt's only)."""
    model = models("qwen3_moe", "float32")
    spec = dict(model=model, dtype="float32", prompts=PROMPTS, max_tokens=16)
    one_rank = vllm_alone(spec)
    llm = dict(tensor_parallel_size=2, distributed_executor_backend="mp",
               enable_expert_parallel=parallel == "expert")
    bind = dict(VLLM_CPU_OMP_THREADS_BIND="0|1")
    got = _ok(run_engine(tmp_path, parallel + "-kt", dict(spec, kt={}, llm=llm), **bind), "kt")
    assert got["tokens"] == one_rank["tokens"]
    if parallel == "tensor":
        ref = _ok(run_engine(tmp_path, parallel + "-vllm", dict(spec, kt=None, llm=llm), **bind), "vllm")
        assert got["tokens"] == ref["tokens"]
    # Each rank computed every MoE layer, and read only its share.
    assert len(got["kt_stats_ranks"]) == 2
    tokens = sum(len(p) for p in PROMPTS)
    for stats in got["kt_stats_ranks"]:
        assert sorted(stats) == sorted(_moe_layers(model)), stats
        assert all(calls > 0 and n >= tokens for calls, n in stats.values()), stats
    for loader in got["kt_loader_ranks"]:
        assert loader == {"skipped": _expert_tensors(model), "through_vllm": 0}, loader
    with open(os.path.join(model, "config.json")) as f:
        c = json.load(f)
    E, I = c.get("num_experts", c.get("num_local_experts")), c["moe_intermediate_size"]
    shares = (["intermediate 0-%d" % (I // 2 - 1), "intermediate %d-%d" % (I // 2, I - 1)] if parallel == "tensor"
              else ["experts 0-%d" % (E // 2 - 1), "experts %d-%d" % (E // 2, E - 1)])
    for layer in _moe_layers(model):
        for share in shares:
            assert re.search(r"kt: %s: \d+ experts of layer \d+ loaded from .*; %s\)" % (re.escape(layer), share),
                             got["log"]), (layer, share)


def test_fp32_greedy_tokens_on_kt_own_workers(tmp_path, models, vllm_alone):
    """"host_openmp": false: kt computes on workers of its own (pinned)
    instead of vLLM's torch threads, split over the NUMA nodes of the
    process's CPUs ("numa": "auto"), with the same tokens as vLLM alone."""
    model = models("qwen3_moe", "float32")
    spec = dict(model=model, dtype="float32", prompts=PROMPTS, max_tokens=16)
    ref = vllm_alone(spec)
    got = _ok(run_engine(tmp_path, "own-workers-kt", dict(spec, kt={"host_openmp": False, "numa": "auto"})), "kt")
    _assert_kt_computed(got, model, PROMPTS)
    assert re.search(r"on kt's own workers, \d+ threads?\)", got["log"]) and "on torch's OpenMP threads" not in got["log"]
    assert got["tokens"] == ref["tokens"]


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss"])
def test_bf16_logprobs_within_bound(tmp_path, models, kind):
    # Experts whose outputs outweigh the residual stream (hidden 128: std
    # 2/sqrt(128) against the default 0.5/sqrt(128)), so that an error in
    # them shows through the bf16 rounding of the hidden states.
    model = models(kind, "bfloat16", expert_scale=2.0 / 128 ** 0.5)
    prompts = PROMPTS[:3]
    spec = dict(model=model, dtype="bfloat16", prompts=prompts, max_tokens=1, prompt_logprobs=True)
    ref = _ok(run_engine(tmp_path, kind + "-bf16-vllm", dict(spec, kt=None)), "vllm")
    got = _ok(run_engine(tmp_path, kind + "-bf16-kt", dict(spec, kt={})), "kt")
    _assert_kt_computed(got, model, prompts)
    err = _rel_l2(got["prompt_logprobs"], ref["prompt_logprobs"])
    print("%s bf16: log-probabilities kt vs vLLM, relative L2 %.2e (bound %.0e)"
          % (kind, err, tolerances.BF16_TORCH))
    # kt computed every layer (above). Equal log-probabilities are possible:
    # both sum in fp32 and round each expert output to bf16, and at these
    # sizes the two summation orders rarely round apart.
    assert err < tolerances.BF16_TORCH


def test_compiled_model_calls_kt(tmp_path, models):
    """vLLM's default mode: the model compiled by torch.compile (Dynamo +
    inductor); kt's call is an opaque torch op (kt::vllm_experts) inside the
    graph, so the compiled model still runs kt, with the same tokens as
    vLLM's own experts."""
    model = models("qwen3_moe", "float32")
    spec = dict(model=model, dtype="float32", prompts=PROMPTS, max_tokens=16)
    ref = _ok(run_engine(tmp_path, "eager-vllm", dict(spec, kt=None)), "vllm")
    got = _ok(run_engine(tmp_path, "compiled-kt", dict(spec, kt={}, llm={"enforce_eager": False})), "kt")
    assert "compil" in got["log"].lower()
    _assert_kt_computed(got, model, PROMPTS)
    assert got["tokens"] == ref["tokens"]


def test_quantized_at_load_runs_in_kt(tmp_path, models):
    """weight_format int8_channel: kt quantizes the dense checkpoint at load
    (kt_c_api.h states the error); the server generates with it."""
    model = models("qwen3_moe", "float32")
    got = _ok(run_engine(tmp_path, "int8", dict(model=model, dtype="float32", prompts=PROMPTS[:2],
                                                  max_tokens=4, kt={"weight_format": "int8_channel"})), "kt")
    _assert_kt_computed(got, model, PROMPTS[:2])
    assert "int8_channel" in got["log"]


def test_int4_checkpoint_served_as_stored(tmp_path, models):
    """An INT4 pack-quantized checkpoint written by compressed-tensors
    (symmetric, groups of 32, power-of-two scales: serve_models.build_int4):
    kt loads the experts as stored (int4_g32, the codes and scales of the
    files) and the server generates, in fp32, the tokens vLLM generates
    alone from the same checkpoint dequantized to dense fp32 weights. (vLLM
    0.32's CPU build has no int4 MoE kernel: alone it refuses this
    checkpoint, "No WNA16 MoE backend supports the deployment
    configuration", so the plugin gives its loader the unquantized method's
    parameter names.)"""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors writes the int4 checkpoint")
    import torch
    import kt
    from safetensors.torch import load_file
    dense = models("qwen3_moe", "float32")
    quantized, dequantized = serve_models.build_int4(dense, str(tmp_path / "int4"), group=32)
    # kt's experts are the dequantized weights exactly.
    want = load_file(os.path.join(dequantized, "model.safetensors"))
    with kt.Checkpoint(quantized) as ck:
        options = ck.moe_options(0)
        assert options["weight_format"] == "int4_g32", options
        layer = kt.MoE(**options, max_tokens=8)
        ck.load_layer(0, layer)
    E, I, H = options["num_experts"], options["intermediate"], options["hidden"]
    got = {"gate": torch.empty(E, I, H), "up": torch.empty(E, I, H), "down": torch.empty(E, H, I)}
    layer.read_weights(**got)
    for p, t in got.items():
        ref = torch.stack([want["model.layers.0.mlp.experts.%d.%s_proj.weight" % (e, p)] for e in range(E)])
        assert torch.equal(t, ref.float()), p
    spec = dict(dtype="float32", prompts=PROMPTS, max_tokens=16)
    ref = _ok(run_engine(tmp_path, "int4-dequantized-vllm", dict(spec, model=dequantized, kt=None)), "vllm")
    got = _ok(run_engine(tmp_path, "int4-kt", dict(spec, model=quantized, kt={})), "kt")
    _assert_kt_computed(got, quantized, PROMPTS)
    assert "int4_g32" in got["log"]
    assert all(len(t) == 16 for t in ref["tokens"])
    assert got["tokens"] == ref["tokens"]


# ------------------------------------------------------------------ bad input

def test_unsupported_format_refused(tmp_path, models):
    model = models("qwen3_moe", "float32")
    spec = dict(model=model, dtype="float32", prompts=PROMPTS[:2], max_tokens=8)
    bad = run_engine(tmp_path, "fp8-strict", dict(spec, kt={"weight_format": "fp8_b128"}))
    assert "error" in bad
    text = bad["error"] + bad.get("traceback", "")
    assert "kt: model.layers.0.mlp.experts" in text and "fp8_b128" in text, text[-3000:]
    # Not strict: the layers stay vLLM's, which says so, and its tokens are vLLM's.
    ref = _ok(run_engine(tmp_path, "fp8-ref", dict(spec, kt=None)), "vllm")
    loose = _ok(run_engine(tmp_path, "fp8-loose", dict(spec, kt={"weight_format": "fp8_b128",
                                                                   "strict": False})), "kt")
    assert loose["kt_stats"] == {}
    assert "stays with vLLM's experts" in loose["log"]
    assert loose["tokens"] == ref["tokens"]


def test_unknown_option_refused(tmp_path, models):
    model = models("qwen3_moe", "float32")
    bad = run_engine(tmp_path, "option", dict(model=model, dtype="float32", prompts=PROMPTS[:1],
                                              max_tokens=2, kt={"thread": 2}))
    assert "error" in bad and "unknown option" in bad["error"] and "thread" in bad["error"]
    bad = run_engine(tmp_path, "option-value", dict(model=model, dtype="float32", prompts=PROMPTS[:1],
                                                    max_tokens=2, kt={"host_openmp": "yes"}))
    assert "error" in bad and "host_openmp must be true or false" in bad["error"], bad.get("error")


def test_unknown_checkpoint_layout_refused(tmp_path, models):
    """A checkpoint whose expert tensors kt does not recognise (the Qwen3-MoE
    checkpoint with its experts under other names): the plugin refuses the
    layer, naming it and the layout kt found. (vLLM's own loader does not
    read such a checkpoint either, so this is the plugin's decision alone,
    taken before vLLM loads anything.)"""
    from safetensors.torch import load_file, save_file
    import kt.integrations.vllm as ktv
    model = models("qwen3_moe", "float32")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    tensors = load_file(os.path.join(model, "model.safetensors"))
    save_file({re.sub(r"\.(gate|up|down)_proj\.", r".w_\1.", k): v for k, v in tensors.items()},
              str(renamed / "model.safetensors"), metadata={"format": "pt"})
    (renamed / "config.json").write_text(open(os.path.join(model, "config.json")).read())
    vllm_config = type("VllmConfig", (), {"additional_config": {"kt": {}}})()
    vllm_config.model_config = type("ModelConfig", (), {"model": str(renamed), "revision": None})()
    settings = ktv.settings_of(vllm_config)
    with pytest.raises(ktv.KtVllmError) as e:
        ktv.plan_layer("model.layers.0.mlp.experts", _FakeMoeConfig(), None, False, vllm_config, settings)
    print(e.value)
    # kt's checkpoint reader refuses it (config.json has MoE layers, the
    # files no expert tensors kt knows), or finds no layer 0.
    text = str(e.value)
    assert text.startswith("kt: model.layers.0.mlp.experts: ") and str(renamed) in text, text
    assert "kt cannot read the checkpoint" in text or "has no MoE layer 0 that kt recognises" in text, text
    # The original checkpoint passes the same checks.
    vllm_config.model_config.model = model
    plan = ktv.plan_layer("model.layers.0.mlp.experts", _FakeMoeConfig(), None, False, vllm_config, settings)
    assert plan.layer == 0 and plan.kt_layer.num_experts == 16


def test_unrecognised_model_refused(tmp_path, models):
    """DBRX: vLLM serves it with its own RoutedExperts subclass, its experts
    are [E*I, H] blocks under transformer.blocks.<L>.ffn, which kt does not
    read: the server asked for kt stops, naming the layer and the reason.
    (vLLM 0.32 cannot load this DBRX checkpoint by itself either, a KeyError
    in its DBRX loader, so there is no "strict": false run to compare.)"""
    model = models("dbrx", "float32")
    bad = run_engine(tmp_path, "dbrx", dict(model=model, dtype="float32", prompts=PROMPTS[:1], max_tokens=2,
                                            kt={}))
    assert "error" in bad
    assert "kt: transformer.blocks.0.ffn: no layer number" in bad["error"], bad["error"]


class _FakeParallel:
    tp_size = ep_size = dp_size = pcp_size = sp_size = 1
    tp_rank = ep_rank = 0
    use_ep = enable_eplb = False


class _FakeAct:
    value = "silu"


class _FakeMoeConfig:
    """The fields of vLLM's FusedMoEConfig that plan_layer reads."""
    moe_parallel_config = _FakeParallel()
    num_experts = num_local_experts = num_logical_experts = 16
    experts_per_token = 4
    hidden_dim = hidden_dim_unpadded = 128
    intermediate_size = intermediate_size_per_partition = 64
    has_bias = False
    activation = _FakeAct()
    swiglu_limit = swiglu_alpha = swiglu_beta = None
    max_num_tokens = 1024

    @property
    def in_dtype(self):
        import torch
        return torch.float32


# ------------------------------------------------------------------ HTTP server

def Server(tmp_path, name, model, extra_args):
    return vllm_server.Server(tmp_path / ("%s.log" % name), model, extra_args, timeout=TIMEOUT)


def _entry_point_installed():
    from importlib.metadata import entry_points
    eps = entry_points()
    group = eps.select(group="vllm.general_plugins") if hasattr(eps, "select") else eps.get("vllm.general_plugins", [])
    return any(ep.name == "kt" and ep.value == "kt.integrations.vllm:register" for ep in group)


def _client_runs(base):
    """A batched request of mixed-length prompts and concurrent clients
    (completions and chat), through the openai client; returns their texts."""
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    texts = [serve_models.prompt_text(p) for p in PROMPTS]
    out = {}
    batch = client.completions.create(model="moe", prompt=texts, max_tokens=12, temperature=0)
    out["batch"] = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert all(c.finish_reason in ("length", "stop") for c in batch.choices)

    def one(i):
        p = texts[i % len(texts)] + " w%d" % i
        if i % 2:
            r = client.chat.completions.create(model="moe", messages=[{"role": "user", "content": p}],
                                               max_tokens=8, temperature=0)
            return r.choices[0].message.content
        r = client.completions.create(model="moe", prompt=p, max_tokens=8, temperature=0)
        return r.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        out["concurrent"] = list(pool.map(one, range(12)))
    return out


def test_http_server_with_and_without_kt(tmp_path, models):
    if not _entry_point_installed():
        pytest.skip("kt is installed without its vllm.general_plugins entry point "
                    "(tools/python_env.sh serve installs the kt wheel that has it)")
    model = models("qwen3_moe", "float32")
    results = {}
    for name, extra in (("kt", ["--additional-config", json.dumps({"kt": {}})]), ("vllm", [])):
        server = Server(tmp_path, "serve-" + name, model, extra)
        try:
            server.wait_ready()
            results[name] = _client_runs(server.base)
        finally:
            server.stop()
        log = server.text()
        loaded = re.findall(r"kt: (model\.layers\.\d+\.mlp\.experts): \d+ experts of layer", log)
        if name == "kt":
            assert sorted(set(loaded)) == _moe_layers(model), log[-4000:]
        else:
            assert not loaded
    assert all(t.strip() for t in results["vllm"]["batch"])
    assert results["kt"] == results["vllm"]
