#include "core/tensor.h"

#include <algorithm>
#include <sstream>

#include "core/checked.h"
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
  // Messages are built only on failure (this runs for every argument of
  // every call).
  const auto who = [&] { return std::string(where) + ": " + spec.name; };
  KT_CHECK(t != nullptr, KT_ERR_NULL_POINTER, who() + " is NULL");
  KT_CHECK(t->device.device_type == kDLCPU || t->device.device_type == kDLCUDAHost, KT_ERR_DEVICE,
           who() + " is on device type " + std::to_string(t->device.device_type) +
               "; kt reads CPU memory only (kDLCPU or kDLCUDAHost)");
  View v;
  KT_CHECK(to_dtype(t->dtype, &v.dtype), KT_ERR_DTYPE,
           who() + " has an unsupported dtype (code " + std::to_string(t->dtype.code) + ", bits " +
               std::to_string(t->dtype.bits) + ", lanes " + std::to_string(t->dtype.lanes) + ")");
  bool dtype_ok = false;
  for (DType d : spec.dtypes) dtype_ok = dtype_ok || d == v.dtype;
  if (!dtype_ok) {
    std::string accepted;
    for (DType d : spec.dtypes)
      accepted += std::string(accepted.empty() ? "" : "|") + dtype_name(d);
    fail(KT_ERR_DTYPE, who() + " has dtype " + dtype_name(v.dtype) + "; expected " + accepted);
  }
  KT_CHECK(t->ndim >= 0 && t->ndim <= kMaxRank, KT_ERR_SHAPE,
           who() + " has rank " + std::to_string(t->ndim));
  KT_CHECK(t->ndim == 0 || t->shape != nullptr, KT_ERR_NULL_POINTER, who() + " has NULL shape");
  v.ndim = t->ndim;
  bool empty = false;
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t->shape[i];
    KT_CHECK(v.shape[i] >= 0, KT_ERR_SHAPE, who() + " has a negative extent");
    empty = empty || v.shape[i] == 0;
  }
  // Element and byte counts must fit in int64_t before anything uses them
  // (compact strides, numel, the byte span below).
  const int64_t es = static_cast<int64_t>(dtype_size(v.dtype));
  CheckedSize bytes = es;
  for (int i = 0; i < v.ndim && !empty; ++i) bytes *= v.shape[i];
  KT_CHECK(
      !bytes.overflow(), KT_ERR_SHAPE,
      who() + " has shape " + shape_string(v) + ": its size in bytes overflows a 64-bit count");
  int64_t compact = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.strides[i] = t->strides ? t->strides[i] : compact;
    if (!empty) compact *= v.shape[i];  // cannot overflow: bounded by `bytes`
  }
  const int64_t* expected = spec.shape.begin();
  bool shape_ok = static_cast<int>(spec.shape.size()) == v.ndim;
  for (int i = 0; shape_ok && i < v.ndim; ++i)
    shape_ok = expected[i] < 0 || v.shape[i] == expected[i];
  if (!shape_ok) {
    std::string want = "[";
    for (size_t i = 0; i < spec.shape.size(); ++i)
      want += (i ? "," : "") + (expected[i] < 0 ? std::string("*") : std::to_string(expected[i]));
    fail(KT_ERR_SHAPE, who() + " has shape " + shape_string(v) + "; expected " + want + "]");
  }
  for (int d = 0; d < v.ndim; ++d) {
    KT_CHECK(v.strides[d] >= 0 || v.shape[d] <= 1, KT_ERR_STRIDE,
             who() + " has a negative stride in dim " + std::to_string(d));
    if (v.shape[d] <= 1 || empty) v.strides[d] = 0;  // irrelevant; normalise
  }
  if (spec.inner_contiguous && v.ndim > 0 && v.shape[v.ndim - 1] > 1 && !empty) {
    KT_CHECK(v.strides[v.ndim - 1] == 1, KT_ERR_STRIDE,
             who() + " must have unit stride in its last dimension (got " +
                 std::to_string(v.strides[v.ndim - 1]) + ")");
  }
  if (empty) {
    v.data = t->data ? static_cast<char*>(t->data) + t->byte_offset : nullptr;
    return v;
  }
  // Every element's byte offset (index * stride * element size, summed over
  // dims) must fit, and so must the address of the last one.
  CheckedSize span = es;  // bytes from the first element to past the last
  for (int d = 0; d < v.ndim; ++d) span += CheckedSize(v.shape[d] - 1) * v.strides[d] * es;
  KT_CHECK(!span.overflow(), KT_ERR_STRIDE,
           who() + " has strides whose byte offsets overflow a 64-bit count");
  KT_CHECK(t->data != nullptr, KT_ERR_NULL_POINTER, who() + " has NULL data");
  const uintptr_t base = reinterpret_cast<uintptr_t>(t->data);
  uintptr_t end = 0;
  KT_CHECK(!__builtin_add_overflow(base, t->byte_offset, &end) &&
               !__builtin_add_overflow(end, static_cast<uint64_t>(span.value()), &end),
           KT_ERR_STRIDE,
           who() + ": byte_offset and strides run past the end of the address space");
  v.data = static_cast<char*>(t->data) + t->byte_offset;
  return v;
}

namespace {

// A view's elements as byte addresses: dims of extent > 1 only, sorted by
// stride, outermost (largest) first.
struct Region {
  uintptr_t base = 0;
  int64_t es = 1;
  int nd = 0;
  int64_t shape[kMaxRank] = {};
  int64_t stride[kMaxRank] = {};  // bytes

  static Region of(const View& v) {
    Region r;
    r.base = reinterpret_cast<uintptr_t>(v.data);
    r.es = static_cast<int64_t>(v.elem_size());
    for (int d = 0; d < v.ndim; ++d) {
      if (v.shape[d] <= 1) continue;
      r.shape[r.nd] = v.shape[d];
      r.stride[r.nd] = v.strides[d] * r.es;
      ++r.nd;
    }
    for (int a = 0; a < r.nd; ++a)  // insertion sort, descending stride
      for (int b = a; b > 0 && r.stride[b] > r.stride[b - 1]; --b) {
        std::swap(r.stride[b], r.stride[b - 1]);
        std::swap(r.shape[b], r.shape[b - 1]);
      }
    return r;
  }
  // One past the last byte (check_tensor bounded this).
  uintptr_t end() const {
    uintptr_t e = base + static_cast<uintptr_t>(es);
    for (int d = 0; d < nd; ++d) e += static_cast<uintptr_t>((shape[d] - 1) * stride[d]);
    return e;
  }
  // Slice i of the outermost dim: a region of one dim less.
  Region slice(int64_t i) const {
    Region r;
    r.base = base + static_cast<uintptr_t>(i * stride[0]);
    r.es = es;
    r.nd = nd - 1;
    for (int d = 1; d < nd; ++d) {
      r.shape[d - 1] = shape[d];
      r.stride[d - 1] = stride[d];
    }
    return r;
  }
};

// Splits the region with the larger outer stride into its slices, visiting
// only those whose byte range meets the other region's; slices of a common
// parent tensor are told apart in a few steps per slice.
Overlap regions_overlap(const Region& a, const Region& b, int64_t* budget) {
  if (--*budget < 0) return Overlap::kUnknown;
  const uintptr_t a_end = a.end(), b_end = b.end();
  if (a_end <= b.base || b_end <= a.base) return Overlap::kNo;
  if (a.nd == 0 && b.nd == 0) return Overlap::kYes;
  const bool split_a = a.nd > 0 && (b.nd == 0 || a.stride[0] >= b.stride[0]);
  const Region& x = split_a ? a : b;
  const Region& y = split_a ? b : a;
  const uintptr_t y_end = split_a ? b_end : a_end;
  const Region first = x.slice(0);
  if (x.stride[0] == 0) return regions_overlap(first, y, budget);  // every slice is the same
  const uintptr_t s = static_cast<uintptr_t>(x.stride[0]);
  const uintptr_t len = first.end() - first.base;
  // Slice i covers [x.base + i*s, x.base + i*s + len): it meets y when it
  // starts before y_end and ends after y.base.
  int64_t lo = 0;
  if (y.base + 1 > x.base + len) lo = static_cast<int64_t>((y.base + 1 - x.base - len + s - 1) / s);
  const int64_t hi = std::min<int64_t>(x.shape[0] - 1, static_cast<int64_t>((y_end - 1 - x.base) / s));
  bool unknown = false;
  for (int64_t i = lo; i <= hi; ++i) {
    const Overlap o = regions_overlap(x.slice(i), y, budget);
    if (o == Overlap::kYes) return o;
    unknown = unknown || o == Overlap::kUnknown;
    if (*budget < 0) return Overlap::kUnknown;
  }
  return unknown ? Overlap::kUnknown : Overlap::kNo;
}

}  // namespace

Overlap views_overlap(const View& a, const View& b) {
  if (a.numel() == 0 || b.numel() == 0) return Overlap::kNo;
  int64_t budget = int64_t{1} << 22;
  return regions_overlap(Region::of(a), Region::of(b), &budget);
}

void check_writable(const View& v, const char* where, const char* name) {
  if (v.numel() == 0) return;
  const Region r = Region::of(v);
  // Innermost first: each stride must step past everything the dims inside
  // it reach, so no two indices share an element.
  int64_t reach = 0;  // bytes spanned by the dims inside, minus one element
  for (int d = r.nd - 1; d >= 0; --d) {
    KT_CHECK(r.stride[d] > reach + r.es - 1, KT_ERR_STRIDE,
             std::string(where) + ": " + name + " is written by this call but its strides make " +
                 "elements overlap (a stride of 0, or dims that interleave)");
    reach += (r.shape[d] - 1) * r.stride[d];
  }
}

void check_disjoint(const View& a, const char* a_name, const View& b, const char* b_name,
                    const char* where) {
  const Overlap o = views_overlap(a, b);
  KT_CHECK(o == Overlap::kNo, KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + a_name + " and " + b_name +
               (o == Overlap::kYes ? " share memory"
                                   : " may share memory (kt could not show their elements apart)") +
               "; " + a_name + " is written by kt, so they must not overlap");
}

}  // namespace kt
