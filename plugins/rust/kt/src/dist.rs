//! Several processes (ranks) sharing one set of experts: the communicator
//! ([`Comm`], Gloo for CPU tensors, NCCL for CUDA ones), one MoE layer spread
//! over its ranks ([`DistMoe`], owner-rank or expert-parallel) and the
//! distributed checkpoint ([`Comm::save_checkpoint`], [`Comm::load_checkpoint`]).
//!
//! Collective calls (creating a communicator or a distributed layer, barrier,
//! broadcast, allgather, forward, backward, checkpoints) must be made by every
//! rank, in the same order. A failure on one rank is returned on every rank,
//! with a message naming the call and that rank.
use std::any::Any;
use std::ffi::{CStr, CString};
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::os::raw::{c_char, c_int, c_void};
use std::panic::{self, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::ptr;

use crate::{
    c_path, c_text, check, forward_args, owned_str, raw_args, sys, Arg, BackwardOptions, Engine, Error, Moe, MoeOptions,
    Optimizer, Result, Status, TensorMut, TensorRef,
};

/// Size of an NCCL unique id (KT_NCCL_UNIQUE_ID_BYTES).
pub const NCCL_UNIQUE_ID_BYTES: usize = sys::KT_NCCL_UNIQUE_ID_BYTES;

/// A collective engine (kt_comm_backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// CPU tensors, over TCP.
    Gloo,
    /// CUDA tensors.
    Nccl,
}

impl Backend {
    fn from_raw(v: sys::kt_comm_backend) -> Option<Backend> {
        match v {
            sys::KT_COMM_BACKEND_GLOO => Some(Backend::Gloo),
            sys::KT_COMM_BACKEND_NCCL => Some(Backend::Nccl),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Backend::Gloo => "gloo",
            Backend::Nccl => "nccl",
        }
    }
}

/// Where a communicator's tensors live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda,
}

/// What a backend string selects (kt_comm_backends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backends {
    /// For CPU tensors.
    pub cpu: Option<Backend>,
    /// For CUDA tensors.
    pub cuda: Option<Backend>,
    /// CUDA when a CUDA backend is named, else CPU.
    pub device: Device,
}

impl From<&sys::kt_comm_backends> for Backends {
    fn from(b: &sys::kt_comm_backends) -> Self {
        Backends {
            cpu: Backend::from_raw(b.cpu),
            cuda: Backend::from_raw(b.cuda),
            device: if b.device == sys::kDLCUDA { Device::Cuda } else { Device::Cpu },
        }
    }
}

fn raw_backends() -> sys::kt_comm_backends {
    sys::kt_comm_backends {
        struct_size: std::mem::size_of::<sys::kt_comm_backends>(),
        cpu: sys::KT_COMM_BACKEND_NONE,
        cuda: sys::KT_COMM_BACKEND_NONE,
        device: sys::kDLCPU,
    }
}

/// Parses a backend string ("gloo", "nccl", "cuda:nccl,cpu:gloo"); needs
/// neither backend in this build. A malformed string is
/// `Status::INVALID_ARGUMENT` with a message saying what is wrong.
pub fn parse_backend(backend: &str) -> Result<Backends> {
    let s = c_text(backend, "backend")?;
    let mut b = raw_backends();
    check(unsafe { sys::kt_comm_parse_backend(s.as_ptr(), &mut b) })?;
    Ok(Backends::from(&b))
}

/// Whether the loaded libkt was built with `backend` (its build info lists
/// it among the collectives). Without it, creating a communicator on it is
/// `Status::UNSUPPORTED`.
pub fn built_with(backend: Backend) -> bool {
    crate::build_info()
        .split(';')
        .filter_map(|part| part.trim().strip_prefix("collectives:"))
        .any(|list| list.split_whitespace().any(|b| b == backend.name()))
}

/// The ranks' common NCCL id, made on one rank and handed to the others.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclUniqueId(pub [u8; NCCL_UNIQUE_ID_BYTES]);

/// A new NCCL unique id; `Status::UNSUPPORTED` without NCCL in the build or
/// on the machine.
pub fn nccl_unique_id() -> Result<NcclUniqueId> {
    let mut id = NcclUniqueId([0; NCCL_UNIQUE_ID_BYTES]);
    check(unsafe { sys::kt_comm_nccl_unique_id(id.0.as_mut_ptr() as *mut c_void, id.0.len()) })?;
    Ok(id)
}

// --------------------------------------------------------------- rendezvous

/// A host's key-value store the ranks meet through (kt_comm_store), such as a
/// trainer's own TCP store. It is used only while [`Comm::new`] runs, on its
/// thread; kt prefixes every key with [`CommOptions::store_prefix`].
pub trait Store {
    /// Stores value under key.
    fn set(&self, key: &str, value: &[u8]) -> std::io::Result<()>;
    /// The value under key, or None while it does not exist yet (kt asks
    /// again until the communicator's timeout).
    fn get(&self, key: &str) -> std::io::Result<Option<Vec<u8>>>;
}

/// How the ranks meet.
pub enum Rendezvous<'s> {
    /// A directory every rank reaches (Gloo's file store; one per
    /// communicator, or distinct prefixes).
    Path(PathBuf),
    /// The host's store.
    Store(&'s dyn Store),
}

/// A panic caught in a callback kt called, resumed once kt has returned:
/// unwinding through C frames is not allowed.
type Panic = Option<Box<dyn Any + Send>>;

fn guarded<R>(panic: &mut Panic, fallback: R, f: impl FnOnce() -> R) -> R {
    if panic.is_some() {
        return fallback;
    }
    match panic::catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            *panic = Some(payload);
            fallback
        }
    }
}

fn resume(panic: Panic) {
    if let Some(payload) = panic {
        panic::resume_unwind(payload);
    }
}

struct StoreCall<'s> {
    store: &'s dyn Store,
    panic: Panic,
}

unsafe extern "C" fn store_set(key: *const c_char, value: *const c_void, size: usize, user: *mut c_void) -> c_int {
    let call = &mut *(user as *mut StoreCall<'_>);
    let store = call.store;
    let key = match CStr::from_ptr(key).to_str() {
        Ok(key) => key,
        Err(_) => return -1,
    };
    let value = if size == 0 { &[][..] } else { std::slice::from_raw_parts(value as *const u8, size) };
    guarded(&mut call.panic, -1, || if store.set(key, value).is_ok() { 0 } else { -1 })
}

unsafe extern "C" fn store_get(
    key: *const c_char,
    buffer: *mut c_void,
    capacity: usize,
    size: *mut usize,
    user: *mut c_void,
) -> c_int {
    let call = &mut *(user as *mut StoreCall<'_>);
    let store = call.store;
    let key = match CStr::from_ptr(key).to_str() {
        Ok(key) => key,
        Err(_) => return -1,
    };
    match guarded(&mut call.panic, Err(()), || store.get(key).map_err(|_| ())) {
        Ok(Some(value)) => {
            *size = value.len();
            let n = value.len().min(capacity);
            if n > 0 {
                ptr::copy_nonoverlapping(value.as_ptr(), buffer as *mut u8, n);
            }
            0
        }
        Ok(None) => 1,
        Err(()) => -1,
    }
}

// ------------------------------------------------------------- communicator

/// A communicator's settings; [`CommOptions::new`] starts from kt's defaults
/// (kt_comm_options_defaults).
pub struct CommOptions<'s> {
    /// "gloo" (default), "nccl", or device:backend pairs ("cuda:nccl,cpu:gloo").
    pub backend: String,
    /// This process, in [0, world_size).
    pub rank: i32,
    pub world_size: i32,
    pub rendezvous: Rendezvous<'s>,
    /// Key prefix in the store (default "kt").
    pub store_prefix: String,
    /// Gloo: the address this rank listens on (default "127.0.0.1").
    pub hostname: String,
    /// Bounds the rendezvous and every collective (default 30000).
    pub timeout_ms: i64,
    /// NCCL: the ranks' common id, or None when the communicator also has a
    /// CPU backend (rank 0 then makes one and broadcasts it over that).
    pub nccl_unique_id: Option<NcclUniqueId>,
    /// NCCL: this rank's CUDA device (default -1: the current one).
    pub cuda_device: i32,
}

fn raw_comm_defaults() -> sys::kt_comm_options {
    let mut o = std::mem::MaybeUninit::<sys::kt_comm_options>::uninit();
    unsafe {
        sys::kt_comm_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_comm_options>());
        o.assume_init()
    }
}

impl<'s> CommOptions<'s> {
    pub fn new(rank: i32, world_size: i32, rendezvous: Rendezvous<'s>) -> CommOptions<'s> {
        let d = raw_comm_defaults();
        CommOptions {
            backend: owned_str(d.backend),
            rank,
            world_size,
            rendezvous,
            store_prefix: owned_str(d.store_prefix),
            hostname: owned_str(d.hostname),
            timeout_ms: d.timeout_ms,
            nccl_unique_id: None,
            cuda_device: d.cuda_device,
        }
    }
}

/// What a communicator reports of itself (kt_comm_info).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommInfo {
    pub rank: i32,
    pub world_size: i32,
    pub backends: Backends,
    pub timeout_ms: i64,
    /// False after a collective failed for a dead or silent peer
    /// (`Status::COMM`): the communicator must then be dropped.
    pub usable: bool,
}

/// This rank's communicator; its collectives may be called from any thread
/// (kt serialises the calls on one communicator).
pub struct Comm {
    raw: *mut sys::kt_comm,
}

unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Comm {
    /// Connects the ranks (collective: every rank calls it with the same
    /// backend, world size and rendezvous).
    pub fn new(options: &CommOptions<'_>) -> Result<Comm> {
        let backend = c_text(&options.backend, "backend")?;
        let prefix = c_text(&options.store_prefix, "store_prefix")?;
        let hostname = c_text(&options.hostname, "hostname")?;
        let mut o = raw_comm_defaults();
        o.backend = backend.as_ptr();
        o.rank = options.rank;
        o.world_size = options.world_size;
        o.store_prefix = prefix.as_ptr();
        o.hostname = hostname.as_ptr();
        o.timeout_ms = options.timeout_ms;
        o.cuda_device = options.cuda_device;
        if let Some(id) = &options.nccl_unique_id {
            o.nccl_unique_id = id.0.as_ptr() as *const c_void;
        }
        let path: Option<CString>;
        let mut call: Option<StoreCall<'_>> = None;
        let store: sys::kt_comm_store;
        match &options.rendezvous {
            Rendezvous::Path(p) => {
                path = Some(c_path(p, "store_path")?);
                o.store_path = path.as_ref().map_or(ptr::null(), |p| p.as_ptr());
            }
            Rendezvous::Store(s) => {
                let call = call.insert(StoreCall { store: *s, panic: None });
                store = sys::kt_comm_store {
                    set: Some(store_set),
                    get: Some(store_get),
                    user: call as *mut StoreCall<'_> as *mut c_void,
                };
                o.store = &store;
            }
        }
        let mut raw = ptr::null_mut();
        let status = unsafe { sys::kt_comm_create(&o, &mut raw) };
        if let Some(call) = call {
            resume(call.panic);
        }
        check(status)?;
        Ok(Comm { raw })
    }

    /// The communicator's settings and state.
    pub fn info(&self) -> Result<CommInfo> {
        let mut i = sys::kt_comm_info {
            struct_size: std::mem::size_of::<sys::kt_comm_info>(),
            rank: 0,
            world_size: 0,
            backends: raw_backends(),
            timeout_ms: 0,
            usable: 0,
        };
        check(unsafe { sys::kt_comm_get_info(self.raw, &mut i) })?;
        Ok(CommInfo {
            rank: i.rank,
            world_size: i.world_size,
            backends: Backends::from(&i.backends),
            timeout_ms: i.timeout_ms,
            usable: i.usable != 0,
        })
    }

    /// Returns when every rank reached it (collective).
    pub fn barrier(&self) -> Result<()> {
        check(unsafe { sys::kt_comm_barrier(self.raw) })
    }

    /// Copies root's tensor into every rank's (collective; same dtype and
    /// shape everywhere).
    pub fn broadcast(&self, tensor: &mut TensorMut<'_>, root: i32) -> Result<()> {
        check(unsafe { sys::kt_comm_broadcast(self.raw, &mut tensor.tensor, root) })
    }

    /// out [world_size, ...input's shape] receives every rank's input, rank
    /// by rank (collective).
    pub fn allgather(&self, input: &TensorRef<'_>, out: &mut TensorMut<'_>) -> Result<()> {
        check(unsafe { sys::kt_comm_allgather(self.raw, &input.tensor, &mut out.tensor) })
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        // Distributed layers borrow the communicator, so none is left here.
        unsafe { sys::kt_comm_destroy(self.raw) };
    }
}

// -------------------------------------------------------- distributed layer

/// How a [`DistMoe`] spreads its experts over the ranks (kt_dist_mode).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DistMode {
    /// One rank holds the whole layer and computes every rank's tokens.
    Owner { rank: i32 },
    /// Each rank holds a shard of the experts: `expert_ranks[e]` is the rank
    /// of expert e (every rank passes the same map), or None for an even
    /// contiguous split.
    ExpertParallel { expert_ranks: Option<Vec<i32>> },
}

/// How parameter gradients of the ranks' tokens combine (kt_dist_grad_average).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GradAverage {
    /// Summed.
    Sum,
    /// Summed, times 1/world_size (a data-parallel average).
    Mean,
}

/// A distributed layer's settings; the default is kt's (owner rank 0, sum).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistMoeOptions {
    pub mode: DistMode,
    pub grad_average: GradAverage,
}

impl Default for DistMoeOptions {
    fn default() -> Self {
        DistMoeOptions { mode: DistMode::Owner { rank: 0 }, grad_average: GradAverage::Sum }
    }
}

/// One MoE layer spread over a communicator's ranks. It borrows the
/// communicator and the engine; the layer this rank computes with is
/// [`DistMoe::layer`].
pub struct DistMoe<'a> {
    raw: *mut sys::kt_dist_moe,
    /// Owned by the distributed layer, which destroys it.
    layer: Option<ManuallyDrop<Moe<'a>>>,
    _comm: PhantomData<&'a Comm>,
}

unsafe impl Send for DistMoe<'_> {}
unsafe impl Sync for DistMoe<'_> {}

impl<'a> DistMoe<'a> {
    /// Creates the layer (collective). `layer_options` are the whole layer's
    /// (max_tokens per rank); every rank passes the same, and the same
    /// `options`: a difference is refused on every rank. `engine`: the
    /// owner's (other owner-mode ranks pass None), or every expert-parallel
    /// rank's that holds experts.
    ///
    /// The length of an expert map is checked here, before the collective
    /// call, since kt reads num_experts entries of it.
    pub fn new(
        comm: &'a Comm,
        engine: Option<&'a Engine>,
        layer_options: &MoeOptions,
        options: &DistMoeOptions,
    ) -> Result<DistMoe<'a>> {
        let mut o = std::mem::MaybeUninit::<sys::kt_dist_moe_options>::uninit();
        let mut o = unsafe {
            sys::kt_dist_moe_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_dist_moe_options>());
            o.assume_init()
        };
        o.grad_average = match options.grad_average {
            GradAverage::Sum => sys::KT_DIST_GRAD_SUM,
            GradAverage::Mean => sys::KT_DIST_GRAD_MEAN,
        };
        match &options.mode {
            DistMode::Owner { rank } => {
                o.mode = sys::KT_DIST_OWNER;
                o.owner_rank = *rank;
            }
            DistMode::ExpertParallel { expert_ranks } => {
                o.mode = sys::KT_DIST_EXPERT_PARALLEL;
                if let Some(map) = expert_ranks {
                    let experts = layer_options.raw.num_experts;
                    if map.len() as i64 != experts {
                        return Err(Error {
                            status: Status::INVALID_ARGUMENT,
                            message: format!(
                                "DistMoe::new: expert_ranks has {} entries, the layer has {} experts",
                                map.len(),
                                experts
                            ),
                        });
                    }
                    o.expert_ranks = map.as_ptr();
                }
            }
        }
        let engine = engine.map_or(ptr::null_mut(), |e| e.raw);
        let mut raw = ptr::null_mut();
        check(unsafe { sys::kt_dist_moe_create(comm.raw, engine, &layer_options.raw, &o, &mut raw) })?;
        let mut local = ptr::null_mut();
        if let Err(e) = check(unsafe { sys::kt_dist_moe_layer(raw, &mut local) }) {
            unsafe { sys::kt_dist_moe_destroy(raw) };
            return Err(e);
        }
        let layer = (!local.is_null())
            .then(|| ManuallyDrop::new(Moe { raw: local, _engine: PhantomData, hook: std::sync::Mutex::new(None) }));
        Ok(DistMoe { raw, layer, _comm: PhantomData })
    }

    /// The layer this rank computes with (load weights, bind parameters and
    /// gradient buffers, make an optimizer through it): the owner's has the
    /// whole layer, an expert-parallel rank's its experts as local experts
    /// 0..n-1 with top_k 1. None on ranks without experts.
    pub fn layer(&self) -> Option<&Moe<'a>> {
        self.layer.as_deref()
    }

    /// Global ids of this rank's experts, in local order (ascending).
    pub fn local_experts(&self) -> Result<Vec<i64>> {
        let mut count = 0;
        check(unsafe { sys::kt_dist_moe_local_experts(self.raw, ptr::null_mut(), 0, &mut count) })?;
        let mut experts = vec![0i64; count as usize];
        check(unsafe { sys::kt_dist_moe_local_experts(self.raw, experts.as_mut_ptr(), count, &mut count) })?;
        experts.truncate(count as usize);
        Ok(experts)
    }

    // Collective: every rank calls them, with its own T tokens (T <= max_tokens).
    forward_methods!(sys::kt_dist_moe_forward, sys::kt_dist_context, DistContext, _dist);

    /// Backward of ctx's forward (collective: every rank passes its context
    /// of the same forward, and the same options). args: arg::DY (required),
    /// arg::DX and arg::DROUTE_WEIGHTS (optional outputs). Parameter
    /// gradients go into the buffers bound to [`DistMoe::layer`].
    pub fn backward(&self, ctx: &mut DistContext<'_>, options: &BackwardOptions, args: &[Arg<'_, '_>]) -> Result<()> {
        let o = options.raw();
        let raw = raw_args(args);
        check(unsafe { sys::kt_dist_moe_backward(self.raw, ctx.raw, &o, raw.as_ptr(), raw.len()) })
    }
}

impl Drop for DistMoe<'_> {
    fn drop(&mut self) {
        unsafe { sys::kt_dist_moe_destroy(self.raw) };
        // The local layer went with it; only its gradient hook is ours to free.
        if let Some(layer) = &self.layer {
            drop(layer.hook.lock().unwrap_or_else(|e| e.into_inner()).take());
        }
    }
}

/// What a distributed training forward saved for its backward; released on drop.
pub struct DistContext<'d> {
    raw: *mut sys::kt_dist_context,
    _dist: PhantomData<&'d ()>,
}

unsafe impl Send for DistContext<'_> {}

impl Drop for DistContext<'_> {
    fn drop(&mut self) {
        unsafe { sys::kt_dist_context_release(self.raw) };
    }
}

// ------------------------------------------------- distributed checkpoints

/// Parts of a distributed checkpoint (KT_DIST_CKPT_* bits); `Parts::AVAILABLE`
/// (0) means what the layers have (saving) or the checkpoint holds (loading).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Parts(pub u32);

impl Parts {
    pub const AVAILABLE: Parts = Parts(0);
    /// Base weights and biases.
    pub const WEIGHTS: Parts = Parts(sys::KT_DIST_CKPT_WEIGHTS);
    /// LoRA factors.
    pub const ADAPTER: Parts = Parts(sys::KT_DIST_CKPT_ADAPTER);
    /// Optimizer state.
    pub const OPTIMIZER: Parts = Parts(sys::KT_DIST_CKPT_OPTIMIZER);
}

impl std::ops::BitOr for Parts {
    type Output = Parts;
    fn bitor(self, other: Parts) -> Parts {
        Parts(self.0 | other.0)
    }
}

/// One layer of a distributed checkpoint on this rank: its number in the
/// checkpoint, this rank's distributed layer (on the communicator) and,
/// optionally, the optimizer over its local layer.
pub struct DistCkptLayer<'r, 'a, 'o> {
    pub layer: i64,
    pub dist: &'r DistMoe<'a>,
    pub optimizer: Option<&'r mut Optimizer<'o>>,
}

/// Settings of a checkpoint save or load.
#[derive(Default)]
pub struct DistCheckpointOptions<'p> {
    pub parts: Parts,
    /// Called on this rank's thread with the bytes of its file written
    /// (save) or copied (load) so far and in all.
    pub progress: Option<&'p mut dyn FnMut(i64, i64)>,
}

struct ProgressCall<'p> {
    f: &'p mut dyn FnMut(i64, i64),
    panic: Panic,
}

unsafe extern "C" fn call_progress(done: i64, total: i64, user: *mut c_void) {
    let call = &mut *(user as *mut ProgressCall<'_>);
    let f = &mut call.f;
    guarded(&mut call.panic, (), || f(done, total));
}

type CheckpointFn = unsafe extern "C" fn(
    *mut sys::kt_comm,
    *const c_char,
    *const sys::kt_dist_ckpt_layer,
    usize,
    *const sys::kt_dist_ckpt_options,
) -> sys::kt_status;

impl Comm {
    fn checkpoint_call(
        &self,
        f: CheckpointFn,
        dir: &Path,
        layers: &[DistCkptLayer<'_, '_, '_>],
        options: DistCheckpointOptions<'_>,
    ) -> Result<()> {
        let d = c_path(dir, "dir")?;
        let raw: Vec<sys::kt_dist_ckpt_layer> = layers
            .iter()
            .map(|l| sys::kt_dist_ckpt_layer {
                layer: l.layer,
                dist: l.dist.raw,
                optimizer: l.optimizer.as_ref().map_or(ptr::null_mut(), |o| o.raw),
            })
            .collect();
        let mut o = std::mem::MaybeUninit::<sys::kt_dist_ckpt_options>::uninit();
        let mut o = unsafe {
            sys::kt_dist_ckpt_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_dist_ckpt_options>());
            o.assume_init()
        };
        o.parts = options.parts.0;
        let mut call = options.progress.map(|f| ProgressCall { f, panic: None });
        if let Some(call) = call.as_mut() {
            o.progress = Some(call_progress);
            o.progress_user = call as *mut ProgressCall<'_> as *mut c_void;
        }
        let status = unsafe { f(self.raw, d.as_ptr(), raw.as_ptr(), raw.len(), &o) };
        if let Some(call) = call {
            resume(call.panic);
        }
        check(status)
    }

    /// Saves the layers' weights, bound LoRA factors and optimizer state into
    /// dir, published atomically (collective: every rank passes the same dir
    /// and layer numbers, in the same order). Changes nothing.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        layers: &[DistCkptLayer<'_, '_, '_>],
        options: DistCheckpointOptions<'_>,
    ) -> Result<()> {
        self.checkpoint_call(sys::kt_dist_ckpt_save, dir.as_ref(), layers, options)
    }

    /// Loads a checkpoint saved by any world size, mode or expert map into
    /// the layers (collective, as [`Comm::save_checkpoint`]): weights into
    /// each local layer, LoRA factors into its bound tensors (see
    /// [`Moe::bind`]), optimizer state into the optimizers. Everything is
    /// checked on every rank before anything changes.
    pub fn load_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        layers: &mut [DistCkptLayer<'_, '_, '_>],
        options: DistCheckpointOptions<'_>,
    ) -> Result<()> {
        self.checkpoint_call(sys::kt_dist_ckpt_load, dir.as_ref(), layers, options)
    }
}
