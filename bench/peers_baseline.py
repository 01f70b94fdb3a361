#!/usr/bin/env python3
"""kt_bench's peers in one subprocess: kt-kernel's MoE and DeepSpeed's CPU Adam,
or vLLM's CPU fused MoE.

kt_bench starts this script with the interpreter of --peers-python (--peers
kt-kernel,deepspeed, the default) and, with --vllm-python, once more with that
interpreter and --peers vllm: vLLM lives in a venv of its own. It talks to
each one flat JSON object a line: a command on stdin, one reply on stdout
(everything else the libraries print goes to stderr). The peers run on the
data kt_bench writes to a directory (the same weights, routing, inputs and
optimizer tensors kt runs on) and kt_bench calls them one call at a time,
between its own calls, so both are timed in the same rounds.

First line out, unasked: {"hello": 1, "python", "threads", "torch" or
"torch_reason", "kt_kernel" (version) or "kt_kernel_reason",
"kt_kernel_variant", "kt_kernel_int8", "kt_kernel_sft" (its bf16 SFT
classes) or "kt_kernel_train_lora_reason" and "kt_kernel_train_dx_reason",
"deepspeed" or "deepspeed_reason"}; with --peers vllm instead of the
kt-kernel and DeepSpeed keys: "vllm" (version) and "vllm_class" (the experts
class and ISA its CPU oracle picks here) or "vllm_reason".

Commands ({"cmd": ...}):
  moe_load  dir, experts, top_k, hidden, intermediate, max_tokens, variant
            (bf16 | int8 | int4), peer (kt-kernel, the default, or vllm:
            bf16 only): builds that peer's MoE of that variant from
            dir/{gate,up,down}.bf16 -> {"ok", "class", "load_s"} or {"reason"}
  moe_call  peer, variant, T, batch: one forward of batch `batch` of
            dir/*_T.* -> {"s": seconds}
  moe_output peer, variant, T, batch, rows, path: y of the first `rows`
            tokens of that batch, fp32, written to path -> {"ok"}
  moe_free  peer, variant
  sft_load  dir, experts, top_k, hidden, intermediate, max_tokens, case
            (train_lora | train_dx), and for train_lora lora_rank, lora_alpha:
            builds kt-kernel's bf16 SFT MoE (AMXBF16_SFT_MOE with the LoRA
            factors dir/lora_{gate,up,down}_{a,b}.bf16, or the frozen-base
            AMXBF16_SFT_MOE_SkipLoRA) -> {"ok", "class", "load_s"} or {"reason"}
  sft_call  case, T, batch: forward_sft_task (saving for backward) and
            backward_task with dy of dir/dy_T.bf16 -> {"s": seconds}
  sft_output case, T, batch, rows, path: that call again, dx of the first
            `rows` tokens, fp32, written to path -> {"ok"}
  sft_free  case
  adam_load dir, count, shape_<i> ("d0xd1x..."), lr, wd: DeepSpeedCPUAdam over
            the fp32 tensors dir/p_<i>.f32 with gradients dir/g_<i>.f32 (its
            op JIT-built or loaded here) -> {"ok", "build_flags"} or {"reason"}
  adam_step -> {"s": seconds}
  adam_free
  quit

kt-kernel is driven through its extension's classes (kt_kernel_ext.moe:
the AVX2/AMX BF16 MoE, and for int8/int4 AMXInt8_MOE/AMXInt4_MOE, which
quantize bf16 weights themselves at load) with the MOEConfig, CPUInfer and
forward_task calls its KTMoEWrapper makes. The wrapper itself cannot be used
on a CPU-only machine: it allocates its buffers with pin_memory=True, which
needs an NVIDIA driver, and its BF16 method reads weights only from a
safetensors path. Pinned buffers serve only copies to a GPU, so the plain
buffers here change nothing on the CPU side.

Its training (SFT) classes are driven the same way, with the MOESFTConfig,
load_weights_task, forward_sft_task and backward_task calls its
AMXSFTMoEWrapper (kt_kernel/sft/amx.py and base.py) makes for the methods
AMXBF16_SFT and AMXBF16_SFT_SkipLoRA with every expert on the CPU: max_len
rounded up to its M_STEP (32, _aligned_max_len), C++-owned optimizer
gradients (authoritative_optimizer_grads, the wrapper's choice for
AMXBF16_SFT without GPU experts: backward_task(..., accumulate=False,
scale=1.0) overwrites the six LoRA gradients), and for SkipLoRA no LoRA
pointers and null gradients. The wrapper is not used for the reasons above
(it also wants its weights from a safetensors path or torch tensors it
keeps, and a torch autograd context around each call); one forward with
save_for_backward followed by one backward is what its autograd function
runs per training step.

vLLM's peer is the op its unquantized CPU experts serve with
(vllm/model_executor/layers/fused_moe/experts/cpu_moe.py), called as they
call it: the class is the first of the oracle's CPU list
(oracle/unquantized.py backend_to_kernel_cls: x86 AMX, Arm, Power, then the
portable vector path) whose _supports_current_device() holds, and its isa
names the kernel. At load, process_weights_after_loading's steps: w13 =
[gate; up] ([E, 2I, H]) and w2 = down ([E, H, I]), the intermediate dimension
zero-padded to the class's alignment (_pad_moe_intermediate), each prepacked
by cpu_prepack_moe_weight(w, isa). Per forward, apply()'s call:
cpu_fused_moe(out, x, w13, w2, None, None, topk_weights, topk_ids, "silu",
isa, False) with bf16 x and out and the routing as contiguous float32/int32
(what its CPU router hands over). vLLM's op has no dropped route: a route to
an expert outside a slice (id -1 in kt_bench's batches, which corrupts its
memory) goes to expert 0 with weight 0, the same y for a little more work.
"""
import argparse
import json
import os
import shutil
import sys
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, required=True, help="threads of every peer")
    p.add_argument("--peers", default="kt-kernel,deepspeed",
                   help="the peers this process imports: kt-kernel,deepspeed (the peers' venv) or vllm (its own venv)")
    return p.parse_args()


ARGS = parse_args()
PEERS = set(ARGS.peers.split(","))
# Before torch (and DeepSpeed's OpenMP op) load their runtimes.
os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
# torch's JIT loader (DeepSpeed's CPU Adam op) runs ninja on every load, even
# of an op already built: pip puts ninja beside this interpreter, which
# need not be on PATH.
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")

# Replies go to the original stdout; everything printed afterwards (by
# Python or by the libraries' C++ code) goes to stderr.
_REPLY = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr


def reply(obj):
    _REPLY.write(json.dumps(obj) + "\n")
    _REPLY.flush()


def first_line(e):
    text = str(e).strip().splitlines()
    return "%s: %s" % (type(e).__name__, text[0] if text else "")


HELLO = {"hello": 1, "python": sys.version.split()[0], "threads": ARGS.threads}
try:
    import torch

    torch.set_num_threads(ARGS.threads)
    HELLO["torch"] = torch.__version__
except Exception as e:  # noqa: BLE001 - any failure to import is a reason
    torch = None
    HELLO["torch_reason"] = first_line(e)

ktk = None
if "kt-kernel" not in PEERS:
    pass
elif torch is not None:
    try:
        import kt_kernel

        ktk = kt_kernel.kt_kernel_ext
        HELLO["kt_kernel"] = kt_kernel.__version__
        HELLO["kt_kernel_variant"] = str(kt_kernel.__cpu_variant__)
        HELLO["kt_kernel_int8"] = str(getattr(kt_kernel, "__int8_kernel__", "unknown"))
        # Its training (SFT) classes: the bf16 LoRA one and its frozen-base
        # (SkipLoRA) twin, or why the training cases cannot run on this build.
        sft = sorted(n for n in dir(ktk.moe) if "SFT" in n and n.endswith("_MOE"))
        if getattr(ktk.moe, "AMXBF16_SFT_MOE", None) and getattr(ktk.moe, "AMXBF16_SFT_MOE_SkipLoRA", None):
            HELLO["kt_kernel_sft"] = "AMXBF16_SFT_MOE, AMXBF16_SFT_MOE_SkipLoRA"
        else:
            HELLO["kt_kernel_train_lora_reason"] = (
                "this build (%s variant) has no bf16 SFT class (AMXBF16_SFT needs its amx build); its SFT "
                "classes: %s (LoRA over an MXFP4 base with a clamped SwiGLU, not this bf16 layer)"
                % (kt_kernel.__cpu_variant__, ", ".join(sft) or "none"))
            HELLO["kt_kernel_train_dx_reason"] = (
                "its dx-only training (the *_SFT_SkipLoRA methods) needs the AMX SFT classes, absent from "
                "this build (%s variant)" % kt_kernel.__cpu_variant__)
    except Exception as e:  # noqa: BLE001
        HELLO["kt_kernel_reason"] = first_line(e)
else:
    HELLO["kt_kernel_reason"] = "needs torch: " + HELLO["torch_reason"]

ds_adam = None
if "deepspeed" not in PEERS:
    pass
elif torch is not None:
    try:
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam as ds_adam

        HELLO["deepspeed"] = deepspeed.__version__
    except Exception as e:  # noqa: BLE001
        HELLO["deepspeed_reason"] = first_line(e)
else:
    HELLO["deepspeed_reason"] = "needs torch: " + HELLO["torch_reason"]

vllm_ops = vllm_experts = None
if "vllm" not in PEERS:
    pass
elif torch is not None:
    try:
        import vllm
        from vllm import _custom_ops as vllm_ops
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.oracle.unquantized import (UnquantizedMoeBackend,
                                                                             backend_to_kernel_cls)
        from vllm.platforms import current_platform

        HELLO["vllm"] = vllm.__version__
        if not current_platform.is_cpu():
            raise LookupError("vLLM's platform here is %s, not its CPU build" % type(current_platform).__name__)
        for op in ("cpu_fused_moe", "prepack_moe_weight"):
            if not hasattr(torch.ops._C, op):
                raise LookupError("this vLLM build registers no torch.ops._C.%s" % op)
        vllm_experts = next((cls for cls in backend_to_kernel_cls(UnquantizedMoeBackend.CPU)
                             if cls._supports_current_device()), None)
        if vllm_experts is None:
            raise LookupError("none of vLLM's unquantized CPU experts classes supports this CPU")
        HELLO["vllm_class"] = "%s (isa %s)" % (vllm_experts.__name__, vllm_experts.isa)
    except Exception as e:  # noqa: BLE001 - any failure to import is a reason
        vllm_ops = vllm_experts = None
        HELLO.pop("vllm", None)
        HELLO["vllm_reason"] = first_line(e)
else:
    HELLO["vllm_reason"] = "needs torch: " + HELLO["torch_reason"]


# ---------------------------------------------------------------- kt-kernel

_CPU_INFER = None


def cpu_infer():
    """One CPUInfer (kt-kernel's worker pool) of --threads threads, one subpool."""
    global _CPU_INFER
    if _CPU_INFER is None:
        wc = ktk.WorkerPoolConfig()
        wc.subpool_count = 1
        wc.subpool_numa_map = [0]
        wc.subpool_thread_count = [ARGS.threads]
        _CPU_INFER = ktk.CPUInfer(wc)
    return _CPU_INFER


def read_tensor(path, dtype, shape):
    with open(path, "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=dtype).view(*shape)


AMX_M_STEP = 32  # kt_kernel/sft/amx.py's _AMX_M_STEP


def aligned_max_len(tokens):
    """tokens rounded up to a multiple of AMX_M_STEP (the SFT wrapper's
    _aligned_max_len)."""
    return (tokens + AMX_M_STEP - 1) // AMX_M_STEP * AMX_M_STEP


def read_batches(directory, T, k, H, with_dy):
    """The batches of T tokens kt_bench wrote: per batch ids (int64), routing
    weights, x and (with_dy) dy, each contiguous."""
    ids = read_tensor(os.path.join(directory, "ids_%d.i32" % T), torch.int32, (-1, T, k)).long()
    rw = read_tensor(os.path.join(directory, "rw_%d.f32" % T), torch.float32, (-1, T, k))
    x = read_tensor(os.path.join(directory, "x_%d.bf16" % T), torch.bfloat16, (-1, T, H))
    dy = read_tensor(os.path.join(directory, "dy_%d.bf16" % T), torch.bfloat16, (-1, T, H)) if with_dy else None
    n = ids.shape[0]
    return [(ids[i].contiguous(), rw[i].contiguous(), x[i].contiguous(),
             dy[i].contiguous() if with_dy else None) for i in range(n)]


class KtKernelMoE:
    """kt-kernel's MoE of one variant on the layer kt_bench wrote."""

    def __init__(self, c):
        moe = ktk.moe
        self.dir, self.E, self.k = c["dir"], int(c["experts"]), int(c["top_k"])
        self.H, self.I = int(c["hidden"]), int(c["intermediate"])
        variant = c["variant"]
        E, H, I = self.E, self.H, self.I
        if variant == "bf16":
            cls_name = "AMXBF16_MOE" if getattr(moe, "AMXBF16_MOE", None) else "AVX2BF16_MOE"
        elif variant == "int8":
            cls_name = "AMXInt8_MOE"
        elif variant == "int4":
            cls_name = "AMXInt4_MOE"
        else:
            raise ValueError("unknown variant " + variant)
        cls = getattr(moe, cls_name, None)
        if cls is None:
            have = sorted(n for n in dir(moe) if n.endswith("_MOE"))
            raise LookupError("this build (%s variant) has no %s (its %s path with its own quantization "
                              "from bf16); its MoE classes: %s" % (HELLO.get("kt_kernel_variant"), cls_name,
                                                                    variant, ", ".join(have)))
        self.cls_name = cls_name
        self.save_path = None
        self.gate = read_tensor(os.path.join(self.dir, "gate.bf16"), torch.bfloat16, (E, I, H))
        self.up = read_tensor(os.path.join(self.dir, "up.bf16"), torch.bfloat16, (E, I, H))
        self.down = read_tensor(os.path.join(self.dir, "down.bf16"), torch.bfloat16, (E, H, I))
        self.mask = torch.zeros(E, dtype=torch.bool)  # no expert on a GPU
        cfg = moe.MOEConfig(E, self.k, H, I, self.mask.data_ptr())
        cfg.layer_idx = 0
        cfg.pool = cpu_infer().backend_
        # Its AMX int8/int4 buffers need a multiple of their M_STEP.
        cfg.max_len = aligned_max_len(int(c["max_tokens"]))
        if variant == "bf16":
            # The native wrapper's per-expert pointers; bf16 has no scales.
            cfg.gate_projs = [[self.gate[e].data_ptr() for e in range(E)]]
            cfg.up_projs = [[self.up[e].data_ptr() for e in range(E)]]
            cfg.down_projs = [[self.down[e].data_ptr() for e in range(E)]]
            cfg.gate_scales = [[0] * E]
            cfg.up_scales = [[0] * E]
            cfg.down_scales = [[0] * E]
        else:
            # AMXMoEWrapper.load_weights_from_tensors: online quantization.
            cfg.save = True
            cfg.load = False
            cfg.gate_proj = self.gate.data_ptr()
            cfg.up_proj = self.up.data_ptr()
            cfg.down_proj = self.down.data_ptr()
            # Where it writes what it quantized; removed with the layer.
            self.save_path = os.path.join(self.dir, "ktk_" + variant)
            cfg.path = self.save_path
        self.moe = cls(cfg)
        self.cfg = cfg
        self.p2l = torch.arange(E, dtype=torch.long)
        start = time.perf_counter()
        cpu_infer().submit(self.moe.load_weights_task(self.p2l.data_ptr()))
        cpu_infer().sync()
        self.load_s = time.perf_counter() - start
        self.batches = {}

    def batch(self, T, b):
        if T not in self.batches:
            self.batches[T] = (read_batches(self.dir, T, self.k, self.H, False),
                               torch.zeros(T, self.H, dtype=torch.bfloat16), torch.tensor([T], dtype=torch.int32))
        batches, out, bsz = self.batches[T]
        ids, rw, x, _ = batches[b % len(batches)]
        return ids, rw, x, out, bsz

    def call(self, T, b):
        ids, rw, x, out, bsz = self.batch(T, b)
        ci = cpu_infer()
        start = time.perf_counter()
        ci.submit(self.moe.forward_task(bsz.data_ptr(), self.k, ids.data_ptr(), rw.data_ptr(), x.data_ptr(),
                                        out.data_ptr(), False))
        ci.sync()
        return time.perf_counter() - start, out


class VllmMoE:
    """vLLM's CPU fused MoE (the op of vllm_experts, with its isa) on the
    layer kt_bench wrote, the weights prepared as its
    process_weights_after_loading prepares them."""

    def __init__(self, c):
        if c["variant"] != "bf16":
            raise LookupError("vLLM's unquantized CPU experts run bf16 weights only, not " + c["variant"])
        self.dir, E, self.k = c["dir"], int(c["experts"]), int(c["top_k"])
        H, I = int(c["hidden"]), int(c["intermediate"])
        self.H = H
        cls = vllm_experts
        if H % cls.output_alignment or H % cls.reduction_alignment:
            raise LookupError("%s needs a hidden size that is a multiple of %d and %d, not %d"
                              % (cls.__name__, cls.output_alignment, cls.reduction_alignment, H))
        self.cls_name, self.isa, self.save_path = HELLO["vllm_class"], cls.isa, None
        align = cls._intermediate_alignment()
        padded = (I + align - 1) // align * align
        gate = read_tensor(os.path.join(self.dir, "gate.bf16"), torch.bfloat16, (E, I, H))
        up = read_tensor(os.path.join(self.dir, "up.bf16"), torch.bfloat16, (E, I, H))
        down = read_tensor(os.path.join(self.dir, "down.bf16"), torch.bfloat16, (E, H, I))
        start = time.perf_counter()
        w13 = torch.zeros(E, 2 * padded, H, dtype=torch.bfloat16)
        w13[:, :I] = gate
        w13[:, padded:padded + I] = up
        w2 = torch.zeros(E, H, padded, dtype=torch.bfloat16)
        w2[:, :, :I] = down
        del gate, up, down
        self.w13 = vllm_ops.cpu_prepack_moe_weight(w13, self.isa)
        del w13
        self.w2 = vllm_ops.cpu_prepack_moe_weight(w2, self.isa)
        self.load_s = time.perf_counter() - start
        self.activation = MoEActivation.SILU.value
        self.batches = {}

    def batch(self, T, b):
        if T not in self.batches:
            routed = []
            for ids, rw, x, _ in read_batches(self.dir, T, self.k, self.H, False):
                dropped = ids < 0  # outside a slice: expert 0 with weight 0 (see the header)
                routed.append((ids.masked_fill(dropped, 0).to(torch.int32).contiguous(),
                               rw.masked_fill(dropped, 0.0).contiguous(), x))
            self.batches[T] = (routed, torch.zeros(T, self.H, dtype=torch.bfloat16))
        routed, out = self.batches[T]
        ids, rw, x = routed[b % len(routed)]
        return ids, rw, x, out

    def call(self, T, b):
        ids, rw, x, out = self.batch(T, b)
        start = time.perf_counter()
        vllm_ops.cpu_fused_moe(out, x, self.w13, self.w2, None, None, rw, ids, self.activation, self.isa, False)
        return time.perf_counter() - start, out


class KtKernelSFT:
    """kt-kernel's bf16 SFT MoE on the layer kt_bench wrote: with LoRA
    (case train_lora) or frozen-base dx only (train_dx, SkipLoRA)."""

    def __init__(self, c):
        moe = ktk.moe
        self.dir, self.E, self.k = c["dir"], int(c["experts"]), int(c["top_k"])
        self.H, self.I = int(c["hidden"]), int(c["intermediate"])
        self.lora = c["case"] == "train_lora"
        if c["case"] not in ("train_lora", "train_dx"):
            raise ValueError("unknown case " + c["case"])
        if "kt_kernel_sft" not in HELLO:
            raise LookupError(HELLO.get("kt_kernel_%s_reason" % c["case"], "no AMX SFT classes"))
        E, H, I = self.E, self.H, self.I
        self.cls_name = "AMXBF16_SFT_MOE" if self.lora else "AMXBF16_SFT_MOE_SkipLoRA"
        self.gate = read_tensor(os.path.join(self.dir, "gate.bf16"), torch.bfloat16, (E, I, H))
        self.up = read_tensor(os.path.join(self.dir, "up.bf16"), torch.bfloat16, (E, I, H))
        self.down = read_tensor(os.path.join(self.dir, "down.bf16"), torch.bfloat16, (E, H, I))
        self.p2l = torch.arange(E, dtype=torch.int64)
        cfg = moe.MOESFTConfig()
        cfg.expert_num = E
        cfg.num_experts_per_tok = self.k
        cfg.hidden_size = H
        cfg.intermediate_size = I
        cfg.lora_rank = int(c.get("lora_rank", 16))
        cfg.lora_alpha = float(c.get("lora_alpha", 32.0))
        cfg.lora_dropout = 0.0
        cfg.max_cache_depth = 1
        cfg.max_len = aligned_max_len(int(c["max_tokens"]))
        cfg.layer_idx = 0
        cfg.full_weight_grad = False
        cfg.authoritative_optimizer_grads = self.lora
        cfg.physical_to_logical_map = self.p2l.data_ptr()
        cfg.gate_proj = self.gate.data_ptr()
        cfg.up_proj = self.up.data_ptr()
        cfg.down_proj = self.down.data_ptr()
        self.factors, self.grads = [], []
        if self.lora:
            r = cfg.lora_rank
            for p, (n_in, n_out) in (("gate", (H, I)), ("up", (H, I)), ("down", (I, H))):
                a = read_tensor(os.path.join(self.dir, "lora_%s_a.bf16" % p), torch.bfloat16, (E, r, n_in))
                b = read_tensor(os.path.join(self.dir, "lora_%s_b.bf16" % p), torch.bfloat16, (E, n_out, r))
                self.factors += [a, b]
                self.grads += [torch.zeros_like(a), torch.zeros_like(b)]
            (cfg.gate_lora_a, cfg.gate_lora_b, cfg.up_lora_a, cfg.up_lora_b, cfg.down_lora_a,
             cfg.down_lora_b) = [t.data_ptr() for t in self.factors]
        cfg.pool = cpu_infer().backend_
        self.cfg = cfg
        self.moe = getattr(moe, self.cls_name)(cfg)
        start = time.perf_counter()
        cpu_infer().submit(self.moe.load_weights_task())
        cpu_infer().sync()
        self.load_s = time.perf_counter() - start
        self.batches = {}

    def call(self, T, b):
        """One training step's forward (saving for backward) and backward."""
        if T not in self.batches:
            self.batches[T] = (read_batches(self.dir, T, self.k, self.H, True),
                               torch.zeros(T, self.H, dtype=torch.bfloat16),
                               torch.zeros(T, self.H, dtype=torch.bfloat16),
                               torch.zeros(T, self.k, dtype=torch.float32),
                               torch.tensor([T], dtype=torch.int32))
        batches, y, dx, droute, bsz = self.batches[T]
        ids, rw, x, dy = batches[b % len(batches)]
        ci = cpu_infer()
        start = time.perf_counter()
        ci.submit(self.moe.forward_sft_task(bsz.data_ptr(), self.k, ids.data_ptr(), rw.data_ptr(), x.data_ptr(),
                                            y.data_ptr(), True))
        ci.sync()
        if self.lora:
            task = self.moe.backward_task(dy.data_ptr(), dx.data_ptr(), *[g.data_ptr() for g in self.grads],
                                          droute.data_ptr(), 0, 0, 0, False, 1.0)
        else:
            task = self.moe.backward_task(dy.data_ptr(), dx.data_ptr(), 0, 0, 0, 0, 0, 0, droute.data_ptr(), 0, 0, 0)
        ci.submit(task)
        ci.sync()
        return time.perf_counter() - start, dx


# ---------------------------------------------------------------- DeepSpeed

def deepspeed_build_flags():
    """The flags DeepSpeed's JIT build compiled cpu_adam with (build.ninja
    torch's extension loader left)."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    for root, _, files in os.walk(base):
        if os.path.basename(root) == "cpu_adam" and "build.ninja" in files:
            with open(os.path.join(root, "build.ninja")) as f:
                text = f.read()
            return " ".join(x for x in ("-O3", "-march=native", "-fopenmp", "-D__AVX512__", "-D__AVX256__")
                            if x in text)
    return "unknown flags"


class DeepSpeedAdam:
    def __init__(self, c):
        self.params = []
        for i in range(int(c["count"])):
            shape = tuple(int(d) for d in c["shape_%d" % i].split("x"))
            p = torch.nn.Parameter(read_tensor(os.path.join(c["dir"], "p_%d.f32" % i), torch.float32, shape))
            p.grad = read_tensor(os.path.join(c["dir"], "g_%d.f32" % i), torch.float32, shape)
            self.params.append(p)
        self.opt = ds_adam(self.params, lr=float(c["lr"]), betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=float(c["wd"]), adamw_mode=True, bias_correction=True,
                           fp32_optimizer_states=True)

    def step(self):
        start = time.perf_counter()
        self.opt.step()
        return time.perf_counter() - start


# ---------------------------------------------------------------- loop

def moe_key(c):
    """A forward MoE held by the loop: its peer and variant."""
    return c.get("peer", "kt-kernel") + "/" + c["variant"]


def main():
    reply(HELLO)
    moes, adam = {}, None
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            c = json.loads(line)
        except json.JSONDecodeError as e:
            reply({"error": "not JSON: " + str(e)})
            continue
        cmd = c.get("cmd")
        try:
            if cmd == "quit":
                reply({"ok": 1})
                break
            if cmd == "moe_load":
                peer = c.get("peer", "kt-kernel")
                moe_class, loaded, why = {
                    "kt-kernel": (KtKernelMoE, ktk is not None, HELLO.get("kt_kernel_reason", "kt-kernel not loaded")),
                    "vllm": (VllmMoE, vllm_experts is not None, HELLO.get("vllm_reason", "vLLM not loaded")),
                }[peer]
                if not loaded:
                    reply({"reason": why})
                    continue
                try:
                    m = moe_class(c)
                except (LookupError, RuntimeError, ValueError, MemoryError, OSError) as e:
                    reply({"reason": first_line(e)})
                    continue
                moes[moe_key(c)] = m
                reply({"ok": 1, "class": m.cls_name, "load_s": m.load_s})
            elif cmd == "moe_call":
                s, _ = moes[moe_key(c)].call(int(c["T"]), int(c["batch"]))
                reply({"s": s})
            elif cmd == "moe_output":
                _, out = moes[moe_key(c)].call(int(c["T"]), int(c["batch"]))
                out[: int(c["rows"])].float().numpy().tofile(c["path"])
                reply({"ok": 1})
            elif cmd == "moe_free":
                m = moes.pop(moe_key(c), None)
                if m is not None and m.save_path:
                    shutil.rmtree(m.save_path, ignore_errors=True)
                reply({"ok": 1})
            elif cmd == "sft_load":
                if ktk is None:
                    reply({"reason": HELLO.get("kt_kernel_reason", "kt-kernel not loaded")})
                    continue
                try:
                    m = KtKernelSFT(c)
                except (LookupError, RuntimeError, ValueError, MemoryError, OSError) as e:
                    reply({"reason": first_line(e)})
                    continue
                moes[c["case"]] = m
                reply({"ok": 1, "class": m.cls_name, "load_s": m.load_s})
            elif cmd == "sft_call":
                s, _ = moes[c["case"]].call(int(c["T"]), int(c["batch"]))
                reply({"s": s})
            elif cmd == "sft_output":
                _, dx = moes[c["case"]].call(int(c["T"]), int(c["batch"]))
                dx[: int(c["rows"])].float().numpy().tofile(c["path"])
                reply({"ok": 1})
            elif cmd == "sft_free":
                moes.pop(c["case"], None)
                reply({"ok": 1})
            elif cmd == "adam_load":
                if ds_adam is None:
                    reply({"reason": HELLO.get("deepspeed_reason", "deepspeed not loaded")})
                    continue
                try:
                    adam = DeepSpeedAdam(c)
                    adam.step()  # builds or loads the op, outside any timing
                except Exception as e:  # noqa: BLE001 - a machine that cannot build the op
                    adam = None
                    reply({"reason": first_line(e)})
                    continue
                reply({"ok": 1, "build_flags": deepspeed_build_flags()})
            elif cmd == "adam_step":
                reply({"s": adam.step()})
            elif cmd == "adam_free":
                adam = None
                reply({"ok": 1})
            else:
                reply({"error": "unknown command %r" % cmd})
        except Exception as e:  # noqa: BLE001 - reported to kt_bench, which stops using the peer
            reply({"error": first_line(e)})


if __name__ == "__main__":
    main()
