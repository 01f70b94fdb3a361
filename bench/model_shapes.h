// Routed-expert shapes of real MoE models (hidden H, expert intermediate I,
// experts E, routes per token k), benchmarked with synthetic bf16 weights:
// those of bench/models/models.json (tests/python/test_model_shapes.py keeps
// the two the same), compiled in so that an installed kt_bench needs no file.
#ifndef KT_BENCH_MODEL_SHAPES_H_
#define KT_BENCH_MODEL_SHAPES_H_

#include <cstdint>

namespace kt_bench {

struct ModelShape {
  const char* name;
  int64_t hidden;
  int64_t intermediate;
  int64_t experts;
  int64_t top_k;
  int64_t moe_layers;
};

// Every model is benchmarked as bf16 with the silu activation: the cost of
// an expert is its three GEMMs whatever the checkpoint's storage format.
inline constexpr ModelShape kModelShapes[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8, 48},
    {"qwen3-235b-a22b", 4096, 1536, 128, 8, 94},
    {"deepseek-v3", 7168, 2048, 256, 8, 58},
    {"kimi-k2", 7168, 2048, 384, 8, 60},
    {"deepseek-v2-lite", 2048, 1408, 64, 6, 26},
    {"qwen1.5-moe-a2.7b", 2048, 1408, 60, 4, 24},
    {"olmoe-1b-7b", 2048, 1024, 64, 8, 16},
    {"mixtral-8x7b", 4096, 14336, 8, 2, 32},
    {"gpt-oss-20b", 2880, 2880, 32, 4, 24},
    {"gpt-oss-120b", 2880, 2880, 128, 4, 36},
};

}  // namespace kt_bench

#endif  // KT_BENCH_MODEL_SHAPES_H_
