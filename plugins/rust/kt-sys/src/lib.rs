//! Raw declarations of kt's C ABI (`kt_c_api.h`, ABI major 1) and of the
//! DLPack types it uses. Everything here is `unsafe` to call and mirrors the
//! header one to one; the safe binding is the `kt` crate.
//!
//! The declarations are written by hand. The macros below also record each
//! function's signature, each constant and each struct's layout as data, so
//! `tests/header.rs` can compile them against the real header and fail on any
//! difference.
#![allow(non_camel_case_types, non_upper_case_globals)]

use std::marker::{PhantomData, PhantomPinned};
pub use std::os::raw::{c_char, c_int, c_uint, c_void};

/// Declares `#[repr(C)]` structs and records their layout for the header check.
macro_rules! kt_structs {
    ($( $(#[$meta:meta])* pub struct $name:ident { $( $(#[$fmeta:meta])* pub $field:ident : $fty:ty, )* } )*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            #[derive(Clone, Copy, Debug)]
            pub struct $name { $( $(#[$fmeta])* pub $field: $fty, )* }
        )*

        /// (name, size, alignment, [(field, offset)]) of every struct declared here.
        #[doc(hidden)]
        pub fn declared_layouts() -> Vec<(&'static str, usize, usize, Vec<(&'static str, usize)>)> {
            vec![$(
                {
                    let probe = std::mem::MaybeUninit::<$name>::uninit();
                    let base = probe.as_ptr();
                    // addr_of! takes field addresses without reading the uninit value.
                    let fields = vec![$( (stringify!($field), unsafe {
                        std::ptr::addr_of!((*base).$field) as usize - base as usize
                    }), )*];
                    (stringify!($name), std::mem::size_of::<$name>(), std::mem::align_of::<$name>(), fields)
                },
            )*]
        }
    };
}

/// Declares integer constants (enum values and `#define`s) and records them.
macro_rules! kt_constants {
    ($( $(#[$meta:meta])* $ty:ident { $( $(#[$cmeta:meta])* $name:ident = $value:expr, )* } )*) => {
        $( $( $(#[$cmeta])* pub const $name: $ty = $value; )* )*

        /// (name, value) of every constant declared here.
        #[doc(hidden)]
        pub const DECLARED_CONSTANTS: &[(&str, i64)] = &[$( $( (stringify!($name), $value as i64), )* )*];
    };
}

/// Declares the exported functions and records their signatures.
macro_rules! kt_functions {
    ($( $(#[$meta:meta])* pub fn $name:ident ( $( $arg:ident : $ty:ty ),* $(,)? ) $( -> $ret:ty )? ; )*) => {
        extern "C" {
            $( $(#[$meta])* pub fn $name( $( $arg: $ty ),* ) $( -> $ret )?; )*
        }

        /// (name, return type, parameter types) as written here, for the header check.
        #[doc(hidden)]
        pub const DECLARED_FUNCTIONS: &[(&str, &str, &[&str])] = &[
            $( (stringify!($name), kt_functions!(@ret $($ret)?), &[ $( stringify!($ty) ),* ]), )*
        ];
    };
    (@ret) => { "()" };
    (@ret $ret:ty) => { stringify!($ret) };
}

/// Declares opaque handle types (only ever used through pointers).
macro_rules! kt_opaque {
    ($( $(#[$meta:meta])* $name:ident; )*) => {
        $(
            $(#[$meta])*
            #[repr(C)]
            pub struct $name {
                _private: [u8; 0],
                _not_send_sync_unpin: PhantomData<(*mut u8, PhantomPinned)>,
            }
        )*
    };
}

// ------------------------------------------------------------------ DLPack

pub type DLDeviceType = c_int;
pub type DLDataTypeCode = u8;

kt_structs! {
    /// Where a tensor's memory lives.
    pub struct DLDevice {
        pub device_type: DLDeviceType,
        pub device_id: i32,
    }
    /// Element type: code (kDLInt, kDLFloat, kDLBfloat...), bits, lanes.
    pub struct DLDataType {
        pub code: u8,
        pub bits: u8,
        pub lanes: u16,
    }
    /// A borrowed tensor view (DLPack).
    pub struct DLTensor {
        pub data: *mut c_void,
        pub device: DLDevice,
        pub ndim: i32,
        pub dtype: DLDataType,
        pub shape: *mut i64,
        pub strides: *mut i64,
        pub byte_offset: u64,
    }

    /// Engine settings; fill with kt_engine_options_defaults(&mut o, size_of::<kt_engine_options>()) (the header's inline kt_engine_options_init).
    pub struct kt_engine_options {
        pub struct_size: usize,
        pub num_threads: c_int,
        pub pin_threads: c_int,
        pub max_isa: kt_isa,
        pub verbosity: c_int,
        pub log_fn: kt_log_fn,
        pub log_user: *mut c_void,
        pub precision: kt_precision,
        pub host_openmp: c_int,
    }
    /// What kt_engine_get_info reports.
    pub struct kt_engine_info {
        pub struct_size: usize,
        pub num_threads: c_int,
        pub isa: kt_isa,
        pub cpu_isa: kt_isa,
        pub kernel_name: *const c_char,
        pub gemm_backend: kt_gemm_backend,
        pub precision: kt_precision,
    }
    /// Layer shapes and settings; fill with kt_moe_options_defaults(&mut o, size_of::<kt_moe_options>()) (the header's inline kt_moe_options_init).
    pub struct kt_moe_options {
        pub struct_size: usize,
        pub num_experts: i64,
        pub top_k: i64,
        pub hidden: i64,
        pub intermediate: i64,
        pub max_tokens: i64,
        pub activation: kt_activation,
        pub act_alpha: f32,
        pub act_limit: f32,
        pub has_bias: c_int,
        pub mode: kt_mode,
        pub weight_format: kt_weight_format,
        pub lora_rank: i64,
        pub lora_alpha: f32,
        pub use_rslora: c_int,
        pub lora_targets: c_uint,
        pub compute: kt_compute,
    }
    /// What kt_moe_get_info reports.
    pub struct kt_moe_info {
        pub struct_size: usize,
        pub num_experts: i64,
        pub top_k: i64,
        pub hidden: i64,
        pub intermediate: i64,
        pub max_tokens: i64,
        pub mode: kt_mode,
        pub weight_format: kt_weight_format,
        pub weight_bytes: i64,
        pub num_weights: i64,
        pub num_loaded: i64,
        pub compute: kt_compute,
    }
    /// What kt_packed_read_info reports of a packed cache.
    pub struct kt_packed_info {
        pub struct_size: usize,
        pub num_experts: i64,
        pub hidden: i64,
        pub intermediate: i64,
        pub has_bias: c_int,
        pub weight_format: kt_weight_format,
        pub num_loaded: i64,
        pub weight_bytes: i64,
        pub file_bytes: i64,
        pub format_version: c_int,
    }
    /// One named argument of a call.
    pub struct kt_arg {
        pub id: c_int,
        pub tensor: *const DLTensor,
    }
    /// Weight loading settings; fill with kt_load_options_defaults(&mut o, size_of::<kt_load_options>()) (the header's inline kt_load_options_init).
    pub struct kt_load_options {
        pub struct_size: usize,
        pub orientation: kt_weight_orientation,
        pub gate_up_order: kt_gate_up_order,
    }
    /// Backward settings; fill with kt_backward_options_defaults(&mut o, size_of::<kt_backward_options>()) (the header's inline kt_backward_options_init).
    pub struct kt_backward_options {
        pub struct_size: usize,
        pub grad_scale: f32,
        pub accumulate: kt_grad_accumulate,
        pub param_grads: c_int,
    }

    /// What kt_ckpt_get_info reports about a checkpoint directory.
    pub struct kt_ckpt_info {
        pub struct_size: usize,
        pub architecture: *const c_char,
        pub model_type: *const c_char,
        pub layout: kt_ckpt_layout,
        pub num_moe_layers: i64,
        pub num_tensors: i64,
        pub num_files: i64,
        pub total_bytes: i64,
        pub top_k: i64,
    }
    /// One MoE layer of a checkpoint.
    pub struct kt_ckpt_layer_info {
        pub struct_size: usize,
        pub layer: i64,
        pub num_experts: i64,
        pub hidden: i64,
        pub intermediate: i64,
        pub has_bias: c_int,
        pub layout: kt_ckpt_layout,
        pub format: kt_ckpt_format,
        pub weight_dtype: kt_ckpt_dtype,
        pub loadable: c_int,
        pub bytes: i64,
        pub weight_format: kt_weight_format,
        pub group_size: i64,
        pub num_tensors: i64,
    }
    /// Settings of kt_ckpt_load_layer_with; fill with kt_ckpt_load_options_defaults(&mut o, size_of::<kt_ckpt_load_options>()) (the header's inline kt_ckpt_load_options_init).
    pub struct kt_ckpt_load_options {
        pub struct_size: usize,
        /// 1 = a quantized layer may load into a KT_FORMAT_BF16 kt_moe, dequantized (default 0: KT_ERR_UNSUPPORTED).
        pub dequantize: c_int,
    }
    /// One tensor of a checkpoint (memory-mapped, owned by the handle).
    pub struct kt_ckpt_tensor {
        pub struct_size: usize,
        pub name: *const c_char,
        pub file: *const c_char,
        pub dtype: kt_ckpt_dtype,
        pub ndim: c_int,
        pub shape: [i64; 8],
        pub nbytes: i64,
        pub data: *const c_void,
    }
    /// Settings of kt_ckpt_write_experts; fill with kt_ckpt_write_options_defaults(&mut o, size_of::<kt_ckpt_write_options>()) (the header's inline kt_ckpt_write_options_init).
    pub struct kt_ckpt_write_options {
        pub struct_size: usize,
        pub layout: kt_ckpt_layout,
        pub dtype: kt_ckpt_dtype,
        pub max_shard_bytes: i64,
        pub config_json: *const c_char,
    }
    /// The tensors of one layer to write.
    pub struct kt_ckpt_layer_args {
        pub layer: i64,
        pub args: *const kt_arg,
        pub num_args: usize,
    }
    /// PEFT adapter settings; fill with kt_ckpt_adapter_config_defaults(&mut c, size_of::<kt_ckpt_adapter_config>()) (the header's inline kt_ckpt_adapter_config_init).
    pub struct kt_ckpt_adapter_config {
        pub struct_size: usize,
        pub rank: i64,
        pub alpha: f32,
        pub use_rslora: c_int,
        pub targets: c_uint,
        pub layout: kt_ckpt_layout,
        pub dtype: kt_ckpt_dtype,
        pub base_model: *const c_char,
    }
    /// Optimizer hyperparameters; fill with kt_optimizer_options_defaults(&mut o, size_of::<kt_optimizer_options>()) (the header's inline kt_optimizer_options_init).
    pub struct kt_optimizer_options {
        pub struct_size: usize,
        pub algorithm: kt_optim_algorithm,
        pub amsgrad: c_int,
        pub lr: f64,
        pub weight_decay: f64,
        pub beta1: f64,
        pub beta2: f64,
        pub eps: f64,
        pub momentum: f64,
        pub dampening: f64,
        pub nesterov: c_int,
        pub arithmetic: kt_optim_arithmetic,
        pub assume_finite: c_int,
    }
    /// One host parameter and its gradient, for kt_optimizer_create.
    pub struct kt_optimizer_param {
        pub param: *const DLTensor,
        pub grad: *const DLTensor,
    }
    /// Per-step factors; fill with kt_optimizer_step_options_defaults.
    pub struct kt_optimizer_step_options {
        pub struct_size: usize,
        pub grad_unscale: f32,
        pub clip_coef: f32,
        pub found_nonfinite: *mut c_int,
    }
}

// ------------------------------------------------------------- enum types

pub type kt_status = c_int;
pub type kt_isa = c_int;
pub type kt_gemm_backend = c_int;
pub type kt_precision = c_int;
pub type kt_activation = c_int;
pub type kt_mode = c_int;
pub type kt_weight_format = c_int;
pub type kt_compute = c_int;
pub type kt_arg_id = c_int;
pub type kt_weight_orientation = c_int;
pub type kt_gate_up_order = c_int;
pub type kt_grad_accumulate = c_int;
pub type kt_stage = c_int;
pub type kt_ckpt_dtype = c_int;
pub type kt_ckpt_layout = c_int;
pub type kt_ckpt_format = c_int;
pub type kt_optim_algorithm = c_int;
pub type kt_optim_arithmetic = c_int;
pub type kt_optim_state = c_int;

/// Log callback: level, message (valid for the call), user pointer.
pub type kt_log_fn = Option<unsafe extern "C" fn(level: c_int, message: *const c_char, user: *mut c_void)>;
/// Called once a backward has written a layer's parameter gradients.
pub type kt_grad_ready_fn = Option<unsafe extern "C" fn(moe: *mut kt_moe, user: *mut c_void)>;
/// Loading progress: units done of total.
pub type kt_ckpt_progress_fn = Option<unsafe extern "C" fn(done: i64, total: i64, user: *mut c_void)>;

kt_opaque! {
    /// An engine: worker pool, kernels.
    kt_engine;
    /// One MoE layer's routed experts.
    kt_moe;
    /// Activations a training forward saved for one backward.
    kt_context;
    /// An asynchronous forward or backward.
    kt_job;
    /// An open checkpoint directory (safetensors files, memory-mapped).
    kt_ckpt;
    /// A fused AdamW/SGD over a layer's parameters or host tensors.
    kt_optimizer;
}

kt_constants! {
    c_int {
        KT_VERSION_MAJOR = 1,
        KT_ABI_VERSION = 1,
    }
    DLDeviceType {
        kDLCPU = 1,
        kDLCUDAHost = 3,
    }
    DLDataTypeCode {
        kDLInt = 0,
        kDLUInt = 1,
        kDLFloat = 2,
        kDLBfloat = 4,
    }
    kt_status {
        KT_OK = 0,
        KT_ERR_INVALID_ARGUMENT = 1,
        KT_ERR_NULL_POINTER = 2,
        KT_ERR_INVALID_HANDLE = 3,
        KT_ERR_DTYPE = 4,
        KT_ERR_SHAPE = 5,
        KT_ERR_STRIDE = 6,
        KT_ERR_DEVICE = 7,
        KT_ERR_EXPERT_ID = 8,
        KT_ERR_TOO_MANY_TOKENS = 9,
        KT_ERR_CONTEXT = 10,
        KT_ERR_NOT_BOUND = 11,
        KT_ERR_NOT_LOADED = 12,
        KT_ERR_MODE = 13,
        KT_ERR_UNSUPPORTED = 14,
        KT_ERR_OUT_OF_MEMORY = 15,
        KT_ERR_IO = 16,
        KT_ERR_INTERNAL = 17,
        KT_ERR_COMM = 18,
    }
    kt_isa {
        KT_ISA_AUTO = 0,
        KT_ISA_REF = 1,
        KT_ISA_AVX2 = 2,
        KT_ISA_AVX512BF16 = 3,
        KT_ISA_AMX = 4,
    }
    kt_gemm_backend {
        KT_GEMM_AUTO = 0,
        KT_GEMM_NATIVE = 1,
        KT_GEMM_ONEDNN = 2,
    }
    kt_precision {
        KT_PRECISION_DEFAULT = 0,
        KT_PRECISION_FP32 = 1,
    }
    kt_activation {
        KT_ACT_SILU = 0,
        KT_ACT_SWIGLU_OAI = 1,
    }
    kt_mode {
        KT_MODE_INFERENCE = 0,
        KT_MODE_LORA = 1,
        KT_MODE_FULL = 2,
    }
    c_uint {
        KT_PROJ_GATE = 1,
        KT_PROJ_UP = 2,
        KT_PROJ_DOWN = 4,
        KT_PROJ_ALL = 7,
        KT_SUBMIT_DEFERRED = 1,
        KT_PACKED_SKIP_CHECKSUMS = 1,
    }
    kt_compute {
        KT_COMPUTE_BF16 = 0,
        KT_COMPUTE_INT8 = 1,
    }
    kt_weight_format {
        KT_FORMAT_BF16 = 0,
        KT_FORMAT_INT8_CHANNEL = 1,
        KT_FORMAT_INT4_G32 = 2,
        KT_FORMAT_FP8_B128 = 3,
        KT_FORMAT_MXFP4 = 4,
        KT_FORMAT_INT4_G128 = 5,
        KT_FORMAT_INT4_G32_ZP = 6,
        KT_FORMAT_INT4_G128_ZP = 7,
    }
    kt_arg_id {
        KT_ARG_X = 1,
        KT_ARG_IDS = 2,
        KT_ARG_ROUTE_WEIGHTS = 3,
        KT_ARG_Y = 4,
        KT_ARG_DY = 5,
        KT_ARG_DX = 6,
        KT_ARG_DROUTE_WEIGHTS = 7,
        KT_ARG_W_GATE = 16,
        KT_ARG_W_UP = 17,
        KT_ARG_W_DOWN = 18,
        KT_ARG_W_GATE_UP = 19,
        KT_ARG_B_GATE = 20,
        KT_ARG_B_UP = 21,
        KT_ARG_B_DOWN = 22,
        KT_ARG_B_GATE_UP = 23,
        KT_ARG_EXPERT_MAP = 24,
        KT_ARG_LORA_A_GATE = 32,
        KT_ARG_LORA_B_GATE = 33,
        KT_ARG_LORA_A_UP = 34,
        KT_ARG_LORA_B_UP = 35,
        KT_ARG_LORA_A_DOWN = 36,
        KT_ARG_LORA_B_DOWN = 37,
        KT_ARG_GRAD_LORA_A_GATE = 48,
        KT_ARG_GRAD_LORA_B_GATE = 49,
        KT_ARG_GRAD_LORA_A_UP = 50,
        KT_ARG_GRAD_LORA_B_UP = 51,
        KT_ARG_GRAD_LORA_A_DOWN = 52,
        KT_ARG_GRAD_LORA_B_DOWN = 53,
        KT_ARG_GRAD_W_GATE = 64,
        KT_ARG_GRAD_W_UP = 65,
        KT_ARG_GRAD_W_DOWN = 66,
        KT_ARG_GRAD_B_GATE = 67,
        KT_ARG_GRAD_B_UP = 68,
        KT_ARG_GRAD_B_DOWN = 69,
    }
    kt_weight_orientation {
        KT_ORIENT_OUT_IN = 0,
        KT_ORIENT_IN_OUT = 1,
    }
    kt_gate_up_order {
        KT_GATE_UP_CONCAT = 0,
        KT_GATE_UP_INTERLEAVED = 1,
    }
    kt_grad_accumulate {
        KT_GRAD_OVERWRITE = 0,
        KT_GRAD_ACCUMULATE = 1,
    }
    kt_stage {
        KT_STAGE_ROUTE = 0,
        KT_STAGE_PACK_INPUT = 1,
        KT_STAGE_LORA_A = 2,
        KT_STAGE_GATE_UP = 3,
        KT_STAGE_DOWN = 4,
        KT_STAGE_BWD_DOWN = 5,
        KT_STAGE_BWD_LORA = 6,
        KT_STAGE_BWD_DX = 7,
        KT_STAGE_BWD_ROUTE = 8,
        KT_STAGE_LORA_GRADS = 9,
        KT_STAGE_FULL_GRADS = 10,
        KT_STAGE_EXPERTS = 11,
    }
    kt_ckpt_dtype {
        KT_CKPT_DTYPE_UNKNOWN = 0,
        KT_CKPT_DTYPE_F32 = 1,
        KT_CKPT_DTYPE_F16 = 2,
        KT_CKPT_DTYPE_BF16 = 3,
        KT_CKPT_DTYPE_F64 = 4,
        KT_CKPT_DTYPE_F8_E4M3 = 5,
        KT_CKPT_DTYPE_F8_E5M2 = 6,
        KT_CKPT_DTYPE_E8M0 = 7,
        KT_CKPT_DTYPE_I8 = 8,
        KT_CKPT_DTYPE_U8 = 9,
        KT_CKPT_DTYPE_I16 = 10,
        KT_CKPT_DTYPE_U16 = 11,
        KT_CKPT_DTYPE_I32 = 12,
        KT_CKPT_DTYPE_U32 = 13,
        KT_CKPT_DTYPE_I64 = 14,
        KT_CKPT_DTYPE_U64 = 15,
        KT_CKPT_DTYPE_BOOL = 16,
    }
    kt_ckpt_layout {
        KT_CKPT_LAYOUT_NONE = 0,
        KT_CKPT_LAYOUT_PER_EXPERT = 1,
        KT_CKPT_LAYOUT_MIXTRAL = 2,
        KT_CKPT_LAYOUT_FUSED = 3,
        KT_CKPT_LAYOUT_FUSED_IN_OUT = 4,
        KT_CKPT_LAYOUT_GPT_OSS = 5,
    }
    kt_optim_algorithm {
        KT_OPTIM_ADAMW = 0,
        KT_OPTIM_SGD = 1,
    }
    kt_optim_arithmetic {
        KT_OPTIM_TORCH1 = 0,
        KT_OPTIM_TORCH2 = 1,
    }
    kt_optim_state {
        KT_OPTIM_STATE_MASTER = 0,
        KT_OPTIM_STATE_EXP_AVG = 1,
        KT_OPTIM_STATE_EXP_AVG_SQ = 2,
        KT_OPTIM_STATE_MAX_EXP_AVG_SQ = 3,
        KT_OPTIM_STATE_MOMENTUM = 4,
    }
    kt_ckpt_format {
        KT_CKPT_FORMAT_DENSE = 0,
        KT_CKPT_FORMAT_FP8_BLOCK = 1,
        KT_CKPT_FORMAT_INT4_GROUP = 2,
        KT_CKPT_FORMAT_MXFP4 = 3,
        KT_CKPT_FORMAT_OTHER = 4,
    }
}

kt_functions! {
    pub fn kt_version() -> *const c_char;
    pub fn kt_version_number() -> c_int;
    pub fn kt_abi_version() -> c_int;
    pub fn kt_build_info() -> *const c_char;
    pub fn kt_status_string(status: kt_status) -> *const c_char;
    pub fn kt_last_error() -> *const c_char;
    pub fn kt_clear_error();
    pub fn kt_cpu_isa() -> kt_isa;
    pub fn kt_isa_name(isa: kt_isa) -> *const c_char;

    pub fn kt_engine_options_defaults(options: *mut kt_engine_options, struct_size: usize);
    pub fn kt_engine_create(options: *const kt_engine_options, engine: *mut *mut kt_engine) -> kt_status;
    pub fn kt_engine_destroy(engine: *mut kt_engine) -> kt_status;
    pub fn kt_engine_get_info(engine: *const kt_engine, info: *mut kt_engine_info) -> kt_status;
    pub fn kt_engine_set_gemm_backend(engine: *mut kt_engine, backend: kt_gemm_backend) -> kt_status;

    pub fn kt_moe_options_defaults(options: *mut kt_moe_options, struct_size: usize);
    pub fn kt_moe_create(engine: *mut kt_engine, options: *const kt_moe_options, moe: *mut *mut kt_moe) -> kt_status;
    pub fn kt_moe_destroy(moe: *mut kt_moe);
    pub fn kt_moe_lora_scale(moe: *const kt_moe, scale: *mut f32) -> kt_status;

    pub fn kt_load_options_defaults(options: *mut kt_load_options, struct_size: usize);
    pub fn kt_moe_load_weights(moe: *mut kt_moe, options: *const kt_load_options, args: *const kt_arg, num_args: usize) -> kt_status;
    pub fn kt_moe_load_expert(moe: *mut kt_moe, expert: i64, options: *const kt_load_options, args: *const kt_arg, num_args: usize) -> kt_status;
    pub fn kt_moe_set_skipped(moe: *mut kt_moe, mask: *const DLTensor) -> kt_status;
    pub fn kt_moe_num_loaded(moe: *const kt_moe, count: *mut i64) -> kt_status;

    pub fn kt_moe_bind(moe: *mut kt_moe, args: *const kt_arg, num_args: usize) -> kt_status;
    pub fn kt_moe_params_changed(moe: *mut kt_moe) -> kt_status;
    pub fn kt_moe_set_grad_hook(moe: *mut kt_moe, hook: kt_grad_ready_fn, user: *mut c_void) -> kt_status;

    pub fn kt_moe_forward(moe: *mut kt_moe, args: *const kt_arg, num_args: usize, saved: *mut *mut kt_context) -> kt_status;
    pub fn kt_backward_options_defaults(options: *mut kt_backward_options, struct_size: usize);
    pub fn kt_moe_backward(moe: *mut kt_moe, ctx: *mut kt_context, options: *const kt_backward_options, args: *const kt_arg, num_args: usize) -> kt_status;
    pub fn kt_context_release(ctx: *mut kt_context);

    pub fn kt_moe_forward_submit(moe: *mut kt_moe, args: *const kt_arg, num_args: usize, saved: *mut *mut kt_context, flags: c_uint, job: *mut *mut kt_job) -> kt_status;
    pub fn kt_moe_backward_submit(moe: *mut kt_moe, ctx: *mut kt_context, options: *const kt_backward_options, args: *const kt_arg, num_args: usize, flags: c_uint, job: *mut *mut kt_job) -> kt_status;
    pub fn kt_job_run(job: *mut c_void);
    pub fn kt_job_wait(job: *mut kt_job) -> kt_status;
    pub fn kt_job_done(job: *const kt_job) -> c_int;
    pub fn kt_job_destroy(job: *mut kt_job);

    pub fn kt_stage_name(stage: c_int) -> *const c_char;
    pub fn kt_engine_set_profiling(engine: *mut kt_engine, enabled: c_int) -> kt_status;
    pub fn kt_engine_profile_stage(engine: *const kt_engine, stage: c_int, calls: *mut i64, seconds: *mut f64) -> kt_status;
    pub fn kt_engine_reset_profile(engine: *mut kt_engine) -> kt_status;
    pub fn kt_kernel_name(kernel: c_int) -> *const c_char;
    pub fn kt_engine_profile_kernel(engine: *const kt_engine, stage: c_int, kernel: c_int, calls: *mut i64, flops: *mut i64) -> kt_status;

    pub fn kt_moe_save_packed(moe: *mut kt_moe, path: *const c_char) -> kt_status;
    pub fn kt_moe_load_packed(moe: *mut kt_moe, path: *const c_char, flags: c_uint) -> kt_status;
    pub fn kt_packed_read_info(path: *const c_char, info: *mut kt_packed_info) -> kt_status;

    pub fn kt_weight_format_name(format: kt_weight_format) -> *const c_char;
    pub fn kt_moe_get_info(moe: *const kt_moe, info: *mut kt_moe_info) -> kt_status;
    pub fn kt_moe_read_weights(moe: *const kt_moe, args: *const kt_arg, num_args: usize) -> kt_status;

    pub fn kt_ckpt_dtype_name(dtype: kt_ckpt_dtype) -> *const c_char;
    pub fn kt_ckpt_layout_name(layout: kt_ckpt_layout) -> *const c_char;
    pub fn kt_ckpt_format_name(format: kt_ckpt_format) -> *const c_char;
    pub fn kt_ckpt_open(dir: *const c_char, ckpt: *mut *mut kt_ckpt) -> kt_status;
    pub fn kt_ckpt_close(ckpt: *mut kt_ckpt);
    pub fn kt_ckpt_get_info(ckpt: *const kt_ckpt, info: *mut kt_ckpt_info) -> kt_status;
    pub fn kt_ckpt_get_layer_info(ckpt: *const kt_ckpt, index: i64, info: *mut kt_ckpt_layer_info) -> kt_status;
    pub fn kt_ckpt_moe_options(ckpt: *const kt_ckpt, layer: i64, options: *mut kt_moe_options) -> kt_status;
    pub fn kt_ckpt_load_layer(ckpt: *const kt_ckpt, layer: i64, moe: *mut kt_moe, progress: kt_ckpt_progress_fn, user: *mut c_void) -> kt_status;
    pub fn kt_ckpt_load_options_defaults(options: *mut kt_ckpt_load_options, struct_size: usize);
    pub fn kt_ckpt_load_layer_with(ckpt: *const kt_ckpt, layer: i64, moe: *mut kt_moe, options: *const kt_ckpt_load_options, progress: kt_ckpt_progress_fn, user: *mut c_void) -> kt_status;
    pub fn kt_ckpt_read_layer(ckpt: *const kt_ckpt, layer: i64, args: *const kt_arg, num_args: usize) -> kt_status;
    pub fn kt_ckpt_layer_tensor_at(ckpt: *const kt_ckpt, layer: i64, index: i64, tensor: *mut kt_ckpt_tensor) -> kt_status;
    pub fn kt_ckpt_tensor_at(ckpt: *const kt_ckpt, index: i64, tensor: *mut kt_ckpt_tensor) -> kt_status;
    pub fn kt_ckpt_find_tensor(ckpt: *const kt_ckpt, name: *const c_char, tensor: *mut kt_ckpt_tensor) -> kt_status;
    pub fn kt_ckpt_write_options_defaults(options: *mut kt_ckpt_write_options, struct_size: usize);
    pub fn kt_ckpt_write_experts(dir: *const c_char, options: *const kt_ckpt_write_options, layers: *const kt_ckpt_layer_args, num_layers: usize) -> kt_status;
    pub fn kt_ckpt_adapter_config_defaults(config: *mut kt_ckpt_adapter_config, struct_size: usize);
    pub fn kt_ckpt_adapter_write(dir: *const c_char, config: *const kt_ckpt_adapter_config, layers: *const kt_ckpt_layer_args, num_layers: usize) -> kt_status;
    pub fn kt_ckpt_adapter_read_config(dir: *const c_char, config: *mut kt_ckpt_adapter_config) -> kt_status;
    pub fn kt_ckpt_adapter_read(dir: *const c_char, layer: i64, args: *const kt_arg, num_args: usize) -> kt_status;
    pub fn kt_optimizer_options_defaults(options: *mut kt_optimizer_options, struct_size: usize);
    pub fn kt_optimizer_step_options_defaults(options: *mut kt_optimizer_step_options, struct_size: usize);
    pub fn kt_optimizer_create(engine: *mut kt_engine, options: *const kt_optimizer_options, params: *const kt_optimizer_param, num_params: usize, opt: *mut *mut kt_optimizer) -> kt_status;
    pub fn kt_optimizer_create_for_layer(moe: *mut kt_moe, options: *const kt_optimizer_options, opt: *mut *mut kt_optimizer) -> kt_status;
    pub fn kt_optimizer_destroy(opt: *mut kt_optimizer);
    pub fn kt_optimizer_set_options(opt: *mut kt_optimizer, options: *const kt_optimizer_options) -> kt_status;
    pub fn kt_optimizer_get_options(opt: *const kt_optimizer, options: *mut kt_optimizer_options) -> kt_status;
    pub fn kt_optimizer_set_grad(opt: *mut kt_optimizer, index: usize, grad: *const DLTensor) -> kt_status;
    pub fn kt_optimizer_step(opt: *mut kt_optimizer, options: *const kt_optimizer_step_options) -> kt_status;
    pub fn kt_optimizer_step_submit(opt: *mut kt_optimizer, options: *const kt_optimizer_step_options, flags: c_uint, job: *mut *mut kt_job) -> kt_status;
    pub fn kt_optimizer_grad_sq_norm(opt: *mut kt_optimizer, out: *mut f64) -> kt_status;
    pub fn kt_optimizer_num_params(opt: *const kt_optimizer, count: *mut usize) -> kt_status;
    pub fn kt_optimizer_get_step(opt: *const kt_optimizer, step: *mut i64) -> kt_status;
    pub fn kt_optimizer_set_step(opt: *mut kt_optimizer, step: i64) -> kt_status;
    pub fn kt_optimizer_state(opt: *mut kt_optimizer, index: usize, which: kt_optim_state, out: *mut DLTensor) -> kt_status;
    pub fn kt_optimizer_save(opt: *mut kt_optimizer, path: *const c_char) -> kt_status;
    pub fn kt_optimizer_load(opt: *mut kt_optimizer, path: *const c_char) -> kt_status;
}
