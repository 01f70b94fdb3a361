/* A C99 host of kt: uses only the public header, references every function of
 * the core ABI (each the one libkt exports under its name), checks the public
 * struct layouts, and runs a tiny layer (forward, backward, async) against
 * values computed here by hand. */
#include <dlfcn.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "kt_c_api.h"

/* C99 has no static_assert: a negative array size fails the build. */
#define LAYOUT(name, cond) typedef char layout_##name[(cond) ? 1 : -1]
LAYOUT(arg_size, sizeof(kt_arg) == 16);
LAYOUT(arg_tensor, offsetof(kt_arg, tensor) == 8);
LAYOUT(engine_options_size, sizeof(kt_engine_options) == 56);
LAYOUT(engine_options_log_user, offsetof(kt_engine_options, log_user) == 32);
LAYOUT(engine_options_precision, offsetof(kt_engine_options, precision) == 40);
LAYOUT(engine_options_host_openmp, offsetof(kt_engine_options, host_openmp) == 44);
LAYOUT(engine_options_numa, offsetof(kt_engine_options, numa) == 48);
LAYOUT(engine_info_size, sizeof(kt_engine_info) == 56);
LAYOUT(engine_info_gemm_backend, offsetof(kt_engine_info, gemm_backend) == 32);
LAYOUT(engine_info_precision, offsetof(kt_engine_info, precision) == 36);
LAYOUT(engine_info_numa_nodes, offsetof(kt_engine_info, numa_nodes) == 40);
LAYOUT(engine_info_numa_node_workers, offsetof(kt_engine_info, numa_node_workers) == 48);
LAYOUT(moe_options_size, sizeof(kt_moe_options) == 96);
LAYOUT(moe_options_max_tokens, offsetof(kt_moe_options, max_tokens) == 40);
LAYOUT(moe_options_lora_targets, offsetof(kt_moe_options, lora_targets) == 88);
LAYOUT(load_options_size, sizeof(kt_load_options) == 16);
LAYOUT(backward_options_size, sizeof(kt_backward_options) == 24);
LAYOUT(backward_options_param_grads, offsetof(kt_backward_options, param_grads) == 16);
LAYOUT(status_values, KT_ERR_SHAPE == 5 && KT_ERR_CONTEXT == 10 && KT_ERR_INTERNAL == 17);
LAYOUT(arg_values, KT_ARG_X == 1 && KT_ARG_W_GATE == 16 && KT_ARG_LORA_A_GATE == 32 &&
                       KT_ARG_GRAD_LORA_A_GATE == 48 && KT_ARG_GRAD_W_GATE == 64);

typedef void (*any_fn)(void);
/* dlsym's object pointer is copied into a function pointer (POSIX). */
LAYOUT(function_pointer_size, sizeof(any_fn) == sizeof(void*));

/* Every function of the core ABI, by name and by the address this host links
 * to (the names are checked against the exported symbol list by
 * tests/abi/check_exports.py; the addresses by check_core_abi_by_name). */
struct abi_function {
  const char* name;
  any_fn address;
};
#define FN(f) {#f, (any_fn)f}
static const struct abi_function core_abi[] = {
    FN(kt_version),
    FN(kt_version_number),
    FN(kt_abi_version),
    FN(kt_build_info),
    FN(kt_status_string),
    FN(kt_last_error),
    FN(kt_clear_error),
    FN(kt_cpu_isa),
    FN(kt_isa_name),
    FN(kt_engine_options_defaults),
    FN(kt_engine_create),
    FN(kt_engine_destroy),
    FN(kt_engine_get_info),
    FN(kt_engine_set_gemm_backend),
    FN(kt_moe_options_defaults),
    FN(kt_moe_create),
    FN(kt_moe_destroy),
    FN(kt_moe_lora_scale),
    FN(kt_load_options_defaults),
    FN(kt_moe_load_weights),
    FN(kt_moe_load_expert),
    FN(kt_moe_set_skipped),
    FN(kt_moe_num_loaded),
    FN(kt_moe_bind),
    FN(kt_moe_params_changed),
    FN(kt_moe_set_grad_hook),
    FN(kt_moe_forward),
    FN(kt_backward_options_defaults),
    FN(kt_moe_backward),
    FN(kt_context_release),
    FN(kt_moe_forward_submit),
    FN(kt_moe_backward_submit),
    FN(kt_job_run),
    FN(kt_job_wait),
    FN(kt_job_done),
    FN(kt_job_destroy),
    FN(kt_stage_name),
    FN(kt_engine_set_profiling),
    FN(kt_engine_profile_stage),
    FN(kt_engine_reset_profile),
    FN(kt_kernel_name),
    FN(kt_engine_profile_kernel),
    FN(kt_moe_read_weights),
};

static int failures = 0;
#define CHECK(cond)                                                      \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, #cond, \
              kt_last_error());                                          \
      ++failures;                                                        \
    }                                                                    \
  } while (0)

static DLTensor tensor(void* data, DLDataTypeCode code, int bits, int ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.dtype.code = (uint8_t)code;
  t.dtype.bits = (uint8_t)bits;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

/* kt_engine_options as a host compiled against the first v1 header laid it
 * out (before precision was appended), followed by memory of the host's own. */
struct engine_options_v1_0 {
  size_t struct_size;
  int num_threads;
  int pin_threads;
  kt_isa max_isa;
  int verbosity;
  kt_log_fn log_fn;
  void* log_user;
};
struct old_host_memory {
  struct engine_options_v1_0 options;
  unsigned char canary[32];
};
/* The same struct as a host compiled against a newer header would have it. */
struct newer_engine_options {
  kt_engine_options known;
  int64_t unknown_field;
};

/* Hosts of older and newer layouts get exactly their own bytes written and
 * read: defaults never run past the caller's struct_size, fields the library
 * does not know are refused unless zero. */
static void check_growable_structs(void) {
  struct old_host_memory old;
  struct newer_engine_options newer;
  kt_engine* e = NULL;
  kt_engine_info info;
  size_t i;
  memset(&old, 0xA5, sizeof(old));
  kt_engine_options_defaults((kt_engine_options*)&old.options, sizeof(old.options));
  CHECK(old.options.struct_size == sizeof(old.options));
  CHECK(old.options.pin_threads == 1 && old.options.max_isa == KT_ISA_AUTO && old.options.verbosity == -1);
  for (i = 0; i < sizeof(old.canary); ++i) CHECK(old.canary[i] == 0xA5);
  old.options.num_threads = 1;
  CHECK(kt_engine_create((const kt_engine_options*)&old.options, &e) == KT_OK);
  info.struct_size = sizeof(info);
  CHECK(kt_engine_get_info(e, &info) == KT_OK && info.num_threads == 1);
  CHECK(info.precision == KT_PRECISION_DEFAULT);
  CHECK(kt_engine_destroy(e) == KT_OK);
  /* An info struct of an older layout (up to gemm_backend) is filled only so far. */
  memset(&info, 0x5A, sizeof(info));
  info.struct_size = offsetof(kt_engine_info, precision);
  CHECK(kt_engine_create(NULL, &e) == KT_OK);
  CHECK(kt_engine_get_info(e, &info) == KT_OK);
  CHECK(info.struct_size == offsetof(kt_engine_info, precision));
  CHECK(*(const unsigned char*)&info.precision == 0x5A);
  CHECK(kt_engine_destroy(e) == KT_OK);

  memset(&newer, 0xA5, sizeof(newer));
  kt_engine_options_defaults(&newer.known, sizeof(newer));
  CHECK(newer.known.struct_size == sizeof(newer) && newer.unknown_field == 0);
  CHECK(newer.known.precision == KT_PRECISION_DEFAULT && newer.known.pin_threads == 1);
  newer.known.num_threads = 1;
  CHECK(kt_engine_create(&newer.known, &e) == KT_OK);
  CHECK(kt_engine_destroy(e) == KT_OK);
  newer.unknown_field = 7;
  e = NULL;
  CHECK(kt_engine_create(&newer.known, &e) == KT_ERR_UNSUPPORTED && e == NULL);
  CHECK(strstr(kt_last_error(), "kt_engine_create") != NULL);
  /* A size that cannot even hold struct_size, or that no struct version has,
   * writes nothing. */
  memset(&old, 0xA5, sizeof(old));
  kt_engine_options_defaults((kt_engine_options*)&old.options, 4);
  CHECK(((const unsigned char*)&old.options)[0] == 0xA5);
  kt_engine_options_defaults((kt_engine_options*)&old.options, (size_t)1 << 40);
  CHECK(((const unsigned char*)&old.options)[0] == 0xA5);
}

/* Looked up by name in the running program (as a binding that loads libkt
 * and looks names up does), each function is the one this host linked to: a
 * name the header turned into a macro, an inline wrapper or another symbol
 * gives another address, or none. */
static void check_core_abi_by_name(void) {
  size_t i;
  void* self = dlopen(NULL, RTLD_NOW);
  CHECK(self != NULL);
  if (!self) return;
  for (i = 0; i < sizeof(core_abi) / sizeof(core_abi[0]); ++i) {
    void* found = dlsym(self, core_abi[i].name);
    any_fn f = NULL;
    if (found) memcpy(&f, &found, sizeof(f));
    if (f != core_abi[i].address) {
      fprintf(stderr, "%s:%d: %s: dlsym gives %p, the host links to another address\n", __FILE__, __LINE__,
              core_abi[i].name, found);
      ++failures;
    }
  }
  CHECK(dlclose(self) == 0);
}

/* |got - want| <= tol * scale, for every element; prints the first miss. */
static void check_close(const char* what, const float* got, const double* want, int n, double tol) {
  double scale = 0;
  int i;
  for (i = 0; i < n; ++i) scale = fabs(want[i]) > scale ? fabs(want[i]) : scale;
  for (i = 0; i < n; ++i) {
    if (!(fabs(got[i] - want[i]) <= tol * scale)) {
      fprintf(stderr, "%s:%d: %s[%d] = %.8g, computed by hand %.8g (tolerance %.1e of %.4g)\n", __FILE__,
              __LINE__, what, i, got[i], want[i], tol, scale);
      ++failures;
      return;
    }
  }
}

static int hook_calls = 0;
static void on_grads(kt_moe* moe, void* user) {
  (void)moe;
  *(int*)user += 1;
}

int main(void) {
  check_core_abi_by_name();
  CHECK(kt_abi_version() == KT_ABI_VERSION);
  CHECK(kt_version_number() == KT_VERSION_MAJOR * 10000 + KT_VERSION_MINOR * 100 + KT_VERSION_PATCH);
  CHECK(strlen(kt_version()) >= 5);
  CHECK(strstr(kt_build_info(), "ref") != NULL);
  CHECK(strcmp(kt_isa_name(KT_ISA_AVX2), "avx2") == 0);
  CHECK(kt_cpu_isa() >= KT_ISA_REF);
  CHECK(strcmp(kt_status_string(KT_ERR_DTYPE), "KT_ERR_DTYPE") == 0);

  check_growable_structs();

  kt_engine* engine = NULL;
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = 1;
  CHECK(kt_engine_create(&eo, &engine) == KT_OK);
  kt_engine_info info;
  info.struct_size = sizeof(info);
  CHECK(kt_engine_get_info(engine, &info) == KT_OK);
  CHECK(info.num_threads == 1 && info.kernel_name != NULL && info.gemm_backend == KT_GEMM_NATIVE);
  /* KT_NUMA_OFF by default: one node holding every worker. */
  CHECK(eo.numa == KT_NUMA_OFF && info.numa_nodes == 1 && info.numa_node_workers != NULL &&
        info.numa_node_workers[0] == 1);
  /* Choosing kt's own GEMMs again is always possible before any layer. */
  CHECK(kt_engine_set_gemm_backend(engine, KT_GEMM_NATIVE) == KT_OK);
  CHECK(kt_engine_set_gemm_backend(engine, (kt_gemm_backend)9) == KT_ERR_INVALID_ARGUMENT);

  /* E = 1 expert, k = 1, H = 2, I = 1, weights exact in bf16 and no two
   * alike (a swapped index shows), LoRA on down with rank 1: A = 0.5,
   * B = (0.5, 0.25), alpha = 2 -> s = alpha / r = 2. */
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = 1; mo.top_k = 1; mo.hidden = 2; mo.intermediate = 1; mo.max_tokens = 1;
  mo.mode = KT_MODE_LORA; mo.lora_rank = 1; mo.lora_alpha = 2.f; mo.lora_targets = KT_PROJ_DOWN;
  kt_moe* moe = NULL;
  CHECK(kt_moe_create(engine, &mo, &moe) == KT_OK);
  float s = 0;
  CHECK(kt_moe_lora_scale(moe, &s) == KT_OK && s == 2.f);

  float wg[2] = {1, 0.5f}, wu[2] = {0.5f, 1}, wd[2] = {1, 0.25f};
  int64_t sg[3] = {1, 1, 2}, sd[3] = {1, 2, 1};
  DLTensor tg = tensor(wg, kDLFloat, 32, 3, sg), tu = tensor(wu, kDLFloat, 32, 3, sg),
           td = tensor(wd, kDLFloat, 32, 3, sd);
  kt_arg load[3];
  load[0].id = KT_ARG_W_GATE; load[0].tensor = &tg;
  load[1].id = KT_ARG_W_UP; load[1].tensor = &tu;
  load[2].id = KT_ARG_W_DOWN; load[2].tensor = &td;
  kt_load_options lo;
  kt_load_options_init(&lo);
  CHECK(kt_moe_load_weights(moe, &lo, load, 3) == KT_OK);
  CHECK(kt_moe_load_expert(moe, 0, NULL, load, 3) == KT_ERR_SHAPE); /* 3-D given to a 2-D call */
  int64_t n = 0;
  CHECK(kt_moe_num_loaded(moe, &n) == KT_OK && n == 1);
  /* The packed weights read back exactly (they are exact in bf16); a layer
   * without biases refuses a bias destination. */
  float back[2] = {0, 0};
  DLTensor tback = tensor(back, kDLFloat, 32, 3, sd);
  kt_arg readback[1];
  readback[0].id = KT_ARG_W_DOWN; readback[0].tensor = &tback;
  CHECK(kt_moe_read_weights(moe, readback, 1) == KT_OK && back[0] == wd[0] && back[1] == wd[1]);
  readback[0].id = KT_ARG_B_DOWN;
  CHECK(kt_moe_read_weights(moe, readback, 1) == KT_ERR_INVALID_ARGUMENT);
  CHECK(strstr(kt_last_error(), "kt_moe_read_weights") != NULL);
  unsigned char mask[1] = {0};
  int64_t smask[1] = {1};
  DLTensor tmask = tensor(mask, kDLUInt, 8, 1, smask);
  CHECK(kt_moe_set_skipped(moe, &tmask) == KT_OK);

  float la[1] = {0.5f}, lb[2] = {0.5f, 0.25f}, gla[1] = {0}, glb[2] = {0, 0};
  int64_t sa[3] = {1, 1, 1}, sb[3] = {1, 2, 1};
  DLTensor ta = tensor(la, kDLFloat, 32, 3, sa), tb = tensor(lb, kDLFloat, 32, 3, sb),
           tga = tensor(gla, kDLFloat, 32, 3, sa), tgb = tensor(glb, kDLFloat, 32, 3, sb);
  kt_arg bind[4];
  bind[0].id = KT_ARG_LORA_A_DOWN; bind[0].tensor = &ta;
  bind[1].id = KT_ARG_LORA_B_DOWN; bind[1].tensor = &tb;
  bind[2].id = KT_ARG_GRAD_LORA_A_DOWN; bind[2].tensor = &tga;
  bind[3].id = KT_ARG_GRAD_LORA_B_DOWN; bind[3].tensor = &tgb;
  CHECK(kt_moe_bind(moe, bind, 4) == KT_OK);
  CHECK(kt_moe_params_changed(moe) == KT_OK);
  CHECK(kt_moe_set_grad_hook(moe, on_grads, &hook_calls) == KT_OK);

  float x[2] = {1, 2}, y[2] = {0, 0}, w[1] = {0.5f}, dy[2] = {1, -0.5f}, dx[2] = {0, 0}, dw[1] = {0};
  /* By hand, in double (docs/math.md): g = Wg x = 2, u = Wu x = 2.5,
   * a = silu(g) u; the down projection's effective weight is
   * Wd + s B A = (1.5, 0.5), o = Weff a, y = w o. Backward with dy:
   * dw = <dy, o>, do = w dy, da = <Weff, do>, dg = da u silu'(g),
   * du = da silu(g), dx = Wg^T dg + Wu^T du, dA = s <B, do> a,
   * dB_h = s do_h A a. */
  double want_y[2], want_dx[2], want_dw[1], want_da[1], want_db[2];
  {
    const double sc = 2.0, g = wg[0] * x[0] + wg[1] * x[1], u = wu[0] * x[0] + wu[1] * x[1];
    const double sig = 1.0 / (1.0 + exp(-g)), a = g * sig * u;
    double weff[2], dout[2], da = 0, bdo = 0, dg, du;
    int h;
    want_dw[0] = 0;
    for (h = 0; h < 2; ++h) {
      weff[h] = wd[h] + sc * lb[h] * la[0];
      want_y[h] = w[0] * weff[h] * a;
      want_dw[0] += dy[h] * weff[h] * a;
      dout[h] = w[0] * dy[h];
      da += weff[h] * dout[h];
      bdo += lb[h] * dout[h];
      want_db[h] = sc * dout[h] * la[0] * a;
    }
    dg = da * u * sig * (1.0 + g * (1.0 - sig));
    du = da * g * sig;
    for (h = 0; h < 2; ++h) want_dx[h] = wg[h] * dg + wu[h] * du;
    want_da[0] = sc * bdo * a;
  }
  /* The default precision may round x, a and the gradients to bf16 on the
   * way (2^-9 each, a few in a row): 1e-2 of the largest element. A wrong
   * scale, a missing term or a swapped index is off by 20 % or more. */
  const double tol = 1e-2;
  int32_t ids[1] = {0};
  int64_t sx[2] = {1, 2}, sk[2] = {1, 1};
  DLTensor tx = tensor(x, kDLFloat, 32, 2, sx), ty = tensor(y, kDLFloat, 32, 2, sx),
           tids = tensor(ids, kDLInt, 32, 2, sk), tw = tensor(w, kDLFloat, 32, 2, sk),
           tdy = tensor(dy, kDLFloat, 32, 2, sx), tdx = tensor(dx, kDLFloat, 32, 2, sx),
           tdw = tensor(dw, kDLFloat, 32, 2, sk);
  kt_arg fwd[4];
  fwd[0].id = KT_ARG_X; fwd[0].tensor = &tx;
  fwd[1].id = KT_ARG_IDS; fwd[1].tensor = &tids;
  fwd[2].id = KT_ARG_ROUTE_WEIGHTS; fwd[2].tensor = &tw;
  fwd[3].id = KT_ARG_Y; fwd[3].tensor = &ty;
  kt_context* ctx = NULL;
  CHECK(kt_engine_set_profiling(engine, 1) == KT_OK);
  CHECK(kt_moe_forward(moe, fwd, 4, &ctx) == KT_OK);
  {
    int64_t calls = 0;
    double seconds = -1;
    int stages = 0;
    while (kt_stage_name(stages) != NULL) ++stages;
    CHECK(stages == KT_STAGE_EXPERTS + 1);
    CHECK(strcmp(kt_stage_name(KT_STAGE_GATE_UP), "gate_up") == 0);
    CHECK(kt_engine_profile_stage(engine, KT_STAGE_GATE_UP, &calls, &seconds) == KT_OK);
    CHECK(calls == 1 && seconds >= 0);
    CHECK(kt_engine_profile_stage(engine, stages, &calls, &seconds) == KT_ERR_INVALID_ARGUMENT);
    {
      /* the gate/up GEMMs' flops, by the kernels that ran them */
      int64_t kernel_calls = 0, flops = 0, gate_up_flops = 0;
      int kernel = 0;
      for (; kt_kernel_name(kernel) != NULL; ++kernel) {
        CHECK(kt_engine_profile_kernel(engine, KT_STAGE_GATE_UP, kernel, &kernel_calls, &flops) ==
              KT_OK);
        gate_up_flops += flops;
      }
      CHECK(gate_up_flops > 0);
      CHECK(kt_engine_profile_kernel(engine, KT_STAGE_GATE_UP, kernel, &kernel_calls, &flops) ==
            KT_ERR_INVALID_ARGUMENT);
    }
    CHECK(kt_engine_reset_profile(engine) == KT_OK);
    CHECK(kt_engine_profile_stage(engine, KT_STAGE_GATE_UP, &calls, &seconds) == KT_OK && calls == 0);
    CHECK(kt_engine_set_profiling(engine, 0) == KT_OK);
  }
  check_close("y", y, want_y, 2, tol);
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  kt_arg bwd[3];
  bwd[0].id = KT_ARG_DY; bwd[0].tensor = &tdy;
  bwd[1].id = KT_ARG_DX; bwd[1].tensor = &tdx;
  bwd[2].id = KT_ARG_DROUTE_WEIGHTS; bwd[2].tensor = &tdw;
  CHECK(kt_moe_backward(moe, ctx, &bo, bwd, 3) == KT_OK);
  CHECK(hook_calls == 1);
  check_close("droute_weights", dw, want_dw, 1, tol);
  check_close("dx", dx, want_dx, 2, tol);
  check_close("grad lora_A_down", gla, want_da, 1, tol);
  check_close("grad lora_B_down", glb, want_db, 2, tol);
  CHECK(kt_moe_backward(moe, ctx, &bo, bwd, 3) == KT_ERR_CONTEXT);
  CHECK(strstr(kt_last_error(), "spent") != NULL);
  kt_clear_error();
  CHECK(strcmp(kt_last_error(), "") == 0);
  kt_context_release(ctx);

  kt_job* job = NULL;
  memset(y, 0, sizeof(y));
  CHECK(kt_moe_forward_submit(moe, fwd, 4, &ctx, 0, &job) == KT_OK);
  CHECK(kt_job_wait(job) == KT_OK);
  CHECK(kt_job_done(job) == 1);
  kt_job_destroy(job);
  check_close("y (submitted)", y, want_y, 2, tol);
  CHECK(kt_moe_backward_submit(moe, ctx, NULL, bwd, 1, KT_SUBMIT_DEFERRED, &job) == KT_OK);
  kt_job_run(job);
  CHECK(kt_job_wait(job) == KT_OK);
  kt_job_destroy(job);
  kt_context_release(ctx);
  CHECK(hook_calls == 2);

  kt_moe_destroy(moe);
  CHECK(kt_engine_destroy(engine) == KT_OK);
  kt_moe_destroy(NULL);
  kt_context_release(NULL);
  kt_job_destroy(NULL);
  CHECK(kt_engine_destroy(NULL) == KT_OK);
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("kt C99 host: all checks passed (kt %s, abi %d)\n", kt_version(), kt_abi_version());
  return 0;
}
