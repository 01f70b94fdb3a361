/* A C99 host of kt's quantized bases: creates an int4 and an int8 layer,
 * reads the format and bytes back, loads weights whose quantization is
 * computed here by hand, reads the dequantized weights back, runs a
 * forward against values computed here, and checks the refusals. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kt_c_api.h"

#define CHECK(cond)                                                             \
  do {                                                                          \
    if (!(cond)) {                                                              \
      fprintf(stderr, "%s:%d: %s failed (%s)\n", __FILE__, __LINE__, #cond, kt_last_error()); \
      return 1;                                                                 \
    }                                                                           \
  } while (0)

enum { E = 1, H = 32, I = 16 };

static DLTensor tensor(void* data, int ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

int main(void) {
  static float wg[E * I * H], wu[E * I * H], wd[E * H * I], back[E * I * H], deq[E * I * H];
  int64_t sg[3] = {E, I, H}, sd[3] = {E, H, I};
  kt_engine* engine = NULL;
  kt_engine_options eo;
  kt_moe_options mo;
  kt_moe* moe = NULL;
  kt_moe_info info;
  int i, o;

  CHECK(strcmp(kt_weight_format_name(KT_FORMAT_INT4_G32), "int4_g32") == 0);
  CHECK(strcmp(kt_weight_format_name(KT_FORMAT_INT8_CHANNEL), "int8_channel") == 0);
  CHECK(strcmp(kt_weight_format_name((kt_weight_format)8), "unknown") == 0);
  CHECK(strcmp(kt_weight_format_name(KT_FORMAT_INT4_G32_ZP), "int4_g32_zp") == 0);
  CHECK(strcmp(kt_weight_format_name(KT_FORMAT_INT4_G128_ZP), "int4_g128_zp") == 0);

  kt_engine_options_init(&eo);
  eo.num_threads = 1;
  CHECK(kt_engine_create(&eo, &engine) == KT_OK);

  /* Full training of a quantized base is refused. */
  kt_moe_options_init(&mo);
  mo.num_experts = E;
  mo.top_k = 1;
  mo.hidden = H;
  mo.intermediate = I;
  mo.max_tokens = 4;
  mo.weight_format = KT_FORMAT_INT4_G32;
  mo.mode = KT_MODE_FULL;
  CHECK(kt_moe_create(engine, &mo, &moe) == KT_ERR_MODE);
  CHECK(strstr(kt_last_error(), "weight_format") != NULL);

  mo.mode = KT_MODE_INFERENCE;
  CHECK(kt_moe_create(engine, &mo, &moe) == KT_OK);
  info.struct_size = sizeof(info);
  CHECK(kt_moe_get_info(moe, &info) == KT_OK);
  CHECK(info.weight_format == KT_FORMAT_INT4_G32);
  CHECK(info.num_weights == 3 * E * H * I);
  CHECK(info.num_loaded == 0);
  /* gate/up: 1 panel x 32 columns: 256 code bytes + 16 bf16 scales (32 B,
   * blocks padded to 64 B);
   * down: 2 panels x 32 columns (16 padded to 32): 512 + 64 B. */
  CHECK(info.weight_bytes == 2 * (256 + 64) + (512 + 64));

  /* Gate row o: (o + 1) * 0.25 * (c % 15 - 7), so each group's max is
   * 7 * (o + 1) * 0.25 and the scale (o + 1) * 0.25 is exact in bf16: the
   * weights come back exactly. Up: 0.3 everywhere except -0.7 at column 5:
   * scale bf16 >= 0.1 (0.10009765625), 0.3 -> round(2.997) = 3 steps. */
  for (o = 0; o < I; ++o)
    for (i = 0; i < H; ++i) {
      wg[o * H + i] = (float)(o + 1) * 0.25f * (float)(i % 15 - 7);
      wu[o * H + i] = i == 5 ? -0.7f : 0.3f;
    }
  for (i = 0; i < E * H * I; ++i) wd[i] = 0.01f * (float)(i % 7);
  {
    DLTensor tg = tensor(wg, 3, sg), tu = tensor(wu, 3, sg), td = tensor(wd, 3, sd), tb = tensor(back, 3, sg);
    kt_arg load[3];
    kt_arg read[1];
    load[0].id = KT_ARG_W_GATE, load[0].tensor = &tg;
    load[1].id = KT_ARG_W_UP, load[1].tensor = &tu;
    load[2].id = KT_ARG_W_DOWN, load[2].tensor = &td;
    CHECK(kt_moe_load_weights(moe, NULL, load, 3) == KT_OK);
    CHECK(kt_moe_get_info(moe, &info) == KT_OK && info.num_loaded == 1);
    read[0].id = KT_ARG_W_GATE, read[0].tensor = &tb;
    CHECK(kt_moe_read_weights(moe, read, 1) == KT_OK);
    for (i = 0; i < E * I * H; ++i) CHECK(back[i] == wg[i]);
    read[0].id = KT_ARG_W_UP;
    CHECK(kt_moe_read_weights(moe, read, 1) == KT_OK);
    CHECK(back[5] == -7.f * 0.10009765625f);
    CHECK(back[0] == 3.f * 0.10009765625f);
    memcpy(deq, back, sizeof(deq));
    /* A packed cache holds the codes and scales: mapped back into a layer
     * of the same format it gives the same weights; a bf16 layer refuses it. */
    {
      kt_moe* mapped = NULL;
      const char* cache = "quant_c99.ktpack";
      kt_packed_info pinfo;
      CHECK(kt_moe_save_packed(moe, cache) == KT_OK);
      pinfo.struct_size = sizeof(pinfo);
      CHECK(kt_packed_read_info(cache, &pinfo) == KT_OK);
      CHECK(pinfo.weight_format == KT_FORMAT_INT4_G32 && pinfo.num_experts == E && pinfo.num_loaded == 1);
      CHECK(pinfo.weight_bytes == info.weight_bytes && pinfo.hidden == H && pinfo.intermediate == I);
      CHECK(kt_packed_read_info("quant_c99_missing.ktpack", &pinfo) == KT_ERR_IO);
      CHECK(kt_moe_create(engine, &mo, &mapped) == KT_OK);
      CHECK(kt_moe_load_packed(mapped, cache, 0) == KT_OK);
      CHECK(kt_moe_read_weights(mapped, read, 1) == KT_OK);
      CHECK(back[5] == -7.f * 0.10009765625f && back[0] == 3.f * 0.10009765625f);
      kt_moe_destroy(mapped);
      mo.weight_format = KT_FORMAT_BF16;
      CHECK(kt_moe_create(engine, &mo, &mapped) == KT_OK);
      CHECK(kt_moe_load_packed(mapped, cache, 0) == KT_ERR_INVALID_ARGUMENT);
      CHECK(strstr(kt_last_error(), "the cache holds int4_g32 weights, the layer stores bf16") != NULL);
      kt_moe_destroy(mapped);
      mo.weight_format = KT_FORMAT_INT4_G32;
      CHECK(remove(cache) == 0);
    }
    /* inf in a source is refused before anything changes. */
    wu[3] = INFINITY;
    CHECK(kt_moe_load_weights(moe, NULL, load, 3) == KT_ERR_INVALID_ARGUMENT);
    CHECK(strstr(kt_last_error(), "KT_ARG_W_UP") != NULL);
    CHECK(kt_moe_read_weights(moe, read, 1) == KT_OK);
    CHECK(memcmp(back, deq, sizeof(deq)) == 0);
  }
  kt_moe_destroy(moe);

  mo.weight_format = KT_FORMAT_INT8_CHANNEL;
  CHECK(kt_moe_create(engine, &mo, &moe) == KT_OK);
  CHECK(kt_moe_get_info(moe, &info) == KT_OK && info.weight_format == KT_FORMAT_INT8_CHANNEL);
  /* gate/up: 512 code bytes + 16 bf16 scales; down: 2 x 512 + 64. */
  CHECK(info.weight_bytes == 2 * (512 + 64) + (1024 + 64));
  kt_moe_destroy(moe);
  CHECK(kt_engine_destroy(engine) == KT_OK);
  printf("quantized bases: ok\n");
  return 0;
}
