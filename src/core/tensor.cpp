#include "core/tensor.h"

#include <sstream>

#include "core/error.h"

namespace kt {

const char* dtype_name(DType t) {
  switch (t) {
    case DType::kF32: return "float32";
    case DType::kBF16: return "bfloat16";
    case DType::kF16: return "float16";
    case DType::kF64: return "float64";
    case DType::kI32: return "int32";
    case DType::kI64: return "int64";
    case DType::kI8: return "int8";
    case DType::kU8: return "uint8";
    case DType::kBool: return "bool";
  }
  return "?";
}

size_t dtype_size(DType t) {
  switch (t) {
    case DType::kF32: case DType::kI32: return 4;
    case DType::kBF16: case DType::kF16: return 2;
    case DType::kF64: case DType::kI64: return 8;
    case DType::kI8: case DType::kU8: case DType::kBool: return 1;
  }
  return 1;
}

int64_t View::numel() const {
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) n *= shape[i];
  return n;
}

static int64_t read_int(const char* p, DType t) {
  switch (t) {
    case DType::kI32: return *reinterpret_cast<const int32_t*>(p);
    case DType::kI64: return *reinterpret_cast<const int64_t*>(p);
    case DType::kI8: return *reinterpret_cast<const int8_t*>(p);
    case DType::kU8: case DType::kBool: return *reinterpret_cast<const uint8_t*>(p);
    default: return static_cast<int64_t>(load_as_f32(p, t));
  }
}

int64_t View::get_int(int64_t i0) const { return read_int(at(i0), dtype); }
int64_t View::get_int(int64_t i0, int64_t i1) const { return read_int(at(i0, i1), dtype); }

View View::slice0(int64_t i0) const {
  View v;
  v.data = at(i0);
  v.dtype = dtype;
  v.ndim = ndim - 1;
  for (int i = 1; i < ndim; ++i) {
    v.shape[i - 1] = shape[i];
    v.strides[i - 1] = strides[i];
  }
  return v;
}

View View::transposed() const {
  View v = *this;
  if (ndim >= 2) {
    std::swap(v.shape[ndim - 1], v.shape[ndim - 2]);
    std::swap(v.strides[ndim - 1], v.strides[ndim - 2]);
  }
  return v;
}

std::string shape_string(const View& v) {
  std::ostringstream s;
  s << "[";
  for (int i = 0; i < v.ndim; ++i) s << (i ? "," : "") << v.shape[i];
  s << "]";
  return s.str();
}

static bool to_dtype(DLDataType d, DType* out) {
  if (d.lanes != 1) return false;
  if (d.code == kDLFloat && d.bits == 32) *out = DType::kF32;
  else if (d.code == kDLFloat && d.bits == 16) *out = DType::kF16;
  else if (d.code == kDLFloat && d.bits == 64) *out = DType::kF64;
  else if (d.code == kDLBfloat && d.bits == 16) *out = DType::kBF16;
  else if (d.code == kDLInt && d.bits == 32) *out = DType::kI32;
  else if (d.code == kDLInt && d.bits == 64) *out = DType::kI64;
  else if (d.code == kDLInt && d.bits == 8) *out = DType::kI8;
  else if (d.code == kDLUInt && d.bits == 8) *out = DType::kU8;
  else if (d.code == kDLUInt && d.bits == 1) *out = DType::kBool;  // some producers
  else if (d.code == 6 /* kDLBool in newer DLPack */ && d.bits == 8) *out = DType::kBool;
  else return false;
  return true;
}

View check_tensor(const DLTensor* t, const TensorSpec& spec, const char* where) {
  std::string who = std::string(where) + ": " + spec.name;
  check(t != nullptr, KT_ERR_NULL_POINTER, who + " is NULL");
  check(t->device.device_type == kDLCPU || t->device.device_type == kDLCUDAHost,
        KT_ERR_DEVICE,
        who + " is on device type " + std::to_string(t->device.device_type) +
            "; kt reads CPU memory only (kDLCPU or kDLCUDAHost)");
  View v;
  check(to_dtype(t->dtype, &v.dtype), KT_ERR_DTYPE,
        who + " has an unsupported dtype (code " + std::to_string(t->dtype.code) + ", bits " +
            std::to_string(t->dtype.bits) + ", lanes " + std::to_string(t->dtype.lanes) + ")");
  bool dtype_ok = false;
  std::string accepted;
  for (DType d : spec.dtypes) {
    dtype_ok = dtype_ok || d == v.dtype;
    accepted += std::string(accepted.empty() ? "" : "|") + dtype_name(d);
  }
  check(dtype_ok, KT_ERR_DTYPE,
        who + " has dtype " + dtype_name(v.dtype) + "; expected " + accepted);
  check(t->ndim >= 0 && t->ndim <= kMaxRank, KT_ERR_SHAPE,
        who + " has rank " + std::to_string(t->ndim));
  check(t->ndim == 0 || t->shape != nullptr, KT_ERR_NULL_POINTER, who + " has NULL shape");
  v.ndim = t->ndim;
  int64_t expect = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = t->shape[i];
    check(v.shape[i] >= 0, KT_ERR_SHAPE, who + " has a negative extent");
    v.strides[i] = t->strides ? t->strides[i] : expect;
    expect *= v.shape[i];
  }
  std::string got = shape_string(v);
  int rank = static_cast<int>(spec.shape.size());
  std::ostringstream want;
  want << "[";
  int i = 0;
  bool shape_ok = rank == v.ndim;
  for (int64_t s : spec.shape) {
    want << (i ? "," : "") << (s < 0 ? std::string("*") : std::to_string(s));
    if (shape_ok && s >= 0 && v.shape[i] != s) shape_ok = false;
    ++i;
  }
  want << "]";
  check(shape_ok, KT_ERR_SHAPE, who + " has shape " + got + "; expected " + want.str());
  for (int d = 0; d < v.ndim; ++d) {
    check(v.strides[d] >= 0 || v.shape[d] <= 1, KT_ERR_STRIDE,
          who + " has a negative stride in dim " + std::to_string(d));
    if (v.shape[d] <= 1) v.strides[d] = 0;  // irrelevant; normalise
  }
  if (spec.inner_contiguous && v.ndim > 0 && v.shape[v.ndim - 1] > 1) {
    check(v.strides[v.ndim - 1] == 1, KT_ERR_STRIDE,
          who + " must have unit stride in its last dimension (got " +
              std::to_string(v.strides[v.ndim - 1]) + ")");
  }
  int64_t n = v.numel();
  check(n == 0 || t->data != nullptr, KT_ERR_NULL_POINTER, who + " has NULL data");
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  return v;
}

}  // namespace kt
