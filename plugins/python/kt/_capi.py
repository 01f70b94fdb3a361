"""ctypes declarations of include/kt_c_api.h (ABI major 1) and the library loader.

The struct layouts below mirror the header field by field; the growable option
structs carry their own ``struct_size`` and are always filled first by the
library's ``*_defaults(struct, sizeof(struct))`` functions (what the header's
inline ``*_init`` do), so the library writes only the bytes these classes have
and fields it appends later keep their defaults.
"""
import ctypes
import ctypes.util
import os

ABI_VERSION = 1

# DLPack (v0.6+) device and type codes used by kt.
KDL_CPU = 1
KDL_CUDA = 2
KDL_CUDA_HOST = 3
KDL_EXT_DEV = 12
KDL_INT = 0
KDL_UINT = 1
KDL_FLOAT = 2
KDL_BFLOAT = 4
KDL_BOOL = 6

# kt_status values (pinned by the ABI).
STATUS_NAMES = {
    0: "KT_OK", 1: "KT_ERR_INVALID_ARGUMENT", 2: "KT_ERR_NULL_POINTER",
    3: "KT_ERR_INVALID_HANDLE", 4: "KT_ERR_DTYPE", 5: "KT_ERR_SHAPE", 6: "KT_ERR_STRIDE",
    7: "KT_ERR_DEVICE", 8: "KT_ERR_EXPERT_ID", 9: "KT_ERR_TOO_MANY_TOKENS",
    10: "KT_ERR_CONTEXT", 11: "KT_ERR_NOT_BOUND", 12: "KT_ERR_NOT_LOADED", 13: "KT_ERR_MODE",
    14: "KT_ERR_UNSUPPORTED", 15: "KT_ERR_OUT_OF_MEMORY", 16: "KT_ERR_IO", 17: "KT_ERR_INTERNAL",
    18: "KT_ERR_COMM",
}

# kt_precision
PRECISION_DEFAULT, PRECISION_FP32 = 0, 1
# kt_isa
ISA_AUTO, ISA_REF, ISA_AVX2, ISA_AVX512BF16, ISA_AMX = 0, 1, 2, 3, 4
# kt_activation
ACT_SILU, ACT_SWIGLU_OAI = 0, 1
# kt_mode
MODE_INFERENCE, MODE_LORA, MODE_FULL = 0, 1, 2
SUBMIT_DEFERRED = 1  # KT_SUBMIT_DEFERRED
# projection bits
PROJ_GATE, PROJ_UP, PROJ_DOWN, PROJ_ALL = 1, 2, 4, 7
# kt_weight_orientation / kt_gate_up_order / kt_grad_accumulate
ORIENT_OUT_IN, ORIENT_IN_OUT = 0, 1
GATE_UP_CONCAT, GATE_UP_INTERLEAVED = 0, 1
GRAD_OVERWRITE, GRAD_ACCUMULATE = 0, 1

# kt_arg_id
ARG = dict(
    X=1, IDS=2, ROUTE_WEIGHTS=3, Y=4, DY=5, DX=6, DROUTE_WEIGHTS=7,
    W_GATE=16, W_UP=17, W_DOWN=18, W_GATE_UP=19, B_GATE=20, B_UP=21, B_DOWN=22,
    B_GATE_UP=23, EXPERT_MAP=24,
    LORA_A_GATE=32, LORA_B_GATE=33, LORA_A_UP=34, LORA_B_UP=35, LORA_A_DOWN=36,
    LORA_B_DOWN=37,
    GRAD_LORA_A_GATE=48, GRAD_LORA_B_GATE=49, GRAD_LORA_A_UP=50, GRAD_LORA_B_UP=51,
    GRAD_LORA_A_DOWN=52, GRAD_LORA_B_DOWN=53,
    GRAD_W_GATE=64, GRAD_W_UP=65, GRAD_W_DOWN=66, GRAD_B_GATE=67, GRAD_B_UP=68,
    GRAD_B_DOWN=69,
)


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)


class EngineOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_threads", ctypes.c_int),
        ("pin_threads", ctypes.c_int),
        ("max_isa", ctypes.c_int),
        ("verbosity", ctypes.c_int),
        ("log_fn", LOG_FN),
        ("log_user", ctypes.c_void_p),
        ("precision", ctypes.c_int),
        ("host_openmp", ctypes.c_int),
    ]


class EngineInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_threads", ctypes.c_int),
        ("isa", ctypes.c_int),
        ("cpu_isa", ctypes.c_int),
        ("kernel_name", ctypes.c_char_p),
        ("gemm_backend", ctypes.c_int),
        ("precision", ctypes.c_int),
    ]


class MoeOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64),
        ("activation", ctypes.c_int),
        ("act_alpha", ctypes.c_float),
        ("act_limit", ctypes.c_float),
        ("has_bias", ctypes.c_int),
        ("mode", ctypes.c_int),
        ("weight_format", ctypes.c_int),
        ("lora_rank", ctypes.c_int64),
        ("lora_alpha", ctypes.c_float),
        ("use_rslora", ctypes.c_int),
        ("lora_targets", ctypes.c_uint),
        ("compute", ctypes.c_int),
    ]


# kt_compute: how a layer's weight GEMMs multiply.
COMPUTES = {"bf16": 0, "int8": 1}

# kt_weight_format
WEIGHT_FORMATS = {"bf16": 0, "int8_channel": 1, "int4_g32": 2, "fp8_b128": 3, "mxfp4": 4, "int4_g128": 5,
                  "int4_g32_zp": 6, "int4_g128_zp": 7}


class MoeInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_experts", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("max_tokens", ctypes.c_int64),
        ("mode", ctypes.c_int),
        ("weight_format", ctypes.c_int),
        ("weight_bytes", ctypes.c_int64),
        ("num_weights", ctypes.c_int64),
        ("num_loaded", ctypes.c_int64),
        ("compute", ctypes.c_int),
    ]


class PackedInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("num_experts", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("has_bias", ctypes.c_int),
        ("weight_format", ctypes.c_int),
        ("num_loaded", ctypes.c_int64),
        ("weight_bytes", ctypes.c_int64),
        ("file_bytes", ctypes.c_int64),
        ("format_version", ctypes.c_int),
    ]


class LoadOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("orientation", ctypes.c_int),
        ("gate_up_order", ctypes.c_int),
    ]


class BackwardOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("grad_scale", ctypes.c_float),
        ("accumulate", ctypes.c_int),
        ("param_grads", ctypes.c_int),
    ]


class Arg(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("tensor", ctypes.POINTER(DLTensor))]


# kt_optim_algorithm / kt_optim_arithmetic / kt_optim_state
OPTIM_ADAMW, OPTIM_SGD = 0, 1
OPTIM_TORCH1, OPTIM_TORCH2 = 0, 1
OPTIM_STATE_MASTER, OPTIM_STATE_EXP_AVG, OPTIM_STATE_EXP_AVG_SQ = 0, 1, 2
OPTIM_STATE_MAX_EXP_AVG_SQ, OPTIM_STATE_MOMENTUM = 3, 4


class OptimizerOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("algorithm", ctypes.c_int),
        ("amsgrad", ctypes.c_int),
        ("lr", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("momentum", ctypes.c_double),
        ("dampening", ctypes.c_double),
        ("nesterov", ctypes.c_int),
        ("arithmetic", ctypes.c_int),
        ("assume_finite", ctypes.c_int),
    ]


class OptimizerStepOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("grad_unscale", ctypes.c_float),
        ("clip_coef", ctypes.c_float),
        ("found_nonfinite", ctypes.POINTER(ctypes.c_int)),
    ]


class OptimizerParam(ctypes.Structure):
    _fields_ = [("param", ctypes.POINTER(DLTensor)), ("grad", ctypes.POINTER(DLTensor))]


# kt_ckpt_dtype (every value; the writers take F32, F16, BF16) / kt_ckpt_layout
CKPT_DTYPES = {"UNKNOWN": 0, "F32": 1, "F16": 2, "BF16": 3, "F64": 4, "F8_E4M3": 5, "F8_E5M2": 6, "E8M0": 7,
               "I8": 8, "U8": 9, "I16": 10, "U16": 11, "I32": 12, "U32": 13, "I64": 14, "U64": 15, "BOOL": 16}
CKPT_LAYOUT_NONE, CKPT_LAYOUT_PER_EXPERT, CKPT_LAYOUT_MIXTRAL = 0, 1, 2
CKPT_LAYOUT_FUSED, CKPT_LAYOUT_FUSED_IN_OUT, CKPT_LAYOUT_GPT_OSS = 3, 4, 5
PACKED_SKIP_CHECKSUMS = 1


class CkptInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("architecture", ctypes.c_char_p),
        ("model_type", ctypes.c_char_p),
        ("layout", ctypes.c_int),
        ("num_moe_layers", ctypes.c_int64),
        ("num_tensors", ctypes.c_int64),
        ("num_files", ctypes.c_int64),
        ("total_bytes", ctypes.c_int64),
        ("top_k", ctypes.c_int64),
    ]


class CkptLayerInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("layer", ctypes.c_int64),
        ("num_experts", ctypes.c_int64),
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("has_bias", ctypes.c_int),
        ("layout", ctypes.c_int),
        ("format", ctypes.c_int),
        ("weight_dtype", ctypes.c_int),
        ("loadable", ctypes.c_int),
        ("bytes", ctypes.c_int64),
        ("weight_format", ctypes.c_int),
        ("group_size", ctypes.c_int64),
        ("num_tensors", ctypes.c_int64),
    ]


class CkptLoadOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("dequantize", ctypes.c_int),
    ]


class CkptTensor(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("name", ctypes.c_char_p),
        ("file", ctypes.c_char_p),
        ("dtype", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("shape", ctypes.c_int64 * 8),
        ("nbytes", ctypes.c_int64),
        ("data", ctypes.c_void_p),
    ]


class CkptWriteOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("layout", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("max_shard_bytes", ctypes.c_int64),
        ("config_json", ctypes.c_char_p),
    ]


class CkptLayerArgs(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_int64), ("args", ctypes.POINTER(Arg)), ("num_args", ctypes.c_size_t)]


class CkptAdapterConfig(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("rank", ctypes.c_int64),
        ("alpha", ctypes.c_float),
        ("use_rslora", ctypes.c_int),
        ("targets", ctypes.c_uint),
        ("layout", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("base_model", ctypes.c_char_p),
    ]


CKPT_PROGRESS_FN = ctypes.CFUNCTYPE(None, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)

# kt_comm_backend, kt_dist_mode, kt_dist_grad_average
COMM_BACKEND_NONE, COMM_BACKEND_GLOO, COMM_BACKEND_NCCL = 0, 1, 2
DIST_OWNER, DIST_EXPERT_PARALLEL = 0, 1
DIST_GRAD_SUM, DIST_GRAD_MEAN = 0, 1


class CommBackends(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("cpu", ctypes.c_int),
        ("cuda", ctypes.c_int),
        ("device", ctypes.c_int),
    ]


STORE_SET_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
STORE_GET_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
                                ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p)


class CommStore(ctypes.Structure):
    _fields_ = [("set", STORE_SET_FN), ("get", STORE_GET_FN), ("user", ctypes.c_void_p)]


class CommOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("backend", ctypes.c_char_p),
        ("rank", ctypes.c_int),
        ("world_size", ctypes.c_int),
        ("store_path", ctypes.c_char_p),
        ("store", ctypes.POINTER(CommStore)),
        ("store_prefix", ctypes.c_char_p),
        ("hostname", ctypes.c_char_p),
        ("timeout_ms", ctypes.c_int64),
        ("nccl_unique_id", ctypes.c_void_p),
        ("nccl_comm", ctypes.c_void_p),
        ("cuda_device", ctypes.c_int),
    ]


class CommInfo(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("rank", ctypes.c_int),
        ("world_size", ctypes.c_int),
        ("backends", CommBackends),
        ("timeout_ms", ctypes.c_int64),
        ("usable", ctypes.c_int),
    ]


class DistMoeOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("mode", ctypes.c_int),
        ("owner_rank", ctypes.c_int),
        ("grad_average", ctypes.c_int),
        ("expert_ranks", ctypes.POINTER(ctypes.c_int32)),
    ]


# KT_DIST_CKPT_* parts
DIST_CKPT_PARTS = {"weights": 1, "adapter": 2, "optimizer": 4}


class DistCkptLayer(ctypes.Structure):
    _fields_ = [("layer", ctypes.c_int64), ("dist", ctypes.c_void_p), ("optimizer", ctypes.c_void_p)]


class DistCkptOptions(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_size_t),
        ("parts", ctypes.c_uint),
        ("progress", CKPT_PROGRESS_FN),
        ("progress_user", ctypes.c_void_p),
    ]


_P = ctypes.c_void_p
_S = ctypes.c_int  # kt_status
_PROTOTYPES = {
    "kt_version": (ctypes.c_char_p, []),
    "kt_version_number": (ctypes.c_int, []),
    "kt_abi_version": (ctypes.c_int, []),
    "kt_build_info": (ctypes.c_char_p, []),
    "kt_status_string": (ctypes.c_char_p, [ctypes.c_int]),
    "kt_last_error": (ctypes.c_char_p, []),
    "kt_clear_error": (None, []),
    "kt_cpu_isa": (ctypes.c_int, []),
    "kt_isa_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kt_engine_options_defaults": (None, [ctypes.POINTER(EngineOptions), ctypes.c_size_t]),
    "kt_engine_create": (_S, [ctypes.POINTER(EngineOptions), ctypes.POINTER(_P)]),
    "kt_engine_destroy": (_S, [_P]),
    "kt_engine_get_info": (_S, [_P, ctypes.POINTER(EngineInfo)]),
    "kt_engine_set_gemm_backend": (_S, [_P, ctypes.c_int]),
    "kt_moe_options_defaults": (None, [ctypes.POINTER(MoeOptions), ctypes.c_size_t]),
    "kt_moe_create": (_S, [_P, ctypes.POINTER(MoeOptions), ctypes.POINTER(_P)]),
    "kt_moe_destroy": (None, [_P]),
    "kt_moe_lora_scale": (_S, [_P, ctypes.POINTER(ctypes.c_float)]),
    "kt_load_options_defaults": (None, [ctypes.POINTER(LoadOptions), ctypes.c_size_t]),
    "kt_moe_load_weights": (_S, [_P, ctypes.POINTER(LoadOptions), ctypes.POINTER(Arg), ctypes.c_size_t]),
    "kt_moe_load_expert": (_S, [_P, ctypes.c_int64, ctypes.POINTER(LoadOptions), ctypes.POINTER(Arg),
                                ctypes.c_size_t]),
    "kt_moe_set_skipped": (_S, [_P, ctypes.POINTER(DLTensor)]),
    "kt_moe_num_loaded": (_S, [_P, ctypes.POINTER(ctypes.c_int64)]),
    "kt_moe_bind": (_S, [_P, ctypes.POINTER(Arg), ctypes.c_size_t]),
    "kt_moe_params_changed": (_S, [_P]),
    "kt_moe_forward": (_S, [_P, ctypes.POINTER(Arg), ctypes.c_size_t, ctypes.POINTER(_P)]),
    "kt_backward_options_defaults": (None, [ctypes.POINTER(BackwardOptions), ctypes.c_size_t]),
    "kt_moe_backward": (_S, [_P, _P, ctypes.POINTER(BackwardOptions), ctypes.POINTER(Arg), ctypes.c_size_t]),
    "kt_context_release": (None, [_P]),
    "kt_moe_forward_submit": (_S, [_P, ctypes.POINTER(Arg), ctypes.c_size_t, ctypes.POINTER(_P),
                                   ctypes.c_uint, ctypes.POINTER(_P)]),
    "kt_job_run": (None, [_P]),
    "kt_job_wait": (_S, [_P]),
    "kt_job_done": (ctypes.c_int, [_P]),
    "kt_job_destroy": (None, [_P]),
    "kt_optimizer_options_defaults": (None, [ctypes.POINTER(OptimizerOptions), ctypes.c_size_t]),
    "kt_optimizer_step_options_defaults": (None, [ctypes.POINTER(OptimizerStepOptions), ctypes.c_size_t]),
    "kt_optimizer_create": (_S, [_P, ctypes.POINTER(OptimizerOptions), ctypes.POINTER(OptimizerParam),
                                 ctypes.c_size_t, ctypes.POINTER(_P)]),
    "kt_optimizer_create_for_layer": (_S, [_P, ctypes.POINTER(OptimizerOptions), ctypes.POINTER(_P)]),
    "kt_optimizer_destroy": (None, [_P]),
    "kt_optimizer_set_options": (_S, [_P, ctypes.POINTER(OptimizerOptions)]),
    "kt_optimizer_get_options": (_S, [_P, ctypes.POINTER(OptimizerOptions)]),
    "kt_optimizer_set_grad": (_S, [_P, ctypes.c_size_t, ctypes.POINTER(DLTensor)]),
    "kt_optimizer_step": (_S, [_P, ctypes.POINTER(OptimizerStepOptions)]),
    "kt_optimizer_step_submit": (_S, [_P, ctypes.POINTER(OptimizerStepOptions), ctypes.c_uint, ctypes.POINTER(_P)]),
    "kt_job_wait": (_S, [_P]),
    "kt_job_destroy": (None, [_P]),
    "kt_optimizer_grad_sq_norm": (_S, [_P, ctypes.POINTER(ctypes.c_double)]),
    "kt_optimizer_num_params": (_S, [_P, ctypes.POINTER(ctypes.c_size_t)]),
    "kt_optimizer_get_step": (_S, [_P, ctypes.POINTER(ctypes.c_int64)]),
    "kt_optimizer_set_step": (_S, [_P, ctypes.c_int64]),
    "kt_optimizer_state": (_S, [_P, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(DLTensor)]),
    "kt_optimizer_save": (_S, [_P, ctypes.c_char_p]),
    "kt_optimizer_load": (_S, [_P, ctypes.c_char_p]),
    "kt_moe_save_packed": (_S, [_P, ctypes.c_char_p]),
    "kt_moe_read_weights": (_S, [_P, ctypes.POINTER(Arg), ctypes.c_size_t]),
    "kt_weight_format_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kt_moe_get_info": (_S, [_P, ctypes.POINTER(MoeInfo)]),
    "kt_packed_read_info": (_S, [ctypes.c_char_p, ctypes.POINTER(PackedInfo)]),
    "kt_moe_load_packed": (_S, [_P, ctypes.c_char_p, ctypes.c_uint]),
    "kt_ckpt_dtype_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kt_ckpt_layout_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kt_ckpt_format_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kt_ckpt_open": (_S, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    "kt_ckpt_close": (None, [_P]),
    "kt_ckpt_get_info": (_S, [_P, ctypes.POINTER(CkptInfo)]),
    "kt_ckpt_get_layer_info": (_S, [_P, ctypes.c_int64, ctypes.POINTER(CkptLayerInfo)]),
    "kt_ckpt_moe_options": (_S, [_P, ctypes.c_int64, ctypes.POINTER(MoeOptions)]),
    "kt_ckpt_load_layer": (_S, [_P, ctypes.c_int64, _P, CKPT_PROGRESS_FN, ctypes.c_void_p]),
    "kt_ckpt_load_options_defaults": (None, [ctypes.POINTER(CkptLoadOptions), ctypes.c_size_t]),
    "kt_ckpt_load_layer_with": (_S, [_P, ctypes.c_int64, _P, ctypes.POINTER(CkptLoadOptions), CKPT_PROGRESS_FN,
                                     ctypes.c_void_p]),
    "kt_ckpt_read_layer": (_S, [_P, ctypes.c_int64, ctypes.POINTER(Arg), ctypes.c_size_t]),
    "kt_ckpt_layer_tensor_at": (_S, [_P, ctypes.c_int64, ctypes.c_int64, ctypes.POINTER(CkptTensor)]),
    "kt_ckpt_tensor_at": (_S, [_P, ctypes.c_int64, ctypes.POINTER(CkptTensor)]),
    "kt_ckpt_find_tensor": (_S, [_P, ctypes.c_char_p, ctypes.POINTER(CkptTensor)]),
    "kt_ckpt_write_options_defaults": (None, [ctypes.POINTER(CkptWriteOptions), ctypes.c_size_t]),
    "kt_ckpt_write_experts": (_S, [ctypes.c_char_p, ctypes.POINTER(CkptWriteOptions),
                                   ctypes.POINTER(CkptLayerArgs), ctypes.c_size_t]),
    "kt_ckpt_adapter_config_defaults": (None, [ctypes.POINTER(CkptAdapterConfig), ctypes.c_size_t]),
    "kt_ckpt_adapter_write": (_S, [ctypes.c_char_p, ctypes.POINTER(CkptAdapterConfig),
                                   ctypes.POINTER(CkptLayerArgs), ctypes.c_size_t]),
    "kt_ckpt_adapter_read_config": (_S, [ctypes.c_char_p, ctypes.POINTER(CkptAdapterConfig)]),
    "kt_ckpt_adapter_read": (_S, [ctypes.c_char_p, ctypes.c_int64, ctypes.POINTER(Arg), ctypes.c_size_t]),
    "kt_comm_parse_backend": (_S, [ctypes.c_char_p, ctypes.POINTER(CommBackends)]),
    "kt_comm_options_defaults": (None, [ctypes.POINTER(CommOptions), ctypes.c_size_t]),
    "kt_comm_create": (_S, [ctypes.POINTER(CommOptions), ctypes.POINTER(_P)]),
    "kt_comm_destroy": (None, [_P]),
    "kt_comm_get_info": (_S, [_P, ctypes.POINTER(CommInfo)]),
    "kt_comm_barrier": (_S, [_P]),
    "kt_dist_moe_options_defaults": (None, [ctypes.POINTER(DistMoeOptions), ctypes.c_size_t]),
    "kt_dist_moe_create": (_S, [_P, _P, ctypes.POINTER(MoeOptions), ctypes.POINTER(DistMoeOptions),
                                ctypes.POINTER(_P)]),
    "kt_dist_moe_destroy": (None, [_P]),
    "kt_dist_moe_layer": (_S, [_P, ctypes.POINTER(_P)]),
    "kt_dist_moe_local_experts": (_S, [_P, ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                       ctypes.POINTER(ctypes.c_int64)]),
    "kt_dist_moe_forward": (_S, [_P, ctypes.POINTER(Arg), ctypes.c_size_t, ctypes.POINTER(_P)]),
    "kt_dist_moe_backward": (_S, [_P, _P, ctypes.POINTER(BackwardOptions), ctypes.POINTER(Arg), ctypes.c_size_t]),
    "kt_dist_context_release": (None, [_P]),
    "kt_dist_ckpt_options_defaults": (None, [ctypes.POINTER(DistCkptOptions), ctypes.c_size_t]),
    "kt_dist_ckpt_save": (_S, [_P, ctypes.c_char_p, ctypes.POINTER(DistCkptLayer), ctypes.c_size_t,
                               ctypes.POINTER(DistCkptOptions)]),
    "kt_dist_ckpt_load": (_S, [_P, ctypes.c_char_p, ctypes.POINTER(DistCkptLayer), ctypes.c_size_t,
                               ctypes.POINTER(DistCkptOptions)]),
}


def _candidates():
    """Where libkt is looked for, in order: $KT_LIBRARY, the build tree
    recorded by install_dev.sh, next to this package, the system loader."""
    env = os.environ.get("KT_LIBRARY")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        from . import _libpath  # written by install_dev.sh; not in version control
        yield _libpath.LIBRARY
    except ImportError:
        pass
    for name in ("libkt.so.%d" % ABI_VERSION, "libkt.so"):
        path = os.path.join(here, name)
        if os.path.exists(path):
            yield path
    yield "libkt.so.%d" % ABI_VERSION
    found = ctypes.util.find_library("kt")
    if found:
        yield found


def load_library():
    errors = []
    for path in _candidates():
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            errors.append("%s: %s" % (path, e))
            continue
        for name, (restype, argtypes) in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        return lib, path
    raise ImportError("kt: cannot load libkt (set KT_LIBRARY to its path); tried:\n  " +
                      "\n  ".join(errors))
