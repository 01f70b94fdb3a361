// Synthetic quantized checkpoints as real models store them, built with the
// formats' own encoders (independently of src/io): fp8 e4m3 with 128x128
// block scales (DeepSeek-V3, Kimi-K2), compressed-tensors int4
// pack-quantized (Kimi-K2-Thinking), MXFP4 (gpt-oss fused blocks, DeepSeek-V4
// per-expert weight + scale), each with the weights its bits stand for.
// Shared by the io tests and the fuzz seed writer (no test framework here).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "st_builder.h"

namespace kt_io_test {
namespace quant {

// ---------------------------------------------------- the formats' values

// OCP E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m/8 * 2^-6); S.1111.111 is NaN.
inline double e4m3(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  const double mag = exp == 0 ? man / 8.0 * std::pow(2.0, -6) : (1.0 + man / 8.0) * std::pow(2.0, exp - 7);
  return sign ? -mag : mag;
}

// OCP E2M1: sign, 2 exponent bits (bias 1), 1 mantissa bit.
inline double e2m1(int nibble) {
  const int sign = nibble >> 3, exp = (nibble >> 1) & 3, man = nibble & 1;
  const double mag = exp == 0 ? man * 0.5 : (1.0 + man / 2.0) * std::pow(2.0, exp - 1);
  return sign ? -mag : mag;
}

// The e4m3 code nearest to v (ties to the smaller magnitude), largest
// finite 448.
inline uint8_t e4m3_nearest(double v) {
  static const std::vector<double> kMagnitudes = [] {
    std::vector<double> m;
    for (int b = 0; b < 0x7f; ++b) m.push_back(e4m3(static_cast<uint8_t>(b)));
    return m;
  }();
  const double a = std::min(std::fabs(v), 448.0);
  size_t i = static_cast<size_t>(std::lower_bound(kMagnitudes.begin(), kMagnitudes.end(), a) - kMagnitudes.begin());
  if (i == kMagnitudes.size()) i = kMagnitudes.size() - 1;
  if (i > 0 && a - kMagnitudes[i - 1] <= kMagnitudes[i] - a) --i;
  return static_cast<uint8_t>((v < 0 ? 0x80 : 0) | i);
}

inline double e8m0(uint8_t b) { return std::pow(2.0, static_cast<int>(b) - 127); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

inline std::vector<uint8_t> bf16_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> out;
  for (float f : v) kt_io_test::put(out, "BF16", f);
  return out;
}

inline std::vector<uint8_t> i32_bytes(const std::vector<uint32_t>& v) {
  std::vector<uint8_t> out(v.size() * 4);
  std::memcpy(out.data(), v.data(), out.size());
  return out;
}

// A synthetic quantized checkpoint: its tensors, its config.json and the
// weights its bits stand for ([E][out][in] per projection, biases [E][out]).
struct QuantCkpt {
  int64_t E = 0, H = 0, I = 0;
  std::vector<StTensor> tensors;
  std::string config;
  std::vector<float> w[3], b[3];
  StTensor& find(const std::string& name) {
    for (auto& t : tensors)
      if (t.name == name) return t;
    throw std::out_of_range("no tensor " + name);
  }
  void write(const std::string& dir) const {
    std::filesystem::create_directories(dir);
    kt_io_test::write_file(dir + "/model.safetensors", kt_io_test::safetensors_bytes(tensors));
    if (!config.empty()) kt_io_test::write_text(dir + "/config.json", config);
  }
};

inline int64_t out_of(const QuantCkpt& q, int p) { return p == 2 ? q.H : q.I; }
inline int64_t in_of(const QuantCkpt& q, int p) { return p == 2 ? q.I : q.H; }

inline const char* const kProj[3] = {"gate_proj", "up_proj", "down_proj"};

// DeepSeek-V3 / Kimi-K2: weight F8_E4M3 [out, in], weight_scale_inv F32
// [ceil(out/128), ceil(in/128)]. Codes of magnitude at most 7.5 (exponent
// field <= 9), scales near 1/(8 sqrt(in)).
inline QuantCkpt fp8_ckpt(int64_t L, int64_t E, int64_t H, int64_t I, uint32_t seed) {
  QuantCkpt q;
  q.E = E, q.H = H, q.I = I;
  q.config = R"({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": )" +
             std::to_string(H) + R"(, "moe_intermediate_size": )" + std::to_string(I) +
             R"(, "n_routed_experts": )" + std::to_string(E) +
             R"(, "num_experts_per_tok": 2, "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",)"
             R"( "quant_method": "fp8", "weight_block_size": [128, 128]}})";
  std::mt19937 rng(seed);
  for (int p = 0; p < 3; ++p) q.w[p].resize(static_cast<size_t>(E * out_of(q, p) * in_of(q, p)));
  for (int64_t e = 0; e < E; ++e)
    for (int p = 0; p < 3; ++p) {
      const int64_t out = out_of(q, p), in = in_of(q, p), sr = ceil_div(out, 128), sc = ceil_div(in, 128);
      // Gaussian weights as a quantizer writes them: N(0, 64^2) rounded to
      // the nearest e4m3 code (|v| < 448 but for the far tail, clamped),
      // block scales near 1/(64 sqrt(in)).
      std::vector<uint8_t> codes(static_cast<size_t>(out * in));
      for (auto& c : codes) c = e4m3_nearest(64.0 * std::normal_distribution<double>(0, 1)(rng));
      std::vector<float> scales(static_cast<size_t>(sr * sc));
      for (auto& s : scales)
        s = static_cast<float>((1.0 + 0.25 * std::uniform_real_distribution<double>(0, 1)(rng)) / (64.0 * std::sqrt(in)));
      if (e == 0 && p == 0) {
        // Hand-checked codes: 448 (largest finite), -448, the smallest
        // subnormal 2^-9, -7 * 2^-9, the smallest normal 2^-6, 1.0, +0.
        const uint8_t special[7] = {0x7e, 0xfe, 0x01, 0x87, 0x08, 0x38, 0x00};
        for (int i = 0; i < 7; ++i) codes[static_cast<size_t>(i)] = special[i];
        scales[0] = 0.5f;
      }
      for (int64_t r = 0; r < out; ++r)
        for (int64_t c = 0; c < in; ++c)
          q.w[p][static_cast<size_t>((e * out + r) * in + c)] =
              static_cast<float>(e4m3(codes[static_cast<size_t>(r * in + c)]) *
                                 static_cast<double>(scales[static_cast<size_t>((r / 128) * sc + c / 128)]));
      const std::string n = "model.layers." + std::to_string(L) + ".mlp.experts." + std::to_string(e) + "." + kProj[p];
      q.tensors.push_back({n + ".weight", "F8_E4M3", {out, in}, codes});
      q.tensors.push_back({n + ".weight_scale_inv", "F32", {sr, sc}, f32_bytes(scales)});
    }
  return q;
}

// Kimi-K2-Thinking: compressed-tensors pack-quantized int4. weight_packed
// I32 [out, ceil(in/8)] with element c in bits 4 (c % 8) of word c / 8,
// stored as q + 8; weight_scale BF16 [out, ceil(in/group)]; weight_shape
// I64 [out, in]; asymmetric: weight_zero_point I32 [ceil(out/8), groups],
// row r in bits 4 (r % 8) of word (r / 8, g), stored as z + 8.
inline QuantCkpt int4_ckpt(int64_t L, int64_t E, int64_t H, int64_t I, int64_t group, bool symmetric, uint32_t seed) {
  QuantCkpt q;
  q.E = E, q.H = H, q.I = I;
  q.config = R"({"model_type": "kimi_k2", "hidden_size": )" + std::to_string(H) +
             R"(, "moe_intermediate_size": )" + std::to_string(I) + R"(, "n_routed_experts": )" + std::to_string(E) +
             R"(, "num_experts_per_tok": 2, "quantization_config": {"quant_method": "compressed-tensors",)"
             R"( "format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights":)"
             R"( {"num_bits": 4, "type": "int", "strategy": "group", "group_size": )" +
             std::to_string(group) + R"(, "symmetric": )" + (symmetric ? "true" : "false") +
             R"(, "dynamic": false}}}, "ignore": ["lm_head"]}})";
  std::mt19937 rng(seed);
  for (int p = 0; p < 3; ++p) q.w[p].resize(static_cast<size_t>(E * out_of(q, p) * in_of(q, p)));
  for (int64_t e = 0; e < E; ++e)
    for (int p = 0; p < 3; ++p) {
      const int64_t out = out_of(q, p), in = in_of(q, p), words = ceil_div(in, 8), groups = ceil_div(in, group);
      std::vector<int> vals(static_cast<size_t>(out * in));
      for (auto& v : vals) v = static_cast<int>(rng() % 16) - 8;
      std::vector<float> scales(static_cast<size_t>(out * groups));
      for (auto& s : scales)
        s = kt::bf16_to_f32(kt::f32_to_bf16(
            static_cast<float>((1.0 + std::uniform_real_distribution<double>(0, 1)(rng)) / (4.0 * std::sqrt(in)))));
      std::vector<int> zeros(static_cast<size_t>(out * groups), 0);
      if (!symmetric)
        for (auto& z : zeros) z = static_cast<int>(rng() % 16) - 8;
      if (e == 0 && p == 0) {
        // Row 0, columns 0-7: -8 (nibble 0), 7 (nibble 15), 0, 1, -1, 3, -3, 5.
        const int special[8] = {-8, 7, 0, 1, -1, 3, -3, 5};
        for (int i = 0; i < 8; ++i) vals[static_cast<size_t>(i)] = special[i];
        scales[0] = 0.25f;
        if (!symmetric) {
          // Zero point 2 in row 0; the extremes of q - z in rows 1 and 2,
          // column 0: 7 - (-8) = 15 and -8 - 7 = -15, at scale 0.5.
          zeros[0] = 2;
          vals[static_cast<size_t>(in)] = 7;
          zeros[static_cast<size_t>(groups)] = -8;
          scales[static_cast<size_t>(groups)] = 0.5f;
          vals[static_cast<size_t>(2 * in)] = -8;
          zeros[static_cast<size_t>(2 * groups)] = 7;
          scales[static_cast<size_t>(2 * groups)] = 0.5f;
        }
      }
      std::vector<uint32_t> packed(static_cast<size_t>(out * words), 0);
      for (int64_t r = 0; r < out; ++r)
        for (int64_t c = 0; c < in; ++c) {
          const uint32_t u = static_cast<uint32_t>(vals[static_cast<size_t>(r * in + c)] + 8);
          packed[static_cast<size_t>(r * words + c / 8)] |= u << (4 * (c % 8));
          const int64_t g = c / group;
          q.w[p][static_cast<size_t>((e * out + r) * in + c)] =
              static_cast<float>((vals[static_cast<size_t>(r * in + c)] - zeros[static_cast<size_t>(r * groups + g)]) *
                                 static_cast<double>(scales[static_cast<size_t>(r * groups + g)]));
        }
      const std::string n = "model.layers." + std::to_string(L) + ".mlp.experts." + std::to_string(e) + "." + kProj[p];
      q.tensors.push_back({n + ".weight_packed", "I32", {out, words}, i32_bytes(packed)});
      q.tensors.push_back({n + ".weight_scale", "BF16", {out, groups}, bf16_bytes(scales)});
      std::vector<uint8_t> shape(16);
      std::memcpy(shape.data(), &out, 8);
      std::memcpy(shape.data() + 8, &in, 8);
      q.tensors.push_back({n + ".weight_shape", "I64", {2}, shape});
      if (!symmetric) {
        std::vector<uint32_t> zp(static_cast<size_t>(ceil_div(out, 8) * groups), 0);
        for (int64_t r = 0; r < out; ++r)
          for (int64_t g = 0; g < groups; ++g)
            zp[static_cast<size_t>((r / 8) * groups + g)] |=
                static_cast<uint32_t>(zeros[static_cast<size_t>(r * groups + g)] + 8) << (4 * (r % 8));
        q.tensors.push_back({n + ".weight_zero_point", "I32", {ceil_div(out, 8), groups}, i32_bytes(zp)});
      }
    }
  return q;
}

// MXFP4 codes of one [out, in] matrix: nibbles with the even column low,
// e8m0 scales per 32 columns near 2^-4.
struct Mx {
  std::vector<uint8_t> bytes, scales;
};
inline Mx mx_codes(int64_t out, int64_t in, std::mt19937& rng) {
  Mx m;
  m.bytes.resize(static_cast<size_t>(out * ceil_div(in, 2)));
  for (auto& b : m.bytes) b = static_cast<uint8_t>(rng());
  m.scales.resize(static_cast<size_t>(out * ceil_div(in, 32)));
  for (auto& s : m.scales) s = static_cast<uint8_t>(121 + rng() % 5);
  return m;
}
inline double mx_value(const Mx& m, int64_t in, int64_t r, int64_t c) {
  const uint8_t b = m.bytes[static_cast<size_t>(r * ceil_div(in, 2) + c / 2)];
  return e2m1(c % 2 ? b >> 4 : b & 15) * e8m0(m.scales[static_cast<size_t>(r * ceil_div(in, 32) + c / 32)]);
}

// gpt-oss: gate_up_proj_blocks U8 [E, 2I, H/32, 16] (gate rows even, up rows
// odd), _scales U8 [E, 2I, H/32], down_proj_blocks [E, H, I/32, 16],
// biases BF16 [E, 2I] (interleaved) and [E, H].
inline QuantCkpt gpt_oss_ckpt(int64_t L, int64_t E, int64_t H, int64_t I, uint32_t seed) {
  QuantCkpt q;
  q.E = E, q.H = H, q.I = I;
  q.config = R"({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "hidden_size": )" +
             std::to_string(H) + R"(, "intermediate_size": )" + std::to_string(I) +
             R"(, "num_local_experts": )" + std::to_string(E) +
             R"(, "experts_per_token": 2, "swiglu_limit": 7.0, "quantization_config": {"quant_method": "mxfp4",)"
             R"( "modules_to_not_convert": ["model.layers.*.self_attn", "model.embed_tokens", "lm_head"]}})";
  std::mt19937 rng(seed);
  std::vector<uint8_t> gub, gus, db, ds, gubias, dbias;
  for (int p = 0; p < 3; ++p) {
    q.w[p].resize(static_cast<size_t>(E * out_of(q, p) * in_of(q, p)));
    q.b[p].resize(static_cast<size_t>(E * out_of(q, p)));
  }
  for (int64_t e = 0; e < E; ++e) {
    Mx gu = mx_codes(2 * I, H, rng), d = mx_codes(H, I, rng);
    if (e == 0) {
      // Gate row 0: 0x21 = 0.5 (low nibble, column 0) then 1.0; 0xf7 = 6
      // then -6; scale 127 = 1. Up row 0 (row 1): 0x9a = -1 then -0.5,
      // scale 128 = 2.
      gu.bytes[0] = 0x21, gu.bytes[1] = 0xf7, gu.scales[0] = 127;
      gu.bytes[static_cast<size_t>(H / 2)] = 0x9a, gu.scales[static_cast<size_t>(H / 32)] = 128;
    }
    for (int64_t r = 0; r < I; ++r)
      for (int64_t c = 0; c < H; ++c) {
        q.w[0][static_cast<size_t>((e * I + r) * H + c)] = static_cast<float>(mx_value(gu, H, 2 * r, c));
        q.w[1][static_cast<size_t>((e * I + r) * H + c)] = static_cast<float>(mx_value(gu, H, 2 * r + 1, c));
      }
    for (int64_t r = 0; r < H; ++r)
      for (int64_t c = 0; c < I; ++c) q.w[2][static_cast<size_t>((e * H + r) * I + c)] = static_cast<float>(mx_value(d, I, r, c));
    gub.insert(gub.end(), gu.bytes.begin(), gu.bytes.end());
    gus.insert(gus.end(), gu.scales.begin(), gu.scales.end());
    db.insert(db.end(), d.bytes.begin(), d.bytes.end());
    ds.insert(ds.end(), d.scales.begin(), d.scales.end());
    for (int64_t j = 0; j < 2 * I; ++j) {
      const float v = kt::bf16_to_f32(kt::f32_to_bf16(static_cast<float>(std::normal_distribution<double>(0, 0.1)(rng))));
      kt_io_test::put(gubias, "BF16", v);
      q.b[j % 2][static_cast<size_t>(e * I + j / 2)] = v;
    }
    for (int64_t j = 0; j < H; ++j) {
      const float v = kt::bf16_to_f32(kt::f32_to_bf16(static_cast<float>(std::normal_distribution<double>(0, 0.1)(rng))));
      kt_io_test::put(dbias, "BF16", v);
      q.b[2][static_cast<size_t>(e * H + j)] = v;
    }
  }
  const std::string n = "model.layers." + std::to_string(L) + ".mlp.experts.";
  q.tensors.push_back({n + "gate_up_proj_blocks", "U8", {E, 2 * I, H / 32, 16}, gub});
  q.tensors.push_back({n + "gate_up_proj_scales", "U8", {E, 2 * I, H / 32}, gus});
  q.tensors.push_back({n + "gate_up_proj_bias", "BF16", {E, 2 * I}, gubias});
  q.tensors.push_back({n + "down_proj_blocks", "U8", {E, H, I / 32, 16}, db});
  q.tensors.push_back({n + "down_proj_scales", "U8", {E, H, I / 32}, ds});
  q.tensors.push_back({n + "down_proj_bias", "BF16", {E, H}, dbias});
  return q;
}

// DeepSeek-V4 style: layers.{L}.ffn.experts.{e}.{w1,w3,w2}.weight U8
// [out, in/2] and .scale F8_E8M0 [out, ceil(in/32)].
inline QuantCkpt dsv4_ckpt(int64_t L, int64_t E, int64_t H, int64_t I, uint32_t seed) {
  QuantCkpt q;
  q.E = E, q.H = H, q.I = I;
  const char* names[3] = {"w1", "w3", "w2"};
  std::mt19937 rng(seed);
  for (int p = 0; p < 3; ++p) q.w[p].resize(static_cast<size_t>(E * out_of(q, p) * in_of(q, p)));
  for (int64_t e = 0; e < E; ++e)
    for (int p = 0; p < 3; ++p) {
      const int64_t out = out_of(q, p), in = in_of(q, p);
      const Mx m = mx_codes(out, in, rng);
      for (int64_t r = 0; r < out; ++r)
        for (int64_t c = 0; c < in; ++c)
          q.w[p][static_cast<size_t>((e * out + r) * in + c)] = static_cast<float>(mx_value(m, in, r, c));
      const std::string n = "layers." + std::to_string(L) + ".ffn.experts." + std::to_string(e) + "." + names[p];
      q.tensors.push_back({n + ".weight", "U8", {out, in / 2}, m.bytes});
      q.tensors.push_back({n + ".scale", "F8_E8M0", {out, ceil_div(in, 32)}, m.scales});
    }
  return q;
}

// Per-expert biases beside the weights of a per-expert checkpoint (fp8_ckpt,
// int4_ckpt, dsv4_ckpt): "<prefix>.bias" BF16 [out] for each tensor named
// "<prefix>.<weight_key>", N(0, 0.1) rounded to bf16, into q.b. The layout's
// per-expert biases, so that swiglu_oai with biases runs on every format.
inline QuantCkpt with_expert_biases(QuantCkpt q, const std::string& weight_key, uint32_t seed) {
  std::mt19937 rng(seed);
  for (int p = 0; p < 3; ++p) q.b[p].assign(static_cast<size_t>(q.E * out_of(q, p)), 0.f);
  std::vector<StTensor> biases;
  const std::string suffix = "." + weight_key;
  for (const StTensor& t : q.tensors) {
    if (t.name.size() <= suffix.size() ||
        t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) != 0)
      continue;
    const std::string prefix = t.name.substr(0, t.name.size() - suffix.size());
    // "...experts.<e>.<projection>"
    const size_t dot = prefix.rfind('.');
    const size_t edot = prefix.rfind('.', dot - 1);
    const int64_t e = std::stoll(prefix.substr(edot + 1, dot - edot - 1));
    const std::string proj = prefix.substr(dot + 1);
    const int p = proj == "gate_proj" || proj == "w1" ? 0
                  : proj == "up_proj" || proj == "w3" ? 1
                                                      : 2;
    const int64_t out = out_of(q, p);
    std::vector<float> v(static_cast<size_t>(out));
    for (auto& x : v)
      x = kt::bf16_to_f32(
          kt::f32_to_bf16(static_cast<float>(std::normal_distribution<double>(0, 0.1)(rng))));
    std::copy(v.begin(), v.end(), q.b[p].begin() + e * out);
    biases.push_back({prefix + ".bias", "BF16", {out}, bf16_bytes(v)});
  }
  q.tensors.insert(q.tensors.end(), biases.begin(), biases.end());
  return q;
}

}  // namespace quant
}  // namespace kt_io_test
