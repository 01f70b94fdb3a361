/* A C99 host of the checkpoint ABI: writes a small checkpoint and an adapter
 * with kt's writers, opens them again, inspects them, loads a layer and runs
 * it, and checks the values against the ones it wrote. argv[1]: a work dir. */
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt_c_api.h"

#define LAYOUT(name, cond) typedef char layout_##name[(cond) ? 1 : -1]
LAYOUT(ckpt_info_size, sizeof(kt_ckpt_info) == 72);
LAYOUT(ckpt_layer_info_size, sizeof(kt_ckpt_layer_info) == 96);
LAYOUT(ckpt_tensor_size, sizeof(kt_ckpt_tensor) == 112);
LAYOUT(ckpt_write_options_size, sizeof(kt_ckpt_write_options) == 32);
LAYOUT(ckpt_adapter_config_size, sizeof(kt_ckpt_adapter_config) == 48);
LAYOUT(ckpt_layer_args_size, sizeof(kt_ckpt_layer_args) == 24);
LAYOUT(ckpt_load_options_size, sizeof(kt_ckpt_load_options) == 56);
LAYOUT(weight_format_values, KT_FORMAT_FP8_B128 == 3 && KT_FORMAT_MXFP4 == 4 && KT_FORMAT_INT4_G128 == 5 &&
                                 KT_FORMAT_INT4_G32_ZP == 6 && KT_FORMAT_INT4_G128_ZP == 7);
LAYOUT(ckpt_values, KT_CKPT_DTYPE_BF16 == 3 && KT_CKPT_DTYPE_E8M0 == 7 && KT_CKPT_LAYOUT_GPT_OSS == 5 &&
                        KT_CKPT_FORMAT_MXFP4 == 3);
LAYOUT(packed_flags, KT_PACKED_SKIP_CHECKSUMS == 1u);

static int failures = 0;
#define CHECK(cond)                                                                              \
  do {                                                                                           \
    if (!(cond)) {                                                                               \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              kt_last_error());                                                                  \
      ++failures;                                                                                \
    }                                                                                            \
  } while (0)

enum { E = 2, H = 16, I = 16, T = 3, R = 2 };

static DLTensor tensor(void* data, DLDataType dt, int ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.dtype = dt;
  t.shape = shape;
  t.strides = NULL;
  return t;
}

static float value(int e, int p, int r, int c) { return (float)(((e * 7 + p * 11 + r * 3 + c) % 17) - 8) / 8.0f; }

static void progress(int64_t done, int64_t total, void* user) {
  int64_t* last = (int64_t*)user;
  last[0] = done;
  last[1] = total;
}

int main(int argc, char** argv) {
  static float gate[E][I][H], up[E][I][H], down[E][H][I];
  static float back[E][I][H];
  static float x[T][H], y[T][H], w[T][2];
  static int32_t ids[T][2];
  static float la[E][R][H], lb[E][I][R], la_back[E][R][H];
  int64_t gshape[3] = {E, I, H}, dshape[3] = {E, H, I}, xshape[2] = {T, H}, kshape[2] = {T, 2};
  int64_t ashape[3] = {E, R, H}, bshape[3] = {E, I, R};
  DLDataType f32 = {kDLFloat, 32, 1}, i32 = {kDLInt, 32, 1};
  DLTensor tg, tu, td, tb, tx, ty, tw, tids, ta, tlb, tab;
  kt_arg wargs[3], fargs[4], largs[2];
  kt_ckpt_write_options wo;
  kt_ckpt_layer_args layer;
  kt_ckpt* ck = NULL;
  kt_ckpt_info info;
  kt_ckpt_layer_info li;
  kt_ckpt_tensor t;
  kt_moe_options mo;
  kt_engine* engine = NULL;
  kt_moe* moe = NULL;
  kt_ckpt_adapter_config ac, ac_back;
  int64_t last[2] = {0, 0};
  char dir[512], adir[512];
  int e, r, c;
  const char* root = argc > 1 ? argv[1] : "kt_io_c99_work";

  snprintf(dir, sizeof(dir), "%s/ckpt", root);
  snprintf(adir, sizeof(adir), "%s/adapter", root);
  for (e = 0; e < E; ++e)
    for (r = 0; r < I; ++r)
      for (c = 0; c < H; ++c) {
        gate[e][r][c] = value(e, 0, r, c);
        up[e][r][c] = value(e, 1, r, c);
        down[e][c][r] = value(e, 2, c, r);
      }
  tg = tensor(gate, f32, 3, gshape);
  tu = tensor(up, f32, 3, gshape);
  td = tensor(down, f32, 3, dshape);
  wargs[0].id = KT_ARG_W_GATE, wargs[0].tensor = &tg;
  wargs[1].id = KT_ARG_W_UP, wargs[1].tensor = &tu;
  wargs[2].id = KT_ARG_W_DOWN, wargs[2].tensor = &td;
  layer.layer = 0, layer.args = wargs, layer.num_args = 3;

  kt_ckpt_write_options_defaults(&wo, sizeof(wo)); /* what kt_ckpt_write_options_init does */
  CHECK(wo.dtype == KT_CKPT_DTYPE_BF16 && wo.layout == KT_CKPT_LAYOUT_PER_EXPERT);
  wo.config_json = "{\"model_type\": \"qwen3_moe\", \"num_experts_per_tok\": 2}";
  CHECK(kt_ckpt_write_experts(dir, &wo, &layer, 1) == KT_OK);

  CHECK(kt_ckpt_open(dir, &ck) == KT_OK);
  if (!ck) return 1;
  info.struct_size = sizeof(info);
  CHECK(kt_ckpt_get_info(ck, &info) == KT_OK);
  CHECK(info.num_moe_layers == 1 && info.num_tensors == 3 * E && info.top_k == 2);
  CHECK(strcmp(info.model_type, "qwen3_moe") == 0);
  CHECK(strcmp(kt_ckpt_layout_name(info.layout), "per_expert") == 0);
  li.struct_size = sizeof(li);
  CHECK(kt_ckpt_get_layer_info(ck, 0, &li) == KT_OK);
  CHECK(li.num_experts == E && li.hidden == H && li.intermediate == I && li.loadable == 1);
  CHECK(strcmp(kt_ckpt_dtype_name(li.weight_dtype), "BF16") == 0);
  CHECK(strcmp(kt_ckpt_format_name(li.format), "dense") == 0);
  CHECK(li.num_tensors == 3 * E);
  t.struct_size = sizeof(t);
  CHECK(kt_ckpt_layer_tensor_at(ck, 0, 3 * E - 1, &t) == KT_OK);
  CHECK(strcmp(t.name, "model.layers.0.mlp.experts.1.up_proj.weight") == 0);
  CHECK(kt_ckpt_layer_tensor_at(ck, 0, 3 * E, &t) == KT_ERR_INVALID_ARGUMENT);
  CHECK(kt_ckpt_get_layer_info(ck, 1, &li) == KT_ERR_INVALID_ARGUMENT);
  t.struct_size = sizeof(t);
  CHECK(kt_ckpt_tensor_at(ck, 0, &t) == KT_OK);
  CHECK(strcmp(t.name, "model.layers.0.mlp.experts.0.down_proj.weight") == 0);
  CHECK(t.ndim == 2 && t.shape[0] == H && t.nbytes == H * I * 2 && t.data != NULL);
  CHECK(kt_ckpt_find_tensor(ck, "model.layers.0.mlp.experts.1.up_proj.weight", &t) == KT_OK);
  CHECK(t.dtype == KT_CKPT_DTYPE_BF16);
  CHECK(kt_ckpt_find_tensor(ck, "nope", &t) == KT_ERR_IO);

  tb = tensor(back, f32, 3, gshape);
  largs[0].id = KT_ARG_W_UP, largs[0].tensor = &tb;
  CHECK(kt_ckpt_read_layer(ck, 0, largs, 1) == KT_OK);
  CHECK(memcmp(back, up, sizeof(up)) == 0);

  CHECK(kt_engine_create(NULL, &engine) == KT_OK);
  kt_moe_options_init(&mo);
  CHECK(kt_ckpt_moe_options(ck, 0, &mo) == KT_OK);
  CHECK(mo.num_experts == E && mo.top_k == 2 && mo.activation == KT_ACT_SILU);
  CHECK(kt_moe_create(engine, &mo, &moe) == KT_OK);
  CHECK(kt_ckpt_load_layer(ck, 0, moe, progress, last) == KT_OK);
  CHECK(last[0] == E && last[1] == E);
  CHECK(li.weight_format == KT_FORMAT_BF16 && li.group_size == 0);
  {
    /* A dense layer loads the same way with options; a bad flag is refused. */
    kt_ckpt_load_options lo;
    kt_ckpt_load_options_defaults(&lo, sizeof(lo)); /* what kt_ckpt_load_options_init does */
    CHECK(lo.struct_size == sizeof(lo) && lo.dequantize == 0);
    lo.dequantize = 1;
    last[0] = 0;
    CHECK(kt_ckpt_load_layer_with(ck, 0, moe, &lo, progress, last) == KT_OK);
    CHECK(last[0] == E);
    CHECK(kt_ckpt_load_layer_with(ck, 0, moe, NULL, NULL, NULL) == KT_OK);
    lo.dequantize = 2;
    CHECK(kt_ckpt_load_layer_with(ck, 0, moe, &lo, NULL, NULL) == KT_ERR_INVALID_ARGUMENT);
    CHECK(strstr(kt_last_error(), "options->dequantize") != NULL);
  }
  for (r = 0; r < T; ++r) {
    for (c = 0; c < H; ++c) x[r][c] = (r == c) ? 1.0f : 0.0f;
    ids[r][0] = 0, ids[r][1] = 1;
    w[r][0] = 1.0f, w[r][1] = 0.0f;
  }
  tx = tensor(x, f32, 2, xshape);
  ty = tensor(y, f32, 2, xshape);
  tw = tensor(w, f32, 2, kshape);
  tids = tensor(ids, i32, 2, kshape);
  fargs[0].id = KT_ARG_X, fargs[0].tensor = &tx;
  fargs[1].id = KT_ARG_IDS, fargs[1].tensor = &tids;
  fargs[2].id = KT_ARG_ROUTE_WEIGHTS, fargs[2].tensor = &tw;
  fargs[3].id = KT_ARG_Y, fargs[3].tensor = &ty;
  CHECK(kt_moe_forward(moe, fargs, 4, NULL) == KT_OK);
  /* Token r is the unit vector e_r into expert 0: g = gate[:, r], u = up[:, r],
   * y = down . (silu(g) * u). */
  for (r = 0; r < T; ++r)
    for (c = 0; c < H; ++c) {
      double want = 0;
      int i;
      for (i = 0; i < I; ++i) {
        double g = gate[0][i][r], u = up[0][i][r];
        want += down[0][c][i] * (g / (1.0 + exp(-g))) * u;
      }
      CHECK(fabs(y[r][c] - want) <= 1e-2 * (1.0 + fabs(want)));
    }
  /* The packed cache: the layer saved, mapped back into a second layer,
   * computes the same Y bit for bit. */
  {
    static float y_cached[T][H];
    char pack[600];
    kt_moe* mapped = NULL;
    DLTensor tyc = tensor(y_cached, f32, 2, xshape);
    snprintf(pack, sizeof(pack), "%s/layer-0.ktpack", root);
    CHECK(kt_moe_save_packed(moe, pack) == KT_OK);
    CHECK(kt_moe_create(engine, &mo, &mapped) == KT_OK);
    CHECK(kt_moe_load_packed(mapped, "/nonexistent/layer.ktpack", 0) == KT_ERR_IO);
    CHECK(strstr(kt_last_error(), "/nonexistent/layer.ktpack") != NULL);
    CHECK(kt_moe_load_packed(mapped, pack, KT_PACKED_SKIP_CHECKSUMS) == KT_OK);
    CHECK(kt_moe_load_packed(mapped, pack, 0) == KT_OK);
    fargs[3].tensor = &tyc;
    CHECK(kt_moe_forward(mapped, fargs, 4, NULL) == KT_OK);
    fargs[3].tensor = &ty;
    CHECK(memcmp(y, y_cached, sizeof(y)) == 0);
    kt_moe_destroy(mapped);
  }
  kt_moe_destroy(moe);
  kt_engine_destroy(engine);
  kt_ckpt_close(ck);
  kt_ckpt_close(NULL);

  for (e = 0; e < E; ++e)
    for (r = 0; r < R; ++r) {
      for (c = 0; c < H; ++c) la[e][r][c] = value(e, 5, r, c) * 0.37f;
      for (c = 0; c < I; ++c) lb[e][c][r] = value(e, 6, c, r) * 0.11f;
    }
  ta = tensor(la, f32, 3, ashape);
  tlb = tensor(lb, f32, 3, bshape);
  largs[0].id = KT_ARG_LORA_A_GATE, largs[0].tensor = &ta;
  largs[1].id = KT_ARG_LORA_B_GATE, largs[1].tensor = &tlb;
  layer.args = largs, layer.num_args = 2, layer.layer = 3;
  kt_ckpt_adapter_config_defaults(&ac, sizeof(ac)); /* what kt_ckpt_adapter_config_init does */
  ac.rank = R;
  ac.alpha = 4.0f;
  ac.targets = KT_PROJ_GATE;
  CHECK(kt_ckpt_adapter_write(adir, &ac, &layer, 1) == KT_OK);
  ac_back.struct_size = sizeof(ac_back);
  CHECK(kt_ckpt_adapter_read_config(adir, &ac_back) == KT_OK);
  CHECK(ac_back.rank == R && ac_back.alpha == 4.0f && ac_back.targets == KT_PROJ_GATE);
  tab = tensor(la_back, f32, 3, ashape);
  largs[0].tensor = &tab;
  CHECK(kt_ckpt_adapter_read(adir, 3, largs, 1) == KT_OK);
  CHECK(memcmp(la_back, la, sizeof(la)) == 0);
  CHECK(kt_ckpt_open(NULL, &ck) == KT_ERR_NULL_POINTER);

  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  else printf("checkpoint ABI from C99: all checks passed\n");
  return failures ? 1 : 0;
}
