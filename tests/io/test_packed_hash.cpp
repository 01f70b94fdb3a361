// The packed cache's checksum is xxHash64: known answers of the published
// algorithm, so caches stay readable by any other implementation of it.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "io/packed_cache.h"

namespace {

uint64_t of(const std::string& s) { return kt::io::hash64(s.data(), s.size()); }

TEST(PackedHash, KnownAnswers) {
  EXPECT_EQ(of(""), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(of("abc"), 0x44BC2CF5AD770999ull);
  // 39 bytes: the 32-byte stripe loop, then the 8-, 4- and 1-byte tails.
  EXPECT_EQ(of("Nobody inspects the spammish repetition"), 0xFBCEA83C8A378BF1ull);
}

// An empty section (a layer without biases) hashes NULL with length 0: the
// empty-input answer, with no arithmetic on the null pointer (UBSan).
TEST(PackedHash, NullWithZeroLengthIsTheEmptyInput) {
  EXPECT_EQ(kt::io::hash64(nullptr, 0), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(kt::io::hash64(nullptr, 0, 7), kt::io::hash64("", 0, 7));
}

TEST(PackedHash, EveryByteMatters) {
  std::string s(1000, 'x');
  const uint64_t h = of(s);
  for (size_t i : {size_t{0}, size_t{31}, size_t{32}, size_t{500}, size_t{999}}) {
    std::string t = s;
    t[i] ^= 1;
    EXPECT_NE(of(t), h) << i;
  }
  EXPECT_NE(of(s.substr(0, 999)), h);
}

}  // namespace
