"""Checkpoints, packed caches and adapters from Python (kt.checkpoint), and
kt.hf filling replaced blocks straight from a checkpoint directory or a
packed cache while the model's routed experts live on the meta device."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kt
import kt.hf
from helpers import st_files
from kt._progress import _bytes_text
from helpers.hf_shaped import (FusedMoeBlock, GptOssMLP, MixtralSparseMoeBlock, Qwen3MoeSparseMoeBlock,
                       round_params_to_bf16)

H, I, E, K = 48, 40, 6, 2
HERE = os.path.dirname(os.path.abspath(__file__))


def stacked(E_, out, inn, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E_, out, inn, generator=g) / inn ** 0.5).to(torch.bfloat16)


def routes(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    w = torch.rand(T, K, generator=g)
    return x, ids, w


def run(layer, x, ids, w):
    y = torch.empty_like(x)
    layer.forward(x, ids, w, y)
    return y


@pytest.fixture()
def expert_ckpt(tmp_path):
    layers = {L: dict(gate=stacked(E, I, H, 10 * L), up=stacked(E, I, H, 10 * L + 1),
                      down=stacked(E, H, I, 10 * L + 2),
                      bias_gate=torch.randn(E, I), bias_up=torch.randn(E, I),
                      bias_down=torch.randn(E, H)) for L in (1, 3)}
    d = tmp_path / "ckpt"
    kt.checkpoint.write_experts(d, layers, config={"architectures": ["Qwen3MoeForCausalLM"],
                                                   "model_type": "qwen3_moe",
                                                   "num_experts_per_tok": K})
    return d, layers


def test_checkpoint_describes_loads_and_reads_layers(expert_ckpt):
    d, layers = expert_ckpt
    with kt.Checkpoint(d) as ck:
        assert ck.info["layout"] == "per_expert" and ck.info["num_moe_layers"] == 2
        assert ck.info["model_type"] == "qwen3_moe" and ck.info["top_k"] == K
        assert sorted(ck.layers) == [1, 3]
        li = ck.layers[3]
        assert (li["num_experts"], li["hidden"], li["intermediate"], li["bias"]) == (E, H, I, True)
        assert li["weight_dtype"] == "BF16" and li["loadable"]
        assert li["weight_format"] == "bf16" and li["group_size"] == 0
        # The layer's expert tensors (weights and biases), nothing else: what
        # a host skips when kt loads the experts.
        names = ck.layer_tensor_names(3)
        assert li["num_tensors"] == 6 * E and names == sorted(names)
        assert names == sorted(n for n in ck.tensor_names() if n.startswith("model.layers.3.mlp.experts."))
        assert not set(names) & set(ck.layer_tensor_names(1))
        with pytest.raises(kt.KtError, match="layer 2 has no routed experts"):
            ck.layer_tensor_names(2)
        opts = ck.moe_options(3)
        assert (opts["num_experts"], opts["top_k"], opts["hidden"], opts["intermediate"]) == (E, K, H, I)
        seen = []
        from_ckpt = kt.MoE(**opts)
        ck.load_layer(3, from_ckpt, progress=lambda done, total: seen.append((done, total)))
        assert seen and seen[-1] == (E, E)
        assert from_ckpt.num_loaded() == E
        assert from_ckpt.weights_source == ("checkpoint", os.fspath(d), 3)
        src = layers[3]
        # Stored as bf16 (the writer's default), so the biases come back rounded.
        by_hand = kt.MoE(**opts)
        by_hand.load_weights(gate=src["gate"], up=src["up"], down=src["down"],
                             bias_gate=src["bias_gate"].bfloat16(), bias_up=src["bias_up"].bfloat16(),
                             bias_down=src["bias_down"].bfloat16())
        x, ids, w = routes(9)
        assert torch.equal(run(from_ckpt, x, ids, w), run(by_hand, x, ids, w))

        gate, bias_down = torch.empty(E, I, H, dtype=torch.bfloat16), torch.empty(E, H)
        ck.read_layer(3, gate=gate, bias_down=bias_down)
        assert torch.equal(gate, src["gate"])
        assert torch.equal(bias_down, src["bias_down"].bfloat16().float())
        t = ck.tensor("model.layers.1.mlp.experts.4.down_proj.weight")
        assert t["dtype"] == "BF16" and t["shape"] == (H, I) and t["nbytes"] == H * I * 2 and t["data"]
        assert "model.layers.3.mlp.experts.0.up_proj.bias" in ck.tensor_names()


def test_a_ranks_share_loads_its_experts_and_slice(expert_ckpt):
    # An expert- and tensor-parallel rank's share: experts 4 and 1, the
    # intermediate rows 8-23, no down biases (another rank adds them).
    d, layers = expert_ckpt
    src, experts, (i0, i1) = layers[3], [4, 1], (8, 24)
    with kt.Checkpoint(d) as ck:
        opts = dict(ck.moe_options(3), num_experts=len(experts), intermediate=i1 - i0)
        share = kt.MoE(**opts)
        ck.load_layer(3, share, experts=experts, intermediate=(i0, i1), zero_down_bias=True)
        assert share.num_loaded() == len(experts)
        assert share.weights_source == ("checkpoint", os.fspath(d), 3,
                                        dict(experts=experts, intermediate=(i0, i1), zero_down_bias=True))
        by_hand = kt.MoE(**opts)
        by_hand.load_weights(gate=src["gate"][experts, i0:i1], up=src["up"][experts, i0:i1],
                             down=src["down"][experts][:, :, i0:i1],
                             bias_gate=src["bias_gate"][experts, i0:i1].bfloat16(),
                             bias_up=src["bias_up"][experts, i0:i1].bfloat16(),
                             bias_down=torch.zeros(len(experts), H))
        g = torch.Generator().manual_seed(5)
        x = torch.randn(7, H, generator=g)
        ids = torch.tensor([[0, 1], [1, -1], [0, -1], [1, 0], [-1, 0], [0, 1], [1, 0]], dtype=torch.int32)
        w = torch.rand(7, K, generator=g)
        assert torch.equal(run(share, x, ids, w), run(by_hand, x, ids, w))
        with pytest.raises(kt.KtError, match=r"experts\[1\] = 6 is not an expert of the layer \[0, 6\)"):
            ck.load_layer(3, kt.MoE(**opts), experts=[0, 6], intermediate=(i0, i1))
        with pytest.raises(kt.KtError, match="intermediate \\(in the share loaded\\) = 40"):
            ck.load_layer(3, kt.MoE(**opts), experts=experts)


def test_checkpoint_errors_name_the_call(tmp_path, expert_ckpt):
    with pytest.raises(kt.IOFailure, match="kt_ckpt_open"):
        kt.Checkpoint(tmp_path / "missing")
    d, _ = expert_ckpt
    ck = kt.Checkpoint(d)
    with pytest.raises(kt.KtError, match="kt_ckpt_load_layer") as err:
        ck.load_layer(2, kt.MoE(E, K, H, I, bias=True))
    assert err.value.status == 1  # KT_ERR_INVALID_ARGUMENT: no layer 2
    with pytest.raises(kt.ShapeError, match="kt_ckpt_load_layer"):
        ck.load_layer(3, kt.MoE(E, K, H, I + 8, bias=True))
    with pytest.raises(ValueError, match="read_layer takes"):
        ck.read_layer(3, w_gate=torch.empty(E, I, H))
    ck.close()
    with pytest.raises(ValueError, match="closed"):
        ck.moe_options(3)


def test_packed_cache_round_trip(tmp_path, expert_ckpt):
    d, _ = expert_ckpt
    ck = kt.Checkpoint(d)
    layer = kt.MoE(**ck.moe_options(1))
    ck.load_layer(1, layer)
    path = tmp_path / "layer-1.ktpack"
    layer.save_packed(path)
    copy = kt.MoE(**ck.moe_options(1))
    copy.load_packed(path)
    assert copy.weights_source == ("packed", os.fspath(path))
    x, ids, w = routes(5, seed=1)
    assert torch.equal(run(copy, x, ids, w), run(layer, x, ids, w))
    with pytest.raises(kt.ShapeError, match="kt_moe_load_packed"):
        kt.MoE(E, K, H, I, bias=False).load_packed(path)


def test_adapter_write_and_read(tmp_path):
    r = 4
    factors = {2: {"lora_A_gate": torch.randn(E, r, H), "lora_B_gate": torch.randn(E, I, r),
                   "lora_A_down": torch.randn(E, r, I), "lora_B_down": torch.randn(E, H, r)}}
    d = tmp_path / "adapter"
    kt.checkpoint.write_adapter(d, factors, rank=r, alpha=8, targets=("gate", "down"),
                                naming="mixtral", base_model="tiny-moe")
    cfg = kt.checkpoint.read_adapter_config(d)
    assert cfg == {"rank": r, "alpha": 8.0, "use_rslora": False, "targets": ("gate", "down"),
                   "naming": "mixtral", "dtype": "F32"}
    back = torch.empty(E, H, r)
    kt.checkpoint.read_adapter(d, 2, lora_B_down=back)
    assert torch.equal(back, factors[2]["lora_B_down"])
    with pytest.raises(kt.KtError, match="kt_ckpt_adapter_read"):
        kt.checkpoint.read_adapter(d, 2, lora_A_up=torch.empty(E, r, H))


class Model(torch.nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for b in blocks:
            m = torch.nn.Module()
            m.mlp = b
            self.layers.append(m)

    def forward(self, x):
        for layer in self.layers:
            out = layer.mlp(x)
            x = x + (out[0] if isinstance(out, tuple) else out)
        return x


def _twin_models(make, make_meta):
    torch.manual_seed(0)
    real = round_params_to_bf16(Model([make(), make()]))
    meta = Model([make_meta(), make_meta()])
    # Everything but the routed experts is the host's: copy it over.
    state = {k: v for k, v in real.state_dict().items() if ".experts." not in k}
    missing, unexpected = meta.load_state_dict(state, strict=False)
    assert not unexpected and all(".experts." in k for k in missing)
    return real, meta


def _per_expert_ckpt(model, d, naming):
    names = ("w1", "w3", "w2") if naming == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    layers = {}
    for L, layer in enumerate(model.layers):
        ex = layer.mlp.experts
        layers[L] = {p: torch.stack([getattr(e, n).weight.detach() for e in ex])
                     for p, n in zip(("gate", "up", "down"), names)}
    kt.checkpoint.write_experts(d, layers, naming=naming)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("source", ["checkpoint", "packed"])
def test_hf_fills_meta_experts_from_checkpoint(tmp_path, capsys, family, source):
    block = Qwen3MoeSparseMoeBlock if family == "qwen3_moe" else MixtralSparseMoeBlock
    real, meta = _twin_models(lambda: block(H, I, E, K), lambda: block(H, I, E, K, expert_device="meta"))
    assert all(p.device.type == "meta" for n, p in meta.named_parameters() if ".experts." in n)
    d = tmp_path / "ckpt"
    _per_expert_ckpt(real, d, "mixtral" if family == "mixtral" else "per_expert")
    kt.hf.replace_moe_experts(real)
    if source == "packed":
        # What `kt-moe convert` writes: one .ktpack per layer and a manifest.
        cache = tmp_path / "packed"
        cache.mkdir()
        entries = []
        with kt.Checkpoint(d) as ck:
            for L in ck.layers:
                layer = kt.MoE(**dict(ck.moe_options(L), top_k=K), max_tokens=8)
                ck.load_layer(L, layer)
                layer.save_packed(cache / ("layer-%d.ktpack" % L))
                entries.append({"layer": L, "file": "layer-%d.ktpack" % L})
        (cache / "manifest.json").write_text(json.dumps({"format": "kt-packed-cache", "layers": entries}))
        capsys.readouterr()
        kt.hf.replace_moe_experts(meta, packed=cache, progress=True)
        assert kt.hf.kt_experts_modules(meta)[1].kt_layer.weights_source[0] == "packed"
        total = sum(os.path.getsize(cache / e["file"]) for e in entries)
    else:
        with kt.Checkpoint(d) as ck:
            total = sum(info["bytes"] for info in ck.layers.values())
        capsys.readouterr()
        kt.hf.replace_moe_experts(meta, checkpoint=d, progress=True)
    # The progress line, asked for: both layers and every byte, on stderr only.
    out = capsys.readouterr()
    last = out.err.strip().splitlines()[-1]
    assert out.out == "" and "layer 2/2" in last and "of %s," % _bytes_text(total) in last, out.err
    assert last.startswith("kt.hf: experts from ") and str(cache if source == "packed" else d) in last
    assert not any(p.device.type == "meta" for p in meta.parameters())
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        assert torch.equal(meta(x), real(x))


def test_hf_fills_fused_and_gpt_oss_meta_experts(tmp_path):
    for name, make in (("fused", lambda: FusedMoeBlock(H, I, E, K)), ("gpt_oss", lambda: GptOssMLP(H, I, E, K))):
        torch.manual_seed(1)
        real = round_params_to_bf16(Model([make(), make()]))
        meta = Model([make(), make()])
        meta.load_state_dict(real.state_dict())
        tensors = {}
        for L, layer in enumerate(meta.layers):
            ex = layer.mlp.experts
            for n, p in list(ex.named_parameters(recurse=False)):
                tensors["model.layers.%d.mlp.experts.%s" % (L, n)] = p.detach().bfloat16()
                setattr(ex, n, torch.nn.Parameter(p.detach().to("meta")))
        d = tmp_path / name
        d.mkdir()
        st_files.write(d / "model.safetensors", tensors, {"format": "pt"})
        (d / "config.json").write_text(json.dumps({"model_type": name, "num_experts_per_tok": K}))
        kt.hf.replace_moe_experts(real)
        kt.hf.replace_moe_experts(meta, checkpoint=d)
        x = torch.randn(2, 5, H)
        with torch.no_grad():
            assert torch.equal(meta(x), real(x)), name


def test_hf_full_mode_reads_checkpoint_into_parameters(tmp_path):
    real, meta = _twin_models(lambda: Qwen3MoeSparseMoeBlock(H, I, E, K),
                              lambda: Qwen3MoeSparseMoeBlock(H, I, E, K, expert_device="meta"))
    d = tmp_path / "ckpt"
    _per_expert_ckpt(real, d, "per_expert")
    kt.hf.replace_moe_experts(meta, mode="full", checkpoint=d)
    ex = kt.hf.kt_experts_modules(meta)[1]
    want = torch.stack([e.down_proj.weight.detach() for e in real.layers[1].mlp.experts])
    assert torch.equal(ex.w_down.data, want)
    with pytest.raises(ValueError, match="checkpoint="):
        _, meta2 = _twin_models(lambda: Qwen3MoeSparseMoeBlock(H, I, E, K),
                                lambda: Qwen3MoeSparseMoeBlock(H, I, E, K, expert_device="meta"))
        kt.hf.replace_moe_experts(meta2, mode="full", packed=_write_manifest(tmp_path, d))


def _write_manifest(tmp_path, d):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text(json.dumps(
        {"format": "kt-packed-cache", "layers": [{"layer": 0, "file": "layer-0.ktpack"}]}))
    return cache


def test_hf_meta_experts_without_a_source_are_refused():
    _, meta = _twin_models(lambda: Qwen3MoeSparseMoeBlock(H, I, E, K),
                           lambda: Qwen3MoeSparseMoeBlock(H, I, E, K, expert_device="meta"))
    with pytest.raises(ValueError, match="meta device; pass checkpoint= or packed="):
        kt.hf.replace_moe_experts(meta)


def test_hf_checkpoint_without_the_layer_is_refused(tmp_path, expert_ckpt):
    d, _ = expert_ckpt  # layers 1 and 3 only
    _, meta = _twin_models(lambda: Qwen3MoeSparseMoeBlock(H, I, E, K),
                           lambda: Qwen3MoeSparseMoeBlock(H, I, E, K, expert_device="meta"))
    with pytest.raises(ValueError, match=r"layers\.0\.mlp: checkpoint .* has no MoE layer 0"):
        kt.hf.replace_moe_experts(meta, checkpoint=d)


# Peak memory of loading a model's experts from a checkpoint of ~1.2 GB: the
# routed experts are on the meta device, kt packs each layer from the mapped
# files and drops the source pages it has packed, so the process grows by the
# packed size plus at most one load batch of source pages (32 experts) and
# LOAD_OVERHEAD for workspaces and allocator slack, not by twice the model.
RSS_LAYERS, RSS_E, RSS_H, RSS_I = 6, 64, 1024, 512
LOAD_BATCH_EXPERTS = 32
LOAD_OVERHEAD = 48 << 20

_WRITER = """
import sys, torch, kt
E, H, I = %d, %d, %d
ones = lambda *s: torch.full(s, 0.0125, dtype=torch.bfloat16)
kt.checkpoint.write_experts(sys.argv[1], {L: dict(gate=ones(E, I, H), up=ones(E, I, H), down=ones(E, H, I))
                                          for L in range(%d)},
                            config={"model_type": "qwen3_moe", "num_experts_per_tok": 4})
""" % (RSS_E, RSS_H, RSS_I, RSS_LAYERS)

_LOADER = """
import json, sys, torch, kt, kt.hf
from helpers.hf_shaped import Qwen3MoeSparseMoeBlock
E, H, I, LAYERS = %d, %d, %d, %d

def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024

model = torch.nn.Module()
model.layers = torch.nn.ModuleList()
for _ in range(LAYERS):
    layer = torch.nn.Module()
    layer.mlp = Qwen3MoeSparseMoeBlock(H, I, E, 4, expert_device="meta")
    model.layers.append(layer)
kt.default_engine()
x = torch.randn(1, 4, H)
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # restart the peak (VmHWM) from here
kt.hf.replace_moe_experts(model, checkpoint=sys.argv[1], max_tokens=64)
for layer in model.layers:
    y = layer.mlp(x)[0]
assert torch.isfinite(y).all()
print(json.dumps({"base": base, "peak": status("VmHWM")}))
""" % (RSS_E, RSS_H, RSS_I, RSS_LAYERS)


def test_loading_from_a_checkpoint_peaks_at_the_packed_size(tmp_path):
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("needs Linux /proc to measure the peak resident size")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                                    "plugins", "python"), HERE]))
    d = tmp_path / "big"
    subprocess.run([sys.executable, "-c", _WRITER, str(d)], env=env, check=True, timeout=300)
    with kt.Checkpoint(d) as ck:
        packed = sum(li["bytes"] for li in ck.layers.values())
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_LOADER), str(d)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grown = m["peak"] - m["base"]
    batch = LOAD_BATCH_EXPERTS * packed // (RSS_LAYERS * RSS_E)
    print("checkpoint %.0f MiB (bf16, the packed size), peak growth while loading %.0f MiB "
          "(%.0f MiB over the packed size; allowed: one batch %.0f MiB + %.0f MiB)"
          % (packed / 2**20, grown / 2**20, (grown - packed) / 2**20, batch / 2**20,
             LOAD_OVERHEAD / 2**20))
    assert packed > 1 << 30
    assert grown <= packed + batch + LOAD_OVERHEAD
