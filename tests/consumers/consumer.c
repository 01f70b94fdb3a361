/* A program as a user of the installed kt writes it: includes <kt_c_api.h>,
 * links -lkt, checks the ABI it runs against, and computes one small MoE
 * layer whose output is known in closed form. */
#include <kt_c_api.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* One expert, H = 2, I = 1: gate row (1, 0), up row (0, 1), down column
 * (1, -2). For x = (2, 3): g = 2, u = 3, a = silu(2) * 3, y = w * a * (1, -2). */
int main(void) {
  if (kt_abi_version() != KT_ABI_VERSION) {
    fprintf(stderr, "consumer: libkt has ABI %d, built for %d\n", kt_abi_version(), KT_ABI_VERSION);
    return 1;
  }
  float wg[2] = {1, 0}, wu[2] = {0, 1}, wd[2] = {1, -2};
  float x[2] = {2, 3}, rw[1] = {0.5f}, y[2] = {0, 0};
  int32_t ids[1] = {0};
  int64_t s_w_ih[3] = {1, 1, 2}, s_w_hi[3] = {1, 2, 1}, s_th[2] = {1, 2}, s_tk[2] = {1, 1};
  DLTensor t_wg = {wg, {kDLCPU, 0}, 3, {kDLFloat, 32, 1}, s_w_ih, NULL, 0};
  DLTensor t_wu = {wu, {kDLCPU, 0}, 3, {kDLFloat, 32, 1}, s_w_ih, NULL, 0};
  DLTensor t_wd = {wd, {kDLCPU, 0}, 3, {kDLFloat, 32, 1}, s_w_hi, NULL, 0};
  DLTensor t_x = {x, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, s_th, NULL, 0};
  DLTensor t_y = {y, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, s_th, NULL, 0};
  DLTensor t_ids = {ids, {kDLCPU, 0}, 2, {kDLInt, 32, 1}, s_tk, NULL, 0};
  DLTensor t_rw = {rw, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, s_tk, NULL, 0};

  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = 1;
  eo.pin_threads = 0;
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = 1;
  mo.top_k = 1;
  mo.hidden = 2;
  mo.intermediate = 1;
  mo.max_tokens = 4;

  kt_engine* engine = NULL;
  kt_moe* moe = NULL;
  const kt_arg weights[] = {{KT_ARG_W_GATE, &t_wg}, {KT_ARG_W_UP, &t_wu}, {KT_ARG_W_DOWN, &t_wd}};
  const kt_arg fwd[] = {{KT_ARG_X, &t_x}, {KT_ARG_IDS, &t_ids}, {KT_ARG_ROUTE_WEIGHTS, &t_rw},
                        {KT_ARG_Y, &t_y}};
  kt_status st = kt_engine_create(&eo, &engine);
  if (st == KT_OK) st = kt_moe_create(engine, &mo, &moe);
  if (st == KT_OK) st = kt_moe_load_weights(moe, NULL, weights, 3);
  if (st == KT_OK) st = kt_moe_forward(moe, fwd, 4, NULL);
  if (st != KT_OK) {
    fprintf(stderr, "consumer: %s: %s\n", kt_status_string(st), kt_last_error());
    return 1;
  }
  kt_moe_destroy(moe);
  kt_engine_destroy(engine);

  const double a = 2.0 / (1.0 + exp(-2.0)) * 3.0;
  const double want[2] = {0.5 * a, -1.0 * a};
  for (int h = 0; h < 2; ++h) {
    if (fabs(y[h] - want[h]) > 1e-2 * fabs(want[h])) {
      fprintf(stderr, "consumer: y[%d] = %g, expected %g\n", h, y[h], want[h]);
      return 1;
    }
  }
  printf("consumer: kt %s, y = (%g, %g) as expected\n", kt_version(), y[0], y[1]);
  return 0;
}
