// WeightOperand: one projection's base weights as the MoE algorithm reads
// them, whatever their storage format and the layer's compute mode. The path
// (bf16 panels; codes dequantized into panels in cache; few rows straight
// from the codes; int8 rows against integer codes) is chosen once, when the
// layer is made; per call the operand chooses only by row count.
#pragma once

#include <cstdint>
#include <vector>

#include "core/buffer.h"
#include "core/checked.h"
#include "formats/packed_bf16.h"
#include "formats/packed_quant.h"
#include "kernels/kernels.h"
#include "moe/blocking.h"

namespace kt {

// Per-thread scratch of the operands of one layer (shared by its
// projections): dequantized panels, their fp32 scales and zero bytes, and A
// rows shifted to a K chunk. Empty for bf16 panels.
struct OperandScratch {
  Buffer<bf16_t> deq;
  Buffer<float> scale;
  Buffer<uint8_t> zero;
  std::vector<const void*> rows;
};

class WeightOperand {
 public:
  WeightOperand() = default;
  // Panels of shape ps (bf16), or, when quantized, codes and scales of shape
  // qs (ps.kp is then qs.kq); int8_rows: the layer's compute reads int8 A
  // rows (KT_COMPUTE_INT8, integer codes only).
  WeightOperand(const Kernels& k, const PanelShape& ps, const QuantShape& qs, bool quantized, bool int8_rows);

  // The stored weights, [E][expert_bytes()] (the layer's buffers or a
  // mapping); borrowed until the next call.
  void set_weights(const uint8_t* stored) { stored_ = stored; }
  int64_t expert_bytes() const { return expert_bytes_; }

  // Whether the weights stream as codes, fewer bytes per column than bf16
  // panels: wider work items and whole experts at decode pay then.
  bool compact() const { return path_ != Path::kPanels; }
  // Whether gemm reads int8 A rows (row_bytes() apart, made by quantize_row)
  // rather than A-format rows of the panels' kp.
  bool int8_rows() const { return path_ == Path::kInt8; }
  int64_t int8_row_stride() const { return int8_row_bytes(qs_.kq, qs_.group); }
  // Row of k fp32 values as an int8 A row (int8_rows() only).
  void quantize_row(const float* row, int64_t k, uint8_t* dst) const {
    quantize_int8_row(row, k, qs_.kq, qs_.group, qs_.bits == 4, dst);
  }
  const QuantShape& quant_shape() const { return qs_; }

  // Per-thread scratch for panels of up to kpad K columns (kpad the largest
  // of the layer's operands), and its bytes (of a layer of these operands).
  void size_scratch(OperandScratch* s, int64_t kpad, int64_t max_rows) const;
  static CheckedSize scratch_bytes(bool quantized, int64_t kpad, bool zero_points);

  // C[m, 16 np] (leading dimension ldc) = rows . W^T over packed rows [16 p0,
  // 16 (p0 + np)) of expert e (quantized: dequantized panel blocks in cache,
  // scales applied per group in fp32). rows are A-format rows of kp, or int8
  // rows when int8_rows(). `next`: what to fetch ahead.
  void gemm(OperandScratch& s, int64_t e, int64_t p0, int np, const void* const* rows, int m, float* c,
            int64_t ldc, const PrefetchRegion& next) const;
  // What gemm over rows [r0, r0 + rb) of expert e reads (prefetch).
  PrefetchRegion block(int64_t e, int64_t r0, int64_t rb) const;
  // The packed W^T panels of columns [c0, c0 + cb) (c0 a multiple of 16) of
  // expert e, built in cache (transposed_panels contract of kernels.h);
  // quantized weights are dequantized (one bf16 rounding).
  void transposed(OperandScratch& s, int64_t e, int64_t c0, int64_t cb, bf16_t* dst) const;
  // What transposed(e, c0, cb) reads, to fetch ahead (of bf16 panels the
  // head of each slice).
  PrefetchRegion transposed_block(int64_t e, int64_t c0, int64_t cb) const;
  // Whether backward multiplies an expert of `rows` rows by W straight from
  // its panels (gemm_t) rather than by W^T panels built by transposed().
  bool reads_w_straight(int64_t rows) const {
    return path_ == Path::kPanels && k_->gemm_bf16w_nn && rows <= k_->gemm_bf16w_nn_rows &&
           rows <= kStraightMaxRows;
  }
  // C[m, cb] (=|+=) rows . W[:, c0:c0 + cb) of expert e from W's panels
  // (reads_w_straight only): rows are A-format rows of the panels' padded
  // rows. next: as transposed_block describes it.
  void gemm_t(int64_t e, const void* const* rows, int m, int64_t c0, int64_t cb, float* c, int64_t ldc,
              bool accumulate, const PrefetchRegion& next) const {
    k_->gemm_bf16w_nn(rows, m, panels(e), ps_.panel_stride(), static_cast<int>(ps_.np), c0, cb, c, ldc, accumulate,
                      next);
  }

 private:
  enum class Path { kPanels, kCodes, kInt8 };
  using DequantKernel = decltype(Kernels::dequant_i8);
  const uint8_t* expert(int64_t e) const { return stored_ + e * expert_bytes_; }
  const bf16_t* panels(int64_t e) const { return reinterpret_cast<const bf16_t*>(expert(e)); }
  // The most rows that run gemm_quant on 4-bit codes on this CPU.
  static int code_rows_4bit(const Kernels& k);
  // gemm over codes dequantized in cache, np <= kBlockPanels.
  void gemm_dequantized(OperandScratch& s, int64_t e, int64_t p0, int np, const void* const* rows, int m,
                        float* c, int64_t ldc, const PrefetchRegion& next) const;

  const Kernels* k_ = nullptr;
  Path path_ = Path::kPanels;
  PanelShape ps_;
  QuantShape qs_;
  int64_t expert_bytes_ = 0;
  const uint8_t* stored_ = nullptr;
  int a_size_ = 0;
  // kCodes: rows up to which gemm_quant reads the codes directly (-1: none).
  int quant_rows_ = -1;
  DequantKernel dequant_ = nullptr;
  // One scale per row (int8 per channel, or one group spanning K): applied
  // to the whole sum; otherwise each group's partial sum times its scale.
  bool per_row_ = false;
  // e2m1 codes: a chunk whose scaled values are exact in bf16 takes the
  // plain GEMM.
  bool e2m1_ = false;
};

}  // namespace kt
