#include <stdio.h>
#include "kt_c_api.h"

enum { E = 4, K = 2, H = 64, I = 32, T = 3 };
static uint16_t w[3][E * I * H];  // gate [E,I,H], up [E,I,H], down [E,H,I]: bf16 bits
static float x[T * H], route_weights[T * K], y[T * H];
static int32_t ids[T * K];

static DLTensor tensor(void* data, DLDataTypeCode code, int ndim, int64_t* shape) {
  DLTensor t = {data, {kDLCPU, 0}, ndim, {code, code == kDLBfloat ? 16 : 32, 1}, shape, NULL, 0};
  return t;
}

int main(void) {
  for (int i = 0; i < E * I * H; ++i) w[0][i] = w[1][i] = w[2][i] = 0x3C80;  // 1/64
  for (int i = 0; i < T * H; ++i) x[i] = 1.f;
  for (int i = 0; i < T * K; ++i) ids[i] = i % E, route_weights[i] = 0.5f;
  int64_t gate_up[] = {E, I, H}, down[] = {E, H, I}, rows[] = {T, H}, routes[] = {T, K};
  DLTensor wg = tensor(w[0], kDLBfloat, 3, gate_up), wu = tensor(w[1], kDLBfloat, 3, gate_up),
           wd = tensor(w[2], kDLBfloat, 3, down), xt = tensor(x, kDLFloat, 2, rows),
           it = tensor(ids, kDLInt, 2, routes), wt = tensor(route_weights, kDLFloat, 2, routes),
           yt = tensor(y, kDLFloat, 2, rows);
  kt_arg weights[] = {{KT_ARG_W_GATE, &wg}, {KT_ARG_W_UP, &wu}, {KT_ARG_W_DOWN, &wd}};
  kt_arg call[] = {{KT_ARG_X, &xt}, {KT_ARG_IDS, &it}, {KT_ARG_ROUTE_WEIGHTS, &wt},
                   {KT_ARG_Y, &yt}};
  kt_engine* engine = NULL;
  kt_moe* moe = NULL;
  kt_moe_options o;
  kt_moe_options_init(&o);
  o.num_experts = E, o.top_k = K, o.hidden = H, o.intermediate = I;
  if (kt_engine_create(NULL, &engine) || kt_moe_create(engine, &o, &moe) ||
      kt_moe_load_weights(moe, NULL, weights, 3) || kt_moe_forward(moe, call, 4, NULL)) {
    fprintf(stderr, "%s\n", kt_last_error());
    return 1;
  }
  printf("y[0][0] = %.4f (silu(1) / 2 = 0.3655)\n", y[0]);
  kt_moe_destroy(moe);
  kt_engine_destroy(engine);
  return 0;
}
