package kt

/*
#include <stdint.h>
#include <stdlib.h>
#include "ktgo.h"

extern int ktgoStoreSet(char* key, void* value, size_t size, uintptr_t user);
extern int ktgoStoreGet(char* key, void* buffer, size_t capacity, size_t* size, uintptr_t user);
extern void ktgoProgress(int64_t done, int64_t total, uintptr_t user);

// Callback users are cgo.Handles, which cross as integers.
static inline int ktgo_store_set(const char* key, const void* value, size_t size, void* user) {
	return ktgoStoreSet((char*)key, (void*)value, size, (uintptr_t)user);
}
static inline int ktgo_store_get(const char* key, void* buffer, size_t capacity, size_t* size, void* user) {
	return ktgoStoreGet((char*)key, buffer, capacity, size, (uintptr_t)user);
}
static inline void ktgo_progress(int64_t done, int64_t total, void* user) {
	ktgoProgress(done, total, (uintptr_t)user);
}

// The store struct lives on this frame: kt calls it only during kt_comm_create.
static inline kt_status ktgo_comm_create(const kt_comm_options* options, uintptr_t store, kt_comm** comm) {
	kt_comm_options o = *options;
	kt_comm_store s = {ktgo_store_set, ktgo_store_get, (void*)store};
	if (store) o.store = &s;
	return kt_comm_create(&o, comm);
}

enum { KTGO_BROADCAST = 0, KTGO_ALLGATHER = 1, KTGO_DIST_FORWARD = 2, KTGO_DIST_BACKWARD = 3 };
enum { KTGO_DIST_MAX_ARGS = 4 };

static inline kt_status ktgo_dist_call(int op, kt_comm* comm, int root, kt_dist_moe* dist, kt_dist_context* ctx,
                                       kt_dist_context** saved, const kt_backward_options* backward_options,
                                       int n, const ktgo_arg* meta, void* d0, void* d1, void* d2, void* d3) {
	void* data[KTGO_DIST_MAX_ARGS] = {d0, d1, d2, d3};
	DLTensor tensors[KTGO_DIST_MAX_ARGS];
	int64_t shapes[KTGO_DIST_MAX_ARGS][KTGO_MAX_DIMS];
	kt_arg args[KTGO_DIST_MAX_ARGS];
	ktgo_fill(n, meta, data, tensors, shapes, args);
	switch (op) {
	case KTGO_BROADCAST: return kt_comm_broadcast(comm, &tensors[0], root);
	case KTGO_ALLGATHER: return kt_comm_allgather(comm, &tensors[0], &tensors[1]);
	case KTGO_DIST_FORWARD: return kt_dist_moe_forward(dist, args, (size_t)n, saved);
	case KTGO_DIST_BACKWARD: return kt_dist_moe_backward(dist, ctx, backward_options, args, (size_t)n);
	}
	return KT_ERR_INVALID_ARGUMENT;
}

static inline kt_status ktgo_dist_ckpt(int save, kt_comm* comm, const char* dir, const kt_dist_ckpt_layer* layers,
                                       size_t num_layers, unsigned parts, uintptr_t progress) {
	kt_dist_ckpt_options o;
	kt_dist_ckpt_options_init(&o);
	o.parts = parts;
	if (progress) {
		o.progress = ktgo_progress;
		o.progress_user = (void*)progress;
	}
	return save ? kt_dist_ckpt_save(comm, dir, layers, num_layers, &o)
	            : kt_dist_ckpt_load(comm, dir, layers, num_layers, &o);
}
*/
import "C"

import (
	"fmt"
	"runtime/cgo"
	"time"
	"unsafe"
)

// Device is the kind of memory a communicator's collectives run on.
type Device int

// Devices of a communicator.
const (
	DeviceCPU  Device = C.kDLCPU
	DeviceCUDA Device = C.kDLCUDA
)

// Backends are what a backend string selects (kt_comm_backends).
type Backends struct {
	CPU, CUDA CommBackend // CommBackendNone where the string names none
	Device    Device      // DeviceCUDA when a CUDA backend is named
}

func backendsFromC(b *C.kt_comm_backends) Backends {
	return Backends{CPU: CommBackend(b.cpu), CUDA: CommBackend(b.cuda), Device: Device(b.device)}
}

// ParseBackend parses a backend string ("gloo", "nccl", "cuda:nccl,cpu:gloo")
// without creating anything; a malformed one is ErrInvalidArgument saying why.
func ParseBackend(backend string) (Backends, error) {
	s := C.CString(backend)
	defer C.free(unsafe.Pointer(s))
	var b C.kt_comm_backends
	b.struct_size = C.size_t(unsafe.Sizeof(b))
	if err := call(func() C.kt_status { return C.kt_comm_parse_backend(s, &b) }); err != nil {
		return Backends{}, err
	}
	return backendsFromC(&b), nil
}

// NCCLUniqueID makes a new NCCL id for CommOptions.NCCLUniqueID (on one rank,
// passed to the others by the host). ErrUnsupported without NCCL in the
// build or on the machine.
func NCCLUniqueID() ([]byte, error) {
	buf := C.malloc(C.KT_NCCL_UNIQUE_ID_BYTES)
	defer C.free(buf)
	if err := call(func() C.kt_status { return C.kt_comm_nccl_unique_id(buf, C.KT_NCCL_UNIQUE_ID_BYTES) }); err != nil {
		return nil, err
	}
	return C.GoBytes(buf, C.KT_NCCL_UNIQUE_ID_BYTES), nil
}

// Store is a host's key-value store the ranks rendezvous through (instead of
// a directory, CommOptions.StorePath). kt calls it only while NewComm runs,
// on NewComm's goroutine, with keys prefixed by CommOptions.StorePrefix.
type Store interface {
	Set(key string, value []byte) error
	// Get returns the value under key, or ok false when the key is not
	// there yet; kt asks again until the communicator's timeout.
	Get(key string) (value []byte, ok bool, err error)
}

// A store callback must not unwind into C: a panic becomes an error status.
func storeCall(fn func() C.int) (status C.int) {
	defer func() {
		if recover() != nil {
			status = -1
		}
	}()
	return fn()
}

//export ktgoStoreSet
func ktgoStoreSet(key *C.char, value unsafe.Pointer, size C.size_t, user C.uintptr_t) C.int {
	return storeCall(func() C.int {
		if cgo.Handle(user).Value().(Store).Set(C.GoString(key), C.GoBytes(value, C.int(size))) != nil {
			return -1
		}
		return 0
	})
}

//export ktgoStoreGet
func ktgoStoreGet(key *C.char, buffer unsafe.Pointer, capacity C.size_t, size *C.size_t, user C.uintptr_t) C.int {
	return storeCall(func() C.int {
		v, ok, err := cgo.Handle(user).Value().(Store).Get(C.GoString(key))
		if err != nil {
			return -1
		}
		if !ok {
			return 1
		}
		*size = C.size_t(len(v))
		if n := min64(int64(len(v)), int64(capacity)); n > 0 {
			copy(unsafe.Slice((*byte)(buffer), n), v)
		}
		return 0
	})
}

func min64(a, b int64) int64 {
	if a < b {
		return a
	}
	return b
}

// CommOptions are a rank's communicator settings; zero values keep kt's
// defaults. Give StorePath or Store.
type CommOptions struct {
	Backend     string // "" = "gloo"
	Rank        int
	WorldSize   int    // 0 = 1
	StorePath   string // Gloo's file store: a directory every rank reaches
	Store       Store
	StorePrefix string        // "" = "kt"
	Hostname    string        // Gloo: the address this rank listens on; "" = "127.0.0.1"
	Timeout     time.Duration // rendezvous and every collective; 0 = 30 s
	// NCCL: the ranks' common id (NCCLUniqueID on one rank), or nil when the
	// communicator also has a CPU backend (rank 0 then makes one).
	NCCLUniqueID []byte
	CUDADevice   *int // NCCL: this rank's CUDA device; nil = the current one
}

// Comm is a rank's communicator (kt_comm). Close it after the DistMoEs made
// on it (kt keeps it alive for them until they are closed).
type Comm struct {
	handle *C.kt_comm
}

// NewComm creates this rank's communicator: collective, every rank calls it
// with the same backend, world size and store. A backend this build or
// machine lacks is ErrUnsupported.
func NewComm(opts CommOptions) (*Comm, error) {
	var o C.kt_comm_options
	C.kt_comm_options_init(&o)
	var strings []*C.char
	cstr := func(s string) *C.char {
		p := C.CString(s)
		strings = append(strings, p)
		return p
	}
	defer func() {
		for _, p := range strings {
			C.free(unsafe.Pointer(p))
		}
	}()
	if opts.Backend != "" {
		o.backend = cstr(opts.Backend)
	}
	o.rank = C.int(opts.Rank)
	if opts.WorldSize != 0 {
		o.world_size = C.int(opts.WorldSize)
	}
	if opts.StorePath != "" {
		o.store_path = cstr(opts.StorePath)
	}
	if opts.StorePrefix != "" {
		o.store_prefix = cstr(opts.StorePrefix)
	}
	if opts.Hostname != "" {
		o.hostname = cstr(opts.Hostname)
	}
	if opts.Timeout != 0 {
		o.timeout_ms = C.int64_t(opts.Timeout.Milliseconds())
	}
	if opts.NCCLUniqueID != nil {
		id := C.CBytes(opts.NCCLUniqueID)
		defer C.free(id)
		o.nccl_unique_id = id
	}
	if opts.CUDADevice != nil {
		o.cuda_device = C.int(*opts.CUDADevice)
	}
	var store cgo.Handle
	if opts.Store != nil {
		store = cgo.NewHandle(opts.Store)
		defer store.Delete()
	}
	c := &Comm{}
	if err := call(func() C.kt_status { return C.ktgo_comm_create(&o, C.uintptr_t(store), &c.handle) }); err != nil {
		return nil, err
	}
	return c, nil
}

// Close closes the connections. Closing twice is a no-op.
func (c *Comm) Close() {
	if c.handle != nil {
		C.kt_comm_destroy(c.handle)
		c.handle = nil
	}
}

// CommInfo are a communicator's settings.
type CommInfo struct {
	Rank, WorldSize int
	Backends        Backends
	Timeout         time.Duration
	Usable          bool // false after a failed collective (ErrComm): close it
}

// Info reports the communicator's settings.
func (c *Comm) Info() (CommInfo, error) {
	if c.handle == nil {
		return CommInfo{}, closedError("communicator")
	}
	var i C.kt_comm_info
	i.struct_size = C.size_t(unsafe.Sizeof(i))
	if err := call(func() C.kt_status { return C.kt_comm_get_info(c.handle, &i) }); err != nil {
		return CommInfo{}, err
	}
	return CommInfo{Rank: int(i.rank), WorldSize: int(i.world_size), Backends: backendsFromC(&i.backends),
		Timeout: time.Duration(i.timeout_ms) * time.Millisecond, Usable: i.usable != 0}, nil
}

// Barrier returns when every rank reached it (collective).
func (c *Comm) Barrier() error {
	if c.handle == nil {
		return closedError("communicator")
	}
	return call(func() C.kt_status { return C.kt_comm_barrier(c.handle) })
}

// Broadcast copies root's t into every rank's t (collective; same dtype and
// shape on every rank).
func (c *Comm) Broadcast(t Tensor, root int) error {
	return c.distCall(C.KTGO_BROADCAST, C.int(root), nil, nil, nil, nil, []Arg{{Tensor: t}})
}

// Allgather writes every rank's in into out [world size, in's shape...],
// rank by rank (collective).
func (c *Comm) Allgather(in, out Tensor) error {
	return c.distCall(C.KTGO_ALLGATHER, 0, nil, nil, nil, nil, []Arg{{Tensor: in}, {Tensor: out}})
}

func (c *Comm) distCall(op, root C.int, dist *C.kt_dist_moe, ctx *C.kt_dist_context, saved **C.kt_dist_context,
	bo *C.kt_backward_options, args []Arg) error {
	if c.handle == nil {
		return closedError("communicator")
	}
	if len(args) > C.KTGO_DIST_MAX_ARGS {
		return &Error{Status: ErrInvalidArgument, Message: fmt.Sprintf("%d args; at most %d per call", len(args), C.KTGO_DIST_MAX_ARGS)}
	}
	return withArgs(args, func(n C.int, meta *C.ktgo_arg, d *[C.KTGO_MAX_ARGS]unsafe.Pointer) C.kt_status {
		return C.ktgo_dist_call(op, c.handle, root, dist, ctx, saved, bo, n, meta, d[0], d[1], d[2], d[3])
	})
}

// DistMoEOptions say how a DistMoE spreads over the ranks; nil or the zero
// value is owner mode with rank 0 as owner, gradients summed.
type DistMoEOptions struct {
	Mode        DistMode
	OwnerRank   int // DistOwner: the rank holding the layer
	GradAverage DistGradAverage
	// DistExpertParallel: the rank of each expert (the same on every rank),
	// or nil for an even contiguous split.
	ExpertRanks []int32
}

// DistMoE is one MoE layer spread over a communicator's ranks (kt_dist_moe).
type DistMoE struct {
	handle *C.kt_dist_moe
	comm   *Comm
	layer  *MoE
}

// NewDistMoE creates the distributed layer (collective; every rank passes the
// same layer options, MaxTokens per rank, and the same opts). engine: the
// owner's engine in owner mode (nil on the other ranks), every rank's in
// expert-parallel mode. opts may be nil.
func (c *Comm) NewDistMoE(engine *Engine, layer MoEOptions, opts *DistMoEOptions) (*DistMoE, error) {
	if c.handle == nil {
		return nil, closedError("communicator")
	}
	var e *C.kt_engine
	if engine != nil {
		if engine.handle == nil {
			return nil, closedError("engine")
		}
		e = engine.handle
	}
	lo := layer.toC()
	var do C.kt_dist_moe_options
	C.kt_dist_moe_options_init(&do)
	if opts != nil {
		do.mode = C.kt_dist_mode(opts.Mode)
		do.owner_rank = C.int(opts.OwnerRank)
		do.grad_average = C.kt_dist_grad_average(opts.GradAverage)
		if opts.ExpertRanks != nil {
			// C memory: the options struct may hold no Go pointer.
			n := C.size_t(len(opts.ExpertRanks)) * C.size_t(unsafe.Sizeof(C.int32_t(0)))
			ranks := C.malloc(n + 1)
			defer C.free(ranks)
			copy(unsafe.Slice((*int32)(ranks), len(opts.ExpertRanks)), opts.ExpertRanks)
			do.expert_ranks = (*C.int32_t)(ranks)
		}
	}
	d := &DistMoE{comm: c}
	if err := call(func() C.kt_status { return C.kt_dist_moe_create(c.handle, e, &lo, &do, &d.handle) }); err != nil {
		return nil, err
	}
	var local *C.kt_moe
	if err := call(func() C.kt_status { return C.kt_dist_moe_layer(d.handle, &local) }); err != nil {
		C.kt_dist_moe_destroy(d.handle)
		return nil, err
	}
	if local != nil {
		d.layer = &MoE{handle: local, borrowed: true}
	}
	return d, nil
}

// Layer is the layer this rank computes with (nil on a rank without one),
// owned by d: load weights, bind parameters, set hooks and create optimizers
// through it; DistMoE.Close frees it. An expert-parallel rank's holds its
// experts only, as local experts 0..n-1 (LocalExperts), with top-k 1.
func (d *DistMoE) Layer() *MoE { return d.layer }

// LocalExperts are the global ids of this rank's experts in local order.
func (d *DistMoE) LocalExperts() ([]int64, error) {
	if d.handle == nil {
		return nil, closedError("distributed layer")
	}
	var count C.int64_t
	if err := call(func() C.kt_status { return C.kt_dist_moe_local_experts(d.handle, nil, 0, &count) }); err != nil {
		return nil, err
	}
	out := make([]int64, count)
	if count == 0 {
		return out, nil
	}
	err := call(func() C.kt_status {
		return C.kt_dist_moe_local_experts(d.handle, (*C.int64_t)(unsafe.Pointer(&out[0])), count, &count)
	})
	return out[:count], err
}

// Forward computes y for this rank's tokens (collective; T <= MaxTokens).
func (d *DistMoE) Forward(x, ids, routeWeights, y Tensor) error {
	if d.handle == nil {
		return closedError("distributed layer")
	}
	return d.comm.distCall(C.KTGO_DIST_FORWARD, 0, d.handle, nil, nil, nil, forwardArgs(x, ids, routeWeights, y))
}

// ForwardTrain is Forward keeping a context for Backward.
func (d *DistMoE) ForwardTrain(x, ids, routeWeights, y Tensor) (*DistContext, error) {
	if d.handle == nil {
		return nil, closedError("distributed layer")
	}
	c := &DistContext{}
	if err := d.comm.distCall(C.KTGO_DIST_FORWARD, 0, d.handle, nil, &c.handle, nil,
		forwardArgs(x, ids, routeWeights, y)); err != nil {
		return nil, err
	}
	return c, nil
}

// Backward of ctx's forward (collective: every rank passes its context of
// the same forward, and the same opts). args as MoE.Backward.
func (d *DistMoE) Backward(ctx *DistContext, opts *BackwardOptions, args ...Arg) error {
	if d.handle == nil {
		return closedError("distributed layer")
	}
	if ctx == nil || ctx.handle == nil {
		return &Error{Status: ErrContext, Message: "context is nil or closed"}
	}
	o := opts.toC()
	return d.comm.distCall(C.KTGO_DIST_BACKWARD, 0, d.handle, ctx.handle, nil, &o, args)
}

// Close frees the layer, its local layer and its contexts (not collective).
// Closing twice is a no-op.
func (d *DistMoE) Close() {
	if d.handle == nil {
		return
	}
	C.kt_dist_moe_destroy(d.handle)
	d.handle = nil
	if d.layer != nil {
		forgetGradHook(d.layer.handle)
		d.layer.handle = nil
	}
}

// DistContext is what a DistMoE forward saved for its backward.
type DistContext struct {
	handle *C.kt_dist_context
}

// Close releases the context. Closing twice is a no-op.
func (c *DistContext) Close() {
	if c != nil && c.handle != nil {
		C.kt_dist_context_release(c.handle)
		c.handle = nil
	}
}

// DistCheckpointLayer is one layer of a distributed checkpoint on this rank.
type DistCheckpointLayer struct {
	Layer     int64      // its number in the checkpoint
	Dist      *DistMoE   // this rank's distributed layer, on the same communicator
	Optimizer *Optimizer // nil, or this rank's optimizer over Dist.Layer()
}

// DistCheckpointOptions: Parts (DistCkptWeights | DistCkptAdapter |
// DistCkptOptimizer, 0 = what the layers have) and Progress, called on the
// calling goroutine with the bytes of this rank's file done and in all.
type DistCheckpointOptions struct {
	Parts    uint32
	Progress func(done, total int64)
}

//export ktgoProgress
func ktgoProgress(done, total C.int64_t, user C.uintptr_t) {
	cgo.Handle(user).Value().(func(done, total int64))(int64(done), int64(total))
}

// SaveCheckpoint saves the layers' state into dir, published atomically
// (collective: every rank passes the same dir and layer numbers). opts may
// be nil.
func (c *Comm) SaveCheckpoint(dir string, layers []DistCheckpointLayer, opts *DistCheckpointOptions) error {
	return c.checkpoint(1, dir, layers, opts)
}

// LoadCheckpoint loads the checkpoint in dir into the layers, which may have
// another world size, mode or expert map than the ranks that saved it
// (collective, as SaveCheckpoint).
func (c *Comm) LoadCheckpoint(dir string, layers []DistCheckpointLayer, opts *DistCheckpointOptions) error {
	return c.checkpoint(0, dir, layers, opts)
}

func (c *Comm) checkpoint(save C.int, dir string, layers []DistCheckpointLayer, opts *DistCheckpointOptions) error {
	if c.handle == nil {
		return closedError("communicator")
	}
	entries := make([]C.kt_dist_ckpt_layer, len(layers)+1)
	for i, l := range layers {
		entries[i].layer = C.int64_t(l.Layer)
		if l.Dist != nil {
			if l.Dist.handle == nil {
				return closedError(fmt.Sprintf("distributed layer %d", l.Layer))
			}
			entries[i].dist = l.Dist.handle
		}
		if l.Optimizer != nil {
			if l.Optimizer.handle == nil {
				return closedError(fmt.Sprintf("optimizer of layer %d", l.Layer))
			}
			entries[i].optimizer = l.Optimizer.handle
		}
	}
	var parts C.uint
	var progress cgo.Handle
	if opts != nil {
		parts = C.uint(opts.Parts)
		if opts.Progress != nil {
			progress = cgo.NewHandle(opts.Progress)
			defer progress.Delete()
		}
	}
	d := C.CString(dir)
	defer C.free(unsafe.Pointer(d))
	return call(func() C.kt_status {
		return C.ktgo_dist_ckpt(save, c.handle, d, &entries[0], C.size_t(len(layers)), parts, C.uintptr_t(progress))
	})
}
