#include "checkpoint_writer.h"

#include <stdlib.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "json_writer.h"

namespace kt_bench {

bool comes_from_checkpoint(kt_weight_format format) {
  return format == KT_FORMAT_FP8_B128 || format == KT_FORMAT_MXFP4 || asymmetric_int4(format);
}

bool asymmetric_int4(kt_weight_format format) {
  return format == KT_FORMAT_INT4_G32_ZP || format == KT_FORMAT_INT4_G128_ZP;
}

namespace {

constexpr float kE4M3Max = 448.f;
constexpr int64_t kFp8Block = 128;
constexpr int64_t kMxGroup = 32;

int64_t int4_group(kt_weight_format format) { return format == KT_FORMAT_INT4_G128_ZP ? 128 : 32; }

// The e4m3 code nearest to v, ties to the even code (round to nearest even
// in fp8), magnitudes at or above 448 saturated to 448.
uint8_t e4m3_code(float v) {
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a == 0.f) return sign;
  if (!(a < kE4M3Max)) return sign | 0x7e;
  int e;
  std::frexp(a, &e);
  // a in [2^(e-1), 2^e): exponent e-1, subnormals share the smallest normal
  // exponent -6. Codes are 2^(exp-3) apart; q counts those steps (8..16 for a
  // normal, 0..8 below 2^-6), and code ((exp + 7) << 3) + q - 8 covers both,
  // a rounding up to 16 carrying into the next exponent.
  const int exp = std::max(e - 1, -6);
  const int q = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - exp)));
  return static_cast<uint8_t>(sign | (((exp + 7) << 3) + q - 8));
}

// The e2m1 code (a nibble) nearest to v, ties to the even code, magnitudes
// above 6 saturated: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
uint8_t e2m1_code(float v) {
  const uint8_t sign = std::signbit(v) ? 8 : 0;
  const float a = std::fabs(v);
  const uint8_t m = a <= 0.25f ? 0 : a < 0.75f ? 1 : a <= 1.25f ? 2 : a < 1.75f ? 3 : a <= 2.5f ? 4 : a < 3.5f ? 5 : a <= 5.f ? 6 : 7;
  return sign | m;
}

// One projection of one expert: its bf16 rows [out, in] and the tensors it becomes.
struct Projection {
  const uint16_t* w;
  int64_t out, in;
  std::string name;  // tensor name without the ".weight" / scale suffix
  std::vector<uint8_t> codes, scales;
  std::vector<uint8_t> zeros;  // asymmetric int4: weight_zero_point
};

void quantize_fp8(Projection& p) {
  const int64_t sr = (p.out + kFp8Block - 1) / kFp8Block, sc = (p.in + kFp8Block - 1) / kFp8Block;
  p.codes.resize(static_cast<size_t>(p.out * p.in));
  std::vector<float> scale(static_cast<size_t>(sr * sc));
  for (int64_t br = 0; br < sr; ++br)
    for (int64_t bc = 0; bc < sc; ++bc) {
      const int64_t r1 = std::min(p.out, (br + 1) * kFp8Block), c1 = std::min(p.in, (bc + 1) * kFp8Block);
      float amax = 0;
      for (int64_t r = br * kFp8Block; r < r1; ++r)
        for (int64_t c = bc * kFp8Block; c < c1; ++c) amax = std::max(amax, std::fabs(from_bf16(p.w[r * p.in + c])));
      const float s = amax > 0 ? amax / kE4M3Max : 1.f;
      scale[static_cast<size_t>(br * sc + bc)] = s;
      for (int64_t r = br * kFp8Block; r < r1; ++r)
        for (int64_t c = bc * kFp8Block; c < c1; ++c)
          p.codes[static_cast<size_t>(r * p.in + c)] = e4m3_code(from_bf16(p.w[r * p.in + c]) / s);
    }
  p.scales.resize(scale.size() * sizeof(float));
  std::memcpy(p.scales.data(), scale.data(), p.scales.size());
}

void quantize_mxfp4(Projection& p) {
  const int64_t groups = (p.in + kMxGroup - 1) / kMxGroup, row_bytes = p.in / 2;
  p.codes.assign(static_cast<size_t>(p.out * row_bytes), 0);
  p.scales.resize(static_cast<size_t>(p.out * groups));
  for (int64_t r = 0; r < p.out; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * kMxGroup, c1 = std::min(p.in, c0 + kMxGroup);
      float amax = 0;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, std::fabs(from_bf16(p.w[r * p.in + c])));
      // The OCP MX shared scale: 2^(floor(log2 amax) - 2), 2 being e2m1's
      // largest exponent; 2^0 for an all-zero group.
      int shared = 0;
      if (amax > 0) {
        int e;
        std::frexp(amax, &e);
        shared = std::max(-127, std::min(127, e - 1 - 2));
      }
      p.scales[static_cast<size_t>(r * groups + g)] = static_cast<uint8_t>(shared + 127);
      for (int64_t c = c0; c < c1; ++c) {
        const uint8_t code = e2m1_code(std::ldexp(from_bf16(p.w[r * p.in + c]), -shared));
        p.codes[static_cast<size_t>(r * row_bytes + c / 2)] |= static_cast<uint8_t>(code << (4 * (c & 1)));
      }
    }
}

// compressed-tensors asymmetric int4, groups of `group` inputs: per (row,
// group) the bf16 scale s = (max - min) / 15 (|value| where all are equal)
// and the zero point z + 8 = round(-min / s), codes q + 8 = round(v / s) +
// z + 8 clamped to [0, 15]; W = (q - z) * s. weight_packed I32 [out,
// ceil(in/8)] (element c in bits 4 (c % 8) of word c / 8), weight_scale BF16
// [out, groups], weight_zero_point I32 [ceil(out/8), groups] (row r in bits
// 4 (r % 8) of word (r / 8, g)).
void quantize_int4_asymmetric(Projection& p, int64_t group) {
  const int64_t words = (p.in + 7) / 8, groups = (p.in + group - 1) / group;
  p.codes.assign(static_cast<size_t>(p.out * words * 4), 0);
  p.scales.resize(static_cast<size_t>(p.out * groups * 2));
  p.zeros.assign(static_cast<size_t>((p.out + 7) / 8 * groups * 4), 0);
  for (int64_t r = 0; r < p.out; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * group, c1 = std::min(p.in, c0 + group);
      float lo = from_bf16(p.w[r * p.in + c0]), hi = lo;
      for (int64_t c = c0; c < c1; ++c) {
        lo = std::min(lo, from_bf16(p.w[r * p.in + c]));
        hi = std::max(hi, from_bf16(p.w[r * p.in + c]));
      }
      const float range = hi > lo ? (hi - lo) / 15.f : std::fabs(lo);
      const uint16_t sb = to_bf16(range > 0 ? range : 1.f);
      const float s = from_bf16(sb);
      std::memcpy(&p.scales[static_cast<size_t>((r * groups + g) * 2)], &sb, 2);
      const int zs = static_cast<int>(std::min(15.f, std::max(0.f, std::nearbyint(-lo / s))));
      p.zeros[static_cast<size_t>(((r / 8) * groups + g) * 4 + (r % 8) / 2)] |=
          static_cast<uint8_t>(zs << (4 * (r % 2)));
      for (int64_t c = c0; c < c1; ++c) {
        const float q = std::nearbyint(from_bf16(p.w[r * p.in + c]) / s) + static_cast<float>(zs);
        const uint8_t u = static_cast<uint8_t>(std::min(15.f, std::max(0.f, q)));
        p.codes[static_cast<size_t>((r * words + c / 8) * 4 + (c % 8) / 2)] |= static_cast<uint8_t>(u << (4 * (c % 2)));
      }
    }
}

std::string config_json(const CheckpointLayer& layer, kt_weight_format format) {
  JsonWriter j;
  j.begin_object();
  j.key("hidden_size").value(layer.hidden);
  j.key("moe_intermediate_size").value(layer.intermediate);
  j.key("n_routed_experts").value(layer.experts);
  j.key("num_experts_per_tok").value(layer.top_k);
  j.key("quantization_config").begin_object();
  if (format == KT_FORMAT_FP8_B128) {
    j.key("quant_method").value("fp8");
    j.key("fmt").value("e4m3");
    j.key("activation_scheme").value("dynamic");
    j.key("weight_block_size").begin_array();
    j.value(kFp8Block);
    j.value(kFp8Block);
    j.end_array();
  } else if (asymmetric_int4(format)) {
    j.key("quant_method").value("compressed-tensors");
    j.key("format").value("pack-quantized");
    j.key("config_groups").begin_object();
    j.key("group_0").begin_object();
    j.key("targets").begin_array();
    j.value("Linear");
    j.end_array();
    j.key("weights").begin_object();
    j.key("num_bits").value(int64_t{4});
    j.key("type").value("int");
    j.key("strategy").value("group");
    j.key("group_size").value(int4_group(format));
    j.key("symmetric").value(false);
    j.end_object();
    j.end_object();
    j.end_object();
  } else {
    j.key("quant_method").value("mxfp4");
  }
  j.end_object();
  j.end_object();
  return j.str() + "\n";
}

bool write_text(const std::string& path, const std::string& text, std::string* error) {
  FILE* f = std::fopen(path.c_str(), "wb");
  const bool ok = f && std::fwrite(text.data(), 1, text.size(), f) == text.size();
  if (f && std::fclose(f) != 0) return (*error = "cannot write " + path), false;
  if (!ok) *error = "cannot write " + path;
  return ok;
}

// A safetensors file: u64 header length, the JSON header (padded with spaces
// to 8 bytes), the tensors' bytes back to back.
bool write_safetensors(const std::string& path, const std::vector<Projection>& projections, kt_weight_format format,
                       std::string* error) {
  const bool fp8 = format == KT_FORMAT_FP8_B128;
  JsonWriter j;
  j.begin_object();
  j.key("__metadata__").begin_object();
  j.key("format").value("pt");
  j.end_object();
  int64_t offset = 0;
  // cols < 0: a 1-D tensor of `rows` elements.
  auto tensor = [&](const std::string& name, const char* dtype, int64_t rows, int64_t cols, size_t bytes) {
    j.key(name).begin_object();
    j.key("dtype").value(dtype);
    j.key("shape").begin_array();
    j.value(rows);
    if (cols >= 0) j.value(cols);
    j.end_array();
    j.key("data_offsets").begin_array();
    j.value(offset);
    j.value(offset + static_cast<int64_t>(bytes));
    j.end_array();
    j.end_object();
    offset += static_cast<int64_t>(bytes);
  };
  for (const Projection& p : projections) {
    if (asymmetric_int4(format)) {
      const int64_t groups = (p.in + int4_group(format) - 1) / int4_group(format);
      tensor(p.name + ".weight_packed", "I32", p.out, (p.in + 7) / 8, p.codes.size());
      tensor(p.name + ".weight_scale", "BF16", p.out, groups, p.scales.size());
      tensor(p.name + ".weight_zero_point", "I32", (p.out + 7) / 8, groups, p.zeros.size());
      tensor(p.name + ".weight_shape", "I64", 2, -1, 16);
    } else if (fp8) {
      tensor(p.name + ".weight", "F8_E4M3", p.out, p.in, p.codes.size());
      tensor(p.name + ".weight_scale_inv", "F32", (p.out + kFp8Block - 1) / kFp8Block, (p.in + kFp8Block - 1) / kFp8Block,
             p.scales.size());
    } else {
      tensor(p.name + ".weight", "U8", p.out, p.in / 2, p.codes.size());
      tensor(p.name + ".scale", "F8_E8M0", p.out, (p.in + kMxGroup - 1) / kMxGroup, p.scales.size());
    }
  }
  j.end_object();
  std::string header = j.str();
  header.append((8 - header.size() % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(header.size()) >> (8 * i));
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) {
    *error = "cannot create " + path;
    return false;
  }
  bool ok = std::fwrite(length, 1, 8, f) == 8 && std::fwrite(header.data(), 1, header.size(), f) == header.size();
  for (const Projection& p : projections) {
    const int64_t shape_values[2] = {p.out, p.in};
    std::vector<uint8_t> shape(16);
    std::memcpy(shape.data(), shape_values, 16);  // little-endian I64 on the x86-64 hosts kt runs on
    const std::vector<uint8_t>* parts[] = {&p.codes, &p.scales, &p.zeros, &shape};
    for (const std::vector<uint8_t>* bytes : parts) {
      if (bytes->empty() || (bytes == &shape && !asymmetric_int4(format)))
        continue;  // fwrite takes no null data
      ok = ok && std::fwrite(bytes->data(), 1, bytes->size(), f) == bytes->size();
    }
  }
  ok = std::fclose(f) == 0 && ok;
  if (!ok) *error = "cannot write " + path + " (disk full?)";
  return ok;
}

}  // namespace

std::string make_temp_dir(std::string* error) {
  const char* tmp = getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/kt_bench.XXXXXX";
  if (!mkdtemp(&tmpl[0])) {
    *error = "cannot create a temporary directory like " + tmpl;
    return {};
  }
  return tmpl;
}

bool write_quant_checkpoint(const CheckpointLayer& layer, kt_weight_format format, int threads, const std::string& dir,
                            std::string* error) {
  if (!comes_from_checkpoint(format)) {
    *error = "not a format of quantized checkpoints (fp8_b128, mxfp4, int4_g32_zp, int4_g128_zp)";
    return false;
  }
  const int64_t H = layer.hidden, I = layer.intermediate;
  if (format == KT_FORMAT_MXFP4 && (H % 2 || I % 2)) {
    *error = "mxfp4 stores two codes a byte: hidden and intermediate must be even";
    return false;
  }
  // Per expert and projection, in checkpoint order; quantized on `threads` threads.
  std::vector<Projection> projections;
  const char* hf_names[3] = {"gate_proj", "up_proj", "down_proj"};
  const char* v4_names[3] = {"w1", "w3", "w2"};
  for (int64_t e = 0; e < layer.experts; ++e)
    for (int p = 0; p < 3; ++p) {
      Projection pr;
      const uint16_t* w = p == 0 ? layer.gate : p == 1 ? layer.up : layer.down;
      pr.out = p == 2 ? H : I;
      pr.in = p == 2 ? I : H;
      pr.w = w + e * H * I;
      pr.name = format != KT_FORMAT_MXFP4
                    ? "model.layers." + std::to_string(kCheckpointLayer) + ".mlp.experts." + std::to_string(e) + "." + hf_names[p]
                    : "layers." + std::to_string(kCheckpointLayer) + ".ffn.experts." + std::to_string(e) + "." + v4_names[p];
      projections.push_back(std::move(pr));
    }
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < projections.size();)
      if (format == KT_FORMAT_FP8_B128) {
        quantize_fp8(projections[i]);
      } else if (asymmetric_int4(format)) {
        quantize_int4_asymmetric(projections[i], int4_group(format));
      } else {
        quantize_mxfp4(projections[i]);
      }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < std::max(1, threads); ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();

  const std::string model = dir + "/model.safetensors";
  return write_safetensors(model, projections, format, error) &&
         write_text(dir + "/config.json", config_json(layer, format), error);
}

}  // namespace kt_bench
