/*
 * A C host that loads kt at run time: dlopen("libkt.so.<KT_ABI_VERSION>"),
 * every call resolved with dlsym, the ABI major checked before anything else.
 * It builds a small synthetic MoE layer, runs a training forward (saving a
 * context) and a backward, and checks y, dx and the routing-weight gradient
 * against a double-precision reference computed here.
 *
 *   kt_c_dlopen [path/to/libkt.so.1]     (default: the SONAME, found through
 *                                         LD_LIBRARY_PATH and the ld.so cache)
 *
 * The header is used for its types and constants only; nothing links to libkt.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt_c_api.h"

#define KT_STR2(x) #x
#define KT_STR(x) KT_STR2(x)
#define KT_SONAME "libkt.so." KT_STR(KT_ABI_VERSION)

/* Layer shape: E experts, top-k routes, hidden H, intermediate I, T tokens. */
enum { E = 4, K = 2, H = 16, I = 8, T = 5 };

/* The calls this host uses, resolved from the library. */
static struct {
  int (*abi_version)(void);
  const char* (*version)(void);
  const char* (*last_error)(void);
  const char* (*status_string)(kt_status);
  void (*engine_options_defaults)(kt_engine_options*, size_t);
  kt_status (*engine_create)(const kt_engine_options*, kt_engine**);
  kt_status (*engine_destroy)(kt_engine*);
  void (*moe_options_defaults)(kt_moe_options*, size_t);
  kt_status (*moe_create)(kt_engine*, const kt_moe_options*, kt_moe**);
  void (*moe_destroy)(kt_moe*);
  kt_status (*moe_load_weights)(kt_moe*, const kt_load_options*, const kt_arg*, size_t);
  kt_status (*moe_forward)(kt_moe*, const kt_arg*, size_t, kt_context**);
  kt_status (*moe_backward)(kt_moe*, kt_context*, const kt_backward_options*, const kt_arg*,
                            size_t);
  void (*context_release)(kt_context*);
} kt;

static int resolve(void* lib, const char* name, void* slot) {
  void* sym = dlsym(lib, name);
  if (!sym) {
    fprintf(stderr, "kt_dlopen: %s does not export %s\n", KT_SONAME, name);
    return 0;
  }
  /* POSIX guarantees object and function pointers convert through void*. */
  memcpy(slot, &sym, sizeof(sym));
  return 1;
}

static int resolve_all(void* lib) {
  int ok = 1;
  ok &= resolve(lib, "kt_abi_version", &kt.abi_version);
  ok &= resolve(lib, "kt_version", &kt.version);
  ok &= resolve(lib, "kt_last_error", &kt.last_error);
  ok &= resolve(lib, "kt_status_string", &kt.status_string);
  ok &= resolve(lib, "kt_engine_options_defaults", &kt.engine_options_defaults);
  ok &= resolve(lib, "kt_engine_create", &kt.engine_create);
  ok &= resolve(lib, "kt_engine_destroy", &kt.engine_destroy);
  ok &= resolve(lib, "kt_moe_options_defaults", &kt.moe_options_defaults);
  ok &= resolve(lib, "kt_moe_create", &kt.moe_create);
  ok &= resolve(lib, "kt_moe_destroy", &kt.moe_destroy);
  ok &= resolve(lib, "kt_moe_load_weights", &kt.moe_load_weights);
  ok &= resolve(lib, "kt_moe_forward", &kt.moe_forward);
  ok &= resolve(lib, "kt_moe_backward", &kt.moe_backward);
  ok &= resolve(lib, "kt_context_release", &kt.context_release);
  return ok;
}

static int check(kt_status status, const char* what) {
  if (status == KT_OK) return 1;
  fprintf(stderr, "kt_dlopen: %s failed: %s: %s\n", what, kt.status_string(status),
          kt.last_error());
  return 0;
}

/* A compact row-major fp32/int32 DLTensor over host memory. */
static DLTensor view(void* data, uint8_t code, int ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device.device_type = kDLCPU;
  t.device.device_id = 0;
  t.ndim = ndim;
  t.dtype.code = code;
  t.dtype.bits = 32;
  t.dtype.lanes = 1;
  t.shape = shape;
  t.strides = NULL;
  t.byte_offset = 0;
  return t;
}

/* Synthetic values that are exact in bf16 (kt stores weights as bf16), so
 * the reference sees the very numbers the kernels multiply. */
static float pattern(int index, int mult, int mod, float scale) {
  return (float)((index * mult + 7) % mod - mod / 2) * scale;
}

static double silu(double g) { return g / (1.0 + exp(-g)); }

static float wg[E][I][H], wu[E][I][H], wd[E][H][I];
static float x[T][H], rw[T][K], y[T][H], dy[T][H], dx[T][H], drw[T][K];
static int32_t ids[T][K] = {{0, 1}, {2, 3}, {1, -1}, {3, 0}, {2, 1}};

/* y, dx and d(route weights) in double precision, straight from the math. */
static void reference(double ref_y[T][H], double ref_dx[T][H], double ref_drw[T][K]) {
  memset(ref_y, 0, sizeof(double) * T * H);
  memset(ref_dx, 0, sizeof(double) * T * H);
  memset(ref_drw, 0, sizeof(double) * T * K);
  for (int t = 0; t < T; ++t) {
    for (int j = 0; j < K; ++j) {
      const int e = ids[t][j];
      if (e < 0) continue;
      double g[I], u[I], a[I], o[H], da[I];
      for (int i = 0; i < I; ++i) {
        g[i] = u[i] = 0;
        for (int h = 0; h < H; ++h) {
          g[i] += (double)wg[e][i][h] * x[t][h];
          u[i] += (double)wu[e][i][h] * x[t][h];
        }
        a[i] = silu(g[i]) * u[i];
      }
      for (int h = 0; h < H; ++h) {
        o[h] = 0;
        for (int i = 0; i < I; ++i) o[h] += (double)wd[e][h][i] * a[i];
        ref_y[t][h] += rw[t][j] * o[h];
        ref_drw[t][j] += dy[t][h] * o[h];
      }
      for (int i = 0; i < I; ++i) {
        da[i] = 0;
        for (int h = 0; h < H; ++h) da[i] += (double)wd[e][h][i] * dy[t][h];
        da[i] *= rw[t][j];
        const double s = 1.0 / (1.0 + exp(-g[i]));
        const double dg = da[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
        const double du = da[i] * silu(g[i]);
        for (int h = 0; h < H; ++h)
          ref_dx[t][h] += (double)wg[e][i][h] * dg + (double)wu[e][i][h] * du;
      }
    }
  }
}

/* Relative error against the reference's largest magnitude; bf16 rounding of
 * the activation between the two GEMMs bounds it near 2^-8. */
static int compare(const char* name, const float* got, const double* want, int n) {
  double max_ref = 0, max_err = 0;
  for (int i = 0; i < n; ++i) {
    if (!isfinite(got[i])) {
      fprintf(stderr, "kt_dlopen: %s[%d] = %g is not finite\n", name, i, got[i]);
      return 0;
    }
    if (fabs(want[i]) > max_ref) max_ref = fabs(want[i]);
    if (fabs(got[i] - want[i]) > max_err) max_err = fabs(got[i] - want[i]);
  }
  const double rel = max_err / (max_ref > 0 ? max_ref : 1);
  printf("  %-18s max|ref| %.4f  max|err| %.2e  rel %.2e\n", name, max_ref, max_err, rel);
  if (max_ref == 0 || rel > 1e-2) {
    fprintf(stderr, "kt_dlopen: %s does not match the reference\n", name);
    return 0;
  }
  return 1;
}

static int run(void) {
  for (int e = 0; e < E; ++e)
    for (int i = 0; i < I; ++i)
      for (int h = 0; h < H; ++h) {
        const int n = (e * I + i) * H + h;
        wg[e][i][h] = pattern(n, 37, 17, 1.0f / 32);
        wu[e][i][h] = pattern(n, 29, 13, 1.0f / 32);
        wd[e][h][i] = pattern(n, 23, 19, 1.0f / 32);
      }
  for (int t = 0; t < T; ++t) {
    for (int h = 0; h < H; ++h) {
      x[t][h] = pattern(t * H + h, 13, 11, 1.0f / 4);
      dy[t][h] = pattern(t * H + h, 7, 9, 1.0f / 8);
    }
    rw[t][0] = 0.625f;
    rw[t][1] = 0.375f;
  }

  kt_engine_options eo;
  kt.engine_options_defaults(&eo, sizeof(eo)); /* what the inline kt_engine_options_init does */
  eo.num_threads = 2;
  eo.pin_threads = 0;
  eo.verbosity = 0;
  kt_engine* engine = NULL;
  if (!check(kt.engine_create(&eo, &engine), "kt_engine_create")) return 0;

  kt_moe_options mo;
  kt.moe_options_defaults(&mo, sizeof(mo));
  mo.num_experts = E;
  mo.top_k = K;
  mo.hidden = H;
  mo.intermediate = I;
  mo.max_tokens = 64;
  kt_moe* moe = NULL;
  int ok = check(kt.moe_create(engine, &mo, &moe), "kt_moe_create");

  int64_t w_ih[3] = {E, I, H}, w_hi[3] = {E, H, I}, th[2] = {T, H}, tk[2] = {T, K};
  DLTensor t_wg = view(wg, kDLFloat, 3, w_ih), t_wu = view(wu, kDLFloat, 3, w_ih);
  DLTensor t_wd = view(wd, kDLFloat, 3, w_hi);
  DLTensor t_x = view(x, kDLFloat, 2, th), t_y = view(y, kDLFloat, 2, th);
  DLTensor t_ids = view(ids, kDLInt, 2, tk), t_rw = view(rw, kDLFloat, 2, tk);
  DLTensor t_dy = view(dy, kDLFloat, 2, th), t_dx = view(dx, kDLFloat, 2, th);
  DLTensor t_drw = view(drw, kDLFloat, 2, tk);

  if (ok) {
    const kt_arg weights[] = {{KT_ARG_W_GATE, &t_wg}, {KT_ARG_W_UP, &t_wu}, {KT_ARG_W_DOWN, &t_wd}};
    ok = check(kt.moe_load_weights(moe, NULL, weights, 3), "kt_moe_load_weights");
  }
  kt_context* ctx = NULL;
  if (ok) {
    const kt_arg fwd[] = {
        {KT_ARG_X, &t_x}, {KT_ARG_IDS, &t_ids}, {KT_ARG_ROUTE_WEIGHTS, &t_rw}, {KT_ARG_Y, &t_y}};
    ok = check(kt.moe_forward(moe, fwd, 4, &ctx), "kt_moe_forward");
  }
  if (ok) {
    const kt_arg bwd[] = {{KT_ARG_DY, &t_dy}, {KT_ARG_DX, &t_dx}, {KT_ARG_DROUTE_WEIGHTS, &t_drw}};
    ok = check(kt.moe_backward(moe, ctx, NULL, bwd, 3), "kt_moe_backward");
  }
  kt.context_release(ctx);
  kt.moe_destroy(moe);
  ok &= check(kt.engine_destroy(engine), "kt_engine_destroy");
  if (!ok) return 0;

  static double ref_y[T][H], ref_dx[T][H], ref_drw[T][K];
  reference(ref_y, ref_dx, ref_drw);
  ok &= compare("y", &y[0][0], &ref_y[0][0], T * H);
  ok &= compare("dx", &dx[0][0], &ref_dx[0][0], T * H);
  ok &= compare("d(route weights)", &drw[0][0], &ref_drw[0][0], T * K);
  if (drw[2][1] != 0.0f) {
    fprintf(stderr, "kt_dlopen: the unrouted slot (id -1) got gradient %g, not 0\n", drw[2][1]);
    ok = 0;
  }
  return ok;
}

int main(int argc, char** argv) {
  const char* path = argc > 1 ? argv[1] : KT_SONAME;
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "kt_dlopen: cannot load %s: %s\n", path, dlerror());
    return 1;
  }
  if (!resolve_all(lib)) return 1;
  /* A library of another ABI major lays out structs and values differently:
   * refuse it before passing any of them. */
  if (kt.abi_version() != KT_ABI_VERSION) {
    fprintf(stderr, "kt_dlopen: %s has ABI %d, this program was built for ABI %d\n", path,
            kt.abi_version(), KT_ABI_VERSION);
    return 1;
  }
  printf("kt %s (ABI %d) loaded from %s\n", kt.version(), kt.abi_version(), path);
  const int ok = run();
  dlclose(lib);
  printf(ok ? "forward and backward match the reference\n" : "FAILED\n");
  return ok ? 0 : 1;
}
