// Element conversions of checkpoint I/O: fp32 -> fp16 rounds to nearest even
// over the whole half range (checked against every half value and every
// midpoint between neighbours), and unaligned bytes convert like aligned ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "io/elements.h"

namespace {

TEST(Elements, F16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const uint16_t bits = static_cast<uint16_t>(h);
    const float f = kt::f16_to_f32(bits);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(kt::f16_to_f32(kt::io::f32_to_f16(f))));
      continue;
    }
    ASSERT_EQ(kt::io::f32_to_f16(f), bits) << "half 0x" << std::hex << h;
  }
}

TEST(Elements, F16MidpointsRoundToEven) {
  // Between consecutive finite positive halves a and b, the midpoint rounds to
  // the one with an even mantissa; just above/below go to b/a.
  for (uint32_t a = 0; a < 0x7bffu; ++a) {
    const uint16_t b = static_cast<uint16_t>(a + 1);
    const double fa = kt::f16_to_f32(static_cast<uint16_t>(a)), fb = kt::f16_to_f32(b);
    const float mid = static_cast<float>((fa + fb) / 2);  // exact in fp32
    const uint16_t even = (a & 1u) ? b : static_cast<uint16_t>(a);
    ASSERT_EQ(kt::io::f32_to_f16(mid), even) << "between 0x" << std::hex << a << " and 0x" << b;
    ASSERT_EQ(kt::io::f32_to_f16(std::nextafter(mid, 1e9f)), b);
    ASSERT_EQ(kt::io::f32_to_f16(std::nextafter(mid, -1e9f)), static_cast<uint16_t>(a));
    ASSERT_EQ(kt::io::f32_to_f16(-mid), static_cast<uint16_t>(even | 0x8000u));
  }
  EXPECT_EQ(kt::io::f32_to_f16(65520.f), 0x7c00u);          // rounds past the largest half
  EXPECT_EQ(kt::io::f32_to_f16(65519.f), 0x7bffu);
  EXPECT_EQ(kt::io::f32_to_f16(INFINITY), 0x7c00u);
  EXPECT_EQ(kt::io::f32_to_f16(std::ldexp(1.f, -25)), 0u);  // half the smallest subnormal: ties to 0
  EXPECT_EQ(kt::io::f32_to_f16(std::nextafter(std::ldexp(1.f, -25), 1.f)), 1u);
}

TEST(Elements, UnalignedConversionsMatchAligned) {
  const float src[5] = {1.5f, -2.25f, 3.0e-3f, 65504.f, -0.f};
  std::vector<uint8_t> shifted(1 + sizeof(src));
  std::memcpy(shifted.data() + 1, src, sizeof(src));
  uint8_t out_aligned[10], out_shifted[11];
  for (kt_ckpt_dtype dd : {KT_CKPT_DTYPE_BF16, KT_CKPT_DTYPE_F16}) {
    kt::io::convert_elements(src, KT_CKPT_DTYPE_F32, out_aligned, dd, 5);
    kt::io::convert_elements(shifted.data() + 1, KT_CKPT_DTYPE_F32, out_shifted + 1, dd, 5);
    EXPECT_EQ(0, std::memcmp(out_aligned, out_shifted + 1, 10));
    float back[5];
    kt::io::convert_elements(out_shifted + 1, dd, back, KT_CKPT_DTYPE_F32, 5);
    EXPECT_EQ(back[0], 1.5f);
    EXPECT_EQ(back[1], -2.25f);
    EXPECT_TRUE(std::signbit(back[4]));
  }
  uint16_t bf = 0;
  kt::io::convert_elements(src, KT_CKPT_DTYPE_F32, &bf, KT_CKPT_DTYPE_BF16, 1);
  EXPECT_EQ(bf, kt::f32_to_bf16(1.5f));
}

}  // namespace
