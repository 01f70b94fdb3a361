// The kernel registry (src/kernels/kernel_list.inc) and the contract of
// every compiled table (src/kernels/kernels.h): the entries each table must
// have, the ones it may leave null, and its tuning numbers in range. Runs on
// any CPU: it reads the tables, it does not call them.
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <string>

#include "kernels/kernels.h"
#include "kernels/update.h"

namespace {

// The entries every table has.
#define KT_REQUIRED_ENTRIES(X) \
  X(gemm_bf16w)                \
  X(pack_a_f32)                \
  X(sgemm_nn)                  \
  X(sgemm_nt)                  \
  X(sgemm_tn)                  \
  X(transpose_panels)          \
  X(act_forward)               \
  X(act_backward)              \
  X(dequant_i8)                \
  X(dequant_i4)                \
  X(dequant_e4m3)              \
  X(dequant_e2m1)              \
  X(dequant_i4_zero)           \
  X(gemm_bf16w_grouped)        \
  X(gemm_int8)                 \
  X(optimizer)
// The entries a table may leave null, each where kernels.h says.
#define KT_OPTIONAL_ENTRIES(X) \
  X(gemm_zip_bf16)             \
  X(zip_rows_bf16)             \
  X(gemm_quant)                \
  X(gemm_bf16w_nn)

#define KT_COUNT_ENTRY(e) +1
constexpr int kEntries = 0 KT_REQUIRED_ENTRIES(KT_COUNT_ENTRY) KT_OPTIONAL_ENTRIES(KT_COUNT_ENTRY);
#undef KT_COUNT_ENTRY

// isa, gemm_name and a_elem_size (24 bytes with padding); the entries; four
// ints and two bools of tuning (24 bytes with padding). A member added to
// Kernels changes the size: check it here, then count it.
static_assert(sizeof(kt::Kernels) == 24 + kEntries * sizeof(void*) + 24,
              "a member of kt::Kernels that this test does not check");

TEST(KernelRegistry, ListsEveryCompiledIsaTableOnce) {
  const std::vector<kt::KernelTableInfo> tables = kt::compiled_kernel_tables();
  ASSERT_FALSE(tables.empty());
  EXPECT_EQ(tables.front().table, kt::kernels_for(KT_ISA_REF)) << "the reference table comes first";
  std::set<std::string> names;
  std::set<const kt::Kernels*> seen;
  for (const kt::KernelTableInfo& t : tables) {
    ASSERT_NE(t.table, nullptr);
    ASSERT_NE(t.name, nullptr);
    ASSERT_NE(t.missing, nullptr) << t.name;
    EXPECT_TRUE(names.insert(t.name).second) << "two tables named " << t.name;
    EXPECT_TRUE(seen.insert(t.table).second) << t.name << " listed twice";
    // An ISA's own table is what kernels_for gives for its ISA.
    if (std::strcmp(t.name, kt::kernel_isa_name(t.table->isa)) == 0) {
      EXPECT_EQ(kt::kernels_for(t.table->isa), t.table) << t.name;
    }
  }
  for (int i = KT_ISA_REF; std::strcmp(kt::kernel_isa_name(static_cast<kt_isa>(i)), "unknown") != 0; ++i) {
    const kt::Kernels* k = kt::kernels_for(static_cast<kt_isa>(i));
    if (k) {
      EXPECT_EQ(k->isa, i);
      EXPECT_TRUE(seen.count(k)) << kt::kernel_isa_name(k->isa) << " compiled but not listed";
    }
  }
}

TEST(KernelRegistry, EveryTableHoldsItsContract) {
  for (const kt::KernelTableInfo& t : kt::compiled_kernel_tables()) {
    SCOPED_TRACE(t.name);
    const kt::Kernels& k = *t.table;
    EXPECT_GE(k.isa, KT_ISA_REF);
    EXPECT_STRNE(kt::kernel_isa_name(k.isa), "unknown");
    // The name's grammar (src/kernels/README.md): gemm_bf16w_<A>_<C>_<tile>__<isa>[_<feature>].
    ASSERT_NE(k.gemm_name, nullptr);
    const std::string name = k.gemm_name;
    const std::string unit = std::string("__") + kt::kernel_isa_name(k.isa);
    EXPECT_EQ(name.rfind("gemm_bf16w_", 0), 0u) << name;
    const size_t at = name.find(unit);
    EXPECT_NE(at, std::string::npos) << name;
    if (at != std::string::npos) {
      EXPECT_TRUE(at + unit.size() == name.size() || name[at + unit.size()] == '_') << name;
    }
    EXPECT_NE(name.find(k.a_elem_size == 2 ? "_bf16_f32_" : "_f32_f32_"), std::string::npos) << name;

#define KT_CHECK_REQUIRED(e) EXPECT_NE(k.e, nullptr) << #e;
    KT_REQUIRED_ENTRIES(KT_CHECK_REQUIRED)
#undef KT_CHECK_REQUIRED

    // The optimizer's loops of the table's own ISA (AMX has none of its own).
    const char* const loops = k.isa == KT_ISA_REF ? "generic" : k.isa == KT_ISA_AVX2 ? "avx2" : "avx512";
    EXPECT_STREQ(k.optimizer->name, loops);

    // The A format, and the zipped weight gradients that only bf16 has.
    EXPECT_TRUE(k.a_elem_size == 2 || k.a_elem_size == 4) << k.a_elem_size;
    EXPECT_EQ(k.gemm_zip_bf16 != nullptr, k.a_elem_size == 2);
    EXPECT_EQ(k.zip_rows_bf16 != nullptr, k.a_elem_size == 2);

    // Tuning: gemm_quant's row bounds are set (not -1), 0 exactly where
    // there is no gemm_quant, and a row count.
    for (int rows : {k.gemm_quant_rows_int8, k.gemm_quant_rows_e4m3, k.gemm_quant_rows_4bit}) {
      EXPECT_GE(rows, 0);
      EXPECT_LE(rows, 1 << 30);
      EXPECT_EQ(rows == 0, k.gemm_quant == nullptr) << rows;
    }
    // gemm_bf16w_nn's row bound likewise.
    EXPECT_GE(k.gemm_bf16w_nn_rows, 0);
    EXPECT_LE(k.gemm_bf16w_nn_rows, 1 << 30);
    EXPECT_EQ(k.gemm_bf16w_nn_rows == 0, k.gemm_bf16w_nn == nullptr) << k.gemm_bf16w_nn_rows;
  }
}

}  // namespace
