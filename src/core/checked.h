// Checked arithmetic for sizes computed from values a host or a file gave,
// and the raw integers behind enum-typed values a C host passed.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#include "core/error.h"

namespace kt {

// Options structs grow by appending fields; a struct_size above this is not
// a size any kt header ever had (and reading that far could fault).
constexpr size_t kMaxOptionsStructSize = 4096;

// a * b and a + b; false when the result does not fit in int64_t.
inline bool mul_fits(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
inline bool add_fits(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

// A non-negative byte or element count that remembers overflow: once a
// product or sum leaves int64_t it stays overflowed, so a long expression is
// checked once at its end.
class CheckedSize {
 public:
  CheckedSize() = default;
  CheckedSize(int64_t v) : value_(v), overflow_(v < 0) {}  // NOLINT: implicit by design

  CheckedSize operator*(CheckedSize o) const {
    CheckedSize r;
    r.overflow_ = overflow_ || o.overflow_ || !mul_fits(value_, o.value_, &r.value_);
    return r;
  }
  CheckedSize operator+(CheckedSize o) const {
    CheckedSize r;
    r.overflow_ = overflow_ || o.overflow_ || !add_fits(value_, o.value_, &r.value_);
    return r;
  }
  CheckedSize& operator*=(CheckedSize o) { return *this = *this * o; }
  CheckedSize& operator+=(CheckedSize o) { return *this = *this + o; }

  bool overflow() const { return overflow_; }
  // The value; only meaningful when !overflow().
  int64_t value() const { return overflow_ ? INT64_MAX : value_; }

 private:
  int64_t value_ = 0;
  bool overflow_ = false;
};

// The integer stored in an enum-typed object. A C host may pass any int in
// an enum parameter or field; loading such a value as the C++ enum is
// undefined when it lies outside the enumerators' range, so the bits are
// copied out and range-checked as an integer before any conversion.
template <class E>
int64_t enum_bits(const E& e) {
  static_assert(std::is_enum<E>::value, "enum_bits reads enum objects");
  using U = typename std::underlying_type<E>::type;
  U u;
  std::memcpy(&u, &e, sizeof(u));
  return static_cast<int64_t>(u);
}

// Refuses (KT_ERR_INVALID_ARGUMENT) an enum-typed value outside [lo, hi];
// `what` names the call and the argument ("kt_moe_create: options->mode").
template <class E>
void check_enum(const E& value, int64_t lo, int64_t hi, const std::string& what, const char* type) {
  const int64_t v = enum_bits(value);
  KT_CHECK(v >= lo && v <= hi, KT_ERR_INVALID_ARGUMENT,
           what + " = " + std::to_string(v) + " is not a " + type);
}

}  // namespace kt
