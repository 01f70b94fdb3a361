//! Safe Rust binding of kt, the CPU engine for the routed experts of
//! Mixture-of-Experts models, over its C ABI (`kt-sys`).
//!
//! - Handles are RAII: [`Engine`], [`Moe`] and [`Context`] free themselves on
//!   drop, and lifetimes keep a layer from outliving its engine and a context
//!   from outliving its layer.
//! - Every failed call is an [`Error`] with kt's status and message.
//! - Tensors are views of slices with a shape ([`TensorRef`] for inputs,
//!   [`TensorMut`] for outputs); kt checks dtype and shape, the views check
//!   that the shape fits the slice.
//!
//! ```no_run
//! let engine = kt::Engine::new(&kt::EngineOptions::default())?;
//! let moe = engine.moe(&kt::MoeOptions::new(8, 2, 64, 32))?;
//! # Ok::<(), kt::Error>(())
//! ```
use std::ffi::CStr;
use std::fmt;
use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};
use std::ptr;

use kt_sys as sys;

/// `forward_raw`, `forward` (y = MoE(x), nothing saved) and `forward_train`
/// (y = MoE(x), saving what the backward needs in the returned context) of a
/// layer type: `$call` is its kt forward, `$raw_ctx` kt's context type, and
/// `$ctx { raw, $phantom }` the context wrapper, borrowing the layer.
macro_rules! forward_methods {
    ($call:path, $raw_ctx:ty, $ctx:ident, $phantom:ident) => {
        fn forward_raw(
            &self,
            x: &TensorRef<'_>,
            ids: &TensorRef<'_>,
            route_weights: &TensorRef<'_>,
            y: &mut TensorMut<'_>,
            saved: *mut *mut $raw_ctx,
        ) -> Result<()> {
            let args = forward_args(x, ids, route_weights, y);
            check(unsafe { $call(self.raw, args.as_ptr(), args.len(), saved) })
        }

        /// y = MoE(x), nothing saved.
        pub fn forward(
            &self,
            x: &TensorRef<'_>,
            ids: &TensorRef<'_>,
            route_weights: &TensorRef<'_>,
            y: &mut TensorMut<'_>,
        ) -> Result<()> {
            self.forward_raw(x, ids, route_weights, y, ptr::null_mut())
        }

        /// y = MoE(x), saving what the backward needs in the returned context.
        pub fn forward_train(
            &self,
            x: &TensorRef<'_>,
            ids: &TensorRef<'_>,
            route_weights: &TensorRef<'_>,
            y: &mut TensorMut<'_>,
        ) -> Result<$ctx<'_>> {
            let mut raw = ptr::null_mut();
            self.forward_raw(x, ids, route_weights, y, &mut raw)?;
            Ok($ctx { raw, $phantom: PhantomData })
        }
    };
}

mod dist;
mod optim;
mod runtime;
mod weight_format;
pub use dist::{
    built_with, nccl_unique_id, parse_backend, Backend, Backends, Comm, CommInfo, CommOptions, Device, DistCheckpointOptions,
    DistCkptLayer, DistContext, DistMode, DistMoe, DistMoeOptions, GradAverage, NcclUniqueId, Parts, Rendezvous, Store,
    NCCL_UNIQUE_ID_BYTES,
};
pub use runtime::{Job, StageProfile};
pub use weight_format::WeightFormat;
pub use optim::{Algorithm, Arithmetic, Optimizer, OptimizerOptions};

/// The ABI major this crate was written for; [`Engine::new`] refuses another.
pub const ABI_VERSION: i32 = sys::KT_ABI_VERSION;

/// A kt_status value.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Status(pub i32);

impl Status {
    pub const OK: Status = Status(sys::KT_OK);
    pub const INVALID_ARGUMENT: Status = Status(sys::KT_ERR_INVALID_ARGUMENT);
    pub const NULL_POINTER: Status = Status(sys::KT_ERR_NULL_POINTER);
    pub const INVALID_HANDLE: Status = Status(sys::KT_ERR_INVALID_HANDLE);
    pub const DTYPE: Status = Status(sys::KT_ERR_DTYPE);
    pub const SHAPE: Status = Status(sys::KT_ERR_SHAPE);
    pub const STRIDE: Status = Status(sys::KT_ERR_STRIDE);
    pub const DEVICE: Status = Status(sys::KT_ERR_DEVICE);
    pub const EXPERT_ID: Status = Status(sys::KT_ERR_EXPERT_ID);
    pub const TOO_MANY_TOKENS: Status = Status(sys::KT_ERR_TOO_MANY_TOKENS);
    pub const CONTEXT: Status = Status(sys::KT_ERR_CONTEXT);
    pub const NOT_BOUND: Status = Status(sys::KT_ERR_NOT_BOUND);
    pub const NOT_LOADED: Status = Status(sys::KT_ERR_NOT_LOADED);
    pub const MODE: Status = Status(sys::KT_ERR_MODE);
    pub const UNSUPPORTED: Status = Status(sys::KT_ERR_UNSUPPORTED);
    pub const OUT_OF_MEMORY: Status = Status(sys::KT_ERR_OUT_OF_MEMORY);
    pub const IO: Status = Status(sys::KT_ERR_IO);
    pub const INTERNAL: Status = Status(sys::KT_ERR_INTERNAL);
    pub const COMM: Status = Status(sys::KT_ERR_COMM);

    /// kt's name of the status ("KT_ERR_SHAPE").
    pub fn name(self) -> &'static str {
        // kt_status_string returns static storage for every value.
        unsafe { CStr::from_ptr(sys::kt_status_string(self.0)) }.to_str().unwrap_or("KT_ERR_UNKNOWN")
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed kt call: the status and kt's message (naming the call and argument).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

/// Turns a status into Ok or an Error with this thread's last message (read
/// right away, on the thread that made the call).
fn check(status: sys::kt_status) -> Result<()> {
    if status == sys::KT_OK {
        return Ok(());
    }
    let message = unsafe { CStr::from_ptr(sys::kt_last_error()) }.to_string_lossy().into_owned();
    Err(Error { status: Status(status), message })
}

fn static_str(s: *const std::os::raw::c_char) -> &'static str {
    unsafe { CStr::from_ptr(s) }.to_str().unwrap_or("")
}

/// Version string of the loaded library ("1.0.0").
pub fn version() -> &'static str {
    static_str(unsafe { sys::kt_version() })
}

/// ABI major of the loaded library.
pub fn library_abi_version() -> i32 {
    unsafe { sys::kt_abi_version() }
}

/// Compiler, build type and kernels of the loaded library.
pub fn build_info() -> &'static str {
    static_str(unsafe { sys::kt_build_info() })
}

// ------------------------------------------------------------------ tensors

/// A bfloat16 value as its bit pattern.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Bf16 {
    /// Rounds to nearest even.
    pub fn from_f32(v: f32) -> Bf16 {
        let bits = v.to_bits();
        if v.is_nan() {
            return Bf16(((bits >> 16) as u16) | 0x40);
        }
        Bf16((bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16)
    }
    pub fn to_f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// Element types a tensor view can have.
pub trait Element: Copy + private::Sealed {
    const DTYPE: sys::DLDataType;
}
mod private {
    pub trait Sealed {}
}
macro_rules! element {
    ($t:ty, $code:expr, $bits:expr) => {
        impl private::Sealed for $t {}
        impl Element for $t {
            const DTYPE: sys::DLDataType = sys::DLDataType { code: $code, bits: $bits, lanes: 1 };
        }
    };
}
element!(f32, sys::kDLFloat, 32);
element!(Bf16, sys::kDLBfloat, 16);
element!(i32, sys::kDLInt, 32);
element!(i64, sys::kDLInt, 64);
element!(u8, sys::kDLUInt, 8);

fn check_shape(len: usize, shape: &[i64]) -> Result<Vec<i64>> {
    let elements = shape.iter().try_fold(1i64, |n, &d| if d < 0 { None } else { n.checked_mul(d) });
    match elements {
        Some(n) if n as usize == len => Ok(shape.to_vec()),
        _ => Err(Error {
            status: Status::SHAPE,
            message: format!("shape {:?} does not fit a slice of {} elements", shape, len),
        }),
    }
}

fn dl_tensor(data: *mut c_void, dtype: sys::DLDataType, shape: &[i64]) -> sys::DLTensor {
    sys::DLTensor {
        data,
        device: sys::DLDevice { device_type: sys::kDLCPU, device_id: 0 },
        ndim: shape.len() as i32,
        dtype,
        // kt only reads the shape; DLTensor's field is not const.
        shape: shape.as_ptr() as *mut i64,
        strides: ptr::null_mut(),
        byte_offset: 0,
    }
}

/// A compact row-major view of a slice that kt reads.
pub struct TensorRef<'a> {
    tensor: sys::DLTensor,
    _shape: Vec<i64>,
    _data: PhantomData<&'a [u8]>,
}

impl<'a> TensorRef<'a> {
    pub fn new<T: Element>(data: &'a [T], shape: &[i64]) -> Result<Self> {
        let shape = check_shape(data.len(), shape)?;
        let tensor = dl_tensor(data.as_ptr() as *mut c_void, T::DTYPE, &shape);
        // The Vec's buffer does not move when the view moves.
        Ok(TensorRef { tensor, _shape: shape, _data: PhantomData })
    }
}

/// A compact row-major view of a slice that kt writes.
pub struct TensorMut<'a> {
    tensor: sys::DLTensor,
    _shape: Vec<i64>,
    _data: PhantomData<&'a mut [u8]>,
}

impl<'a> TensorMut<'a> {
    pub fn new<T: Element>(data: &'a mut [T], shape: &[i64]) -> Result<Self> {
        let shape = check_shape(data.len(), shape)?;
        let tensor = dl_tensor(data.as_mut_ptr() as *mut c_void, T::DTYPE, &shape);
        Ok(TensorMut { tensor, _shape: shape, _data: PhantomData })
    }
}

/// Argument ids (kt_arg_id).
pub use sys::kt_arg_id as ArgId;
pub mod arg {
    //! The argument ids of kt_arg_id.
    pub use kt_sys::{
        KT_ARG_B_DOWN as B_DOWN, KT_ARG_B_GATE as B_GATE, KT_ARG_B_GATE_UP as B_GATE_UP,
        KT_ARG_B_UP as B_UP, KT_ARG_DROUTE_WEIGHTS as DROUTE_WEIGHTS, KT_ARG_DX as DX,
        KT_ARG_DY as DY, KT_ARG_EXPERT_MAP as EXPERT_MAP, KT_ARG_GRAD_B_DOWN as GRAD_B_DOWN,
        KT_ARG_GRAD_B_GATE as GRAD_B_GATE, KT_ARG_GRAD_B_UP as GRAD_B_UP,
        KT_ARG_GRAD_LORA_A_DOWN as GRAD_LORA_A_DOWN, KT_ARG_GRAD_LORA_A_GATE as GRAD_LORA_A_GATE,
        KT_ARG_GRAD_LORA_A_UP as GRAD_LORA_A_UP, KT_ARG_GRAD_LORA_B_DOWN as GRAD_LORA_B_DOWN,
        KT_ARG_GRAD_LORA_B_GATE as GRAD_LORA_B_GATE, KT_ARG_GRAD_LORA_B_UP as GRAD_LORA_B_UP,
        KT_ARG_GRAD_W_DOWN as GRAD_W_DOWN, KT_ARG_GRAD_W_GATE as GRAD_W_GATE,
        KT_ARG_GRAD_W_UP as GRAD_W_UP, KT_ARG_IDS as IDS, KT_ARG_LORA_A_DOWN as LORA_A_DOWN,
        KT_ARG_LORA_A_GATE as LORA_A_GATE, KT_ARG_LORA_A_UP as LORA_A_UP,
        KT_ARG_LORA_B_DOWN as LORA_B_DOWN, KT_ARG_LORA_B_GATE as LORA_B_GATE,
        KT_ARG_LORA_B_UP as LORA_B_UP, KT_ARG_ROUTE_WEIGHTS as ROUTE_WEIGHTS,
        KT_ARG_W_DOWN as W_DOWN, KT_ARG_W_GATE as W_GATE, KT_ARG_W_GATE_UP as W_GATE_UP,
        KT_ARG_W_UP as W_UP, KT_ARG_X as X, KT_ARG_Y as Y,
    };
}

/// One named argument: an input view or an output view.
pub enum Arg<'t, 'a> {
    In(ArgId, &'t TensorRef<'a>),
    Out(ArgId, &'t mut TensorMut<'a>),
}

fn raw_args(args: &[Arg<'_, '_>]) -> Vec<sys::kt_arg> {
    args.iter()
        .map(|a| match a {
            Arg::In(id, t) => sys::kt_arg { id: *id, tensor: &t.tensor },
            Arg::Out(id, t) => sys::kt_arg { id: *id, tensor: &t.tensor },
        })
        .collect()
}

/// The four arguments of a forward (kt_moe_forward, kt_dist_moe_forward).
fn forward_args(x: &TensorRef<'_>, ids: &TensorRef<'_>, route_weights: &TensorRef<'_>, y: &mut TensorMut<'_>) -> [sys::kt_arg; 4] {
    [
        sys::kt_arg { id: sys::KT_ARG_X, tensor: &x.tensor },
        sys::kt_arg { id: sys::KT_ARG_IDS, tensor: &ids.tensor },
        sys::kt_arg { id: sys::KT_ARG_ROUTE_WEIGHTS, tensor: &route_weights.tensor },
        sys::kt_arg { id: sys::KT_ARG_Y, tensor: &y.tensor },
    ]
}

// ------------------------------------------------------------------- engine

/// Engine settings; `None`/defaults keep kt's choices.
#[derive(Clone, Debug, Default)]
pub struct EngineOptions {
    /// Worker threads; 0 = one per CPU of the affinity mask.
    pub num_threads: i32,
    /// Pin worker i to the i-th CPU (kt's default: yes).
    pub pin_threads: Option<bool>,
    /// Log level to stderr; None = from the environment (KT_VERBOSE).
    pub verbosity: Option<i32>,
    /// Keep fp32 activations fp32 in the weight GEMMs (KT_PRECISION_FP32;
    /// by default the avx512bf16 kernels round them to bf16).
    pub fp32_precision: bool,
    /// Compute on the OpenMP threads of the calling thread instead of kt's
    /// own workers (KT_API kt_engine_options.host_openmp).
    pub host_openmp: bool,
    /// Split workers and experts over the NUMA nodes of the affinity mask
    /// (KT_NUMA_AUTO; the same bits as without). [`Engine::numa_node_workers`]
    /// says the nodes in use.
    pub numa: bool,
}

/// An engine: a worker pool and the kernels for this CPU.
pub struct Engine {
    raw: *mut sys::kt_engine,
}

// kt documents every call as safe from any thread.
unsafe impl Send for Engine {}
unsafe impl Sync for Engine {}

impl Engine {
    pub fn new(options: &EngineOptions) -> Result<Engine> {
        if library_abi_version() != ABI_VERSION {
            return Err(Error {
                status: Status::UNSUPPORTED,
                message: format!(
                    "libkt has ABI {}, this crate was written for ABI {}",
                    library_abi_version(),
                    ABI_VERSION
                ),
            });
        }
        let mut o = std::mem::MaybeUninit::<sys::kt_engine_options>::uninit();
        let mut o = unsafe {
            sys::kt_engine_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_engine_options>());
            o.assume_init()
        };
        o.num_threads = options.num_threads;
        if let Some(pin) = options.pin_threads {
            o.pin_threads = pin as c_int;
        }
        if let Some(v) = options.verbosity {
            o.verbosity = v;
        }
        if options.fp32_precision {
            o.precision = sys::KT_PRECISION_FP32;
        }
        o.host_openmp = options.host_openmp as c_int;
        if options.numa {
            o.numa = sys::KT_NUMA_AUTO;
        }
        let mut raw = ptr::null_mut();
        check(unsafe { sys::kt_engine_create(&o, &mut raw) })?;
        Ok(Engine { raw })
    }

    fn info(&self) -> Result<sys::kt_engine_info> {
        let mut info = sys::kt_engine_info {
            struct_size: std::mem::size_of::<sys::kt_engine_info>(),
            num_threads: 0,
            isa: 0,
            cpu_isa: 0,
            kernel_name: ptr::null(),
            gemm_backend: sys::KT_GEMM_AUTO,
            precision: sys::KT_PRECISION_DEFAULT,
            numa_nodes: 0,
            numa_node_workers: ptr::null(),
        };
        check(unsafe { sys::kt_engine_get_info(self.raw, &mut info) })?;
        Ok(info)
    }

    /// Worker threads of the engine.
    pub fn num_threads(&self) -> Result<i32> {
        Ok(self.info()?.num_threads)
    }

    /// Workers of each NUMA node the engine is split over, in node order
    /// (one entry unless `numa` found several nodes).
    pub fn numa_node_workers(&self) -> Result<Vec<i32>> {
        let info = self.info()?;
        let n = info.numa_nodes.max(0) as usize;
        if n == 0 || info.numa_node_workers.is_null() {
            return Ok(Vec::new());
        }
        Ok(unsafe { std::slice::from_raw_parts(info.numa_node_workers, n) }.to_vec())
    }

    /// Whether fp32 activations stay fp32 in the weight GEMMs (KT_PRECISION_FP32).
    pub fn fp32_precision(&self) -> Result<bool> {
        Ok(self.info()?.precision == sys::KT_PRECISION_FP32)
    }

    /// Name of the GEMM micro-kernel in use (owned by the engine).
    pub fn kernel_name(&self) -> Result<&str> {
        let name = self.info()?.kernel_name;
        Ok(unsafe { CStr::from_ptr(name) }.to_str().unwrap_or(""))
    }

    /// Creates a layer on this engine; it cannot outlive the engine.
    pub fn moe(&self, options: &MoeOptions) -> Result<Moe<'_>> {
        let mut raw = ptr::null_mut();
        check(unsafe { sys::kt_moe_create(self.raw, &options.raw, &mut raw) })?;
        Ok(Moe { raw, _engine: PhantomData, hook: std::sync::Mutex::new(None) })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Every layer borrowed the engine and is gone, so destroy cannot
        // refuse; its status has nowhere to go from a destructor.
        unsafe { sys::kt_engine_destroy(self.raw) };
    }
}

// -------------------------------------------------------------------- layer

/// A layer's shapes and settings, over kt's defaults (kt_moe_options_defaults).
#[derive(Clone, Copy)]
pub struct MoeOptions {
    raw: sys::kt_moe_options,
}

impl MoeOptions {
    /// E experts, k routes per token, hidden H, intermediate I; the rest default.
    pub fn new(num_experts: i64, top_k: i64, hidden: i64, intermediate: i64) -> MoeOptions {
        let mut o = std::mem::MaybeUninit::<sys::kt_moe_options>::uninit();
        let mut raw = unsafe {
            sys::kt_moe_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_moe_options>());
            o.assume_init()
        };
        raw.num_experts = num_experts;
        raw.top_k = top_k;
        raw.hidden = hidden;
        raw.intermediate = intermediate;
        MoeOptions { raw }
    }
    /// Most tokens per call (workspaces are sized for it).
    pub fn max_tokens(mut self, t: i64) -> Self {
        self.raw.max_tokens = t;
        self
    }
    /// Activation kind (sys::KT_ACT_*), alpha (swiglu_oai) and clamp limit (<= 0: none).
    pub fn activation(mut self, kind: sys::kt_activation, alpha: f32, limit: f32) -> Self {
        self.raw.activation = kind;
        self.raw.act_alpha = alpha;
        self.raw.act_limit = limit;
        self
    }
    /// Biases bg, bu, bd.
    pub fn with_bias(mut self) -> Self {
        self.raw.has_bias = 1;
        self
    }
    /// LoRA mode: rank, alpha, targets (sys::KT_PROJ_* bits).
    pub fn lora(mut self, rank: i64, alpha: f32, targets: u32) -> Self {
        self.raw.mode = sys::KT_MODE_LORA;
        self.raw.lora_rank = rank;
        self.raw.lora_alpha = alpha;
        self.raw.lora_targets = targets;
        self
    }
    /// Full fine-tuning mode (base weights trainable).
    pub fn full_training(mut self) -> Self {
        self.raw.mode = sys::KT_MODE_FULL;
        self
    }
    /// Storage format of the frozen base (default bf16; the quantized ones
    /// are quantized by kt at load, inference and LoRA mode only).
    pub fn weight_format(mut self, format: WeightFormat) -> Self {
        self.raw.weight_format = format.raw();
        self
    }
    /// Int8 activations (KT_COMPUTE_INT8): an inference layer on an
    /// integer base (Int8Channel, Int4G32, Int4G128, Int4G32Zp, Int4G128Zp, Mxfp4) multiplies x and the activation
    /// quantized to int8 per row (forward only, without saved contexts; the
    /// error is stated in kt_c_api.h, "Int8 compute").
    pub fn int8_compute(mut self) -> Self {
        self.raw.compute = sys::KT_COMPUTE_INT8;
        self
    }
}

impl WeightFormat {
    /// kt's name of the format ("bf16", "int8_channel", "int4_g32",
    /// "fp8_b128", "mxfp4", "int4_g128", "int4_g32_zp", "int4_g128_zp").
    pub fn name(self) -> &'static str {
        unsafe { CStr::from_ptr(sys::kt_weight_format_name(self.raw())) }.to_str().unwrap_or("unknown")
    }
}

/// What a layer reports of itself (kt_moe_get_info).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeInfo {
    pub num_experts: i64,
    pub hidden: i64,
    pub intermediate: i64,
    /// Storage format of the base weights.
    pub weight_format: WeightFormat,
    /// Bytes the stored base weights take (scales and padding included).
    pub weight_bytes: i64,
    /// E * 3 * H * I.
    pub num_weights: i64,
    pub num_loaded: i64,
    /// The weight GEMMs multiply int8 activations (KT_COMPUTE_INT8).
    pub int8_compute: bool,
}

/// Backward settings.
#[derive(Clone, Copy, Debug)]
pub struct BackwardOptions {
    /// Multiplies parameter gradients only.
    pub grad_scale: f32,
    /// Add into the gradient buffers instead of overwriting them.
    pub accumulate: bool,
    /// Compute parameter gradients (false: only dx and routing gradients).
    pub param_grads: bool,
}

impl BackwardOptions {
    fn raw(&self) -> sys::kt_backward_options {
        let mut o = std::mem::MaybeUninit::<sys::kt_backward_options>::uninit();
        let mut o = unsafe {
            sys::kt_backward_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_backward_options>());
            o.assume_init()
        };
        o.grad_scale = self.grad_scale;
        o.accumulate = if self.accumulate { sys::KT_GRAD_ACCUMULATE } else { sys::KT_GRAD_OVERWRITE };
        o.param_grads = self.param_grads as c_int;
        o
    }
}

impl Default for BackwardOptions {
    fn default() -> Self {
        BackwardOptions { grad_scale: 1.0, accumulate: false, param_grads: true }
    }
}

/// One MoE layer's routed experts.
pub struct Moe<'e> {
    raw: *mut sys::kt_moe,
    _engine: PhantomData<&'e Engine>,
    /// The gradient hook kt calls (runtime.rs); dropped after kt_moe_destroy.
    hook: std::sync::Mutex<Option<Box<runtime::GradHook>>>,
}

unsafe impl Send for Moe<'_> {}
unsafe impl Sync for Moe<'_> {}

impl<'e> Moe<'e> {
    /// Loads stacked weights: arg::W_GATE, arg::W_UP [E,I,H], arg::W_DOWN
    /// [E,H,I] (or W_GATE_UP), biases when the layer has them, EXPERT_MAP.
    pub fn load_weights(&self, args: &[Arg<'_, '_>]) -> Result<()> {
        let raw = raw_args(args);
        check(unsafe { sys::kt_moe_load_weights(self.raw, ptr::null(), raw.as_ptr(), raw.len()) })
    }

    /// The layer's settings: storage format, bytes, experts loaded.
    pub fn info(&self) -> Result<MoeInfo> {
        let mut i = std::mem::MaybeUninit::<sys::kt_moe_info>::zeroed();
        let i = unsafe {
            (*i.as_mut_ptr()).struct_size = std::mem::size_of::<sys::kt_moe_info>();
            check(sys::kt_moe_get_info(self.raw, i.as_mut_ptr()))?;
            i.assume_init()
        };
        Ok(MoeInfo {
            num_experts: i.num_experts,
            hidden: i.hidden,
            intermediate: i.intermediate,
            weight_format: WeightFormat::from_raw(i.weight_format).ok_or_else(|| Error {
                status: Status::INTERNAL,
                message: format!("kt_moe_get_info: unknown weight format {}", i.weight_format),
            })?,
            weight_bytes: i.weight_bytes,
            num_weights: i.num_weights,
            num_loaded: i.num_loaded,
            int8_compute: i.compute == sys::KT_COMPUTE_INT8,
        })
    }

    /// Copies the base weights the layer computes with (dequantized for a
    /// quantized base) into outputs: arg::W_GATE, arg::W_UP [E,I,H],
    /// arg::W_DOWN [E,H,I], and biases.
    pub fn read_weights(&self, args: &[Arg<'_, '_>]) -> Result<()> {
        let raw = raw_args(args);
        check(unsafe { sys::kt_moe_read_weights(self.raw, raw.as_ptr(), raw.len()) })
    }

    /// Number of experts loaded.
    pub fn num_loaded(&self) -> Result<i64> {
        let mut n = 0;
        check(unsafe { sys::kt_moe_num_loaded(self.raw, &mut n) })?;
        Ok(n)
    }

    /// Effective LoRA scale (0 outside LoRA mode).
    pub fn lora_scale(&self) -> Result<f32> {
        let mut s = 0.0;
        check(unsafe { sys::kt_moe_lora_scale(self.raw, &mut s) })?;
        Ok(s)
    }

    /// Binds trainable parameters and gradient buffers.
    ///
    /// # Safety
    /// kt keeps the tensors' data pointers until the same id is bound again
    /// or the layer is dropped: that memory must stay alive and unmoved, and
    /// not be accessed while a backward writes the gradients or an
    /// [`Optimizer`] step writes the parameters.
    pub unsafe fn bind(&self, args: &[Arg<'_, '_>]) -> Result<()> {
        let raw = raw_args(args);
        check(sys::kt_moe_bind(self.raw, raw.as_ptr(), raw.len()))
    }

    /// The bound parameters changed (after an optimizer step).
    pub fn params_changed(&self) -> Result<()> {
        check(unsafe { sys::kt_moe_params_changed(self.raw) })
    }

    forward_methods!(sys::kt_moe_forward, sys::kt_context, Context, _moe);

    /// Backward of ctx's forward. args: arg::DY (required), arg::DX and
    /// arg::DROUTE_WEIGHTS (optional outputs). The context is spent.
    pub fn backward(&self, ctx: &mut Context<'_>, options: &BackwardOptions, args: &[Arg<'_, '_>]) -> Result<()> {
        let o = options.raw();
        let raw = raw_args(args);
        check(unsafe { sys::kt_moe_backward(self.raw, ctx.raw, &o, raw.as_ptr(), raw.len()) })
    }
}

impl Drop for Moe<'_> {
    fn drop(&mut self) {
        unsafe { sys::kt_moe_destroy(self.raw) };
    }
}

/// What a training forward saved for its backward; released on drop.
pub struct Context<'m> {
    raw: *mut sys::kt_context,
    _moe: PhantomData<&'m ()>,
}

unsafe impl Send for Context<'_> {}

impl Drop for Context<'_> {
    fn drop(&mut self) {
        unsafe { sys::kt_context_release(self.raw) };
    }
}

// ------------------------------------------------------ packed caches, checkpoints

fn c_path(path: &std::path::Path, what: &str) -> Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|_| Error {
        status: Status::INVALID_ARGUMENT,
        message: format!("{} contains a NUL byte", what),
    })
}

fn c_text(text: &str, what: &str) -> Result<std::ffi::CString> {
    std::ffi::CString::new(text).map_err(|_| Error {
        status: Status::INVALID_ARGUMENT,
        message: format!("{} contains a NUL byte", what),
    })
}

fn owned_str(s: *const std::os::raw::c_char) -> String {
    if s.is_null() {
        String::new()
    } else {
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    }
}

impl<'e> Moe<'e> {
    /// Writes the packed weights to one file (atomically replaced).
    pub fn save_packed(&self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let p = c_path(path.as_ref(), "path")?;
        check(unsafe { sys::kt_moe_save_packed(self.raw, p.as_ptr()) })
    }

    /// Replaces the weights with a packed cache's (inference and LoRA mode
    /// read them from a read-only mapping of the file). `verify_checksums`
    /// false checks the header only.
    pub fn load_packed(&self, path: impl AsRef<std::path::Path>, verify_checksums: bool) -> Result<()> {
        let p = c_path(path.as_ref(), "path")?;
        let flags = if verify_checksums { 0 } else { sys::KT_PACKED_SKIP_CHECKSUMS };
        check(unsafe { sys::kt_moe_load_packed(self.raw, p.as_ptr(), flags) })
    }
}

/// What a packed cache file holds (kt_packed_read_info).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PackedInfo {
    pub num_experts: i64,
    pub hidden: i64,
    pub intermediate: i64,
    pub has_bias: bool,
    pub weight_format: WeightFormat,
    pub num_loaded: i64,
    /// Bytes of the stored weights (codes, scales and padding).
    pub weight_bytes: i64,
    pub file_bytes: i64,
    pub format_version: i32,
}

/// Reads a packed cache's header and loaded flags (kt_packed_read_info).
pub fn packed_info(path: impl AsRef<std::path::Path>) -> Result<PackedInfo> {
    let p = c_path(path.as_ref(), "path")?;
    let mut i = std::mem::MaybeUninit::<sys::kt_packed_info>::zeroed();
    let i = unsafe {
        (*i.as_mut_ptr()).struct_size = std::mem::size_of::<sys::kt_packed_info>();
        check(sys::kt_packed_read_info(p.as_ptr(), i.as_mut_ptr()))?;
        i.assume_init()
    };
    Ok(PackedInfo {
        num_experts: i.num_experts,
        hidden: i.hidden,
        intermediate: i.intermediate,
        has_bias: i.has_bias != 0,
        weight_format: WeightFormat::from_raw(i.weight_format).ok_or_else(|| Error {
            status: Status::INTERNAL,
            message: format!("kt_packed_read_info: unknown weight format {}", i.weight_format),
        })?,
        num_loaded: i.num_loaded,
        weight_bytes: i.weight_bytes,
        file_bytes: i.file_bytes,
        format_version: i.format_version,
    })
}

/// Element types of checkpoint tensors (kt_ckpt_dtype) kt's writers store.
pub mod ckpt_dtype {
    pub use kt_sys::{KT_CKPT_DTYPE_BF16 as BF16, KT_CKPT_DTYPE_F16 as F16, KT_CKPT_DTYPE_F32 as F32};
}
/// Routed-expert layouts (kt_ckpt_layout).
pub mod ckpt_layout {
    pub use kt_sys::{
        KT_CKPT_LAYOUT_FUSED as FUSED, KT_CKPT_LAYOUT_FUSED_IN_OUT as FUSED_IN_OUT,
        KT_CKPT_LAYOUT_GPT_OSS as GPT_OSS, KT_CKPT_LAYOUT_MIXTRAL as MIXTRAL, KT_CKPT_LAYOUT_NONE as NONE,
        KT_CKPT_LAYOUT_PER_EXPERT as PER_EXPERT,
    };
}

/// What a checkpoint directory holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointInfo {
    pub architecture: String,
    pub model_type: String,
    /// A [`ckpt_layout`] value.
    pub layout: i32,
    pub num_moe_layers: i64,
    pub num_tensors: i64,
    pub num_files: i64,
    pub total_bytes: i64,
    pub top_k: i64,
}

/// One MoE layer of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerInfo {
    pub layer: i64,
    pub num_experts: i64,
    pub hidden: i64,
    pub intermediate: i64,
    pub has_bias: bool,
    pub layout: i32,
    /// kt_ckpt_format_name: "dense", "fp8_block", ...
    pub format: String,
    /// kt_ckpt_dtype_name of the weights: "BF16", ...
    pub weight_dtype: String,
    pub loadable: bool,
    pub bytes: i64,
    /// The layer format that holds the experts as stored (None for a value
    /// this binding does not know).
    pub weight_format: Option<WeightFormat>,
    /// Inputs per scale of a quantized layer (fp8: the block's 128), 0 if dense.
    pub group_size: i64,
    /// Checkpoint tensors of the layer's routed experts (weights, scales, biases).
    pub num_tensors: i64,
}

/// An open Hugging Face checkpoint directory (memory-mapped, validated);
/// read-only, usable from any thread.
pub struct Checkpoint {
    raw: *mut sys::kt_ckpt,
}

unsafe impl Send for Checkpoint {}
unsafe impl Sync for Checkpoint {}

impl Checkpoint {
    pub fn open(dir: impl AsRef<std::path::Path>) -> Result<Checkpoint> {
        let d = c_path(dir.as_ref(), "dir")?;
        let mut raw = ptr::null_mut();
        check(unsafe { sys::kt_ckpt_open(d.as_ptr(), &mut raw) })?;
        Ok(Checkpoint { raw })
    }

    pub fn info(&self) -> Result<CheckpointInfo> {
        let mut i = std::mem::MaybeUninit::<sys::kt_ckpt_info>::zeroed();
        let i = unsafe {
            (*i.as_mut_ptr()).struct_size = std::mem::size_of::<sys::kt_ckpt_info>();
            check(sys::kt_ckpt_get_info(self.raw, i.as_mut_ptr()))?;
            i.assume_init()
        };
        Ok(CheckpointInfo {
            architecture: owned_str(i.architecture),
            model_type: owned_str(i.model_type),
            layout: i.layout,
            num_moe_layers: i.num_moe_layers,
            num_tensors: i.num_tensors,
            num_files: i.num_files,
            total_bytes: i.total_bytes,
            top_k: i.top_k,
        })
    }

    /// The MoE layers, ordered by layer number.
    pub fn layers(&self) -> Result<Vec<LayerInfo>> {
        let n = self.info()?.num_moe_layers;
        (0..n)
            .map(|index| {
                let mut l = std::mem::MaybeUninit::<sys::kt_ckpt_layer_info>::zeroed();
                let l = unsafe {
                    (*l.as_mut_ptr()).struct_size = std::mem::size_of::<sys::kt_ckpt_layer_info>();
                    check(sys::kt_ckpt_get_layer_info(self.raw, index, l.as_mut_ptr()))?;
                    l.assume_init()
                };
                Ok(LayerInfo {
                    layer: l.layer,
                    num_experts: l.num_experts,
                    hidden: l.hidden,
                    intermediate: l.intermediate,
                    has_bias: l.has_bias != 0,
                    layout: l.layout,
                    format: static_str(unsafe { sys::kt_ckpt_format_name(l.format) }).to_string(),
                    weight_dtype: static_str(unsafe { sys::kt_ckpt_dtype_name(l.weight_dtype) }).to_string(),
                    loadable: l.loadable != 0,
                    bytes: l.bytes,
                    weight_format: WeightFormat::from_raw(l.weight_format),
                    group_size: l.group_size,
                    num_tensors: l.num_tensors,
                })
            })
            .collect()
    }

    /// Layer options for layer L (shapes, bias, activation, top_k, and the
    /// weight format that holds the experts as stored); change
    /// mode or LoRA settings with the builder methods before creating it.
    pub fn moe_options(&self, layer: i64) -> Result<MoeOptions> {
        let mut o = MoeOptions::new(0, 0, 0, 0);
        check(unsafe { sys::kt_ckpt_moe_options(self.raw, layer, &mut o.raw) })?;
        Ok(o)
    }

    /// Loads layer L's routed experts into moe straight from the mapped files
    /// with kt's default [`LoadLayerOptions`] (a quantized layer loads only
    /// into a layer of its own format).
    pub fn load_layer(&self, layer: i64, moe: &Moe<'_>) -> Result<()> {
        check(unsafe { sys::kt_ckpt_load_layer(self.raw, layer, moe.raw, None, ptr::null_mut()) })
    }

    /// [`load_layer`](Checkpoint::load_layer) with options
    /// (kt_ckpt_load_layer_with), e.g. `&LoadLayerOptions { dequantize: true }`
    /// to load a quantized layer into a bf16 layer.
    pub fn load_layer_with(&self, layer: i64, moe: &Moe<'_>, options: &LoadLayerOptions) -> Result<()> {
        self.load_share(layer, moe, options, &LayerShare::default())
    }

    /// A rank's share of layer L (kt_ckpt_load_options: its experts, its
    /// slice of the intermediate dimension), for a host whose own
    /// collectives combine expert- or tensor-parallel ranks: `moe` is made
    /// with the share's expert count and intermediate size, and only the
    /// share's bytes are read.
    pub fn load_share(&self, layer: i64, moe: &Moe<'_>, options: &LoadLayerOptions, share: &LayerShare) -> Result<()> {
        let mut o = std::mem::MaybeUninit::<sys::kt_ckpt_load_options>::uninit();
        let mut o = unsafe {
            sys::kt_ckpt_load_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_ckpt_load_options>());
            o.assume_init()
        };
        o.dequantize = options.dequantize as c_int;
        if let Some(experts) = &share.experts {
            o.experts = experts.as_ptr();
            o.num_experts = experts.len() as i64;
        }
        if let Some((begin, end)) = share.intermediate {
            o.intermediate_begin = begin;
            o.intermediate_end = end;
        }
        o.zero_down_bias = share.zero_down_bias as c_int;
        check(unsafe { sys::kt_ckpt_load_layer_with(self.raw, layer, moe.raw, &o, None, ptr::null_mut()) })
    }

    /// Copies layer L's weights into host tensors: `Arg::Out` with arg::W_GATE,
    /// arg::W_UP [E,I,H], arg::W_DOWN [E,H,I], arg::B_* (fp32/bf16).
    pub fn read_layer(&self, layer: i64, args: &[Arg<'_, '_>]) -> Result<()> {
        let raw = raw_args(args);
        check(unsafe { sys::kt_ckpt_read_layer(self.raw, layer, raw.as_ptr(), raw.len()) })
    }
}

/// Settings of [`Checkpoint::load_layer_with`]; the default is kt's (that of
/// [`Checkpoint::load_layer`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadLayerOptions {
    /// Lets a quantized layer (fp8 blocks, int4 groups, mxfp4) load into a
    /// [`WeightFormat::Bf16`] layer, each weight dequantized and rounded to
    /// bf16 once; without it that load fails with `Status::UNSUPPORTED`. A
    /// quantized layer loads as stored into a layer of its own format either
    /// way and is never re-quantized into another quantized format; dense
    /// layers ignore it.
    pub dequantize: bool,
}

/// What of a layer [`Checkpoint::load_share`] loads; the default is the
/// whole layer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LayerShare {
    /// Checkpoint expert ids, the layer's expert i being `experts[i]`
    /// (expert parallel); `None`: every expert, in order.
    pub experts: Option<Vec<i64>>,
    /// `(begin, end)`: the slice of the intermediate dimension held (tensor
    /// parallel: gate and up rows, down columns, gate and up biases); a
    /// quantized layer loaded as stored needs both ends on whole scale
    /// groups. `None`: all of it.
    pub intermediate: Option<(i64, i64)>,
    /// The down biases load as zeros: every rank of a tensor-parallel group
    /// but one, whose outputs are summed.
    pub zero_down_bias: bool,
}

impl Drop for Checkpoint {
    fn drop(&mut self) {
        unsafe { sys::kt_ckpt_close(self.raw) };
    }
}

/// One layer's tensors for a writer: its layer number and named arguments.
pub struct LayerArgs<'t, 'a> {
    pub layer: i64,
    pub args: &'t [Arg<'t, 'a>],
}

fn raw_layers(layers: &[LayerArgs<'_, '_>]) -> (Vec<Vec<sys::kt_arg>>, Vec<sys::kt_ckpt_layer_args>) {
    let args: Vec<Vec<sys::kt_arg>> = layers.iter().map(|l| raw_args(l.args)).collect();
    let raw = layers
        .iter()
        .zip(&args)
        .map(|(l, a)| sys::kt_ckpt_layer_args { layer: l.layer, args: a.as_ptr(), num_args: a.len() })
        .collect();
    (args, raw)
}

/// Settings of [`write_experts`].
#[derive(Clone, Debug)]
pub struct WriteOptions {
    /// Key names: ckpt_layout::PER_EXPERT or ckpt_layout::MIXTRAL.
    pub layout: i32,
    /// Stored dtype: ckpt_dtype::BF16, F16 or F32.
    pub dtype: i32,
    pub max_shard_bytes: i64,
    /// config.json text to write.
    pub config_json: Option<String>,
}

impl Default for WriteOptions {
    fn default() -> Self {
        let mut o = std::mem::MaybeUninit::<sys::kt_ckpt_write_options>::uninit();
        let o = unsafe {
            sys::kt_ckpt_write_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_ckpt_write_options>());
            o.assume_init()
        };
        WriteOptions { layout: o.layout, dtype: o.dtype, max_shard_bytes: o.max_shard_bytes, config_json: None }
    }
}

/// Writes a full-expert checkpoint with HF key names into dir (published
/// atomically). Each layer: arg::W_GATE, arg::W_UP [E,I,H], arg::W_DOWN
/// [E,H,I], optional arg::B_*.
pub fn write_experts(dir: impl AsRef<std::path::Path>, options: &WriteOptions, layers: &[LayerArgs<'_, '_>]) -> Result<()> {
    let d = c_path(dir.as_ref(), "dir")?;
    let config = options.config_json.as_deref().map(|c| c_text(c, "config_json")).transpose()?;
    let mut o = std::mem::MaybeUninit::<sys::kt_ckpt_write_options>::uninit();
    let mut o = unsafe {
        sys::kt_ckpt_write_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_ckpt_write_options>());
        o.assume_init()
    };
    o.layout = options.layout;
    o.dtype = options.dtype;
    o.max_shard_bytes = options.max_shard_bytes;
    o.config_json = config.as_ref().map_or(ptr::null(), |c| c.as_ptr());
    let (_args, raw) = raw_layers(layers);
    check(unsafe { sys::kt_ckpt_write_experts(d.as_ptr(), &o, raw.as_ptr(), raw.len()) })
}

/// A PEFT LoRA adapter's settings (adapter_config.json).
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterConfig {
    pub rank: i64,
    pub alpha: f32,
    pub use_rslora: bool,
    /// sys::KT_PROJ_* bits.
    pub targets: u32,
    /// Key names: ckpt_layout::PER_EXPERT or ckpt_layout::MIXTRAL.
    pub layout: i32,
    /// Stored dtype: ckpt_dtype::F32 or BF16.
    pub dtype: i32,
    /// base_model_name_or_path (written only).
    pub base_model: Option<String>,
}

impl AdapterConfig {
    fn raw_defaults() -> sys::kt_ckpt_adapter_config {
        let mut c = std::mem::MaybeUninit::<sys::kt_ckpt_adapter_config>::uninit();
        unsafe {
            sys::kt_ckpt_adapter_config_defaults(c.as_mut_ptr(), std::mem::size_of::<sys::kt_ckpt_adapter_config>());
            c.assume_init()
        }
    }

    /// kt's defaults (all projections, per-expert names, fp32) with rank and alpha.
    pub fn new(rank: i64, alpha: f32) -> AdapterConfig {
        let c = Self::raw_defaults();
        AdapterConfig {
            rank,
            alpha,
            use_rslora: false,
            targets: c.targets,
            layout: c.layout,
            dtype: c.dtype,
            base_model: None,
        }
    }
}

/// Writes a PEFT adapter into dir from each layer's arg::LORA_A_* [E,r,in]
/// and arg::LORA_B_* [E,out,r] (published atomically).
pub fn write_adapter(dir: impl AsRef<std::path::Path>, config: &AdapterConfig, layers: &[LayerArgs<'_, '_>]) -> Result<()> {
    let d = c_path(dir.as_ref(), "dir")?;
    let base = config.base_model.as_deref().map(|b| c_text(b, "base_model")).transpose()?;
    let mut c = AdapterConfig::raw_defaults();
    c.rank = config.rank;
    c.alpha = config.alpha;
    c.use_rslora = config.use_rslora as c_int;
    c.targets = config.targets;
    c.layout = config.layout;
    c.dtype = config.dtype;
    c.base_model = base.as_ref().map_or(ptr::null(), |b| b.as_ptr());
    let (_args, raw) = raw_layers(layers);
    check(unsafe { sys::kt_ckpt_adapter_write(d.as_ptr(), &c, raw.as_ptr(), raw.len()) })
}

/// Reads an adapter's adapter_config.json.
pub fn read_adapter_config(dir: impl AsRef<std::path::Path>) -> Result<AdapterConfig> {
    let d = c_path(dir.as_ref(), "dir")?;
    let mut c = AdapterConfig::raw_defaults();
    check(unsafe { sys::kt_ckpt_adapter_read_config(d.as_ptr(), &mut c) })?;
    Ok(AdapterConfig {
        rank: c.rank,
        alpha: c.alpha,
        use_rslora: c.use_rslora != 0,
        targets: c.targets,
        layout: c.layout,
        dtype: c.dtype,
        base_model: None,
    })
}

/// Copies layer L's LoRA factors of the adapter in dir into `Arg::Out`
/// tensors arg::LORA_A_* [E,r,in], arg::LORA_B_* [E,out,r].
pub fn read_adapter(dir: impl AsRef<std::path::Path>, layer: i64, args: &[Arg<'_, '_>]) -> Result<()> {
    let d = c_path(dir.as_ref(), "dir")?;
    let raw = raw_args(args);
    check(unsafe { sys::kt_ckpt_adapter_read(d.as_ptr(), layer, raw.as_ptr(), raw.len()) })
}
