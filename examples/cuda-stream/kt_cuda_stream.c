/*
 * The CUDA-stream path of a serving host: kt's routed-expert forward runs as
 * a deferred job that the host's own CUDA stream starts in order with its GPU
 * work, through cudaLaunchHostFunc(stream, kt_job_run, job):
 *
 *   stream: copy x GPU -> pinned host | kt_job_run (kt computes y) |
 *           copy y pinned host -> GPU | (the host's next kernels)
 *
 * The host thread only enqueues; it never blocks between the copies. The
 * result read back from the GPU is checked against a synchronous
 * kt_moe_forward of the same layer on the same inputs (the same engine, so
 * the same bits). Exits 77 (skipped) when no CUDA device is usable.
 *
 *   kt_cuda_stream [tokens]
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kt_c_api.h"

enum { E = 8, K = 2, H = 64, I = 32, MAX_T = 256, SKIPPED = 77 };

#define CUDA_CHECK(call)                                                                     \
  do {                                                                                       \
    cudaError_t err_ = (call);                                                               \
    if (err_ != cudaSuccess) {                                                               \
      fprintf(stderr, "kt_cuda_stream: %s: %s\n", #call, cudaGetErrorString(err_));          \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

#define KT_CHECK(call)                                                                       \
  do {                                                                                       \
    kt_status st_ = (call);                                                                  \
    if (st_ != KT_OK) {                                                                      \
      fprintf(stderr, "kt_cuda_stream: %s: %s: %s\n", #call, kt_status_string(st_),          \
              kt_last_error());                                                              \
      return 1;                                                                              \
    }                                                                                        \
  } while (0)

static uint32_t rng_state = 12345u;
static float uniform(void) { /* in [-1, 1) */
  rng_state = rng_state * 1664525u + 1013904223u;
  return (float)(rng_state >> 8) / (float)(1u << 23) - 1.0f;
}

static DLTensor view(void* data, DLDataTypeCode code, int bits, int ndim, int64_t* shape) {
  DLTensor t;
  memset(&t, 0, sizeof(t));
  t.data = data;
  t.device.device_type = kDLCPU; /* pinned host memory is CPU memory to kt */
  t.ndim = ndim;
  t.dtype.code = (uint8_t)code;
  t.dtype.bits = (uint8_t)bits;
  t.dtype.lanes = 1;
  t.shape = shape;
  return t;
}

static int run(int T) {
  /* A small layer with synthetic fp32 weights (kt stores them as bf16). */
  static float w_gate[E * I * H], w_up[E * I * H], w_down[E * H * I];
  for (size_t i = 0; i < sizeof(w_gate) / sizeof(w_gate[0]); ++i) w_gate[i] = uniform() * 0.125f;
  for (size_t i = 0; i < sizeof(w_up) / sizeof(w_up[0]); ++i) w_up[i] = uniform() * 0.125f;
  for (size_t i = 0; i < sizeof(w_down) / sizeof(w_down[0]); ++i) w_down[i] = uniform() * 0.18f;

  kt_engine_options eo;
  kt_engine_options_init(&eo);
  kt_engine* engine = NULL;
  KT_CHECK(kt_engine_create(&eo, &engine));
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = E;
  mo.top_k = K;
  mo.hidden = H;
  mo.intermediate = I;
  mo.max_tokens = MAX_T;
  kt_moe* moe = NULL;
  KT_CHECK(kt_moe_create(engine, &mo, &moe));
  int64_t gate_shape[3] = {E, I, H}, down_shape[3] = {E, H, I};
  DLTensor tg = view(w_gate, kDLFloat, 32, 3, gate_shape);
  DLTensor tu = view(w_up, kDLFloat, 32, 3, gate_shape);
  DLTensor td = view(w_down, kDLFloat, 32, 3, down_shape);
  kt_arg load[3] = {{KT_ARG_W_GATE, &tg}, {KT_ARG_W_UP, &tu}, {KT_ARG_W_DOWN, &td}};
  KT_CHECK(kt_moe_load_weights(moe, NULL, load, 3));

  /* The host's activations start on the GPU; the routing is in pinned memory
   * (as a router's top-k copied back would be). */
  float *x_host, *y_host, *w_host, *x_stage, *y_back, *y_ref, *x_dev, *y_dev;
  int32_t* ids_host;
  size_t xbytes = (size_t)T * H * sizeof(float);
  CUDA_CHECK(cudaMallocHost((void**)&x_host, xbytes));
  CUDA_CHECK(cudaMallocHost((void**)&y_host, xbytes));
  CUDA_CHECK(cudaMallocHost((void**)&w_host, (size_t)T * K * sizeof(float)));
  CUDA_CHECK(cudaMallocHost((void**)&ids_host, (size_t)T * K * sizeof(int32_t)));
  CUDA_CHECK(cudaMalloc((void**)&x_dev, xbytes));
  CUDA_CHECK(cudaMalloc((void**)&y_dev, xbytes));
  x_stage = (float*)malloc(xbytes);
  y_back = (float*)malloc(xbytes);
  y_ref = (float*)malloc(xbytes);
  if (!x_stage || !y_back || !y_ref) return 1;
  for (int64_t i = 0; i < (int64_t)T * H; ++i) x_stage[i] = uniform();
  CUDA_CHECK(cudaMemcpy(x_dev, x_stage, xbytes, cudaMemcpyHostToDevice));
  for (int t = 0; t < T; ++t) {
    ids_host[t * K] = (int32_t)(t % E);
    ids_host[t * K + 1] = (int32_t)((t * 3 + 1) % E);
    w_host[t * K] = 0.75f;
    w_host[t * K + 1] = 0.25f;
  }

  int64_t x_shape[2] = {T, H}, r_shape[2] = {T, K};
  DLTensor tx = view(x_host, kDLFloat, 32, 2, x_shape);
  DLTensor ty = view(y_host, kDLFloat, 32, 2, x_shape);
  DLTensor tids = view(ids_host, kDLInt, 32, 2, r_shape);
  DLTensor tw = view(w_host, kDLFloat, 32, 2, r_shape);
  kt_arg fwd[4] = {{KT_ARG_X, &tx}, {KT_ARG_IDS, &tids}, {KT_ARG_ROUTE_WEIGHTS, &tw}, {KT_ARG_Y, &ty}};

  cudaStream_t stream;
  CUDA_CHECK(cudaStreamCreate(&stream));
  /* Submitted deferred: nothing runs until the stream reaches kt_job_run,
   * after the copy that fills x_host. */
  kt_job* job = NULL;
  KT_CHECK(kt_moe_forward_submit(moe, fwd, 4, NULL, KT_SUBMIT_DEFERRED, &job));
  CUDA_CHECK(cudaMemcpyAsync(x_host, x_dev, xbytes, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaLaunchHostFunc(stream, kt_job_run, job));
  CUDA_CHECK(cudaMemcpyAsync(y_dev, y_host, xbytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaMemcpyAsync(y_back, y_dev, xbytes, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  KT_CHECK(kt_job_wait(job)); /* the job's own status; it ran on the stream's thread */
  kt_job_destroy(job);

  /* The same forward, synchronously, on the x that reached the host. */
  DLTensor tref = view(y_ref, kDLFloat, 32, 2, x_shape);
  kt_arg sync_args[4] = {{KT_ARG_X, &tx}, {KT_ARG_IDS, &tids}, {KT_ARG_ROUTE_WEIGHTS, &tw},
                         {KT_ARG_Y, &tref}};
  KT_CHECK(kt_moe_forward(moe, sync_args, 4, NULL));
  int64_t mismatches = 0;
  double norm = 0.0;
  for (int64_t i = 0; i < (int64_t)T * H; ++i) {
    mismatches += y_back[i] != y_ref[i] || x_host[i] != x_stage[i];
    norm += (double)y_ref[i] * y_ref[i];
  }
  printf("kt_cuda_stream: T=%d, y through the stream %s the synchronous forward's (|y| = %.4f)\n", T,
         mismatches ? "DIFFERS FROM" : "equals", sqrt(norm));

  CUDA_CHECK(cudaStreamDestroy(stream));
  CUDA_CHECK(cudaFree(x_dev));
  CUDA_CHECK(cudaFree(y_dev));
  CUDA_CHECK(cudaFreeHost(x_host));
  CUDA_CHECK(cudaFreeHost(y_host));
  CUDA_CHECK(cudaFreeHost(w_host));
  CUDA_CHECK(cudaFreeHost(ids_host));
  free(x_stage);
  free(y_back);
  free(y_ref);
  kt_moe_destroy(moe);
  KT_CHECK(kt_engine_destroy(engine));
  return mismatches != 0 || norm == 0.0;
}

int main(int argc, char** argv) {
  int T = argc > 1 ? atoi(argv[1]) : 48;
  if (T < 1 || T > MAX_T) {
    fprintf(stderr, "usage: kt_cuda_stream [tokens in 1..%d]\n", MAX_T);
    return 2;
  }
  int devices = 0;
  cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    printf("kt_cuda_stream: no usable CUDA device (%s): skipped\n",
           err != cudaSuccess ? cudaGetErrorString(err) : "none found");
    return SKIPPED;
  }
  return run(T);
}
