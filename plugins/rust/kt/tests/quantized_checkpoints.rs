//! Quantized checkpoints through the safe binding: an fp8 checkpoint
//! (128x128 blocks), a DeepSeek-V4 style MXFP4 one and an asymmetric
//! compressed-tensors int4 one (zero points), written here as their models
//! store them, report the format that holds each layer as stored (the int4
//! layer holds exactly (q - z) * scale of its bits); the layer loaded in
//! that format saves a packed cache that `packed_info` reports in the same
//! format, maps back with the same weights and output, and is refused
//! (naming both formats) by a bf16 layer. A bf16 layer takes a quantized
//! layer only through `load_layer_with(.., &LoadLayerOptions { dequantize:
//! true })`, and then holds the weights decoded here from the checkpoint's
//! bytes, rounded to bf16; a layer of another quantized format never does.
use kt::{
    arg, Arg, Checkpoint, Engine, EngineOptions, LoadLayerOptions, Moe, Status, TensorMut, TensorRef, WeightFormat,
};

const E: usize = 3;
const K: usize = 2;
const H: usize = 160;
const I: usize = 96;
const T: usize = 5;

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("kt-rust-quant-{}-{}", name, std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Deterministic bytes (an LCG).
fn bytes(n: usize, seed: u64, f: impl Fn(u8) -> u8) -> Vec<u8> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            f((s >> 33) as u8)
        })
        .collect()
}

/// A safetensors file: u64 header length, JSON header, the tensors' bytes.
fn write_safetensors(path: &std::path::Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = String::from("{");
    let mut offset = 0;
    for (i, (name, dtype, shape, data)) in tensors.iter().enumerate() {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        header += &format!(
            "{}\"{}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
            if i > 0 { "," } else { "" },
            name,
            dtype,
            dims.join(","),
            offset,
            offset + data.len()
        );
        offset += data.len();
    }
    header += "}";
    while header.len() % 8 != 0 {
        header.push(' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    for t in tensors {
        out.extend_from_slice(&t.3);
    }
    std::fs::write(path, out).unwrap();
}

/// (out, in) of gate, up, down.
const SHAPES: [(usize, usize); 3] = [(I, H), (I, H), (H, I)];

/// DeepSeek-V3: weight F8_E4M3 [out, in] (exponent fields <= 9: no NaN),
/// weight_scale_inv F32 [ceil(out/128), ceil(in/128)]. Layer 1.
fn fp8_checkpoint(dir: &std::path::Path) -> i64 {
    let mut tensors = Vec::new();
    for e in 0..E {
        for (p, (name, (out, inp))) in ["gate_proj", "up_proj", "down_proj"].iter().zip(SHAPES).enumerate() {
            let base = format!("model.layers.1.mlp.experts.{}.{}", e, name);
            let seed = (e * 3 + p) as u64;
            let codes = bytes(out * inp, seed, |b| (b & 0x87) | ((b >> 3) % 10) << 3);
            let (rows, cols) = ((out + 127) / 128, (inp + 127) / 128);
            let scales: Vec<u8> = (0..rows * cols)
                .flat_map(|i| ((1.0 + i as f32 / 8.0) / (8.0 * (inp as f32).sqrt())).to_le_bytes())
                .collect();
            tensors.push((base.clone() + ".weight", "F8_E4M3", vec![out, inp], codes));
            tensors.push((base + ".weight_scale_inv", "F32", vec![rows, cols], scales));
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    std::fs::write(
        dir.join("config.json"),
        format!(
            "{{\"num_experts_per_tok\": {}, \"quantization_config\": {{\"quant_method\": \"fp8\", \"fmt\": \
             \"e4m3\", \"activation_scheme\": \"dynamic\", \"weight_block_size\": [128, 128]}}}}",
            K
        ),
    )
    .unwrap();
    1
}

/// DeepSeek-V4 style: weight U8 [out, in/2] (two e2m1 codes a byte),
/// scale F8_E8M0 [out, ceil(in/32)] near 2^-4. Layer 2.
fn mxfp4_checkpoint(dir: &std::path::Path) -> i64 {
    let mut tensors = Vec::new();
    for e in 0..E {
        for (p, (name, (out, inp))) in ["w1", "w3", "w2"].iter().zip(SHAPES).enumerate() {
            let base = format!("layers.2.ffn.experts.{}.{}", e, name);
            let seed = 100 + (e * 3 + p) as u64;
            tensors.push((
                base.clone() + ".weight",
                "U8",
                vec![out, inp / 2],
                bytes(out * inp / 2, seed, |b| b),
            ));
            let groups = (inp + 31) / 32;
            tensors.push((
                base + ".scale",
                "F8_E8M0",
                vec![out, groups],
                bytes(out * groups, seed + 50, |b| 121 + b % 5),
            ));
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    std::fs::write(
        dir.join("config.json"),
        format!(
            "{{\"num_experts_per_tok\": {}, \"quantization_config\": {{\"quant_method\": \"mxfp4\"}}}}",
            K
        ),
    )
    .unwrap();
    2
}

/// compressed-tensors pack-quantized int4, asymmetric: weight_packed I32
/// [out, in/8] (element c in bits 4 (c % 8) of word c / 8, q + 8),
/// weight_scale BF16 [out, in/32], weight_zero_point I32 [ceil(out/8),
/// in/32] (row r in bits 4 (r % 8), z + 8), weight_shape. Layer 3.
fn int4_zp_checkpoint(dir: &std::path::Path) -> i64 {
    let mut tensors = Vec::new();
    for e in 0..E {
        for (p, (name, (out, inp))) in ["gate_proj", "up_proj", "down_proj"].iter().zip(SHAPES).enumerate() {
            let base = format!("model.layers.3.mlp.experts.{}.{}", e, name);
            let seed = 200 + (e * 3 + p) as u64;
            let groups = inp / 32;
            // bf16 scales 2^-6 .. 2^-5 (bits 0x3c80 + m).
            let scales: Vec<u8> = bytes(out * groups, seed + 50, |b| b & 0x7f)
                .iter()
                .flat_map(|&m| (0x3c80u16 + m as u16).to_le_bytes())
                .collect();
            let zero_words = (out + 7) / 8 * groups;
            tensors.push((base.clone() + ".weight_packed", "I32", vec![out, inp / 8], bytes(out * inp / 2, seed, |b| b)));
            tensors.push((base.clone() + ".weight_scale", "BF16", vec![out, groups], scales));
            tensors.push((
                base.clone() + ".weight_zero_point",
                "I32",
                vec![(out + 7) / 8, groups],
                bytes(zero_words * 4, seed + 90, |b| b),
            ));
            let shape: Vec<u8> = [out as i64, inp as i64].iter().flat_map(|v| v.to_le_bytes()).collect();
            tensors.push((base + ".weight_shape", "I64", vec![2], shape));
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    std::fs::write(
        dir.join("config.json"),
        format!(
            "{{\"num_experts_per_tok\": {}, \"quantization_config\": {{\"quant_method\": \"compressed-tensors\", \
             \"format\": \"pack-quantized\", \"config_groups\": {{\"group_0\": {{\"targets\": [\"Linear\"], \
             \"weights\": {{\"num_bits\": 4, \"type\": \"int\", \"strategy\": \"group\", \"group_size\": 32, \
             \"symmetric\": false}}}}}}}}}}",
            K
        ),
    )
    .unwrap();
    3
}

/// The weights of int4_zp_checkpoint decoded here from its bytes, gate, up,
/// down [E][out][in]: (q - z) * scale.
fn int4_zp_weights() -> Vec<f32> {
    let nibble = |b: &[u8], word: usize, i: usize| ((b[word * 4 + i / 2] >> (4 * (i % 2))) & 15) as i32;
    let mut all = vec![Vec::new(), Vec::new(), Vec::new()];
    for e in 0..E {
        for (p, (out, inp)) in SHAPES.iter().copied().enumerate() {
            let seed = 200 + (e * 3 + p) as u64;
            let groups = inp / 32;
            let codes = bytes(out * inp / 2, seed, |b| b);
            let scale_bits = bytes(out * groups, seed + 50, |b| b & 0x7f);
            let zeros = bytes((out + 7) / 8 * groups * 4, seed + 90, |b| b);
            for r in 0..out {
                for c in 0..inp {
                    let q = nibble(&codes, r * inp / 8 + c / 8, c % 8);
                    let z = nibble(&zeros, (r / 8) * groups + c / 32, r % 8);
                    let s = f32::from_bits(((0x3c80u32 + scale_bits[r * groups + c / 32] as u32) << 16) as u32);
                    all[p].push((q - z) as f32 * s);
                }
            }
        }
    }
    all.concat()
}

fn forward(moe: &Moe<'_>) -> Vec<f32> {
    let x: Vec<f32> = (0..T * H).map(|i| (i % 13) as f32 / 8.0 - 0.7).collect();
    let ids: Vec<i32> = (0..T * K).map(|i| ((i * 2 + i / K) % E) as i32).collect();
    let rw: Vec<f32> = (0..T * K).map(|i| if i % K == 0 { 0.75 } else { 0.25 }).collect();
    let mut y = vec![0.0f32; T * H];
    let (xt, it, wt) = (
        TensorRef::new(&x, &[T as i64, H as i64]).unwrap(),
        TensorRef::new(&ids, &[T as i64, K as i64]).unwrap(),
        TensorRef::new(&rw, &[T as i64, K as i64]).unwrap(),
    );
    let mut yt = TensorMut::new(&mut y, &[T as i64, H as i64]).unwrap();
    moe.forward(&xt, &it, &wt, &mut yt).unwrap();
    y
}

fn weights(moe: &Moe<'_>) -> Vec<f32> {
    let (mut g, mut u, mut d) = (
        vec![0.0f32; E * I * H],
        vec![0.0f32; E * I * H],
        vec![0.0f32; E * H * I],
    );
    {
        let mut gt = TensorMut::new(&mut g, &[E as i64, I as i64, H as i64]).unwrap();
        let mut ut = TensorMut::new(&mut u, &[E as i64, I as i64, H as i64]).unwrap();
        let mut dt = TensorMut::new(&mut d, &[E as i64, H as i64, I as i64]).unwrap();
        moe.read_weights(&[
            Arg::Out(arg::W_GATE, &mut gt),
            Arg::Out(arg::W_UP, &mut ut),
            Arg::Out(arg::W_DOWN, &mut dt),
        ])
        .unwrap();
    }
    g.into_iter().chain(u).chain(d).collect()
}

#[test]
fn quantized_checkpoints_make_packed_caches_of_their_format() {
    let engine = Engine::new(&EngineOptions {
        num_threads: 2,
        ..Default::default()
    })
    .unwrap();
    let cases: [(&str, fn(&std::path::Path) -> i64, WeightFormat); 3] = [
        ("fp8", fp8_checkpoint, WeightFormat::Fp8B128),
        ("mxfp4", mxfp4_checkpoint, WeightFormat::Mxfp4),
        ("int4_zp", int4_zp_checkpoint, WeightFormat::Int4G32Zp),
    ];
    for (name, write, format) in cases {
        let dir = scratch(name);
        let ckpt_dir = dir.join("ckpt");
        std::fs::create_dir_all(&ckpt_dir).unwrap();
        let layer = write(&ckpt_dir);
        let ck = Checkpoint::open(&ckpt_dir).unwrap();
        let layers = ck.layers().unwrap();
        assert_eq!(layers.len(), 1);
        assert_eq!(layers[0].weight_format, Some(format), "{}", name);
        assert_eq!(
            layers[0].group_size,
            if format == WeightFormat::Fp8B128 { 128 } else { 32 }
        );
        let options = ck.moe_options(layer).unwrap().max_tokens(T as i64);
        let loaded = engine.moe(&options).unwrap();
        ck.load_layer(layer, &loaded).unwrap();
        let info = loaded.info().unwrap();
        assert_eq!(info.weight_format, format);
        if format == WeightFormat::Int4G32Zp {
            assert_eq!(format.name(), "int4_g32_zp");
            assert_eq!(weights(&loaded), int4_zp_weights(), "held natively: (q - z) * scale, exactly");
            assert!(info.weight_bytes < info.num_weights, "quantized in memory: {} bytes", info.weight_bytes);
            assert!(forward(&loaded).iter().all(|v| v.is_finite()));
        }

        let cache = dir.join("layer.ktpack");
        loaded.save_packed(&cache).unwrap();
        let p = kt::packed_info(&cache).unwrap();
        assert_eq!(p.weight_format, format, "{}", name);
        assert_eq!(
            (p.num_experts, p.num_loaded, p.hidden, p.intermediate),
            (E as i64, E as i64, H as i64, I as i64)
        );
        assert_eq!(p.weight_bytes, info.weight_bytes);
        assert_eq!(p.file_bytes, std::fs::metadata(&cache).unwrap().len() as i64);
        assert!(!p.has_bias);

        let mapped = engine.moe(&options).unwrap();
        mapped.load_packed(&cache, true).unwrap();
        assert_eq!(mapped.info().unwrap().weight_format, format);
        assert_eq!(
            weights(&mapped),
            weights(&loaded),
            "{}: the cached weights are the checkpoint's",
            name
        );
        assert_eq!(forward(&mapped), forward(&loaded), "{}", name);

        let bf16 = engine.moe(&options.weight_format(WeightFormat::Bf16)).unwrap();
        let err = bf16.load_packed(&cache, true).unwrap_err();
        assert_eq!(err.status, Status::INVALID_ARGUMENT);
        let want = format!("the cache holds {} weights, the layer stores bf16", format.name());
        assert!(err.message.contains(&want), "{}", err.message);
        assert_eq!(bf16.num_loaded().unwrap(), 0);
        drop(ck);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The value of an fp8 e4m3 code (bias 7; exponent field 0: subnormal).
fn e4m3(b: u8) -> f32 {
    let (e, m) = (((b >> 3) & 15) as i32, (b & 7) as f64);
    let v = if e == 0 { m / 8.0 * 2f64.powi(-6) } else { (1.0 + m / 8.0) * 2f64.powi(e - 7) };
    (if b & 0x80 != 0 { -v } else { v }) as f32
}

/// The weights of fp8_checkpoint decoded here from its bytes, gate, up, down
/// [E][out][in]: the f32 product code * scale of its 128x128 block.
fn fp8_weights() -> Vec<f32> {
    let mut all = vec![Vec::new(), Vec::new(), Vec::new()];
    for e in 0..E {
        for (p, (out, inp)) in SHAPES.iter().copied().enumerate() {
            let seed = (e * 3 + p) as u64;
            let codes = bytes(out * inp, seed, |b| (b & 0x87) | ((b >> 3) % 10) << 3);
            let cols = (inp + 127) / 128;
            for r in 0..out {
                for c in 0..inp {
                    let i = (r / 128) * cols + c / 128;
                    let scale = (1.0 + i as f32 / 8.0) / (8.0 * (inp as f32).sqrt());
                    all[p].push(e4m3(codes[r * inp + c]) * scale);
                }
            }
        }
    }
    all.concat()
}

/// The weights of mxfp4_checkpoint decoded here from its bytes: e2m1 code
/// (the even element in the low nibble) * 2^(scale - 127) of its 32 inputs.
fn mxfp4_weights() -> Vec<f32> {
    const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];
    let mut all = vec![Vec::new(), Vec::new(), Vec::new()];
    for e in 0..E {
        for (p, (out, inp)) in SHAPES.iter().copied().enumerate() {
            let seed = 100 + (e * 3 + p) as u64;
            let groups = (inp + 31) / 32;
            let codes = bytes(out * inp / 2, seed, |b| b);
            let scales = bytes(out * groups, seed + 50, |b| 121 + b % 5);
            for r in 0..out {
                for c in 0..inp {
                    let byte = codes[r * inp / 2 + c / 2];
                    let code = if c % 2 == 0 { byte & 15 } else { byte >> 4 };
                    let scale = 2f32.powi(scales[r * groups + c / 32] as i32 - 127);
                    all[p].push(E2M1[code as usize] * scale);
                }
            }
        }
    }
    all.concat()
}

/// Rounded to the nearest bf16, ties to even (no NaN here).
fn to_bf16(w: &[f32]) -> Vec<f32> {
    w.iter()
        .map(|v| {
            let b = v.to_bits();
            f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
        })
        .collect()
}

fn assert_same(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{}", what);
    if let Some(i) = (0..got.len()).find(|&i| got[i] != want[i]) {
        panic!("{}: weight {} is {}, want {}", what, i, got[i], want[i]);
    }
}

#[test]
fn quantized_checkpoints_load_into_bf16_only_when_dequantized() {
    let engine = Engine::new(&EngineOptions { num_threads: 2, ..Default::default() }).unwrap();
    let cases: [(&str, fn(&std::path::Path) -> i64, WeightFormat, fn() -> Vec<f32>); 3] = [
        ("fp8", fp8_checkpoint, WeightFormat::Fp8B128, fp8_weights),
        ("mxfp4", mxfp4_checkpoint, WeightFormat::Mxfp4, mxfp4_weights),
        ("int4_zp", int4_zp_checkpoint, WeightFormat::Int4G32Zp, int4_zp_weights),
    ];
    assert_eq!(LoadLayerOptions::default(), LoadLayerOptions { dequantize: false });
    for (name, write, format, decoded) in cases {
        let dir = scratch(&format!("dequantize-{}", name));
        let ckpt_dir = dir.join("ckpt");
        std::fs::create_dir_all(&ckpt_dir).unwrap();
        let layer = write(&ckpt_dir);
        let ck = Checkpoint::open(&ckpt_dir).unwrap();
        let options = ck.moe_options(layer).unwrap().max_tokens(T as i64);
        let bf16 = engine.moe(&options.weight_format(WeightFormat::Bf16)).unwrap();

        // No choice made: refused, naming the option; the layer keeps nothing.
        let refusals = [
            ("kt_ckpt_load_layer", ck.load_layer(layer, &bf16).unwrap_err()),
            ("kt_ckpt_load_layer_with", ck.load_layer_with(layer, &bf16, &LoadLayerOptions::default()).unwrap_err()),
        ];
        for (call, err) in refusals {
            assert_eq!(err.status, Status::UNSUPPORTED, "{}: {}", name, err.message);
            assert!(err.message.starts_with(&format!("{}: layer {} stores ", call, layer)), "{}", err.message);
            for part in [
                "the kt_moe stores bf16".to_string(),
                format!("create the kt_moe with weight_format {}", format.name()),
                "kt_ckpt_load_options.dequantize = 1".to_string(),
            ] {
                assert!(err.message.contains(&part), "{}: {:?} lacks {:?}", name, err.message, part);
            }
            assert_eq!(bf16.num_loaded().unwrap(), 0, "{}", name);
        }

        // Asked for: dequantized, rounded to bf16 once.
        ck.load_layer_with(layer, &bf16, &LoadLayerOptions { dequantize: true }).unwrap();
        let info = bf16.info().unwrap();
        assert_eq!((info.weight_format, info.num_loaded), (WeightFormat::Bf16, E as i64), "{}", name);
        assert_eq!(info.weight_bytes, (E * 3 * H * I * 2) as i64, "{}", name);
        let held = weights(&bf16);
        assert_same(
            &format!("{}: the bf16 layer vs the checkpoint's bytes rounded to bf16", name),
            &held,
            &to_bf16(&decoded()),
        );

        // The flag permits, never forces: a layer of the checkpoint's format loads it as stored.
        let native = engine.moe(&options).unwrap();
        ck.load_layer_with(layer, &native, &LoadLayerOptions { dequantize: true }).unwrap();
        assert_eq!(native.info().unwrap().weight_format, format, "{}", name);
        assert_same(
            &format!("{}: the bf16 layer vs the {} layer rounded", name, format.name()),
            &held,
            &to_bf16(&weights(&native)),
        );

        // Never re-quantized: another quantized format is refused with or without the flag.
        let other = engine.moe(&options.weight_format(WeightFormat::Int8Channel)).unwrap();
        for dequantize in [false, true] {
            let err = ck.load_layer_with(layer, &other, &LoadLayerOptions { dequantize }).unwrap_err();
            assert_eq!(err.status, Status::UNSUPPORTED, "{}: {}", name, err.message);
            assert!(
                err.message.contains("the kt_moe stores int8_channel: a quantized checkpoint is never re-quantized"),
                "{}: {}",
                name,
                err.message
            );
            assert_eq!(other.num_loaded().unwrap(), 0, "{}", name);
        }
        drop(ck);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
