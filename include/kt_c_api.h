/*
 * kt — CPU engine for the routed experts of Mixture-of-Experts models.
 *
 * This header is the whole public contract of libkt. It is C99, compiles alone
 * (`-std=c99 -pedantic`), and every symbol it declares starts with `kt_`/`KT_`.
 *
 * Ownership words used below:
 *   borrowed for the call   kt reads/writes it only while the call runs.
 *   retained                kt keeps the pointer (not the memory) until the
 *                           stated end; the host keeps the memory alive.
 *   written by the call     an output; written only when the call returns KT_OK.
 *   owned by the handle     kt allocated it; valid until the handle is destroyed.
 *
 * Thread safety: every call is safe to make from any thread. Calls that compute
 * on one engine (forward, backward, load, params_changed) are serialised on
 * that engine's worker pool; two engines compute independently.
 *
 * Errors: every call that can fail returns a kt_status. On failure the state of
 * every handle is as it was before the call, outputs are untouched (except the
 * tensors an asynchronous job was computing into), and kt_last_error() returns a
 * message naming the call and the argument. No C++ exception, abort or exit
 * crosses this boundary.
 *
 * Handles (kt_engine*, kt_moe*, kt_context*, kt_job*, kt_ckpt*, kt_optimizer*,
 * kt_comm*, kt_dist_moe*, kt_dist_context*) are opaque
 * values, not addresses: kt finds each in a process-wide table of live
 * handles and never reads memory through one, and it never gives the same
 * value out twice in a process. So a destroyed, released, closed or
 * never-issued handle is refused (KT_ERR_INVALID_HANDLE; KT_ERR_CONTEXT for a
 * context), even after a new object took the old one's memory, and nothing is
 * acted on; calls returning void then do nothing and set kt_last_error(). A
 * handle destroyed while another thread's call on it runs is freed when that
 * call returns; calls that start after the destroy are refused.
 *
 * fork(): a process forked from one that holds kt handles (DataLoader workers,
 * multiprocessing's "fork" start method) inherits none of the engines' worker
 * and job threads, so every handle made before the fork is refused there at
 * once, by every call: calls returning kt_status give KT_ERR_INVALID_HANDLE
 * (destroy calls too), calls returning void do nothing, and kt_last_error()
 * says that the handle was made before this process was forked and names the
 * parent's pid. The child never frees what it inherited (the parent still owns
 * it). Engines, layers and everything else the child creates work as usual.
 * A child that only exec()s, or never calls kt, is not affected.
 *
 * Tensors cross as DLPack DLTensor (borrowed): dtype, shape, strides and device
 * are checked against what each argument requires; NULL strides mean compact
 * row-major. Only kDLCPU (and kDLCUDAHost) memory is accepted. A tensor's
 * byte size and the byte offset of each element must fit in 64 bits
 * (KT_ERR_SHAPE, KT_ERR_STRIDE). A tensor kt writes (Y, DX, DROUTE_WEIGHTS,
 * gradient buffers, kt_ckpt_* destinations) must address distinct elements
 * (no stride 0 over an extent > 1: KT_ERR_STRIDE) and must share no memory
 * with the call's other tensors, nor with the layer's bound parameters and
 * gradient buffers (KT_ERR_INVALID_ARGUMENT).
 *
 * Enum arguments and fields holding a value outside their enumerators are
 * refused with KT_ERR_INVALID_ARGUMENT.
 *
 * Growable structs start with `size_t struct_size`, the size of the struct as
 * the caller was compiled (fields are only ever appended). kt reads and writes
 * only the first struct_size bytes, so a host built against an older header
 * works with a newer library and the other way round. Option structs are set
 * up by their static inline `*_init()` (below), which passes the caller's
 * sizeof to the exported `*_defaults(struct, struct_size)`; bindings that
 * cannot call inline functions call `*_defaults` with their own size. Fields
 * the library does not know must be zero (they are then ignored); set to
 * anything else they fail the call with KT_ERR_UNSUPPORTED. A struct_size
 * above 4096 is KT_ERR_INVALID_ARGUMENT (and `*_defaults` writes nothing
 * then).
 *
 * Precision: kt computes in fp32 between stages. The weight GEMMs of the
 * default engine (avx512bf16 kernels) multiply bf16 operands: bf16 activations
 * are exact there, fp32 activations are rounded to bf16 first (relative L2
 * error of y, dx and gradients 2-3e-3 on fp32 inputs, against below 1e-6
 * with fp32 operands). An engine created with precision = KT_PRECISION_FP32
 * keeps fp32 operands (fp32 FMA kernels; weights are still stored in bf16).
 */
#ifndef KT_C_API_H_
#define KT_C_API_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- version */

/* The single definition of kt's version; the build reads it from here. */
#define KT_VERSION_MAJOR 1
#define KT_VERSION_MINOR 0
#define KT_VERSION_PATCH 0
/* ABI major: the SONAME is libkt.so.<KT_ABI_VERSION>. Raised on any
 * incompatible change of this header's functions, structs or values. */
#define KT_ABI_VERSION 1

#if defined(_WIN32)
#define KT_API
#else
#define KT_API __attribute__((visibility("default")))
#endif

/* "1.0.0": the library's version string (static storage). */
KT_API const char* kt_version(void);
/* MAJOR*10000 + MINOR*100 + PATCH of the loaded library. */
KT_API int kt_version_number(void);
/* ABI major of the loaded library; a host compares it with KT_ABI_VERSION. */
KT_API int kt_abi_version(void);
/* Compiler, build type, compiled ISA kernels, optional parts (static storage). */
KT_API const char* kt_build_info(void);

/* ----------------------------------------------------------------- status */

/* Numeric values are pinned: they never change within ABI major 1. */
typedef enum kt_status {
  KT_OK = 0,
  KT_ERR_INVALID_ARGUMENT = 1, /* a value out of its allowed set or range */
  KT_ERR_NULL_POINTER = 2,     /* a required pointer or tensor is NULL */
  KT_ERR_INVALID_HANDLE = 3,   /* NULL, destroyed or never-issued handle, one of another kind, or
                                  one made before this process was forked */
  KT_ERR_DTYPE = 4,            /* tensor dtype not accepted for that argument */
  KT_ERR_SHAPE = 5,            /* tensor rank or extents wrong */
  KT_ERR_STRIDE = 6,           /* strides not supported for that argument */
  KT_ERR_DEVICE = 7,           /* tensor not in CPU-addressable memory */
  KT_ERR_EXPERT_ID = 8,        /* an expert id outside [-1, E) */
  KT_ERR_TOO_MANY_TOKENS = 9,  /* T above the layer's max_tokens */
  KT_ERR_CONTEXT = 10,         /* saved context missing, released, spent, not ready, or of another layer */
  KT_ERR_NOT_BOUND = 11,       /* LoRA parameters or gradient buffers not bound */
  KT_ERR_NOT_LOADED = 12,      /* a routed expert has no weights loaded */
  KT_ERR_MODE = 13,            /* call not allowed in the layer's training mode */
  KT_ERR_UNSUPPORTED = 14,     /* valid request this build or CPU cannot do */
  KT_ERR_OUT_OF_MEMORY = 15,
  KT_ERR_IO = 16,              /* file system or file format error */
  KT_ERR_INTERNAL = 17,        /* a bug in kt; the message says where */
  KT_ERR_COMM = 18             /* a collective failed: a peer died or closed its connection,
                                  or the operation passed the communicator's timeout; the
                                  communicator is unusable afterwards */
} kt_status;

/* Short English name of a status ("KT_ERR_SHAPE"); never NULL. */
KT_API const char* kt_status_string(kt_status status);
/* The message of the last failed call on this thread ("" if none). The
 * pointer is valid until the next kt call on this thread. */
KT_API const char* kt_last_error(void);
/* Clears this thread's last error. */
KT_API void kt_clear_error(void);

/* -------------------------------------------------------------------- ISA */

/* Ordered: each level implies the kernels of the levels below it. */
typedef enum kt_isa {
  KT_ISA_AUTO = 0,       /* best this CPU runs, capped by env KT_MAX_ISA */
  KT_ISA_REF = 1,        /* portable scalar kernels (the reference twin) */
  KT_ISA_AVX2 = 2,       /* AVX2 + FMA, fp32 accumulate */
  KT_ISA_AVX512BF16 = 3, /* AVX-512 F/BW/VL + BF16 (vdpbf16ps) */
  KT_ISA_AMX = 4         /* AMX-BF16 tiles (falls back to AVX512BF16 kernels) */
} kt_isa;

/* Best ISA this CPU and OS support (cpuid + XCR0 + AMX permission), ignoring
 * KT_MAX_ISA. */
KT_API kt_isa kt_cpu_isa(void);
/* "ref", "avx2", "avx512bf16", "amx", "auto"; "unknown" otherwise. */
KT_API const char* kt_isa_name(kt_isa isa);

/* -------------------------------------------------------------------- log */

/* Log levels: 1 = what was chosen (ISA, kernels, threads), 2 = per call. */
typedef void (*kt_log_fn)(int level, const char* message, void* user);

/* ----------------------------------------------------------------- engine */

typedef struct kt_engine kt_engine;

/* Who computes the weight GEMMs (everything else is kt's own kernels). */
typedef enum kt_gemm_backend {
  KT_GEMM_AUTO = 0,   /* the default: kt's kernels, except with the amx kernels, where a
                         decode-sized and a prefill-sized GEMM are timed once per
                         process with both and oneDNN is taken when it is at least
                         15 % faster at both
                         (kt_engine_get_info says which; KT_VERBOSE=1 logs the times) */
  KT_GEMM_NATIVE = 1, /* kt's kernels */
  KT_GEMM_ONEDNN = 2  /* oneDNN matmul (brgemm) on kt's packed panels, in place: it uses
                         AMX on CPUs that have it. Needs a build with oneDNN and an
                         AVX-512 BF16 CPU. */
} kt_gemm_backend;

/* What the weight GEMMs multiply (see "Precision" at the top). */
typedef enum kt_precision {
  KT_PRECISION_DEFAULT = 0, /* fastest kernels: on avx512bf16 fp32 activations are
                               rounded to bf16 operands */
  KT_PRECISION_FP32 = 1     /* fp32 activations stay fp32: the fp32 FMA kernels (avx2, or
                               ref without AVX2); bf16 activations give the same results
                               as by default, more slowly */
} kt_precision;

/* Whether an engine splits over the NUMA nodes of its CPUs. */
typedef enum kt_numa_mode {
  KT_NUMA_OFF = 0, /* the default: one pool of workers, weights where they were first written */
  KT_NUMA_AUTO = 1 /* on a machine whose CPUs in the affinity mask span several nodes: workers
                      in proportion to each node's CPUs, pinned to CPUs of their node (even
                      with pin_threads 0); each expert owned by one node (consecutive experts
                      per node, in proportion to its workers), computed by that node's
                      workers, its weights asked to live on that node (kt's own buffers,
                      not a mapped packed cache). Results are the same bits as with
                      KT_NUMA_OFF. One node (one-node machine, one thread, host_openmp, or a
                      build without libnuma): the same as KT_NUMA_OFF */
} kt_numa_mode;

typedef struct kt_engine_options {
  size_t struct_size; /* sizeof(kt_engine_options); set by _init */
  int num_threads;    /* worker threads; 0 = one per CPU in the affinity mask; 1 = kt
                         computes on the calling thread (no worker) */
  int pin_threads;    /* 1 = pin worker i to the i-th CPU of the mask (default 1) */
  kt_isa max_isa;     /* cap; KT_ISA_AUTO = best, itself capped by env KT_MAX_ISA
                         (ref|avx2|avx512bf16|amx|auto, any case; another value
                         fails kt_engine_create with KT_ERR_INVALID_ARGUMENT) */
  int verbosity;      /* log level; -1 = from env KT_VERBOSE (default), 0 = silent */
  kt_log_fn log_fn;   /* NULL = stderr when verbosity > 0 */
  void* log_user;     /* passed to log_fn */
  kt_precision precision; /* default KT_PRECISION_DEFAULT */
  int host_openmp;    /* 1 = compute on the OpenMP threads of the thread that calls
                         kt (GNU OpenMP, the runtime torch's intra-op threads run
                         on) instead of kt's own workers: a host whose CPU work
                         runs on OpenMP then shares one set of threads with kt,
                         and those threads' idle spinning takes no core from kt.
                         num_threads 0 = the creating thread's omp_get_max_threads();
                         pin_threads is ignored (the host binds its OpenMP
                         threads). Asynchronous calls run on the engine's job
                         thread, whose OpenMP team is its own. Default 0;
                         KT_ERR_UNSUPPORTED in a build without OpenMP */
  kt_numa_mode numa;  /* default KT_NUMA_OFF; kt_engine_get_info says the nodes in use */
} kt_engine_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_engine_options_defaults(kt_engine_options* options, size_t struct_size);
static inline void kt_engine_options_init(kt_engine_options* options) {
  kt_engine_options_defaults(options, sizeof(*options));
}

/* Creates an engine with its own pinned worker pool. options may be NULL
 * (defaults). *engine is written by the call and owned by the caller. */
KT_API kt_status kt_engine_create(const kt_engine_options* options, kt_engine** engine);
/* Waits for the engine's pending jobs, then frees it. Every layer created on
 * it must be destroyed first (the call fails with KT_ERR_INVALID_ARGUMENT
 * otherwise, and the engine stays usable). NULL is accepted; a destroyed
 * engine gives KT_ERR_INVALID_HANDLE. */
KT_API kt_status kt_engine_destroy(kt_engine* engine);

typedef struct kt_engine_info {
  size_t struct_size;      /* set by the caller to sizeof(kt_engine_info) */
  int num_threads;         /* worker threads */
  kt_isa isa;              /* kernels in use */
  kt_isa cpu_isa;          /* best the CPU runs */
  const char* kernel_name; /* e.g. "gemm_bf16w_bf16_f32_6x64__avx512bf16" (grammar: src/kernels/README.md); owned by the engine */
  kt_gemm_backend gemm_backend; /* KT_GEMM_NATIVE or KT_GEMM_ONEDNN (never AUTO) */
  kt_precision precision;  /* as created */
  int numa_nodes;          /* NUMA nodes the workers and experts are split over (1 unless
                              KT_NUMA_AUTO found several) */
  const int* numa_node_workers; /* [numa_nodes] workers of each node, in node order (the
                              workers of a node have consecutive indices); owned by the engine */
} kt_engine_info;

/* Writes the engine's settings into *info (fields up to info->struct_size). */
KT_API kt_status kt_engine_get_info(const kt_engine* engine, kt_engine_info* info);

/* Chooses who computes the engine's weight GEMMs, before any layer is created
 * on it (a layer keeps the kernels it was created with): fails with
 * KT_ERR_INVALID_ARGUMENT while layers exist, KT_ERR_UNSUPPORTED when this
 * build (no oneDNN) or the engine's kernels (not avx512bf16) cannot run the
 * backend; the engine is unchanged then. Not thread-safe with other calls on
 * the engine. */
KT_API kt_status kt_engine_set_gemm_backend(kt_engine* engine, kt_gemm_backend backend);

/* -------------------------------------------------------------- MoE layer */

typedef struct kt_moe kt_moe;
/* Activations saved by a training forward for one backward. */
typedef struct kt_context kt_context;

typedef enum kt_activation {
  KT_ACT_SILU = 0,      /* a = silu(min(g,L)) * clamp(u,-L,L); no clamp when limit <= 0 */
  KT_ACT_SWIGLU_OAI = 1 /* g'=min(g,L), u'=clamp(u,-L,L), a = g'*sigmoid(alpha*g')*(u'+1) */
} kt_activation;

typedef enum kt_mode {
  KT_MODE_INFERENCE = 0, /* frozen experts; backward still gives dx and routing grads */
  KT_MODE_LORA = 1,      /* frozen base + trainable LoRA on the targeted projections */
  KT_MODE_FULL = 2       /* base weights (and biases) trainable */
} kt_mode;

/* Projection bits, for LoRA targets. */
#define KT_PROJ_GATE 1u
#define KT_PROJ_UP 2u
#define KT_PROJ_DOWN 4u
#define KT_PROJ_ALL 7u

/* Storage format of the frozen base weights inside kt (values pinned). The
 * quantized formats keep the weights quantized in memory, in the kernels'
 * panel layout with their scales; kernels dequantize in cache. They are
 * frozen bases: KT_MODE_INFERENCE or KT_MODE_LORA (KT_MODE_FULL is refused
 * with KT_ERR_MODE). See "Quantized frozen bases" below. */
typedef enum kt_weight_format {
  KT_FORMAT_BF16 = 0,         /* bf16 packed panels (sources bf16/fp16/fp32 are rounded to bf16) */
  KT_FORMAT_INT8_CHANNEL = 1, /* int8 per output channel, symmetric, quantized by kt at load */
  KT_FORMAT_INT4_G32 = 2,     /* int4 in groups of 32 inputs, symmetric, quantized by kt at load */
  /* Formats of quantized checkpoints (kt_ckpt_load_layer; see "Quantized
   * checkpoint formats" below): */
  KT_FORMAT_FP8_B128 = 3,     /* fp8 e4m3 with fp32 scales per 128x128 block (DeepSeek-V3, Kimi-K2) */
  KT_FORMAT_MXFP4 = 4,        /* fp4 e2m1 with e8m0 scales per 32 inputs (gpt-oss, DeepSeek-V4) */
  KT_FORMAT_INT4_G128 = 5,    /* int4 in groups of 128 inputs, symmetric (compressed-tensors);
                               * also quantized by kt at load from bf16/fp16/fp32 */
  /* Asymmetric int4 (compressed-tensors with zero points): int4 codes, a
   * bf16 scale and an int4 zero point per (output row, group of inputs);
   * W = (q - z) * s. Only from checkpoints (kt does not quantize to them). */
  KT_FORMAT_INT4_G32_ZP = 6,  /* int4 with zero points, groups of 32 inputs */
  KT_FORMAT_INT4_G128_ZP = 7  /* int4 with zero points, groups of 128 inputs */
} kt_weight_format;

/* How a layer's weight GEMMs multiply (kt_moe_options.compute). */
typedef enum kt_compute {
  KT_COMPUTE_BF16 = 0, /* activations as the kernels' A format (bf16, fp32 on the ref and avx2
                        * kernels): the error bounds of the bf16 path, every format and mode
                        * (default) */
  KT_COMPUTE_INT8 = 1  /* inference on an integer base (int8_channel, int4_g32, int4_g128,
                        * int4_g32_zp, int4_g128_zp, mxfp4): the input and the activation
                        * quantized to int8 per row, integer products; see "Int8 compute" below */
} kt_compute;

typedef struct kt_moe_options {
  size_t struct_size;       /* set by _init */
  int64_t num_experts;      /* E >= 1 (logical experts; ids are in [0, E)) */
  int64_t top_k;            /* k >= 1, routes per token */
  int64_t hidden;           /* H >= 1 */
  int64_t intermediate;     /* I >= 1 */
  int64_t max_tokens;       /* T per call <= max_tokens; workspaces are sized for it (default 1024) */
  kt_activation activation; /* default KT_ACT_SILU */
  float act_alpha;          /* swiglu_oai alpha (default 1.702) */
  float act_limit;          /* clamp limit L; <= 0 = none (default 0) */
  int has_bias;             /* 1 = biases bg, bu, bd (default 0) */
  kt_mode mode;             /* default KT_MODE_INFERENCE */
  kt_weight_format weight_format; /* default KT_FORMAT_BF16 */
  int64_t lora_rank;        /* r in [1, 1024] for KT_MODE_LORA */
  float lora_alpha;         /* scale s = alpha / r, or alpha / sqrt(r) with rslora */
  int use_rslora;           /* default 0 */
  unsigned lora_targets;    /* KT_PROJ_* bits (default KT_PROJ_ALL) */
  kt_compute compute;       /* default KT_COMPUTE_BF16 */
} kt_moe_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_moe_options_defaults(kt_moe_options* options, size_t struct_size);
static inline void kt_moe_options_init(kt_moe_options* options) {
  kt_moe_options_defaults(options, sizeof(*options));
}

/* Creates a layer on engine (retained until kt_moe_destroy). The layer holds
 * no weights yet: every expert must be loaded or marked skipped before a
 * forward routes to it. *moe is written by the call. Its memory (packed
 * weights, biases, LoRA factors, workspaces for max_tokens) is allocated
 * now: a layer needing more than the machine's physical memory is refused
 * with KT_ERR_INVALID_ARGUMENT, an allocation that fails is
 * KT_ERR_OUT_OF_MEMORY. */
KT_API kt_status kt_moe_create(kt_engine* engine, const kt_moe_options* options, kt_moe** moe);
/* Waits for the layer's pending jobs, releases its saved contexts, frees it.
 * Deferred jobs nobody ran are cancelled instead (waiting on one returns
 * KT_ERR_INVALID_HANDLE). The handles of its contexts end with it. The
 * layer's gradient hook may destroy the layer (and then its engine). NULL is
 * accepted; a destroyed layer is left alone (kt_last_error() says so). */
KT_API void kt_moe_destroy(kt_moe* moe);

/* Effective LoRA scale s of the layer (0 when not in LoRA mode). */
KT_API kt_status kt_moe_lora_scale(const kt_moe* moe, float* scale);

/* ------------------------------------------------------- named arguments */

/* Argument ids. Values are pinned; new ids are appended. */
typedef enum kt_arg_id {
  /* forward / backward activations */
  KT_ARG_X = 1,               /* [T,H] bf16|fp32, input */
  KT_ARG_IDS = 2,             /* [T,k] int32|int64, expert ids, -1 = no route */
  KT_ARG_ROUTE_WEIGHTS = 3,   /* [T,k] fp32|bf16, routing weights */
  KT_ARG_Y = 4,               /* [T,H] dtype of X, output (overwritten) */
  KT_ARG_DY = 5,              /* [T,H] bf16|fp32, gradient of Y */
  KT_ARG_DX = 6,              /* [T,H] dtype of X saved by forward, output (overwritten) */
  KT_ARG_DROUTE_WEIGHTS = 7,  /* [T,k] fp32|bf16, output: gradient of ROUTE_WEIGHTS */
  /* base weights (load, and bind in full mode); stacked [E,...] or, with
   * kt_moe_load_expert, one expert's [...] */
  KT_ARG_W_GATE = 16,         /* [E,I,H] */
  KT_ARG_W_UP = 17,           /* [E,I,H] */
  KT_ARG_W_DOWN = 18,         /* [E,H,I] */
  KT_ARG_W_GATE_UP = 19,      /* [E,2I,H], gate rows first (or interleaved, see kt_load_options) */
  KT_ARG_B_GATE = 20,         /* [E,I] */
  KT_ARG_B_UP = 21,           /* [E,I] */
  KT_ARG_B_DOWN = 22,         /* [E,H] */
  KT_ARG_B_GATE_UP = 23,      /* [E,2I] */
  KT_ARG_EXPERT_MAP = 24,     /* [P] int32|int64: stacked index p holds logical expert map[p] */
  /* LoRA parameters [E,r,in] (A) and [E,out,r] (B), fp32|bf16 */
  KT_ARG_LORA_A_GATE = 32,
  KT_ARG_LORA_B_GATE = 33,
  KT_ARG_LORA_A_UP = 34,
  KT_ARG_LORA_B_UP = 35,
  KT_ARG_LORA_A_DOWN = 36,
  KT_ARG_LORA_B_DOWN = 37,
  /* LoRA gradient buffers, same shapes, fp32|bf16 */
  KT_ARG_GRAD_LORA_A_GATE = 48,
  KT_ARG_GRAD_LORA_B_GATE = 49,
  KT_ARG_GRAD_LORA_A_UP = 50,
  KT_ARG_GRAD_LORA_B_UP = 51,
  KT_ARG_GRAD_LORA_A_DOWN = 52,
  KT_ARG_GRAD_LORA_B_DOWN = 53,
  /* full fine-tuning gradient buffers, shapes of the weights, fp32|bf16 */
  KT_ARG_GRAD_W_GATE = 64,
  KT_ARG_GRAD_W_UP = 65,
  KT_ARG_GRAD_W_DOWN = 66,
  KT_ARG_GRAD_B_GATE = 67,
  KT_ARG_GRAD_B_UP = 68,
  KT_ARG_GRAD_B_DOWN = 69
} kt_arg_id;

/* One named argument. The tensor is borrowed for the call unless the call
 * says it is retained. */
typedef struct kt_arg {
  int id; /* a kt_arg_id */
  const DLTensor* tensor;
} kt_arg;

/* ---------------------------------------------------------------- loading */

typedef enum kt_weight_orientation {
  KT_ORIENT_OUT_IN = 0, /* HF nn.Linear: gate/up [I,H], down [H,I] */
  KT_ORIENT_IN_OUT = 1  /* transposed: gate/up [H,I], down [I,H] (gate_up [H,2I]) */
} kt_weight_orientation;

typedef enum kt_gate_up_order {
  KT_GATE_UP_CONCAT = 0,     /* gate rows [0,I), up rows [I,2I) */
  KT_GATE_UP_INTERLEAVED = 1 /* gate rows even, up rows odd (gpt-oss) */
} kt_gate_up_order;

typedef struct kt_load_options {
  size_t struct_size;
  kt_weight_orientation orientation; /* default KT_ORIENT_OUT_IN */
  kt_gate_up_order gate_up_order;    /* default KT_GATE_UP_CONCAT */
} kt_load_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_load_options_defaults(kt_load_options* options, size_t struct_size);
static inline void kt_load_options_init(kt_load_options* options) {
  kt_load_options_defaults(options, sizeof(*options));
}

/* Loads (packs) stacked expert weights. Accepted args: W_GATE+W_UP (or
 * W_GATE_UP), W_DOWN, biases when the layer has them, and optionally
 * EXPERT_MAP. Without a map the leading dim is E; with a map of P entries the
 * leading dim is P and entry p is loaded as logical expert map[p] (distinct,
 * in [0,E)). Gate, up and down must all be given; experts that are loaded
 * again are replaced. Sources bf16|fp16|fp32, any strides. Tensors borrowed
 * for the call. options may be NULL. Nothing changes when the call fails. */
KT_API kt_status kt_moe_load_weights(kt_moe* moe, const kt_load_options* options,
                                     const kt_arg* args, size_t num_args);

/* Loads one logical expert from 2-D tensors (per-expert lists): W_GATE [I,H],
 * W_UP [I,H] (or W_GATE_UP [2I,H]), W_DOWN [H,I], biases [I]/[H]. */
KT_API kt_status kt_moe_load_expert(kt_moe* moe, int64_t expert, const kt_load_options* options,
                                    const kt_arg* args, size_t num_args);

/* Marks experts the host computes elsewhere: mask [E] (bool/uint8/int8/int32),
 * non-zero = skipped. Routes to skipped experts contribute nothing to Y, get
 * zero routing-weight gradient, and their parameter gradient entries are never
 * written. Replaces the previous mask. */
KT_API kt_status kt_moe_set_skipped(kt_moe* moe, const DLTensor* mask);

/* Number of experts loaded (not counting skipped ones). */
KT_API kt_status kt_moe_num_loaded(const kt_moe* moe, int64_t* count);

/* ------------------------------------------------- quantized frozen bases
 *
 * A layer's base weights are stored in options.weight_format. kt quantizes
 * bf16/fp16/fp32 sources at load (kt_moe_load_weights, kt_moe_load_expert,
 * kt_ckpt_load_layer):
 * - KT_FORMAT_INT8_CHANNEL: per output row o, scale s_o = bf16(max|W[o,:]| /
 *   127) rounded up, q = round_half_even(W / s_o) in [-127, 127]; the layer
 *   computes with W' = q * s_o. Error against W: at most s_o / 2 per
 *   element; 0.8 % relative L2 measured on Gaussian rows of 768-2048.
 * - KT_FORMAT_INT4_G32: per output row and group of 32 inputs,
 *   s = bf16(max|W[o,group]| / 7) rounded up, q in [-7, 7]; W' = q * s.
 *   Error against W: at most s / 2 per element; 9.7 % relative L2
 *   measured on Gaussian rows (4 bits).
 * - KT_FORMAT_INT4_G128: the same per group of 128 inputs; 11.8 % relative
 *   L2 on Gaussian rows (a group's largest value sets a wider step).
 * Scales are stored as bf16, so W' is exact in fp32. The forward applies
 * each group's scale in fp32 to the group's partial sum, so y has the
 * accuracy of the bf16 path against a reference computed from W'. Backward
 * builds the W'^T panels in cache, each element rounded to bf16 once (as
 * activations are), and never stores a second copy. Memory per weight:
 * bf16 2 bytes, int8 1 + 2/K bytes, int4 0.5 + 2/32 bytes, int4 with zero
 * points (KT_FORMAT_INT4_G32_ZP) 0.5 + 3/32 bytes. */

/* Int8 compute (kt_moe_options.compute = KT_COMPUTE_INT8): for serving an integer base
 * (KT_FORMAT_INT8_CHANNEL, _INT4_G32, _INT4_G128, with zero points _INT4_G32_ZP, _INT4_G128_ZP,
 * and KT_FORMAT_MXFP4, whose e2m1 values doubled are the integers -12..12) with integer products: vpdpbusd (AVX512-VNNI) makes twice as many products per
 * instruction as vdpbf16ps (kt_bench's `integer dot` line measures the two rates on the machine at
 * hand). Each row of X, and each route's activation between the projections, is quantized per row:
 * s = max|v| / 127, q = round_half_even(v / s) in [-127, 127]; the GEMMs sum q * code exactly in
 * int32 per group and apply the group scales and s in fp32. Against y computed from the layer's W'
 * (kt_moe_read_weights) with the exact x, the error is that of int8 activations, x and the
 * activation: 1-2.5 % relative L2 measured on Gaussian inputs (tests/unit/test_moe_reference.cpp
 * and tests/io, Int8Compute: more for wider rows, whose largest values are larger), and several
 * percent where a few channels of x are far larger than the rest (outliers), against 0.2 % for
 * bf16 activations; kt_bench --format int8_channel/int8,... reports it on its layer. The choice is
 * the host's and is reported by kt_moe_get_info; nothing falls back to it or from it.
 * Restrictions, each checked by kt_moe_create: KT_MODE_INFERENCE (KT_ERR_MODE otherwise), one of
 * those formats (KT_ERR_UNSUPPORTED: fp8 codes are not integers), H and I at most 65536
 * (KT_ERR_UNSUPPORTED: the int32 sums of a group must stay exact). Such a layer runs forwards
 * without a saved context only: kt_moe_forward with saved != NULL and kt_moe_backward are refused
 * with KT_ERR_MODE. Kernels: AMX-INT8 tiles for 16 rows and more where the CPU has them,
 * AVX512-VNNI where it has that, a portable loop elsewhere (the same GEMM results to the bit). */

/* Short name of a format ("bf16", "int8_channel", "int4_g32", "fp8_b128",
 * "mxfp4", "int4_g128", "int4_g32_zp", "int4_g128_zp"); static storage, never NULL ("unknown" outside the
 * enum). */
KT_API const char* kt_weight_format_name(kt_weight_format format);

typedef struct kt_moe_info {
  size_t struct_size;             /* set by the caller to sizeof(kt_moe_info) */
  int64_t num_experts;            /* E */
  int64_t top_k;
  int64_t hidden;                 /* H */
  int64_t intermediate;           /* I */
  int64_t max_tokens;
  kt_mode mode;
  kt_weight_format weight_format; /* storage format of the base weights */
  int64_t weight_bytes;           /* bytes the stored base weights take (scales and
                                   * padding included, biases not) */
  int64_t num_weights;            /* E * 3 * H * I */
  int64_t num_loaded;             /* experts loaded, skipped ones not counted */
  kt_compute compute;             /* how the weight GEMMs multiply (options.compute) */
} kt_moe_info;

/* Writes the layer's settings into *info (fields up to info->struct_size).
 * Read-only; may run beside the layer's other calls. */
KT_API kt_status kt_moe_get_info(const kt_moe* moe, kt_moe_info* info);

/* Copies the base weights the layer computes with (dequantized: W' above)
 * into host tensors in the stacked HF nn.Linear orientation: W_GATE, W_UP
 * [E,I,H], W_DOWN [E,H,I], and with biases B_GATE, B_UP [E,I], B_DOWN
 * [E,H]; any subset of these ids, fp32/bf16/fp16 destinations, any strides.
 * A bf16 layer's weights are stored as bf16, so a bf16 destination gets
 * them exactly (a quantized layer's W' is exact in fp32 and rounded in
 * bf16). Experts never loaded read as zeros. For state_dict-style saving,
 * copies of a layer and references in tests. Tensors written by the call
 * (nothing is written when it fails). Serialised with the layer's compute
 * calls. */
KT_API kt_status kt_moe_read_weights(const kt_moe* moe, const kt_arg* args, size_t num_args);

/* ------------------------------------------- quantized checkpoint formats
 *
 * kt_ckpt_open reads each MoE layer's routed-expert tensors and, in
 * config.json, quantization_config, and checks them against each other
 * before anything is loaded (a contradiction fails the open with KT_ERR_IO
 * naming what was found):
 * - fp8 blocks (DeepSeek-V3/R1, Kimi-K2 base): `weight` F8_E4M3 [out, in]
 *   and `weight_scale_inv` (float) [ceil(out/128), ceil(in/128)]; W = code
 *   * scale_inv of its block. quantization_config: quant_method "fp8",
 *   fmt "e4m3", weight_block_size [128, 128], activation_scheme "dynamic"
 *   or "static" (activations stay bf16/fp32 in kt). The same blocks as
 *   compressed-tensors writes them ("float-quantized"): the multiplier is
 *   named `weight_scale`, and the experts' config group says weights
 *   num_bits 8, type "float", strategy "block", block_structure [128, 128],
 *   symmetric (quant_method "compressed-tensors"). Held as
 *   KT_FORMAT_FP8_B128 (codes as stored, scales fp32: exact).
 * - compressed-tensors int4 "pack-quantized" (Kimi-K2-Thinking):
 *   `weight_packed` I32 [out, ceil(in/8)] (element c in bits 4(c%8).. of
 *   word c/8, stored as q + 8), `weight_scale` [out, ceil(in/group)],
 *   `weight_shape` [out, in], optional `weight_zero_point` (asymmetric,
 *   packed along out). quantization_config: quant_method
 *   "compressed-tensors", format "pack-quantized", config_groups weights
 *   num_bits 4, type "int", strategy "group", group_size 32 or 128,
 *   symmetric. W = q * scale. Symmetric groups of 32 with bf16 scales are
 *   KT_FORMAT_INT4_G32 exactly (the same codes and scales), groups of 128
 *   KT_FORMAT_INT4_G128. Asymmetric layers (symmetric false,
 *   `weight_zero_point` I32 [ceil(out/8), ceil(in/group)], eight output
 *   rows a word, row r in bits 4(r%8).., stored as z + 8): W = (q - z) *
 *   scale, held as KT_FORMAT_INT4_G32_ZP / KT_FORMAT_INT4_G128_ZP (codes,
 *   bf16 scales and zero points as stored: exact). The forward computes
 *   with (q - z), an integer in [-15, 15] exact in bf16, and applies each
 *   group's scale in fp32 to the group's partial sum, as for symmetric
 *   int4. A layer mixing symmetric and asymmetric experts is refused.
 * - MXFP4: gpt-oss `{gate_up,down}_proj_blocks` U8 [E, out, in/32, 16]
 *   (two e2m1 values a byte, the even element in the low nibble),
 *   `_scales` U8/E8M0 [E, out, in/32] (2^(s - 127)), `_bias` [E, out],
 *   gate and up interleaved (even rows gate); DeepSeek-V4 style per-expert
 *   `weight` U8/I8 [out, in/2] and `scale` [out, ceil(in/32)]. Held as
 *   KT_FORMAT_MXFP4 (codes and scales as stored: exact).
 * Every e4m3 NaN code, e8m0 scale 0xFF and non-finite scale is refused at
 * load (KT_ERR_IO, naming the tensor, row and column). A finite scale of 0
 * is taken as stored: its block's or group's weights are 0 (none of these
 * formats reserves it; e8m0 cannot express 0). A checkpoint whose
 * expert tensors are bf16/fp16/fp32 (e.g. a dequantized training checkpoint
 * of a quantized base) is dense whatever its quantization_config says: the
 * tensors decide. kt_ckpt_moe_options sets weight_format to the format that
 * holds the layer as stored. Loading a quantized layer into a kt_moe of
 * another format fails with KT_ERR_UNSUPPORTED, except into a
 * KT_FORMAT_BF16 layer when the host asks for it with
 * kt_ckpt_load_options.dequantize (W rounded to bf16 once); a quantized
 * checkpoint is never re-quantized. */

/* --------------------------------------------------- trainable parameters */

/* Binds parameter tensors and gradient buffers (retained until the same id is
 * bound again or the layer is destroyed; the host keeps the memory alive).
 *   LoRA mode:  LORA_A_* / LORA_B_* (read now and at kt_moe_params_changed),
 *               GRAD_LORA_* (written by backward).
 *   full mode:  W_* / B_* (the trainable weights, stacked [E,...], read at
 *               kt_moe_params_changed), GRAD_W_* / GRAD_B_* (written by backward).
 * Shapes, dtypes and strides are checked here; nothing is bound if any arg is
 * wrong. Ids that do not belong to the layer's mode fail with KT_ERR_MODE. */
KT_API kt_status kt_moe_bind(kt_moe* moe, const kt_arg* args, size_t num_args);

/* The host changed the bound parameters (after an optimizer step): kt reads
 * them again (LoRA factors; in full mode the base weights are repacked).
 * Forwards submitted before this call use the old values. */
KT_API kt_status kt_moe_params_changed(kt_moe* moe);

/* Called once a backward has finished writing this layer's parameter
 * gradients, on the thread that ran the backward, after kt released the
 * layer (so the hook may call kt, e.g. to start an optimizer step). */
typedef void (*kt_grad_ready_fn)(kt_moe* moe, void* user);
/* fn NULL removes the hook. user is retained with fn. */
KT_API kt_status kt_moe_set_grad_hook(kt_moe* moe, kt_grad_ready_fn fn, void* user);

/* ------------------------------------------------------ forward/backward */

/* Forward. args: X, IDS, ROUTE_WEIGHTS, Y (all [T,...], inner stride 1).
 * Y has the dtype of X (never the weights' storage dtype). Precision: fp32
 * between stages; on the default engine with avx512bf16 kernels an fp32 X is
 * rounded to bf16 for the weight GEMMs (2-3e-3 relative L2 error in y, dx
 * and gradients); an engine with KT_PRECISION_FP32 keeps it fp32 (below 1e-6).
 * T = 0 is valid. With saved == NULL nothing is kept (inference). With
 * saved != NULL a new context holding what backward needs is written to
 * *saved; several contexts may be outstanding per layer. Each must be
 * released with kt_context_release (after its backward, or instead of it). */
KT_API kt_status kt_moe_forward(kt_moe* moe, const kt_arg* args, size_t num_args,
                                kt_context** saved);

typedef enum kt_grad_accumulate {
  KT_GRAD_OVERWRITE = 0, /* grad buffer = grad_scale * g (first micro-batch) */
  KT_GRAD_ACCUMULATE = 1 /* grad buffer += grad_scale * g */
} kt_grad_accumulate;

typedef struct kt_backward_options {
  size_t struct_size;
  float grad_scale;              /* multiplies parameter gradients only (default 1) */
  kt_grad_accumulate accumulate; /* default KT_GRAD_OVERWRITE */
  int param_grads;               /* 1 = also parameter gradients (default), 0 = only dx
                                    and routing grads; other values are refused */
} kt_backward_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_backward_options_defaults(kt_backward_options* options, size_t struct_size);
static inline void kt_backward_options_init(kt_backward_options* options) {
  kt_backward_options_defaults(options, sizeof(*options));
}

/* Backward of the forward that wrote ctx. args: DY (required), DX and
 * DROUTE_WEIGHTS (each optional, overwritten). In LoRA/full mode with
 * param_grads, the bound gradient buffers of every computed (non-skipped,
 * loaded) expert are written; experts no token was routed to get zero
 * (overwrite) or are left as they are (accumulate). ctx is spent afterwards;
 * a second backward on it fails with KT_ERR_CONTEXT. options may be NULL. */
KT_API kt_status kt_moe_backward(kt_moe* moe, kt_context* ctx, const kt_backward_options* options,
                                 const kt_arg* args, size_t num_args);

/* Frees a context (spent or not) and ends its handle at once: a backward or
 * a second release with it is refused (KT_ERR_CONTEXT; a second release does
 * nothing and sets kt_last_error()), and never reaches a newer context. A
 * context that a submitted job still uses (its forward job, or a submitted
 * backward) is freed when that job ends; the job runs as submitted. The
 * contexts of a destroyed layer are already freed: releasing one does
 * nothing. NULL accepted. */
KT_API void kt_context_release(kt_context* ctx);

/* -------------------------------------------------------------- async jobs */

typedef struct kt_job kt_job;

#define KT_SUBMIT_DEFERRED 1u /* do not start: the host runs it with kt_job_run */

/* Submits a forward. Arguments are checked now (errors are returned now);
 * the tensors' memory is borrowed until the job ends. Without
 * KT_SUBMIT_DEFERRED the job starts on the engine's job thread. With saved
 * != NULL, *saved is written now and becomes usable by backward once the job
 * ended successfully. *job is written by the call; wait for it and destroy it. */
KT_API kt_status kt_moe_forward_submit(kt_moe* moe, const kt_arg* args, size_t num_args,
                                       kt_context** saved, unsigned flags, kt_job** job);
/* Submits a backward, as kt_moe_forward_submit. ctx may come from a
 * forward job that has not run yet: when the backward job starts first (for
 * example, kt_job_wait on a deferred backward before its deferred forward
 * ran), it runs that deferred forward first on its own thread, or waits for
 * it when it is queued or running; if that forward fails, the backward fails
 * with KT_ERR_CONTEXT. The forward job then counts as run (kt_job_done = 1,
 * kt_job_wait returns its status). */
KT_API kt_status kt_moe_backward_submit(kt_moe* moe, kt_context* ctx,
                                        const kt_backward_options* options, const kt_arg* args,
                                        size_t num_args, unsigned flags, kt_job** job);
/* Runs a deferred job on the calling thread; a plain void(*)(void*) so a host
 * can enqueue it as a host function on its own stream (cudaLaunchHostFunc).
 * It returns when the job has ended: a job that another thread is running
 * (a backward job that started its deferred forward) is waited for. Running
 * a job that ended, or a job that is not deferred, does nothing. */
KT_API void kt_job_run(void* job);
/* Waits until the job ended; returns its status (its message becomes this
 * thread's last error). A deferred job that nobody runs is never waited for:
 * kt_job_wait runs it on the calling thread. */
KT_API kt_status kt_job_wait(kt_job* job);
/* 1 if the job ended (or job is not a live job), 0 if not. */
KT_API int kt_job_done(const kt_job* job);
/* Waits for (or runs) the job, then frees it. NULL accepted. A destroyed job
 * is refused by every kt_job_* call (wait: KT_ERR_INVALID_HANDLE). */
KT_API void kt_job_destroy(kt_job* job);

/* ---------------------------------------------------------------- profile */

/* Stages of forward and backward, for the per-stage profile. Values are
 * pinned; new stages are appended. */
typedef enum kt_stage {
  KT_STAGE_ROUTE = 0,       /* routing: counting sort of the routes */
  KT_STAGE_PACK_INPUT = 1,  /* x (forward) or dy (backward) to the kernels' format */
  KT_STAGE_LORA_A = 2,      /* forward LoRA A-projections */
  KT_STAGE_GATE_UP = 3,     /* gate + up GEMMs with bias, LoRA and activation */
  KT_STAGE_DOWN = 4,        /* down GEMM with bias, LoRA, routing weight and combine */
  KT_STAGE_BWD_DOWN = 5,    /* Wd^T dy, routing-weight grad parts, activation derivative */
  KT_STAGE_BWD_LORA = 6,    /* backward LoRA projections */
  KT_STAGE_BWD_DX = 7,      /* dx from dg, du */
  KT_STAGE_BWD_ROUTE = 8,   /* routing-weight gradients */
  KT_STAGE_LORA_GRADS = 9,  /* LoRA parameter gradients */
  KT_STAGE_FULL_GRADS = 10, /* full weight and bias gradients */
  KT_STAGE_EXPERTS = 11     /* forward at decode on a quantized base: each expert's gate/up and
                               down GEMMs in one pass (the combine follows in KT_STAGE_DOWN) */
} kt_stage;

/* Name of a stage ("gate_up"), or NULL past the last stage: hosts iterate
 * stages from 0 until NULL. Static storage. */
KT_API const char* kt_stage_name(int stage);
/* Turns the per-stage profile of the engine's computations on or off (off by
 * default; off costs one relaxed atomic load per stage). */
KT_API kt_status kt_engine_set_profiling(kt_engine* engine, int enabled);
/* Accumulated wall time and count of a stage since creation or the last
 * reset; KT_ERR_INVALID_ARGUMENT past the last stage. */
KT_API kt_status kt_engine_profile_stage(const kt_engine* engine, int stage, int64_t* calls,
                                         double* seconds);
/* Zeroes every stage's time and count, and the kernel counts. */
KT_API kt_status kt_engine_reset_profile(kt_engine* engine);
/* Which kernels each stage ran while profiling was on. Every call of a
 * kernel table's GEMM (and W^T panel build) counts as the kernel that
 * computed it, named entry__table: "gemm_bf16w__amx" for the calls that ran
 * on AMX tiles, "gemm_bf16w__avx512bf16" for those an amx engine leaves to
 * the AVX-512 kernel (fewer than 8 rows, a K remainder),
 * "gemm_bf16w__onednn" for oneDNN's, "sgemm_nt__avx512bf16" for an fp32
 * LoRA projection. Name of kernel number `kernel`, or NULL past the last:
 * hosts iterate from 0 until NULL (numbers may change between versions,
 * names do not). Static storage. */
KT_API const char* kt_kernel_name(int kernel);
/* Calls of a kernel in a stage since creation or the last reset, and the
 * flops they computed (2 m n k per GEMM call of m x k times k x n, with K and
 * N as the kernels see them: padded to the panel layout; 0 for panel
 * builds). Either pointer may be NULL. KT_ERR_INVALID_ARGUMENT past the
 * last stage or kernel. */
KT_API kt_status kt_engine_profile_kernel(const kt_engine* engine, int stage, int kernel,
                                          int64_t* calls, int64_t* flops);

/* ----------------------------------------------------------- packed cache */

/* A layer's weights in kt's packed panel layout, saved to one file and
 * memory-mapped back, so a large model reloads without repacking (`kt
 * convert` writes one per MoE layer of a checkpoint).
 *
 * The file carries a versioned header (magic, cache format version, kt ABI
 * version, weight format and its panel layout id, E/H/I and bias flag,
 * section offsets and byte sizes) and a 64-bit checksum of the header and of
 * each section (gate, up, down panels; fp32 biases; per-expert loaded
 * flags). A quantized layer's cache holds its weights as stored: the codes
 * and scales in the kernels' panel layout (those of a checkpoint's fp8,
 * MXFP4 or int4 layer as the checkpoint gave them), mapped back without
 * re-quantizing (kt_moe_info.weight_bytes per layer). The panel layout is
 * the same for every ISA (ref, avx2, avx512bf16, amx), so a cache written on
 * one CPU loads on any; a cache of another format version, ABI version or
 * panel layout is refused (KT_ERR_IO), one of another E/H/I/bias setting too
 * (KT_ERR_SHAPE), and one of another weight format than the layer's
 * (options.weight_format) with KT_ERR_INVALID_ARGUMENT naming both formats;
 * messages name the file. */

/* kt_moe_load_packed flag: check the header only, not the section
 * checksums (which read the whole file once). */
#define KT_PACKED_SKIP_CHECKSUMS 1u

/* Writes moe's packed weights, biases and loaded flags to path (borrowed):
 * to a temporary file in the same directory, fsync'ed and renamed over path,
 * so path holds the old file or the whole new one, also when the writer is
 * killed or the disk is full (KT_ERR_IO naming the call and path). The
 * temporaries of writers that died are removed by the next save to the same
 * path. Experts never loaded are
 * stored as zeros and flagged not loaded; the skipped mask is the host's
 * routing setting and is not stored. At least one expert must be loaded
 * (KT_ERR_NOT_LOADED otherwise). Serialised with the layer's compute calls. */
KT_API kt_status kt_moe_save_packed(kt_moe* moe, const char* path);

/* Replaces moe's weights, biases and loaded flags (experts not loaded in the
 * file become not loaded; the skipped mask is kept) with those of the cache
 * at path (borrowed). moe's E, H, I and bias setting must match the file's.
 * The file is checked in full (header, sizes, and section checksums unless
 * flags has KT_PACKED_SKIP_CHECKSUMS) before anything changes: on failure
 * moe is as it was.
 * In KT_MODE_INFERENCE and KT_MODE_LORA the weights are not copied: the
 * layer reads them from a read-only mapping of the file, which it keeps
 * until it is destroyed or weights are loaded into it again (the file may be
 * replaced or removed meanwhile; it must not be modified in place). In
 * KT_MODE_FULL, where kt_moe_params_changed repacks the base weights, they
 * are copied into the layer's own memory and the file is not kept open.
 * Serialised with the layer's compute calls. */
KT_API kt_status kt_moe_load_packed(kt_moe* moe, const char* path, unsigned flags);

/* ---------------------------------------------- packed cache description */

/* What a packed cache holds, read from its header (for `kt-moe info` and hosts
 * choosing the layer to create for it). */
typedef struct kt_packed_info {
  size_t struct_size;             /* set by the caller to sizeof(kt_packed_info) */
  int64_t num_experts;            /* E */
  int64_t hidden;                 /* H */
  int64_t intermediate;           /* I */
  int has_bias;
  kt_weight_format weight_format; /* the format of the stored weights: a layer
                                   * loading the cache must store the same */
  int64_t num_loaded;             /* experts flagged loaded */
  int64_t weight_bytes;           /* bytes of the gate, up and down sections */
  int64_t file_bytes;
  int format_version;             /* the cache format version */
} kt_packed_info;

/* Reads the header of the packed cache at path (borrowed) and its loaded
 * flags into *info (fields up to info->struct_size). The header is checked
 * as kt_moe_load_packed checks it (magic, versions, header checksum, panel
 * layout, section table, file size; KT_ERR_IO naming the file); the
 * section checksums are not read. */
KT_API kt_status kt_packed_read_info(const char* path, kt_packed_info* info);

/* ------------------------------------------------ checkpoints (kt_ckpt_*) */

/* Hugging Face checkpoint directories: config.json plus safetensors files
 * (model.safetensors.index.json with its shards, or model.safetensors, or
 * adapter_model.safetensors). Files are memory-mapped read-only; every
 * header is validated in full when the checkpoint is opened (lengths,
 * JSON, dtype/shape/byte-size agreement, offsets inside the file, no
 * overlaps; index entries must name files inside the directory, no
 * absolute paths, no "..", no symlink leading out). File and format errors
 * are KT_ERR_IO with a message naming the call, the file and the tensor.
 * Anything that is not a regular file (a FIFO, a device, a directory) is
 * refused with KT_ERR_IO without blocking on it, here and in
 * kt_moe_load_packed. Every file of one checkpoint (config.json, index,
 * shards) is opened relative to one handle of the directory, so a reader
 * sees one version of a directory that a kt writer replaces meanwhile
 * (below), never files of two.
 *
 * Thread safety: a kt_ckpt does not change after kt_ckpt_open; every call
 * taking a const kt_ckpt* may run concurrently with the others from any
 * thread. A kt_ckpt_close racing with them frees the checkpoint when the
 * last of them returns. */

/* Element types of checkpoint tensors. Values are pinned. */
typedef enum kt_ckpt_dtype {
  KT_CKPT_DTYPE_UNKNOWN = 0,
  KT_CKPT_DTYPE_F32 = 1,
  KT_CKPT_DTYPE_F16 = 2,
  KT_CKPT_DTYPE_BF16 = 3,
  KT_CKPT_DTYPE_F64 = 4,
  KT_CKPT_DTYPE_F8_E4M3 = 5, /* fp8 e4m3fn */
  KT_CKPT_DTYPE_F8_E5M2 = 6,
  KT_CKPT_DTYPE_E8M0 = 7,    /* power-of-two scales (safetensors "F8_E8M0") */
  KT_CKPT_DTYPE_I8 = 8,
  KT_CKPT_DTYPE_U8 = 9,      /* also packed e2m1 pairs (MXFP4 blocks) */
  KT_CKPT_DTYPE_I16 = 10,
  KT_CKPT_DTYPE_U16 = 11,
  KT_CKPT_DTYPE_I32 = 12,    /* also packed int4 (compressed-tensors weight_packed) */
  KT_CKPT_DTYPE_U32 = 13,
  KT_CKPT_DTYPE_I64 = 14,
  KT_CKPT_DTYPE_U64 = 15,
  KT_CKPT_DTYPE_BOOL = 16
} kt_ckpt_dtype;

/* Routed-expert tensor layouts (docs/layouts.md, "Checkpoint tensor names"). Pinned. */
typedef enum kt_ckpt_layout {
  KT_CKPT_LAYOUT_NONE = 0,         /* no routed experts found */
  KT_CKPT_LAYOUT_PER_EXPERT = 1,   /* layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight */
  KT_CKPT_LAYOUT_MIXTRAL = 2,      /* layers.{L}.block_sparse_moe.experts.{e}.{w1,w3,w2}.weight */
  KT_CKPT_LAYOUT_FUSED = 3,        /* layers.{L}.mlp.experts.gate_up_proj [E,2I,H], down_proj [E,H,I] */
  KT_CKPT_LAYOUT_FUSED_IN_OUT = 4, /* the same names, gate_up_proj [E,H,2I], down_proj [E,I,H] */
  KT_CKPT_LAYOUT_GPT_OSS = 5       /* gpt-oss: fused in x out, gate/up interleaved, with
                                    * _bias tensors; MXFP4 (_blocks/_scales) or dequantized */
} kt_ckpt_layout;

/* How a layer's expert weights are stored. Pinned. */
typedef enum kt_ckpt_format {
  KT_CKPT_FORMAT_DENSE = 0,      /* bf16/fp16/fp32 (loadable) */
  KT_CKPT_FORMAT_FP8_BLOCK = 1,  /* F8_E4M3 + weight_scale_inv (or weight_scale) [out/128, in/128] */
  KT_CKPT_FORMAT_INT4_GROUP = 2, /* compressed-tensors weight_packed int32 [out, in/8] + weight_scale */
  KT_CKPT_FORMAT_MXFP4 = 3,      /* e2m1 pairs (U8) + E8M0 scales per 32 */
  KT_CKPT_FORMAT_OTHER = 4       /* a weight format kt does not know; hidden and
                                  * intermediate are the stored gate extents */
} kt_ckpt_format;

/* Short names ("BF16", "per_expert", "fp8_block"); static storage, never
 * NULL ("unknown" for values outside the enum). */
KT_API const char* kt_ckpt_dtype_name(kt_ckpt_dtype dtype);
KT_API const char* kt_ckpt_layout_name(kt_ckpt_layout layout);
KT_API const char* kt_ckpt_format_name(kt_ckpt_format format);

typedef struct kt_ckpt kt_ckpt;

/* Opens the checkpoint in directory dir (borrowed for the call): maps and
 * validates every safetensors file, reads config.json when present, and
 * detects the MoE layers. *ckpt is written by the call and owned by the
 * caller (kt_ckpt_close). Either everything opens or nothing stays open. */
KT_API kt_status kt_ckpt_open(const char* dir, kt_ckpt** ckpt);
/* Unmaps the files and frees the handle. Pointers the handle gave out
 * (names, tensor data) become invalid. NULL is accepted; closing twice does
 * nothing (kt_last_error() says so). */
KT_API void kt_ckpt_close(kt_ckpt* ckpt);

typedef struct kt_ckpt_info {
  size_t struct_size;         /* set by the caller to sizeof(kt_ckpt_info) */
  const char* architecture;   /* config.json architectures[0], "" if none; owned by the handle */
  const char* model_type;     /* config.json model_type, "" if none; owned by the handle */
  kt_ckpt_layout layout;      /* layout of the routed experts */
  int64_t num_moe_layers;     /* layers with routed experts */
  int64_t num_tensors;        /* tensors in all files */
  int64_t num_files;          /* safetensors files */
  int64_t total_bytes;        /* tensor bytes in all files */
  int64_t top_k;              /* config.json num_experts_per_tok (0 if absent) */
} kt_ckpt_info;

/* Writes the checkpoint's summary (fields up to info->struct_size).
 * Read-only; safe from any thread while the handle is open. */
KT_API kt_status kt_ckpt_get_info(const kt_ckpt* ckpt, kt_ckpt_info* info);

typedef struct kt_ckpt_layer_info {
  size_t struct_size;         /* set by the caller to sizeof(kt_ckpt_layer_info) */
  int64_t layer;              /* L in the tensor names */
  int64_t num_experts;        /* E */
  int64_t hidden;             /* H */
  int64_t intermediate;       /* I */
  int has_bias;               /* 1 = bias tensors present (gpt-oss) */
  kt_ckpt_layout layout;
  kt_ckpt_format format;
  kt_ckpt_dtype weight_dtype; /* element type of the weight tensors */
  int loadable;               /* 1 = kt_ckpt_load_layer can load it in this build */
  int64_t bytes;              /* bytes of this layer's routed-expert tensors (scales included) */
  kt_weight_format weight_format; /* the kt_moe format that holds the experts as stored
                                   * (KT_FORMAT_BF16 for dense layers; see "Quantized
                                   * checkpoint formats") */
  int64_t group_size;         /* inputs per scale of a quantized layer (fp8: the block's 128), 0 if dense */
  int64_t num_tensors;        /* checkpoint tensors of this layer's routed experts
                               * (kt_ckpt_layer_tensor_at) */
} kt_ckpt_layer_info;

/* Describes the index-th MoE layer, index in [0, num_moe_layers), ordered by
 * layer number. */
KT_API kt_status kt_ckpt_get_layer_info(const kt_ckpt* ckpt, int64_t index,
                                        kt_ckpt_layer_info* info);

/* Fills *options, which kt_moe_options_init set up (kt writes its first
 * options->struct_size bytes: kt's defaults, then), for layer L (the layer
 * number of the tensor names): num_experts, hidden, intermediate, has_bias,
 * top_k from config.json (1 if absent), activation (gpt-oss: swiglu_oai
 * with its alpha and swiglu_limit; otherwise silu). The host may change
 * mode, LoRA and max_tokens fields before kt_moe_create. */
KT_API kt_status kt_ckpt_moe_options(const kt_ckpt* ckpt, int64_t layer, kt_moe_options* options);

/* Progress of a load: experts done out of total; called on the loading
 * thread between batches of experts, never while kt holds the layer. */
typedef void (*kt_ckpt_progress_fn)(int64_t done, int64_t total, void* user);

/* Loads layer L's routed experts into moe (its E, H, I and bias setting must
 * match the layer) straight from the mapped files: bf16/fp16/fp32 sources,
 * any of the layouts above; quantized layers into a kt_moe of their format
 * (kt_ckpt_layer_info.weight_format; "Quantized checkpoint formats" above).
 * Every tensor is checked before the first expert is loaded, so a failing
 * call leaves moe as it was. Experts go in batches, each serialised with the
 * layer's other compute calls; a forward another thread runs between two
 * batches sees some experts already replaced (or, on a new layer, fails with
 * KT_ERR_NOT_LOADED). progress may be NULL; user is passed to it. */
KT_API kt_status kt_ckpt_load_layer(const kt_ckpt* ckpt, int64_t layer, kt_moe* moe,
                                    kt_ckpt_progress_fn progress, void* user);

typedef struct kt_ckpt_load_options {
  size_t struct_size; /* set by _init */
  int dequantize;     /* 1 = a quantized layer may load into a KT_FORMAT_BF16 kt_moe,
                       * dequantized (default 0: refused with KT_ERR_UNSUPPORTED) */
  /* A share of the layer, for a rank of an expert- or tensor-parallel group:
   * the kt_moe is created with the share's E and I, and only the share's
   * bytes are read. */
  const int64_t* experts;     /* NULL (default): every expert, in order; else num_experts distinct
                               * checkpoint expert ids in [0, E): the kt_moe's expert i is the
                               * checkpoint's expert experts[i] (borrowed for the call) */
  int64_t num_experts;        /* entries of experts (the kt_moe's E); 0 when experts is NULL */
  int64_t intermediate_begin; /* the slice [begin, end) of the intermediate dimension held: gate and */
  int64_t intermediate_end;   /* up rows, down columns, gate and up biases (the kt_moe's I is
                               * end - begin); 0 and 0 (default): all of it. A quantized layer
                               * loaded as stored needs both ends on whole scale groups (blocks) */
  int zero_down_bias;         /* 1 = the down-projection biases load as zeros: every rank of a
                               * tensor-parallel group but one, since their outputs are summed
                               * (default 0) */
} kt_ckpt_load_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_ckpt_load_options_defaults(kt_ckpt_load_options* options, size_t struct_size);
static inline void kt_ckpt_load_options_init(kt_ckpt_load_options* options) {
  kt_ckpt_load_options_defaults(options, sizeof(*options));
}

/* kt_ckpt_load_layer with options (NULL = defaults). */
KT_API kt_status kt_ckpt_load_layer_with(const kt_ckpt* ckpt, int64_t layer, kt_moe* moe,
                                         const kt_ckpt_load_options* options, kt_ckpt_progress_fn progress,
                                         void* user);

/* Copies layer L's expert weights into host tensors, in the stacked HF
 * nn.Linear orientation: W_GATE, W_UP [E,I,H], W_DOWN [E,H,I], and with
 * biases B_GATE, B_UP [E,I], B_DOWN [E,H]; any subset of these ids.
 * Destination dtypes fp32/bf16/fp16; a destination of the source's dtype
 * gets the stored bits exactly. Tensors written by the call (nothing is
 * written when it fails). */
KT_API kt_status kt_ckpt_read_layer(const kt_ckpt* ckpt, int64_t layer, const kt_arg* args,
                                    size_t num_args);

typedef struct kt_ckpt_tensor {
  size_t struct_size;       /* set by the caller to sizeof(kt_ckpt_tensor) */
  const char* name;         /* owned by the handle */
  const char* file;         /* path of its safetensors file; owned by the handle */
  kt_ckpt_dtype dtype;
  int ndim;                 /* <= 8 */
  int64_t shape[8];
  int64_t nbytes;
  const void* data;         /* mapped, read-only, owned by the handle; may be
                             * unaligned for its dtype */
} kt_ckpt_tensor;

/* The index-th checkpoint tensor of layer L's routed experts, index in [0,
 * kt_ckpt_layer_info.num_tensors), ordered by name: every tensor the layout
 * recognises as the layer's (weights, their scales, zero points and shape
 * tensors, biases), which kt_ckpt_load_layer and kt_ckpt_read_layer read
 * from. A host that loads the experts through kt skips these when it
 * loads the rest of the model, so their bytes are read once, by kt. */
KT_API kt_status kt_ckpt_layer_tensor_at(const kt_ckpt* ckpt, int64_t layer, int64_t index,
                                         kt_ckpt_tensor* tensor);

/* Tensors, ordered by name: index in [0, num_tensors). */
KT_API kt_status kt_ckpt_tensor_at(const kt_ckpt* ckpt, int64_t index, kt_ckpt_tensor* tensor);
/* The tensor called name; KT_ERR_IO when the checkpoint has none. */
KT_API kt_status kt_ckpt_find_tensor(const kt_ckpt* ckpt, const char* name, kt_ckpt_tensor* tensor);

/* ---- writers. A writer publishes its output directory in one atomic
 * step, so a reader (kt, PEFT, transformers) sees the old output or the
 * whole new one, never a mix, whatever happens to the writer (killed, disk
 * full). The rule, for kt_ckpt_write_experts, kt_ckpt_adapter_write and
 * `kt-moe convert`:
 * - the new version is built in a fresh sibling directory
 *   ".<dir>.kt-new.<pid>.<n>" (every file fsync'ed), then swapped with dir
 *   by renameat2(RENAME_EXCHANGE) (a rename when dir does not exist; it and
 *   its parents are created), and the old version is removed. dir keeps its
 *   path and its flat layout (adapter_config.json and
 *   adapter_model.safetensors at the top, as PEFT loads them). dir's parent
 *   must be writable; a symlink to a directory stays a link to the new one.
 * - dir is replaced as a whole: the names the call owns (listed at each
 *   writer) come from the new version; every other entry of the old dir (a
 *   README, a tokenizer, subdirectories) is carried over as a hard link (a
 *   copy where links are refused). A process whose working directory is
 *   inside dir keeps the old one.
 * - every argument (shapes, names, UTF-8 of strings) is checked before the
 *   first byte is written; any failure, a full disk included (KT_ERR_IO
 *   naming the call and the path), leaves the old dir as it was.
 * - staging directories of writers that died are removed by the next writer
 *   of the same dir. On file systems without RENAME_EXCHANGE the swap is two
 *   renames, between which dir is briefly absent (never mixed). */

typedef struct kt_ckpt_write_options {
  size_t struct_size;
  kt_ckpt_layout layout;       /* key names: KT_CKPT_LAYOUT_PER_EXPERT (default) or _MIXTRAL */
  kt_ckpt_dtype dtype;         /* stored dtype: BF16 (default), F16, F32 */
  int64_t max_shard_bytes;     /* shard size bound (default 4 GiB); more than one shard
                                * writes model-0000i-of-0000N.safetensors + index */
  const char* config_json;     /* config.json text to write (validated JSON); NULL = none */
} kt_ckpt_write_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_ckpt_write_options_defaults(kt_ckpt_write_options* options, size_t struct_size);
static inline void kt_ckpt_write_options_init(kt_ckpt_write_options* options) {
  kt_ckpt_write_options_defaults(options, sizeof(*options));
}

/* One layer's stacked weights for a writer: W_GATE, W_UP [E,I,H], W_DOWN
 * [E,H,I] and optionally B_GATE, B_UP [E,I], B_DOWN [E,H] (bf16/fp16/fp32,
 * any strides). Borrowed for the call. */
typedef struct kt_ckpt_layer_args {
  int64_t layer; /* L in the tensor names */
  const kt_arg* args;
  size_t num_args;
} kt_ckpt_layer_args;

/* Writes a full-expert checkpoint with HF key names into dir (borrowed):
 * model.layers.{L}.mlp.experts.{e}.{gate,up,down}_proj.weight [out,in] (or
 * the Mixtral names), biases as ....{proj}.bias; plus config.json when
 * options->config_json is set. Shards fill up to max_shard_bytes (a larger
 * tensor gets a shard of its own); one shard is written as model.safetensors.
 * Owns (replaces) model.safetensors, model.safetensors.index.json,
 * model-*-of-*.safetensors, and config.json when options->config_json is set
 * (else an existing config.json is kept). options may be NULL (defaults). */
KT_API kt_status kt_ckpt_write_experts(const char* dir, const kt_ckpt_write_options* options,
                                       const kt_ckpt_layer_args* layers, size_t num_layers);

/* PEFT LoRA adapters (adapter_config.json + adapter_model.safetensors), with
 * PEFT's keys base_model.model.model.layers.{L}.mlp.experts.{e}.{proj}.lora_{A,B}.weight
 * (block_sparse_moe / w1,w3,w2 for Mixtral naming). */
typedef struct kt_ckpt_adapter_config {
  size_t struct_size;
  int64_t rank;                /* r >= 1 */
  float alpha;                 /* lora_alpha */
  int use_rslora;              /* 0/1 */
  unsigned targets;            /* KT_PROJ_* bits */
  kt_ckpt_layout layout;       /* key names: PER_EXPERT (default) or MIXTRAL */
  kt_ckpt_dtype dtype;         /* stored dtype: F32 (default) or BF16 */
  const char* base_model;      /* base_model_name_or_path; NULL = "" (writing only) */
} kt_ckpt_adapter_config;

/* Writes the defaults into the first struct_size bytes of *config (zero past
 * the fields this library knows) and sets config->struct_size. */
KT_API void kt_ckpt_adapter_config_defaults(kt_ckpt_adapter_config* config, size_t struct_size);
static inline void kt_ckpt_adapter_config_init(kt_ckpt_adapter_config* config) {
  kt_ckpt_adapter_config_defaults(config, sizeof(*config));
}

/* Writes an adapter into dir from each layer's LoRA tensors: LORA_A_{p}
 * [E,r,in] and LORA_B_{p} [E,out,r] (fp32|bf16) for every targeted p.
 * Owns adapter_config.json and adapter_model.safetensors, published
 * together. config->base_model must be UTF-8 (KT_ERR_INVALID_ARGUMENT).
 * Tensors borrowed for the call. */
KT_API kt_status kt_ckpt_adapter_write(const char* dir, const kt_ckpt_adapter_config* config,
                                       const kt_ckpt_layer_args* layers, size_t num_layers);

/* Reads adapter_config.json of dir into *config (rank, alpha, use_rslora,
 * targets, layout; dtype of the stored tensors; base_model set to NULL), up to
 * config->struct_size bytes (set it with kt_ckpt_adapter_config_init).
 * config NULL: KT_ERR_NULL_POINTER, before any file is read. */
KT_API kt_status kt_ckpt_adapter_read_config(const char* dir, kt_ckpt_adapter_config* config);

/* Copies layer L's LoRA factors of the adapter in dir into host tensors:
 * LORA_A_{p} [E,r,in], LORA_B_{p} [E,out,r] (fp32|bf16), any subset of the
 * adapter's targets. Written by the call; nothing is written on failure.
 * A layer or projection the adapter lacks: KT_ERR_INVALID_ARGUMENT; a
 * destination whose E, r, in or out differ from the stored tensors:
 * KT_ERR_SHAPE; a broken file: KT_ERR_IO. */
KT_API kt_status kt_ckpt_adapter_read(const char* dir, int64_t layer, const kt_arg* args,
                                      size_t num_args);

/* ------------------------------------------------ optimizer (kt_optimizer_*) */

/* A fused CPU optimizer, AdamW or SGD with torch.optim's semantics, over fp32
 * master weights. It is created over a layer's trainable parameters (the
 * tensors bound with kt_moe_bind and their bound gradient buffers) or over
 * host tensors given as (param, grad) pairs. kt owns the state (moments,
 * momentum buffers, the step count); a step reads every gradient, updates
 * masters and state, and leaves the layer using the new values.
 *
 * Masters: an fp32 parameter tensor is its own master and is updated in
 * place. A bf16 parameter (layer mode) gets an fp32 master inside the
 * optimizer, initialised from its values at creation (later host writes to
 * the bf16 tensor are not read back: the next step overwrites them); each
 * step updates the master and writes the parameter back rounded to bf16
 * (nearest even).
 *
 * Arithmetic, per element in fp32, with g = (grad * grad_unscale) * clip_coef
 * and the scalars below computed in double and rounded to fp32 once:
 *   AdamW: p = p * (1 - lr*wd); m = fma(g, 1-b1, m*b1) (KT_OPTIM_TORCH1) or
 *          m = lerp(m, g, 1-b1) (KT_OPTIM_TORCH2: with w = 1-b1,
 *          w < 0.5 ? fma(w, g-m, m) : fma(w-1, g-m, g));
 *          v = fma((1-b2)*g, g, v*b2); (amsgrad: vmax = max(vmax, v), used for v)
 *          p = p + (-lr/(1-b1^t)) * m / (sqrt(v) / sqrt(1-b2^t) + eps)
 *   SGD:   d = wd ? fma(p, wd, g) : g; with momentum mu: buf = d at its first
 *          step, then fma(d, 1-dampening, buf*mu); d = nesterov ? fma(buf, mu, d)
 *          : buf; p = fma(d, -lr, p)
 * This is the operation order of torch.optim.AdamW and SGD (for-loop, CPU)
 * of torch 1.13 (KT_OPTIM_TORCH1; the same bits) and torch 2.x (TORCH2: the
 * same bits as torch 2 with a correctly rounded sqrt; its MKL sqrt is not, so
 * p may differ in the last bits, m and v do not). Elements are independent,
 * so the result does not depend on thread count or kernel ISA. */

typedef struct kt_optimizer kt_optimizer;

typedef enum kt_optim_algorithm {
  KT_OPTIM_ADAMW = 0, /* decoupled weight decay, bias correction, optional amsgrad */
  KT_OPTIM_SGD = 1    /* momentum, dampening, nesterov, L2 weight decay */
} kt_optim_algorithm;

/* Whose arithmetic a step reproduces bit for bit (see above). */
typedef enum kt_optim_arithmetic {
  KT_OPTIM_TORCH1 = 0, /* torch 1.x: AdamW m = fma(g, 1-b1, m*b1) */
  KT_OPTIM_TORCH2 = 1  /* torch 2.x: AdamW m = lerp(m, g, 1-b1) */
} kt_optim_arithmetic;

typedef struct kt_optimizer_options {
  size_t struct_size;           /* set by _init */
  kt_optim_algorithm algorithm; /* default KT_OPTIM_ADAMW */
  int amsgrad;                  /* AdamW, 0/1 (default 0) */
  double lr;                    /* learning rate >= 0 (default 1e-3) */
  double weight_decay;          /* >= 0; default 1e-2 (torch AdamW's; torch SGD's is 0) */
  double beta1, beta2;          /* AdamW, in [0, 1) (default 0.9, 0.999) */
  double eps;                   /* AdamW, >= 0 (default 1e-8) */
  double momentum;              /* SGD, >= 0 (default 0) */
  double dampening;             /* SGD (default 0) */
  int nesterov;                 /* SGD, 0/1; needs momentum > 0 and dampening 0 */
  kt_optim_arithmetic arithmetic; /* default KT_OPTIM_TORCH1; may change with
                                     kt_optimizer_set_options */
  int assume_finite;            /* 0/1 (default 0; may change with
                                   kt_optimizer_set_options). 0: a step first
                                   reads every gradient and is skipped when
                                   some g is inf or NaN (kt_optimizer_step).
                                   1: the host has checked the gradients
                                   itself (as torch's GradScaler does before
                                   its step): a step reads each gradient once,
                                   in the update, and does not check it;
                                   found_nonfinite is written 0, and a
                                   non-finite g goes into p, m and v as in
                                   torch.optim's step (inf/NaN there, only
                                   at its own elements) */
} kt_optimizer_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_optimizer_options_defaults(kt_optimizer_options* options, size_t struct_size);
static inline void kt_optimizer_options_init(kt_optimizer_options* options) {
  kt_optimizer_options_defaults(options, sizeof(*options));
}

/* One host parameter: param fp32, compact row-major, updated in place; grad
 * fp32|bf16, compact, the shape of param, read by each step. Both retained
 * until the optimizer is destroyed (grad until kt_optimizer_set_grad
 * replaces it); they may not share memory with each other or with another
 * pair's tensors. */
typedef struct kt_optimizer_param {
  const DLTensor* param;
  const DLTensor* grad;
} kt_optimizer_param;

/* Creates an optimizer over host tensors. engine may be NULL (steps run on
 * the calling thread); otherwise steps run on its worker pool and the engine
 * must outlive the optimizer (kt_engine_destroy refuses while it exists).
 * options may be NULL (defaults). *opt is written by the call. */
KT_API kt_status kt_optimizer_create(kt_engine* engine, const kt_optimizer_options* options,
                                     const kt_optimizer_param* params, size_t num_params,
                                     kt_optimizer** opt);

/* Creates an optimizer over moe's trainable parameters: in KT_MODE_LORA the
 * bound LORA_A_p and LORA_B_p of every target p with their GRAD_LORA_ ids; in
 * KT_MODE_FULL W_GATE, W_UP, W_DOWN (and the B_ ids with biases) with their
 * GRAD_W_ (GRAD_B_) ids. All
 * must be bound (KT_ERR_NOT_BOUND), compact (KT_ERR_STRIDE), parameters
 * fp32|bf16 (KT_ERR_DTYPE); KT_MODE_INFERENCE is KT_ERR_MODE. Parameter
 * order (for kt_optimizer_state): gate, up, down; A before B; weights before
 * biases. After a step the layer computes with the new values: in
 * KT_MODE_FULL each work item packs the weight rows it has just updated into
 * the layer's bf16 panels (and biases) in the same pass over memory, with the
 * result kt_moe_params_changed would give, which is then not needed; in
 * KT_MODE_LORA the layer re-reads its factors. Rebinding a parameter afterwards makes later
 * steps fail (KT_ERR_INVALID_ARGUMENT); destroying the layer makes them fail
 * with KT_ERR_INVALID_HANDLE (destroy the optimizer, then the layer). */
KT_API kt_status kt_optimizer_create_for_layer(kt_moe* moe, const kt_optimizer_options* options,
                                               kt_optimizer** opt);

/* Waits for the optimizer's submitted steps and frees it. NULL accepted. */
KT_API void kt_optimizer_destroy(kt_optimizer* opt);

/* Replaces the hyperparameters for the following steps (lr schedules).
 * algorithm and amsgrad must stay as created (KT_ERR_INVALID_ARGUMENT). */
KT_API kt_status kt_optimizer_set_options(kt_optimizer* opt, const kt_optimizer_options* options);
/* Writes the current hyperparameters (fields up to options->struct_size). */
KT_API kt_status kt_optimizer_get_options(const kt_optimizer* opt, kt_optimizer_options* options);

/* Replaces the gradient of host parameter index (retained; same rules as at
 * creation). Not for optimizers of a layer (KT_ERR_MODE). */
KT_API kt_status kt_optimizer_set_grad(kt_optimizer* opt, size_t index, const DLTensor* grad);

typedef struct kt_optimizer_step_options {
  size_t struct_size;   /* set by _init */
  float grad_unscale;   /* multiplies every gradient first (1/loss scale; default 1) */
  float clip_coef;      /* then multiplies it (global-norm clipping; default 1) */
  int* found_nonfinite; /* NULL, or written by the call: 1 = some g was inf or
                           NaN and the step was skipped (nothing changed, the
                           step count kept), 0 = the step was made */
} kt_optimizer_step_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_optimizer_step_options_defaults(kt_optimizer_step_options* options,
                                               size_t struct_size);
static inline void kt_optimizer_step_options_init(kt_optimizer_step_options* options) {
  kt_optimizer_step_options_defaults(options, sizeof(*options));
}

/* One step over every parameter. options may be NULL (defaults). Every
 * gradient is checked before anything changes: a non-finite one skips the
 * step (reported through found_nonfinite; the call returns KT_OK).
 * Serialised with the engine's compute calls. */
KT_API kt_status kt_optimizer_step(kt_optimizer* opt, const kt_optimizer_step_options* options);

/* Submits a step as a job on the engine's job thread (after the jobs
 * submitted before it), as kt_moe_backward_submit; found_nonfinite is
 * written when the job ends. Needs an engine (KT_ERR_UNSUPPORTED without). */
KT_API kt_status kt_optimizer_step_submit(kt_optimizer* opt, const kt_optimizer_step_options* options,
                                          unsigned flags, kt_job** job);

/* *out = sum of g*g over every gradient as stored (before grad_unscale; a
 * host with loss scale s multiplies by 1/s^2), accumulated in double in a
 * fixed order. Inf or NaN when a gradient is. */
KT_API kt_status kt_optimizer_grad_sq_norm(kt_optimizer* opt, double* out);

/* Number of parameters, and steps made so far. */
KT_API kt_status kt_optimizer_num_params(const kt_optimizer* opt, size_t* count);
KT_API kt_status kt_optimizer_get_step(const kt_optimizer* opt, int64_t* step);
/* Sets the step count (resuming from a host's own state); step >= 0. With
 * SGD, step > 0 marks the momentum buffers as started. */
KT_API kt_status kt_optimizer_set_step(kt_optimizer* opt, int64_t step);

/* State tensors of one parameter. Values are pinned. */
typedef enum kt_optim_state {
  KT_OPTIM_STATE_MASTER = 0,     /* fp32 master (the host tensor itself when fp32) */
  KT_OPTIM_STATE_EXP_AVG = 1,    /* AdamW m */
  KT_OPTIM_STATE_EXP_AVG_SQ = 2, /* AdamW v */
  KT_OPTIM_STATE_MAX_EXP_AVG_SQ = 3, /* AdamW with amsgrad */
  KT_OPTIM_STATE_MOMENTUM = 4    /* SGD momentum buffer */
} kt_optim_state;

/* Writes into *out a view (fp32, compact, the parameter's shape) of parameter
 * index's state tensor: data and shape are owned by the optimizer and valid
 * until it is destroyed. The host may read it, or write it between steps
 * (restoring a state). A state the algorithm does not keep is
 * KT_ERR_INVALID_ARGUMENT. A layer follows masters written through the view
 * at the next step (or use kt_optimizer_load, which it follows at once). */
KT_API kt_status kt_optimizer_state(kt_optimizer* opt, size_t index, kt_optim_state which,
                                    DLTensor* out);

/* Saves masters, state, step and hyperparameters to one safetensors file at
 * path (borrowed): written to a temporary file in the same directory,
 * fsync'ed and renamed over path. Serialised with the engine's compute calls. */
KT_API kt_status kt_optimizer_save(kt_optimizer* opt, const char* path);
/* Restores what kt_optimizer_save wrote. The file must come from an
 * optimizer of the same algorithm, amsgrad setting, parameter count, names,
 * shapes and dtypes (KT_ERR_SHAPE / KT_ERR_INVALID_ARGUMENT otherwise; a
 * damaged or truncated file is KT_ERR_IO); everything is checked before
 * anything changes. A layer's optimizer also makes the layer use the loaded
 * masters. */
KT_API kt_status kt_optimizer_load(kt_optimizer* opt, const char* path);

/* -------------------------------- distributed (kt_comm_*, kt_dist_*) */

/* Several processes (ranks) share one set of experts. A kt_comm is the
 * ranks' communicator; collectives run on existing engines, never on a
 * transport of kt's own: Gloo (TCP) for CPU tensors, NCCL for CUDA tensors.
 * A build finds each when its development files are there; kt_build_info()
 * lists "gloo" and "nccl" among the optional parts it has, and a backend
 * this build lacks is KT_ERR_UNSUPPORTED at kt_comm_create. NCCL is loaded
 * at run time (libnccl.so.2, libcudart.so): libkt never needs CUDA to load.
 *
 * Collective calls (kt_comm_create, kt_comm_barrier, kt_comm_broadcast,
 * kt_comm_allgather, kt_dist_moe_create, kt_dist_moe_forward,
 * kt_dist_moe_backward) must be made by every rank of the communicator, in
 * the same order; calls on one communicator are serialised. Each returns the
 * same status on every rank: when one rank's part fails (bad arguments, a
 * compute error), every rank returns that rank's status, with a message
 * naming the call, the rank and its own message. A peer that dies or stops
 * answering makes the others' calls return KT_ERR_COMM within
 * options->timeout_ms; the communicator then stays unusable (every later
 * call returns KT_ERR_COMM) and must be destroyed. */

typedef struct kt_comm kt_comm;

/* Collective engines. Values are pinned. */
typedef enum kt_comm_backend {
  KT_COMM_BACKEND_NONE = 0,
  KT_COMM_BACKEND_GLOO = 1, /* CPU tensors (TCP) */
  KT_COMM_BACKEND_NCCL = 2  /* CUDA tensors */
} kt_comm_backend;

/* What a backend string selects. "gloo" is cpu:gloo; "nccl" is cuda:nccl;
 * a list of device:backend pairs, such as "cuda:nccl,cpu:gloo", names one
 * backend per device (cpu or cuda, each at most once; cpu takes gloo, cuda
 * takes nccl). The device is CUDA when a CUDA backend is named, else CPU
 * (the combined string prefers CUDA); CPU tensors always go through the
 * CPU backend. Lowercase, no spaces; anything else is refused with
 * KT_ERR_INVALID_ARGUMENT and a message saying what is wrong. */
typedef struct kt_comm_backends {
  size_t struct_size;   /* set by the caller to sizeof(kt_comm_backends) */
  kt_comm_backend cpu;  /* for CPU tensors, or NONE */
  kt_comm_backend cuda; /* for CUDA tensors, or NONE */
  DLDeviceType device;  /* the resolved device: kDLCUDA when cuda is set, else kDLCPU */
} kt_comm_backends;

/* Parses backend (borrowed) into *out (fields up to out->struct_size);
 * creates nothing, needs neither backend in this build. */
KT_API kt_status kt_comm_parse_backend(const char* backend, kt_comm_backends* out);

/* A host's key-value store (torch.distributed's TCPStore, say) that the
 * ranks rendezvous through. Called on the thread of kt_comm_create; kt
 * prefixes every key with options->store_prefix. */
typedef struct kt_comm_store {
  /* Stores value (size bytes) under key; 0 on success. */
  int (*set)(const char* key, const void* value, size_t size, void* user);
  /* Reads key without waiting: returns 0 and writes *size (the value's
   * size) when the key exists, copying min(size, capacity) bytes to buffer
   * (kt calls again with a larger buffer when *size > capacity); 1 when it
   * does not exist yet (kt calls again until the timeout); anything else is
   * an error. */
  int (*get)(const char* key, void* buffer, size_t capacity, size_t* size, void* user);
  void* user;
} kt_comm_store;

#define KT_NCCL_UNIQUE_ID_BYTES 128

typedef struct kt_comm_options {
  size_t struct_size;       /* set by _init */
  const char* backend;      /* default "gloo" (see kt_comm_backends) */
  int rank;                 /* this process, in [0, world_size) */
  int world_size;           /* >= 1 */
  /* Rendezvous, for Gloo: a directory every rank can reach (Gloo's file store; one per
   * communicator, or distinct prefixes), or the host's store. One of the
   * two. */
  const char* store_path;
  const kt_comm_store* store;
  const char* store_prefix; /* key prefix (default "kt") */
  const char* hostname;     /* Gloo: the address this rank listens on (default "127.0.0.1") */
  int64_t timeout_ms;       /* rendezvous and every collective (default 30000), >= 1 */
  /* NCCL: the ranks' common id (KT_NCCL_UNIQUE_ID_BYTES, from
   * kt_comm_nccl_unique_id on one rank), or the host's ncclComm_t
   * (retained, never destroyed by kt; world_size and rank must be its
   * own), or neither when the communicator also has a CPU backend: rank 0
   * then makes an id and broadcasts it over that backend. */
  const void* nccl_unique_id;
  void* nccl_comm;
  int cuda_device;          /* NCCL: CUDA device of this rank (default -1: the current one) */
} kt_comm_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_comm_options_defaults(kt_comm_options* options, size_t struct_size);
static inline void kt_comm_options_init(kt_comm_options* options) {
  kt_comm_options_defaults(options, sizeof(*options));
}

/* Creates this rank's communicator (collective: every rank calls it with
 * the same backend, world_size and store). Strings are borrowed for the
 * call. *comm is written by the call. */
KT_API kt_status kt_comm_create(const kt_comm_options* options, kt_comm** comm);
/* Closes the connections and frees the handle; distributed layers created
 * on it keep it alive until they are destroyed. NULL accepted. */
KT_API void kt_comm_destroy(kt_comm* comm);

typedef struct kt_comm_info {
  size_t struct_size;        /* set by the caller to sizeof(kt_comm_info) */
  int rank;
  int world_size;
  kt_comm_backends backends; /* as parsed from options->backend */
  int64_t timeout_ms;
  int usable;                /* 0 after a failed collective (KT_ERR_COMM) */
} kt_comm_info;

/* Writes the communicator's settings (fields up to info->struct_size). */
KT_API kt_status kt_comm_get_info(const kt_comm* comm, kt_comm_info* info);

/* Makes a new NCCL unique id (KT_NCCL_UNIQUE_ID_BYTES into id, size the
 * caller's buffer). KT_ERR_UNSUPPORTED without NCCL in the build or the
 * machine. */
KT_API kt_status kt_comm_nccl_unique_id(void* id, size_t size);

/* Collective. Returns when every rank reached it. */
KT_API kt_status kt_comm_barrier(kt_comm* comm);
/* Collective: root's tensor is copied into every rank's tensor (same
 * dtype and shape on every rank, compact). A CPU tensor goes through the
 * CPU backend, a CUDA tensor through the CUDA one. */
KT_API kt_status kt_comm_broadcast(kt_comm* comm, DLTensor* tensor, int root);
/* Collective: out [world_size, ...in's shape] (compact, in's dtype and
 * device) receives every rank's in, rank by rank. */
KT_API kt_status kt_comm_allgather(kt_comm* comm, const DLTensor* in, DLTensor* out);

/* One MoE layer spread over a communicator's ranks. Two ways:
 *
 * KT_DIST_OWNER: one rank (the owner) holds the whole layer, creates it on
 * its engine and loads its weights; the other ranks have no engine, no
 * weights and never read a checkpoint. Each forward gathers every rank's
 * token rows (x, ids, routing weights; T may differ per rank, 0 included)
 * to the owner, computes them as one batched call (rank 0's rows first)
 * and scatters y back; backward does the same with dy, and computes the
 * parameter gradients once, for all ranks' tokens, into the owner's bound
 * buffers.
 *
 * KT_DIST_EXPERT_PARALLEL: the experts are sharded over the ranks (an even
 * contiguous split, or options->expert_ranks); each rank holds a layer of
 * its experts only (kt_dist_moe_local_experts says which, in local order)
 * and loads those. A forward sends each route's x row to the rank of its
 * expert (all-to-all, each rank's outcome and route count ahead of its
 * rows), computes there, and sends each route's weighted output back
 * (all-to-all): two exchanges, one each way (a backward likewise, dy out,
 * dx and routing-weight gradients back); the origin sums a token's routes
 * in ascending expert order, so y, dx and the routing-weight gradients are
 * the bits one process gives for the same tokens, and each rank's
 * parameter gradients those of its experts.
 *
 * Both: every rank calls forward and backward (collectives); X, Y, DY, DX
 * have one dtype on every rank; backward options must agree on every rank.
 * Parameter gradients are multiplied by options->grad_scale, and with
 * KT_DIST_GRAD_MEAN also by 1/world_size, matching a host whose
 * data-parallel ranks average their gradients (DDP); KT_DIST_GRAD_SUM sums
 * them. dx and routing-weight gradients are never scaled. */

typedef struct kt_dist_moe kt_dist_moe;
typedef struct kt_dist_context kt_dist_context;

typedef enum kt_dist_mode {
  KT_DIST_OWNER = 0,
  KT_DIST_EXPERT_PARALLEL = 1
} kt_dist_mode;

typedef enum kt_dist_grad_average {
  KT_DIST_GRAD_SUM = 0, /* gradients of all ranks' tokens, summed (times grad_scale) */
  KT_DIST_GRAD_MEAN = 1 /* the same times 1/world_size (DDP's average) */
} kt_dist_grad_average;

typedef struct kt_dist_moe_options {
  size_t struct_size;                /* set by _init */
  kt_dist_mode mode;                 /* default KT_DIST_OWNER */
  int owner_rank;                    /* KT_DIST_OWNER: the rank holding the layer (default 0) */
  kt_dist_grad_average grad_average; /* default KT_DIST_GRAD_SUM */
  /* KT_DIST_EXPERT_PARALLEL: [num_experts] rank of each expert (borrowed
   * for the call; every rank passes the same map), or NULL for an even
   * contiguous split (rank r holds experts [r*E/W, (r+1)*E/W)). */
  const int32_t* expert_ranks;
} kt_dist_moe_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_dist_moe_options_defaults(kt_dist_moe_options* options, size_t struct_size);
static inline void kt_dist_moe_options_init(kt_dist_moe_options* options) {
  kt_dist_moe_options_defaults(options, sizeof(*options));
}

/* Creates the distributed layer (collective). layer_options are the whole
 * layer's (E, k, H, I, max_tokens per rank, activation, mode, LoRA); every
 * rank passes the same, and the same dist options: a difference (E, k, H,
 * I, activation, mode, weight format, ...) is found here and refused on
 * every rank with KT_ERR_INVALID_ARGUMENT naming the field and the ranks.
 * engine: the owner's engine (KT_DIST_OWNER; other ranks pass NULL), or
 * every rank's (KT_DIST_EXPERT_PARALLEL). comm and engine are retained
 * until kt_dist_moe_destroy. *dist is written by the call. */
KT_API kt_status kt_dist_moe_create(kt_comm* comm, kt_engine* engine,
                                    const kt_moe_options* layer_options,
                                    const kt_dist_moe_options* options, kt_dist_moe** dist);
/* Frees the layer and its contexts (not collective). NULL accepted. */
KT_API void kt_dist_moe_destroy(kt_dist_moe* dist);

/* The layer this rank computes with, owned by dist (never destroy it): load
 * weights, bind parameters and gradient buffers, set hooks through it. The
 * owner's has the whole layer (max_tokens = world_size x the per-rank
 * max_tokens); an expert-parallel rank's holds its experts only, as local
 * experts 0..n-1, with top_k 1 (each computed row is one route). NULL on
 * ranks without one. */
KT_API kt_status kt_dist_moe_layer(const kt_dist_moe* dist, kt_moe** layer);

/* The global ids of this rank's experts in local order (ascending), up to
 * capacity of them into experts (may be NULL with capacity 0); *count gets
 * how many there are. Owner mode: all E on the owner, none elsewhere. */
KT_API kt_status kt_dist_moe_local_experts(const kt_dist_moe* dist, int64_t* experts,
                                           int64_t capacity, int64_t* count);

/* Forward (collective). args: X, IDS, ROUTE_WEIGHTS, Y of this rank's T
 * tokens (T <= layer_options->max_tokens), as kt_moe_forward. With saved !=
 * NULL, *saved gets a context for kt_dist_moe_backward. */
KT_API kt_status kt_dist_moe_forward(kt_dist_moe* dist, const kt_arg* args, size_t num_args,
                                     kt_dist_context** saved);
/* Backward (collective) of the forward that wrote ctx: every rank passes
 * the context of the same forward (refused on every rank otherwise). args:
 * DY (required), DX, DROUTE_WEIGHTS (optional), as kt_moe_backward. */
KT_API kt_status kt_dist_moe_backward(kt_dist_moe* dist, kt_dist_context* ctx,
                                      const kt_backward_options* options, const kt_arg* args,
                                      size_t num_args);
/* Frees a context (not collective). NULL accepted. */
KT_API void kt_dist_context_release(kt_dist_context* ctx);

/* ------------------------------------ distributed checkpoints (kt_dist_ckpt_*)
 *
 * A training state spread over a communicator's ranks, saved into one
 * checkpoint directory and loaded back by any number of ranks with any
 * expert map. dir names the same directory on every rank (a shared file
 * system past one machine). It holds:
 * - kt_dist_checkpoint.json, the manifest: format and version, a
 *   checkpoint id, the world size and files, and per layer its number, the
 *   layer options (E, k, H, I, activation, bias, mode, weight format,
 *   LoRA rank/alpha/targets), the distribution mode and expert map (the
 *   rank that saved each expert), the parts saved, the per-expert shape and
 *   dtype of every tensor, and the optimizer's algorithm, hyperparameters
 *   and step count;
 * - rank-<r>-of-<W>.safetensors, one per saving rank, with the experts that
 *   rank held (expert parallel: its shard; owner mode: all, on the owner),
 *   named by layer and global expert id:
 *     layers.{L}.experts.{e}.{gate,up,down}_proj.weight / .bias   base weights
 *     layers.{L}.experts.{e}.{gate,up,down}_proj.lora_A / .lora_B LoRA factors
 *     layers.{L}.experts.{e}.optim.{PARAM}.{master,exp_avg,...}   optimizer state
 *   (PARAM: W_GATE, B_DOWN, LORA_A_UP, ...; fp32).
 * Weights are stored as the layer holds them: a bf16 layer's packed weights
 * (bf16, exactly), or in KT_MODE_FULL the bound trainable tensors in their
 * dtype; biases fp32; LoRA factors in their bound dtype. So a load gives
 * back the same bits, and a training run resumed from a checkpoint on
 * another world size makes the same steps as one never interrupted.
 *
 * Publishing: every rank writes its file into one staging directory next
 * to dir (made by rank 0, as kt_ckpt_write_experts does, see "writers"
 * above); the ranks then agree that every file is complete and fsync'ed,
 * and only then rank 0 writes the manifest and swaps the staging directory
 * in as dir. So dir holds the previous checkpoint or the whole new one:
 * a rank that fails or dies mid-save (the others return its status, or
 * KT_ERR_COMM within the communicator's timeout) leaves the previous one as
 * it was; the staging directory is removed by rank 0, or by the next save
 * of dir when rank 0 itself died. Entries of dir that the checkpoint does
 * not own (the manifest, rank-*-of-*.safetensors) are carried over.
 *
 * Both calls are collective over comm: every rank calls them with the same
 * dir and the same layers (numbers, in the same order), each passing its
 * own kt_dist_moe of each layer (on comm) and its own optimizer. Each
 * returns the same status on every rank (the lowest failing rank's, with
 * its message). Serialised with the layers' compute calls. */

/* Parts of a checkpoint (bits). */
#define KT_DIST_CKPT_WEIGHTS 1u   /* base weights and biases */
#define KT_DIST_CKPT_ADAPTER 2u   /* LoRA factors (KT_MODE_LORA) */
#define KT_DIST_CKPT_OPTIMIZER 4u /* kt_optimizer state */

typedef struct kt_dist_ckpt_layer {
  int64_t layer;           /* L, the layer's number in the checkpoint (>= 0, distinct) */
  kt_dist_moe* dist;       /* this rank's distributed layer, created on comm */
  kt_optimizer* optimizer; /* NULL, or this rank's optimizer over the local layer
                            * (kt_optimizer_create_for_layer of kt_dist_moe_layer) */
} kt_dist_ckpt_layer;

typedef struct kt_dist_ckpt_options {
  size_t struct_size; /* set by _init */
  /* KT_DIST_CKPT_* bits, or 0 (default) for what the layers have: saving,
   * the weights of bf16 layers (a quantized base is frozen and reloaded from
   * its source checkpoint), LoRA factors in KT_MODE_LORA, optimizer state
   * where optimizers are given (every rank holding experts of a layer must
   * pass one, or none); loading, every part the checkpoint holds that the
   * layers can take (optimizer state only where an optimizer is given). A
   * part named explicitly that a layer cannot give or take is refused
   * (KT_ERR_UNSUPPORTED for the weights of a quantized layer, KT_ERR_MODE
   * for LoRA outside KT_MODE_LORA, KT_ERR_NULL_POINTER for a missing
   * optimizer, KT_ERR_INVALID_ARGUMENT for a part the checkpoint lacks). */
  unsigned parts;
  /* Called on each rank's calling thread with the bytes of its file written
   * (save) or copied (load) so far and in all; may be NULL. */
  kt_ckpt_progress_fn progress;
  void* progress_user;
} kt_dist_ckpt_options;

/* Writes the defaults into the first struct_size bytes of *options (zero past
 * the fields this library knows) and sets options->struct_size. */
KT_API void kt_dist_ckpt_options_defaults(kt_dist_ckpt_options* options, size_t struct_size);
static inline void kt_dist_ckpt_options_init(kt_dist_ckpt_options* options) {
  kt_dist_ckpt_options_defaults(options, sizeof(*options));
}

/* Saves the layers' state into dir (borrowed; created with its parents when
 * missing), published atomically as described above. Reads the layers'
 * weights, bound LoRA factors and the optimizers' state; changes nothing.
 * LoRA factors must be bound (KT_ERR_NOT_BOUND). The ranks holding experts
 * of a layer must agree on its optimizer's algorithm, hyperparameters and
 * step count, and on the dtypes of its bound tensors
 * (KT_ERR_INVALID_ARGUMENT naming the ranks). options may be NULL. */
KT_API kt_status kt_dist_ckpt_save(kt_comm* comm, const char* dir, const kt_dist_ckpt_layer* layers,
                                   size_t num_layers, const kt_dist_ckpt_options* options);

/* Loads the checkpoint in dir (borrowed) into the layers, which may have
 * another world size, distribution mode or expert map than the ranks that
 * saved it: each rank reads its own experts from whichever files hold them.
 * Weights go into the local layer (kt_moe_load_expert; in KT_MODE_FULL
 * into the bound trainable tensors, then kt_moe_params_changed), LoRA
 * factors into the bound tensors (converted to their dtype), optimizer
 * state into the optimizer (masters, moments, step, hyperparameters). The
 * manifest and every tensor are checked on every rank before anything
 * changes: a layer the checkpoint lacks or one saved with another E, H, I,
 * bias setting, LoRA rank or targets (KT_ERR_SHAPE or
 * KT_ERR_INVALID_ARGUMENT, naming the layer, the field and both values), an
 * optimizer of another algorithm, or a damaged file (KT_ERR_IO) fail the
 * call on every rank with nothing changed; the ranks also check that they
 * read one and the same checkpoint. options may be NULL. */
KT_API kt_status kt_dist_ckpt_load(kt_comm* comm, const char* dir, const kt_dist_ckpt_layer* layers,
                                   size_t num_layers, const kt_dist_ckpt_options* options);

#ifdef __cplusplus
}
#endif

#endif /* KT_C_API_H_ */
