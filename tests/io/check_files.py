"""An independent reader of kt's checkpoint files, in plain Python (json + struct).

  check_files.py KT_BINARY C99_WORK_DIR

1. Builds a sharded Qwen3-MoE-style checkpoint here (its own safetensors writer),
   runs `kt-moe info --json` on it and checks the reported layers, experts, shapes,
   dtypes and byte counts.
2. Reads the checkpoint and the PEFT adapter that the C99 host test wrote with
   kt's writers, validates every header the way the format defines it, and
   compares every tensor value with the formula that host used.
3. Runs `kt-moe demo --json` and checks its self-comparison.
"""
import json
import os
import struct
import subprocess
import sys
import tempfile

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)


def value(layer, e, p, r, c):
    return float(((layer * 5 + e * 7 + p * 11 + r * 3 + c) % 17) - 8) / 8.0


def bf16_bits(v):
    """Bits of a value exact in bf16 (the formula's values are)."""
    (u,) = struct.unpack("<I", struct.pack("<f", v))
    assert u & 0xFFFF == 0
    return u >> 16


def write_safetensors(path, tensors):
    """tensors: list of (name, dtype, shape, bytes); contiguous data area."""
    header, offset = {}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, _, data in tensors:
            f.write(data)


SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1}


def read_safetensors(path):
    """Returns {name: (dtype, shape, bytes)}, checking the header strictly."""
    with open(path, "rb") as f:
        blob = f.read()
    check(len(blob) >= 8, f"{path}: shorter than 8 bytes")
    (n,) = struct.unpack("<Q", blob[:8])
    check(8 + n <= len(blob), f"{path}: header length past the file")
    header = json.loads(blob[8 : 8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    check(meta.get("format") == "pt", f"{path}: __metadata__.format is {meta.get('format')!r}, transformers wants 'pt'")
    data = blob[8 + n :]
    spans, out = [], {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        count = 1
        for d in entry["shape"]:
            count *= d
        check(end - begin == count * SIZES[entry["dtype"]], f"{path}: {name}: byte size disagrees with dtype/shape")
        check(begin % SIZES[entry["dtype"]] == 0 and (8 + n) % 8 == 0, f"{path}: {name}: not aligned")
        spans.append((begin, end, name))
        out[name] = (entry["dtype"], entry["shape"], data[begin:end])
    spans.sort()
    pos = 0
    for begin, end, name in spans:  # the reference reader wants a contiguous data area
        check(begin == pos, f"{path}: {name} starts at {begin}, expected {pos} (gap or overlap)")
        pos = end
    check(pos == len(data), f"{path}: data area has {len(data) - pos} trailing bytes")
    return out


def run_json(args):
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    check(res.returncode == 0, f"{' '.join(args)} exited {res.returncode}: {res.stderr}{res.stdout}")
    try:
        return json.loads(res.stdout)
    except json.JSONDecodeError as e:
        failures.append(f"{' '.join(args)}: output is not JSON ({e}): {res.stdout[:500]}")
        return {}


def check_kt_info(kt):
    E, H, I = 6, 64, 32
    with tempfile.TemporaryDirectory() as d:
        shards = {1: [], 2: []}
        for layer in (1, 3):
            for e in range(E):
                for p, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
                    rows, cols = (H, I) if p == 2 else (I, H)
                    data = b"".join(
                        struct.pack("<H", bf16_bits(value(layer, e, p, r, c))) for r in range(rows) for c in range(cols)
                    )
                    name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                    shards[1 if layer == 1 else 2].append((name, "BF16", [rows, cols], data))
            shards[1 if layer == 1 else 2].append(
                (f"model.layers.{layer}.mlp.gate.weight", "BF16", [E, H], b"\0\0" * E * H)
            )
        shards[1].append(("model.embed_tokens.weight", "F32", [10, H], b"\0" * 4 * 10 * H))
        weight_map = {}
        for i, ts in shards.items():
            fname = f"model-0000{i}-of-00002.safetensors"
            write_safetensors(os.path.join(d, fname), ts)
            weight_map.update({t[0]: fname for t in ts})
        with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
                       "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": 4}, f)
        info = run_json([kt, "info", "--json", d])
        n_tensors = len(weight_map)
        expert_bytes = 2 * E * 3 * I * H * 2
        total = expert_bytes + 2 * E * H * 2 + 4 * 10 * H
        want = {"ok": True, "architecture": "Qwen3MoeForCausalLM", "layout": "per_expert", "files": 2,
                "tensors": n_tensors, "bytes": total, "top_k": 4, "moe_layers": 2, "routed_experts": 2 * E,
                "expert_bytes": expert_bytes}
        for k, v in want.items():
            check(info.get(k) == v, f"kt-moe info: {k} = {info.get(k)!r}, expected {v!r}")
        layers = info.get("layers", [])
        check([l["layer"] for l in layers] == [1, 3], f"kt-moe info: layers {layers}")
        for l in layers:
            check((l["experts"], l["hidden"], l["intermediate"], l["dtype"], l["format"], l["loadable"])
                  == (E, H, I, "BF16", "dense", True), f"kt-moe info: layer entry {l}")
        check(info.get("dtypes", {}).get("BF16", {}).get("tensors") == n_tensors - 1, f"kt-moe info: dtypes {info.get('dtypes')}")
        # A broken checkpoint: kt-moe info fails with a JSON error naming the file.
        with open(os.path.join(d, "model-00002-of-00002.safetensors"), "r+b") as f:
            f.truncate(100)
        res = subprocess.run([kt, "info", "--json", d], capture_output=True, text=True, timeout=60)
        check(res.returncode != 0, "kt-moe info on a truncated shard succeeded")
        err = json.loads(res.stdout) if res.stdout.strip() else {}
        check(err.get("ok") is False and err.get("status") == "KT_ERR_IO"
              and "model-00002-of-00002.safetensors" in err.get("error", ""), f"kt-moe info error: {res.stdout}")


def check_c99_files(work):
    """The C99 host wrote E=2, H=16, I=16 experts of layer 0 (bf16) and a
    rank-2 gate adapter of layer 3 (fp32)."""
    E, H, I, R = 2, 16, 16, 2
    ckpt = os.path.join(work, "ckpt")
    single = os.path.join(ckpt, "model.safetensors")
    check(os.path.exists(single), f"{single} missing")
    tensors = read_safetensors(single)
    check(len(tensors) == 3 * E, f"{single}: {len(tensors)} tensors")
    for e in range(E):
        for p, proj in enumerate(("gate_proj", "up_proj", "down_proj")):
            name = f"model.layers.0.mlp.experts.{e}.{proj}.weight"
            dtype, shape, data = tensors.get(name, (None, None, b""))
            rows, cols = (H, I) if p == 2 else (I, H)
            check(dtype == "BF16" and shape == [rows, cols], f"{name}: {dtype} {shape}")
            got = struct.unpack(f"<{rows * cols}H", data) if len(data) == rows * cols * 2 else ()
            want = tuple(bf16_bits(value(0, e, p, r, c)) for r in range(rows) for c in range(cols))
            check(got == want, f"{name}: values differ from what the host wrote")
    with open(os.path.join(ckpt, "config.json")) as f:
        check(json.load(f).get("model_type") == "qwen3_moe", "config.json not written as given")

    adapter = os.path.join(work, "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        cfg = json.load(f)
    for k, v in {"peft_type": "LORA", "r": R, "lora_alpha": 4.0, "use_rslora": False, "bias": "none"}.items():
        check(cfg.get(k) == v, f"adapter_config.json: {k} = {cfg.get(k)!r}, expected {v!r}")
    import re

    check(re.fullmatch(cfg["target_modules"], "model.layers.3.mlp.experts.1.gate_proj") is not None,
          f"target_modules {cfg['target_modules']!r} does not match the expert gate")
    check(re.fullmatch(cfg["target_modules"], "model.layers.3.mlp.gate_proj") is None,
          "target_modules also matches a dense MLP")
    tensors = read_safetensors(os.path.join(adapter, "adapter_model.safetensors"))
    check(len(tensors) == 2 * E, f"adapter: {len(tensors)} tensors")
    f037 = struct.unpack("<f", struct.pack("<f", 0.37))[0]
    f011 = struct.unpack("<f", struct.pack("<f", 0.11))[0]
    for e in range(E):
        key = f"base_model.model.model.layers.3.mlp.experts.{e}.gate_proj"
        dtype, shape, data = tensors.get(key + ".lora_A.weight", (None, None, b""))
        check(dtype == "F32" and shape == [R, H], f"{key}.lora_A.weight: {dtype} {shape}")
        want = struct.pack(f"<{R * H}f", *[value(0, e, 5, r, c) * f037 for r in range(R) for c in range(H)])
        check(data == want, f"{key}.lora_A.weight: values differ")
        dtype, shape, data = tensors.get(key + ".lora_B.weight", (None, None, b""))
        check(dtype == "F32" and shape == [I, R], f"{key}.lora_B.weight: {dtype} {shape}")
        want = struct.pack(f"<{I * R}f", *[value(0, e, 6, c, r) * f011 for c in range(I) for r in range(R)])
        check(data == want, f"{key}.lora_B.weight: values differ")


def check_demo(kt):
    out = run_json([kt, "demo", "--json"])
    check(out.get("ok") is True, f"kt-moe demo: {out}")
    check(out.get("max_abs_diff_vs_tensors") == 0, f"kt-moe demo: difference {out.get('max_abs_diff_vs_tensors')}")
    check(out.get("y_norm", 0) > 0 and len(out.get("token_norms", [])) == out.get("tokens"), f"kt-moe demo: {out}")
    check(out.get("files") == 2 and out.get("tensors") == 2 * 8 * 3, f"kt-moe demo: files/tensors {out}")
    check(not os.path.exists(out.get("checkpoint", "/nonexistent")), "kt-moe demo left its temporary checkpoint")


def main():
    kt, work = sys.argv[1], sys.argv[2]
    check_kt_info(kt)
    check_c99_files(work)
    check_demo(kt)
    if failures:
        print("\n".join(failures))
        sys.exit(1)
    print("independent reader: kt-moe info, kt-written checkpoint and adapter, kt-moe demo all as expected")


if __name__ == "__main__":
    main()
