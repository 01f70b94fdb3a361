/* A C99 host of kt's optimizer: every kt_optimizer_* call through the public
 * header, on a tiny SGD problem whose values are computed here by hand. */
#define _POSIX_C_SOURCE 200809L
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "kt_c_api.h"

#define LAYOUT(name, cond) typedef char layout_##name[(cond) ? 1 : -1]
LAYOUT(optimizer_options_size, sizeof(kt_optimizer_options) == 88);
LAYOUT(optimizer_options_momentum, offsetof(kt_optimizer_options, momentum) == 56 && offsetof(kt_optimizer_options, amsgrad) == 12);
LAYOUT(step_options_size, sizeof(kt_optimizer_step_options) == 24);
LAYOUT(optimizer_param_size, sizeof(kt_optimizer_param) == 16);
LAYOUT(state_values, KT_OPTIM_STATE_MASTER == 0 && KT_OPTIM_STATE_MOMENTUM == 4 && KT_OPTIM_SGD == 1);

static int failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    if (!(cond)) {                                                             \
      fprintf(stderr, "%s:%d: %s (%s)\n", __FILE__, __LINE__, #cond, kt_last_error()); \
      ++failures;                                                              \
    }                                                                          \
  } while (0)

static DLTensor vec(float* data, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = 1;
  t.dtype.code = kDLFloat;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

int main(void) {
  float p[4] = {1.f, 2.f, -1.f, 0.5f}, g[4] = {0.5f, -0.25f, 1.f, 0.f}, g2[4] = {1.f, 1.f, 1.f, 1.f};
  int64_t shape[1] = {4};
  DLTensor tp = vec(p, shape), tg = vec(g, shape), tg2 = vec(g2, shape);
  kt_optimizer_param pair;
  kt_optimizer_options o, got;
  kt_optimizer_step_options so;
  kt_optimizer* opt = NULL;
  kt_optimizer* layer_opt = NULL;
  kt_engine* engine = NULL;
  kt_moe* moe = NULL;
  kt_moe_options mo;
  kt_job* job = NULL;
  DLTensor buf;
  double norm = 0;
  size_t count = 0;
  int64_t step = -1;
  int nonfinite = -1;
  char path[256];
  const char* tmp = getenv("TMPDIR");

  pair.param = &tp;
  pair.grad = &tg;
  kt_optimizer_options_defaults(&o, sizeof(o));
  CHECK(o.algorithm == KT_OPTIM_ADAMW && o.lr == 1e-3 && o.beta2 == 0.999);
  kt_optimizer_options_init(&o);
  o.algorithm = KT_OPTIM_SGD;
  o.lr = 0.5;
  o.weight_decay = 0;
  o.momentum = 0.5;
  CHECK(kt_engine_create(NULL, &engine) == KT_OK);
  CHECK(kt_optimizer_create(engine, &o, &pair, 1, &opt) == KT_OK);
  CHECK(kt_optimizer_num_params(opt, &count) == KT_OK && count == 1);
  CHECK(kt_optimizer_grad_sq_norm(opt, &norm) == KT_OK && norm == 0.25 + 0.0625 + 1.0);

  /* Step 1: buf = g, p -= 0.5 * g (all exact in binary). */
  kt_optimizer_step_options_defaults(&so, sizeof(so));
  CHECK(so.grad_unscale == 1.f && so.clip_coef == 1.f && so.found_nonfinite == NULL);
  kt_optimizer_step_options_init(&so);
  so.found_nonfinite = &nonfinite;
  CHECK(kt_optimizer_step(opt, &so) == KT_OK && nonfinite == 0);
  CHECK(p[0] == 0.75f && p[1] == 2.125f && p[2] == -1.5f && p[3] == 0.5f);

  /* Step 2 (submitted) with another gradient and lr: buf = 0.5*buf + g2. */
  CHECK(kt_optimizer_set_grad(opt, 0, &tg2) == KT_OK);
  o.lr = 0.25;
  CHECK(kt_optimizer_set_options(opt, &o) == KT_OK);
  kt_optimizer_options_init(&got);
  CHECK(kt_optimizer_get_options(opt, &got) == KT_OK && got.lr == 0.25 && got.momentum == 0.5);
  CHECK(kt_optimizer_step_submit(opt, &so, 0, &job) == KT_OK);
  CHECK(kt_job_wait(job) == KT_OK && nonfinite == 0);
  kt_job_destroy(job);
  CHECK(p[0] == 0.75f - 0.25f * 1.25f && p[1] == 2.125f - 0.25f * 0.875f);
  CHECK(kt_optimizer_get_step(opt, &step) == KT_OK && step == 2);
  CHECK(kt_optimizer_state(opt, 0, KT_OPTIM_STATE_MOMENTUM, &buf) == KT_OK);
  CHECK(buf.ndim == 1 && buf.shape[0] == 4 && ((float*)buf.data)[2] == 1.5f);
  CHECK(kt_optimizer_state(opt, 0, KT_OPTIM_STATE_EXP_AVG, &buf) == KT_ERR_INVALID_ARGUMENT);

  /* Save, change, load: back to the saved values. */
  snprintf(path, sizeof(path), "%s/kt_optim_c99_%ld.safetensors", tmp && *tmp ? tmp : "/tmp", (long)getpid());
  CHECK(kt_optimizer_save(opt, path) == KT_OK);
  CHECK(kt_optimizer_set_step(opt, 7) == KT_OK);
  p[0] = 42.f;
  CHECK(kt_optimizer_load(opt, path) == KT_OK);
  CHECK(p[0] == 0.75f - 0.25f * 1.25f);
  CHECK(kt_optimizer_get_step(opt, &step) == KT_OK && step == 2);
  remove(path);

  /* A layer in inference mode has nothing to train. */
  kt_moe_options_init(&mo);
  mo.num_experts = 2;
  mo.top_k = 1;
  mo.hidden = 8;
  mo.intermediate = 4;
  CHECK(kt_moe_create(engine, &mo, &moe) == KT_OK);
  CHECK(kt_optimizer_create_for_layer(moe, NULL, &layer_opt) == KT_ERR_MODE && layer_opt == NULL);
  kt_moe_destroy(moe);

  kt_optimizer_destroy(opt);
  CHECK(kt_engine_destroy(engine) == KT_OK);
  if (failures) return 1;
  printf("optimizer C99 host: ok\n");
  return 0;
}
