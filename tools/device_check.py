"""The GPU steps of tools/device_check.sh: kt beside a real CUDA device.

  python3 tools/device_check.py hybrid [--device cuda|cpu]
      kt.hf on a small real transformers Qwen3-MoE (built from its config
      class, fp32): the hottest experts of each block in torch on the device,
      the rest in kt (precision="fp32"), against the same model all on the
      device: logits and dx in inference, then one LoRA training step (loss,
      every LoRA gradient, the attention gradients, the loss after an SGD step).
  python3 tools/device_check.py real [--layers N] [--device cuda|cpu] [--small]
      the product's setting: a transformers Qwen3-MoE with Qwen3-30B-A3B's
      shapes (H 2048, 128 experts of I 768, top-8), N layers, bf16, with
      attention, routers and embeddings on the device and the routed experts
      in kt on the CPU; tokens/s for decode at batch 1 and 32, a 512-token
      prefill and a LoRA r16 training step, beside the same model all on the
      device; kt's share of each step and whether the device had work queued
      while kt ran (the overlap).
  python3 tools/device_check.py nccl
      kt's communicator on NCCL (world size 1): over the host's ncclComm_t,
      over kt's own unique id, and "cuda:nccl,cpu:gloo" (the id broadcast over
      Gloo), each with broadcast/allgather of CUDA tensors (and CPU ones on the
      mixed one), and a DistMoE forward over the mixed one.

Needs torch and transformers; kt from plugins/python (or $PYTHONPATH) and
libkt from $KT_LIBRARY. --device cpu runs the same code without a GPU (for
checking the script; nothing of it is a GPU measurement). Every check prints
one line "RESULT <name>: PASS|FAIL ..." and the process exits non-zero when
one failed.
"""
import argparse
import copy
import ctypes
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

RESULTS = []


def result(name, ok, detail=""):
    RESULTS.append((name, ok))
    print("RESULT %s: %s %s" % (name, "PASS" if ok else "FAIL", detail), flush=True)


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def qwen3_moe_config(**kw):
    from transformers import Qwen3MoeConfig
    return Qwen3MoeConfig(**kw)


def expert_blocks(model):
    """(name, block) of every sparse MoE block (those with a fused experts module)."""
    return [(n, m) for n, m in model.named_modules()
            if hasattr(m, "experts") and hasattr(getattr(m, "experts"), "gate_up_proj")]


class LoraExperts(torch.nn.Module):
    """Torch's reference for kt's LoRA mode on a fused experts module: the
    same base (gate_up_proj [E, 2I, H], down_proj [E, H, I]) plus PEFT-style
    factors per expert and projection, computed expert by expert."""

    def __init__(self, base, rank, scale, dtype):
        super().__init__()
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        E, I2, H = self.gate_up_proj.shape
        I = I2 // 2
        self.E, self.I, self.scale = E, I, scale
        dev = self.gate_up_proj.device
        for p, (fin, fout) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H))):
            setattr(self, "lora_A_" + p, torch.nn.Parameter(torch.zeros(E, rank, fin, device=dev, dtype=dtype)))
            setattr(self, "lora_B_" + p, torch.nn.Parameter(torch.zeros(E, fout, rank, device=dev, dtype=dtype)))

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        dt = hidden.dtype
        for e in torch.unique(top_k_index).tolist():
            tok, slot = torch.nonzero(top_k_index == e, as_tuple=True)
            h = hidden.index_select(0, tok)
            wg, wu = self.gate_up_proj[e, :self.I].to(dt), self.gate_up_proj[e, self.I:].to(dt)

            def lora(p, x):
                a, b = getattr(self, "lora_A_" + p)[e].to(dt), getattr(self, "lora_B_" + p)[e].to(dt)
                return self.scale * F.linear(F.linear(x, a), b)

            g = F.linear(h, wg) + lora("gate", h)
            u = F.linear(h, wu) + lora("up", h)
            a = F.silu(g) * u
            o = F.linear(a, self.down_proj[e].to(dt)) + lora("down", a)
            out = out.index_add(0, tok, o * top_k_weights[tok, slot].to(dt).unsqueeze(1))
        return out


def routing_counts(model, ids):
    """Routes per expert of each layer in one forward: [layers, E]."""
    counts = {}
    hooks = []
    for name, block in expert_blocks(model):
        layer = int(name.split("layers.")[1].split(".")[0])

        def hook(mod, inp, out, layer=layer):
            idx = out[2] if isinstance(out, tuple) and len(out) >= 3 else out[0]
            counts[layer] = torch.bincount(idx.reshape(-1).cpu(), minlength=mod.num_experts)
        hooks.append(block.gate.register_forward_hook(hook))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return torch.stack([counts[i] for i in sorted(counts)])


# ------------------------------------------------------------------ hybrid

def check_hybrid(device):
    import kt
    import kt.hf
    from transformers import Qwen3MoeForCausalLM
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    E, K, H, I, L, R = 16, 4, 64, 48, 2, 4
    cfg = qwen3_moe_config(vocab_size=512, hidden_size=H, intermediate_size=96, moe_intermediate_size=I,
                           num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, max_position_embeddings=256,
                           tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        ref = Qwen3MoeForCausalLM(cfg).float()
    with torch.no_grad():  # kt stores bf16 base weights: give torch the same values
        for p in ref.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    ref.eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (3, 24), generator=g).to(device)
    counts = routing_counts(ref, ids)
    n_hot = 5
    engine = kt.Engine(precision="fp32")
    print("hybrid: engine", engine.info(), "routes per expert (layer 0):", counts[0].tolist(), flush=True)

    # Inference: logits and the gradient at the input embeddings.
    model = copy.deepcopy(ref)
    replaced = kt.hf.replace_moe_experts(model, engine=engine, torch_experts=n_hot, torch_expert_counts=counts)
    mods = kt.hf.kt_experts_modules(model)
    where = {m.torch_experts.ids.device.type for m in mods}
    hot = [m.torch_expert_ids for m in mods]
    want_hot = [kt.hf.hottest_experts(counts[i], n_hot) for i in range(L)]
    loaded = [m.kt_layer.num_loaded() for m in mods]
    result("hybrid.placement", len(replaced) == L and where == {device.type} and hot == want_hot
           and loaded == [E - n_hot] * L,
           "replaced %s; torch experts %s on %s; kt holds %s of %d" % (replaced, hot, where, loaded, E))

    def fwd_bwd(m):
        emb = m.get_input_embeddings()(ids).detach().requires_grad_()
        logits = m(inputs_embeds=emb).logits
        logits.backward(torch.ones_like(logits) / logits.numel() ** 0.5)
        return logits.detach(), emb.grad

    y0, dx0 = fwd_bwd(ref)
    y1, dx1 = fwd_bwd(model)
    ey, edx = rel(y1, y0), rel(dx1, dx0)
    result("hybrid.inference", ey <= 2e-5 and edx <= 2e-5,
           "rel L2 vs the all-%s model: logits %.2e, dx %.2e (bound 2e-5)" % (device.type, ey, edx))

    # One LoRA training step: kt LoRA (hot experts in torch on the device,
    # their factor rows shared) vs torch LoRA experts on the device.
    lmodel = copy.deepcopy(ref)
    kt.hf.replace_moe_experts(lmodel, mode="lora", lora_rank=R, lora_alpha=2.0 * R, engine=engine,
                              torch_experts=n_hot, torch_expert_counts=counts)
    kmods = kt.hf.kt_experts_modules(lmodel)
    tref = copy.deepcopy(ref)
    trefs = []
    for (name, block), km in zip(expert_blocks(tref), kmods):
        le = LoraExperts(block.experts, R, km.lora_scale, torch.float32)
        with torch.no_grad():
            for p in ("gate", "up", "down"):
                a = getattr(km, "lora_A_" + p)
                b = getattr(km, "lora_B_" + p)
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)  # non-zero B: every factor gets a gradient
                getattr(le, "lora_A_" + p).copy_(a)
                getattr(le, "lora_B_" + p).copy_(b)
        block.experts = le
        trefs.append(le)
    for mm in (lmodel, tref):
        mm.train()
        for n, p in mm.named_parameters():
            p.requires_grad_("lora_" in n or "self_attn.q_proj" in n)
    labels = ids.clone()
    loss0 = tref(ids, labels=labels).loss
    loss0.backward()
    loss1 = lmodel(ids, labels=labels).loss
    loss1.backward()
    el = abs(loss1.item() - loss0.item()) / abs(loss0.item())
    worst = ("", 0.0)
    for km, le in zip(kmods, trefs):
        for p in ("gate", "up", "down"):
            for ab in ("A", "B"):
                n = "lora_%s_%s" % (ab, p)
                e = rel(getattr(km, n).grad, getattr(le, n).grad)
                if e > worst[1]:
                    worst = (n, e)
    qa = dict(lmodel.named_parameters())
    eq = max(rel(qa[n].grad, p.grad) for n, p in tref.named_parameters() if "q_proj" in n)
    # SGD on both, then the loss again.
    with torch.no_grad():
        for mm in (lmodel, tref):
            for p in mm.parameters():
                if p.requires_grad and p.grad is not None:
                    p.add_(p.grad, alpha=-0.5)
                    p.grad = None
    loss0b, loss1b = tref(ids, labels=labels).loss.item(), lmodel(ids, labels=labels).loss.item()
    el2 = abs(loss1b - loss0b) / abs(loss0b)
    moved = abs(loss0b - loss0.item()) / abs(loss0.item())
    ok = el <= 2e-5 and worst[1] <= 2e-5 and eq <= 2e-5 and el2 <= 2e-5 and moved > 1e-4
    result("hybrid.lora_step", ok,
           "loss %.6f vs %.6f (rel %.1e); worst LoRA grad %s %.2e; q_proj grads %.2e; after an SGD step "
           "loss %.6f vs %.6f (rel %.1e; the step moved it %.1e) (bound 2e-5)" %
           (loss1.item(), loss0.item(), el, worst[0], worst[1], eq, loss1b, loss0b, el2, moved))


# -------------------------------------------------------------------- real

class KtTimer:
    """Time inside kt's forward/backward calls, and whether the device's
    stream had work queued when each began."""

    def __init__(self, device):
        import kt.core
        self.device, self.core = device, kt.core
        self.orig = (kt.core.MoE.forward, kt.core.MoE.backward)
        self.seconds, self.calls, self.busy_at_entry = 0.0, 0, 0
        timer = self

        def wrap(fn):
            def inner(*a, **k):
                if timer.device.type == "cuda" and not torch.cuda.current_stream().query():
                    timer.busy_at_entry += 1
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    timer.seconds += time.perf_counter() - t0
                    timer.calls += 1
            return inner
        kt.core.MoE.forward, kt.core.MoE.backward = wrap(self.orig[0]), wrap(self.orig[1])

    def reset(self):
        self.seconds, self.calls, self.busy_at_entry = 0.0, 0, 0

    def close(self):
        self.core.MoE.forward, self.core.MoE.backward = self.orig


def timed(device, fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_run(model, device, batch, context, steps, vocab):
    """Prefill `context` tokens untimed, then `steps` decode steps timed."""
    from transformers import DynamicCache
    g = torch.Generator().manual_seed(batch)
    ids = torch.randint(0, vocab, (batch, context), generator=g).to(device)
    with torch.no_grad():
        cache = DynamicCache(config=model.config)
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1:].argmax(-1)
        sync(device)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
        sync(device)
        return time.perf_counter() - t0


def measure_inference(label, model, device, vocab, decode_steps, reps, timer=None):
    rows = []
    for batch in (1, 32):
        decode_run(model, device, batch, 32, 2, vocab)  # warm-up
        if timer:
            timer.reset()
        ts = [decode_run(model, device, batch, 32, decode_steps, vocab) for _ in range(reps)]
        t = statistics.median(ts)
        extra = ""
        if timer:
            extra = "; kt %.0f%% of the time, device busy at %d of %d kt calls" % (
                100 * timer.seconds / sum(ts), timer.busy_at_entry, timer.calls)
        rows.append(("decode b%d" % batch, batch * decode_steps / t, 1000 * t / decode_steps, extra))
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (1, 512), generator=g).to(device)

    def prefill():
        with torch.no_grad():
            model(ids, use_cache=False, logits_to_keep=1)
    prefill()
    if timer:
        timer.reset()
    t = timed(device, prefill, reps, warmup=0)
    extra = ""
    if timer:
        extra = "; kt %.0f%% of the time, device busy at %d of %d kt calls" % (
            100 * timer.seconds / (t * reps), timer.busy_at_entry, timer.calls)
    rows.append(("prefill 512", 512 / t, 1000 * t, extra))
    for name, tps, ms, extra in rows:
        print("REAL %-8s %-12s %9.1f tokens/s  %8.2f ms/step%s" % (label, name, tps, ms, extra), flush=True)
    return rows


def measure_lora_step(label, model, device, vocab, reps, params, timer=None):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (1, 512), generator=g).to(device)
    opt = torch.optim.AdamW(params, lr=1e-4)

    def fwd_bwd():
        loss = model(ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss

    def step():
        opt.step()
        opt.zero_grad(set_to_none=False)

    losses = [fwd_bwd().item()]
    step()
    if timer:
        timer.reset()
    t_fb = timed(device, fwd_bwd, reps, warmup=0)
    kt_share = ""
    if timer:
        kt_share = "; kt %.0f%% of fwd+bwd, device busy at %d of %d kt calls" % (
            100 * timer.seconds / (t_fb * reps), timer.busy_at_entry, timer.calls)
    t_opt = timed(device, step, reps, warmup=0)
    losses.append(fwd_bwd().item())
    n = sum(p.numel() for p in params)
    print("REAL %-8s %-12s %9.1f tokens/s  %8.2f ms fwd+bwd, AdamW over %.1fM LoRA parameters (%s) "
          "%.2f ms; loss %.4f -> %.4f%s" % (label, "LoRA step", 512 / (t_fb + t_opt), 1000 * t_fb, n / 1e6,
                                              params[0].device.type, 1000 * t_opt, losses[0], losses[-1],
                                              kt_share), flush=True)
    return t_fb, t_opt


def check_real(device, layers, small):
    import kt
    import kt.hf
    from transformers import Qwen3MoeForCausalLM
    if small:  # for checking the script on a CPU: a tiny model of the same form
        shape = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=16,
                     num_experts_per_tok=4)
        decode_steps, reps = 4, 2
    else:  # Qwen3-30B-A3B
        shape = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8)
        decode_steps, reps = 16, 3
    cfg = qwen3_moe_config(num_hidden_layers=layers, norm_topk_prob=True, max_position_embeddings=4096,
                           rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, **shape)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    sync(device)
    print("real: %d layers of Qwen3-30B-A3B's shapes (%s), built on %s in %.1f s; experts implementation %s"
          % (layers, shape, device, time.perf_counter() - t0, cfg._experts_implementation), flush=True)
    vocab = cfg.vocab_size
    blocks = expert_blocks(model)
    stash = {name: block.experts for name, block in blocks}

    ok_all = True
    # All on the device: the transformers experts, then its grouped_mm form when there is one.
    impls = [cfg._experts_implementation]
    if device.type == "cuda" and "grouped_mm" not in impls:
        impls.append("grouped_mm")
    for impl in impls:
        try:
            model.config._experts_implementation = impl
            measure_inference("%s/%s" % (device.type, impl), model, device, vocab, decode_steps, reps)
        except Exception as e:  # noqa: BLE001
            print("real: all-%s with experts implementation %s failed: %s" % (device.type, impl, e), flush=True)
    model.config._experts_implementation = impls[0]
    # All on the device, LoRA r16 on every expert (torch's per-expert loop, as the reference above).
    try:
        loras = []
        for name, block in blocks:
            le = LoraExperts(block.experts, 16, 2.0, torch.bfloat16)
            with torch.no_grad():
                for p in ("gate", "up", "down"):
                    a = getattr(le, "lora_A_" + p)
                    a.uniform_(-1.0 / a.shape[-1] ** 0.5, 1.0 / a.shape[-1] ** 0.5)
            block.experts = le
            loras.append(le)
        model.train()
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
        measure_lora_step(device.type, model, device, vocab, reps, [p for le in loras for p in le.parameters()
                                                                      if p.requires_grad])
    except Exception:  # noqa: BLE001
        ok_all = False
        traceback.print_exc()
    for name, block in blocks:
        block.experts = stash[name]
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # The routed experts in kt on the CPU, everything else on the device.
    engine = kt.Engine()
    print("real: kt engine", engine.info(), flush=True)
    timer = KtTimer(device)
    try:
        t0 = time.perf_counter()
        kt.hf.replace_moe_experts(model, engine=engine, max_tokens=512)
        print("real: experts into kt in %.1f s" % (time.perf_counter() - t0), flush=True)
        measure_inference("kt", model, device, vocab, decode_steps, reps, timer)
    except Exception:  # noqa: BLE001
        ok_all = False
        traceback.print_exc()
    for name, block in blocks:
        block.experts = stash[name]
    try:
        kt.hf.replace_moe_experts(model, mode="lora", lora_rank=16, lora_alpha=32.0, engine=engine, max_tokens=512)
        model.train()
        params = []
        for n, p in model.named_parameters():
            p.requires_grad_("lora_" in n)
            if "lora_" in n:
                params.append(p)
        measure_lora_step("kt", model, device, vocab, reps, params, timer)
    except Exception:  # noqa: BLE001
        ok_all = False
        traceback.print_exc()
    # Hybrid placement in the same setting: the 16 most routed experts of each block on the device.
    try:
        for name, block in blocks:
            block.experts = stash[name]
        model.eval()
        g = torch.Generator().manual_seed(3)
        counts = routing_counts(model, torch.randint(0, vocab, (4, 256), generator=g).to(device))
        kt.hf.replace_moe_experts(model, engine=engine, max_tokens=512, torch_experts=16, torch_expert_counts=counts)
        measure_inference("kt+16%s" % device.type, model, device, vocab, decode_steps, reps, timer)
    except Exception:  # noqa: BLE001
        ok_all = False
        traceback.print_exc()
    timer.close()
    result("real.measured", ok_all, "(figures in the REAL lines above)")


# -------------------------------------------------------------------- nccl

def check_nccl(device):
    import kt
    import kt.dist
    from kt import _capi
    from kt._tensor import DLView
    from kt.core import check, lib
    lib_ = lib()
    lib_.kt_build_info.restype = ctypes.c_char_p
    print("nccl: kt", lib_.kt_build_info().decode(), flush=True)
    lib_.kt_comm_nccl_unique_id.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    lib_.kt_comm_nccl_unique_id.restype = ctypes.c_int
    lib_.kt_comm_broadcast.argtypes = [ctypes.c_void_p, ctypes.POINTER(_capi.DLTensor), ctypes.c_int]
    lib_.kt_comm_broadcast.restype = ctypes.c_int
    lib_.kt_comm_allgather.argtypes = [ctypes.c_void_p, ctypes.POINTER(_capi.DLTensor),
                                       ctypes.POINTER(_capi.DLTensor)]
    lib_.kt_comm_allgather.restype = ctypes.c_int

    def create(backend, **kw):
        o = _capi.CommOptions()
        lib_.kt_comm_options_defaults(ctypes.byref(o), ctypes.sizeof(o))
        o.backend = backend.encode()
        o.rank, o.world_size, o.timeout_ms = 0, 1, 30000
        for k, v in kw.items():
            setattr(o, k, v)
        h = ctypes.c_void_p()
        check(lib_.kt_comm_create(ctypes.byref(o), ctypes.byref(h)))
        return h

    def exercise(h, label, devices):
        info = _capi.CommInfo()
        info.struct_size = ctypes.sizeof(info)
        check(lib_.kt_comm_get_info(h, ctypes.byref(info)))
        check(lib_.kt_comm_barrier(h))
        notes = ["device %s" % ("cuda" if info.backends.device == _capi.KDL_CUDA else "cpu")]
        ok = True
        for d in devices:
            x = torch.arange(1000, dtype=torch.float32, device=d) * 0.5
            before = x.clone()
            v = DLView(x)
            check(lib_.kt_comm_broadcast(h, v.ptr, 0))
            sync(x.device)
            xin = torch.randn(7, 3, device=d).to(torch.bfloat16)
            out = torch.full((1, 7, 3), float("nan"), device=d, dtype=torch.bfloat16)
            vi, vo = DLView(xin), DLView(out)
            check(lib_.kt_comm_allgather(h, vi.ptr, vo.ptr))
            sync(out.device)
            same = torch.equal(x, before) and torch.equal(out[0], xin)
            ok = ok and same
            notes.append("%s broadcast+allgather %s" % (d, "equal" if same else "DIFFER"))
        return ok and info.backends.device == _capi.KDL_CUDA, ", ".join(notes)

    if device.type != "cuda":  # checks this script's calls on Gloo and CPU tensors only
        with tempfile.TemporaryDirectory() as d:
            h = create("gloo", store_path=d.encode())
            ok, notes = exercise(h, "gloo", [device])
            lib_.kt_comm_destroy(h)
        result("nccl.script_on_gloo", "DIFFER" not in notes, notes)
        return
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    # 1. Over the host's ncclComm_t (made here by NCCL's own calls, as torch's process group would).
    try:
        nccl = ctypes.CDLL("libnccl.so.2")

        class UniqueId(ctypes.Structure):
            _fields_ = [("internal", ctypes.c_char * 128)]
        nccl.ncclGetUniqueId.argtypes = [ctypes.POINTER(UniqueId)]
        nccl.ncclCommInitRank.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId, ctypes.c_int]
        nccl.ncclCommDestroy.argtypes = [ctypes.c_void_p]
        nccl.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        ver = ctypes.c_int()
        nccl.ncclGetVersion(ctypes.byref(ver))
        uid = UniqueId()
        assert nccl.ncclGetUniqueId(ctypes.byref(uid)) == 0
        comm = ctypes.c_void_p()
        assert nccl.ncclCommInitRank(ctypes.byref(comm), 1, uid, 0) == 0
        h = create("nccl", nccl_comm=comm.value)
        ok, notes = exercise(h, "host", [dev])
        lib_.kt_comm_destroy(h)
        assert nccl.ncclCommDestroy(comm) == 0  # kt never destroys the host's communicator
        result("nccl.host_comm", ok, "NCCL %d; %s" % (ver.value, notes))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        result("nccl.host_comm", False, repr(e))
    # 2. Over kt's own id.
    try:
        buf = ctypes.create_string_buffer(128)
        check(lib_.kt_comm_nccl_unique_id(buf, 128))
        h = create("nccl", nccl_unique_id=ctypes.addressof(buf))
        ok, notes = exercise(h, "kt id", [dev])
        lib_.kt_comm_destroy(h)
        result("nccl.kt_id", ok, notes)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        result("nccl.kt_id", False, repr(e))
    # 3. cuda:nccl,cpu:gloo: rank 0 makes the id and broadcasts it over Gloo.
    try:
        parsed = kt.dist.parse_backend("cuda:nccl,cpu:gloo")
        with tempfile.TemporaryDirectory() as d:
            h = create("cuda:nccl,cpu:gloo", store_path=d.encode())
            ok, notes = exercise(h, "mixed", [dev, torch.device("cpu")])
            lib_.kt_comm_destroy(h)
            os.makedirs(os.path.join(d, "py"))
            comm = kt.dist.Communicator(0, 1, backend="cuda:nccl,cpu:gloo", store_path=os.path.join(d, "py"))
            info = comm.info()
            # A DistMoE forward over it (owner mode, CPU tensors through Gloo) against one process's MoE.
            E, K, H, I, T = 8, 2, 64, 32, 40
            dm = kt.dist.DistMoE(comm, E, K, H, I, max_tokens=64)
            g = torch.Generator().manual_seed(5)
            w = dict(gate=torch.randn(E, I, H, generator=g) * 0.1, up=torch.randn(E, I, H, generator=g) * 0.1,
                     down=torch.randn(E, H, I, generator=g) * 0.1)
            dm.layer.load_weights(**w)
            single = kt.MoE(E, K, H, I, max_tokens=64)
            single.load_weights(**w)
            x = torch.randn(T, H, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
            rw = torch.softmax(torch.randn(T, K, generator=g), -1)
            y1, y2 = torch.empty(T, H), torch.empty(T, H)
            dm.forward(x, ids, rw, y1)
            single.forward(x, ids, rw, y2)
            same = torch.equal(y1, y2)
            dm.close()
            comm.close()
        ok = ok and parsed == {"cpu": "gloo", "cuda": "nccl", "device": "cuda"} and info["device"] == "cuda" and same
        result("nccl.cuda_nccl_cpu_gloo", ok, "parse %s; %s; Communicator.info %s; DistMoE forward (CPU tensors) "
               "%s one process's" % (parsed, notes, info, "equals" if same else "DIFFERS FROM"))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        result("nccl.cuda_nccl_cpu_gloo", False, repr(e))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("hybrid", "real", "nccl"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--small", action="store_true")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        result(a.what, False, "no CUDA device")
        return 1
    import kt
    print("%s: torch %s, kt from %s (%s)" % (a.what, torch.__version__, os.path.dirname(kt.__file__),
                                            kt.library_path() if hasattr(kt, "library_path") else ""),
          flush=True)
    try:
        if a.what == "hybrid":
            check_hybrid(device)
        elif a.what == "real":
            check_real(device, a.layers, a.small)
        else:
            check_nccl(device)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        result(a.what, False, repr(e))
    return 0 if RESULTS and all(ok for _, ok in RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
