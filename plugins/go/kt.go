// Package kt is the Go binding of kt, the CPU engine for the routed experts of
// Mixture-of-Experts models. It is a thin layer over the C ABI (kt_c_api.h):
// every failed call returns an *Error carrying kt's status and message, and
// every handle is released by an explicit Close (there are no finalizers: a
// handle's lifetime is the program's decision, as in C).
//
// Build: the header and libkt are found the usual way (installed in /usr, or
// CGO_CFLAGS="$(pkg-config --cflags kt)" CGO_LDFLAGS="$(pkg-config --libs kt)").
package kt

/*
#cgo LDFLAGS: -lkt
#include <stdlib.h>
#include <string.h>
#include <kt_c_api.h>

#include "ktgo.h"

enum { KTGO_LOAD = 0, KTGO_FORWARD = 1, KTGO_BACKWARD = 2, KTGO_BIND = 3, KTGO_READ_WEIGHTS = 4 };

static kt_status ktgo_call(int op, kt_moe* moe, kt_context* ctx, kt_context** saved,
                           const kt_backward_options* backward_options, int n, const ktgo_arg* meta,
                           void* d0, void* d1, void* d2, void* d3, void* d4, void* d5, void* d6,
                           void* d7, void* d8, void* d9, void* d10, void* d11, void* d12,
                           void* d13, void* d14, void* d15) {
	void* data[KTGO_MAX_ARGS] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15};
	DLTensor tensors[KTGO_MAX_ARGS];
	int64_t shapes[KTGO_MAX_ARGS][KTGO_MAX_DIMS];
	kt_arg args[KTGO_MAX_ARGS];
	ktgo_fill(n, meta, data, tensors, shapes, args);
	switch (op) {
	case KTGO_LOAD: return kt_moe_load_weights(moe, NULL, args, (size_t)n);
	case KTGO_FORWARD: return kt_moe_forward(moe, args, (size_t)n, saved);
	case KTGO_BACKWARD: return kt_moe_backward(moe, ctx, backward_options, args, (size_t)n);
	case KTGO_BIND: return kt_moe_bind(moe, args, (size_t)n);
	case KTGO_READ_WEIGHTS: return kt_moe_read_weights(moe, args, (size_t)n);
	}
	return KT_ERR_INVALID_ARGUMENT;
}

enum { KTGO_READ_LAYER = 0, KTGO_READ_ADAPTER = 1 };

// Readers write into Go memory: its pointers cross as direct arguments.
static kt_status ktgo_read(int op, const kt_ckpt* ckpt, const char* dir, int64_t layer, int n,
                           const ktgo_arg* meta, void* d0, void* d1, void* d2, void* d3, void* d4,
                           void* d5, void* d6, void* d7, void* d8, void* d9, void* d10, void* d11,
                           void* d12, void* d13, void* d14, void* d15) {
	void* data[KTGO_MAX_ARGS] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15};
	DLTensor tensors[KTGO_MAX_ARGS];
	int64_t shapes[KTGO_MAX_ARGS][KTGO_MAX_DIMS];
	kt_arg args[KTGO_MAX_ARGS];
	ktgo_fill(n, meta, data, tensors, shapes, args);
	if (op == KTGO_READ_LAYER) return kt_ckpt_read_layer(ckpt, layer, args, (size_t)n);
	return kt_ckpt_adapter_read(dir, layer, args, (size_t)n);
}

// Writers take any number of tensors, so their data are copies in C memory
// (data is a C array of C pointers); counts[l] tensors belong to layers[l].
static kt_status ktgo_write(const char* dir, const kt_ckpt_write_options* options,
                            const kt_ckpt_adapter_config* config, int num_layers,
                            const int64_t* layers, const int* counts, int n, const ktgo_arg* meta,
                            void* const* data) {
	DLTensor* tensors = calloc((size_t)(n > 0 ? n : 1), sizeof(DLTensor));
	int64_t (*shapes)[KTGO_MAX_DIMS] = calloc((size_t)(n > 0 ? n : 1), sizeof(*shapes));
	kt_arg* args = calloc((size_t)(n > 0 ? n : 1), sizeof(kt_arg));
	kt_ckpt_layer_args* la = calloc((size_t)(num_layers > 0 ? num_layers : 1), sizeof(kt_ckpt_layer_args));
	kt_status st = KT_ERR_OUT_OF_MEMORY;
	if (tensors && shapes && args && la) {
		ktgo_fill(n, meta, data, tensors, shapes, args);
		int at = 0;
		for (int l = 0; l < num_layers; ++l) {
			la[l].layer = layers[l];
			la[l].args = args + at;
			la[l].num_args = (size_t)counts[l];
			at += counts[l];
		}
		st = config ? kt_ckpt_adapter_write(dir, config, la, (size_t)num_layers)
		            : kt_ckpt_write_experts(dir, options, la, (size_t)num_layers);
	}
	free(tensors);
	free(shapes);
	free(args);
	free(la);
	return st;
}
*/
import "C"

import (
	"fmt"
	"runtime"
	"unsafe"
)

// ABIVersion is the ABI major this package was compiled against.
const ABIVersion = int(C.KT_ABI_VERSION)

// LibraryABIVersion is the ABI major of the loaded libkt.
func LibraryABIVersion() int { return int(C.kt_abi_version()) }

// Version is the loaded library's version string ("1.0.0").
func Version() string { return C.GoString(C.kt_version()) }

// BuildInfo describes the loaded library's compiler, build type and kernels.
func BuildInfo() string { return C.GoString(C.kt_build_info()) }

// String is the status's name ("KT_ERR_SHAPE").
func (s Status) String() string { return C.GoString(C.kt_status_string(C.kt_status(s))) }

// Error is a failed kt call: its status and kt's message (which names the
// call and the argument).
type Error struct {
	Status  Status
	Message string
}

func (e *Error) Error() string { return fmt.Sprintf("kt: %s: %s", e.Status, e.Message) }

// Is makes errors.Is(err, &kt.Error{Status: kt.ErrShape}) match on the status.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Status == e.Status && t.Message == ""
}

// call runs one kt call and turns its status into nil or an *Error. kt's
// message is thread-local, so the goroutine stays on its OS thread from the
// call until the message is read.
func call(fn func() C.kt_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	status := fn()
	if status == C.KT_OK {
		return nil
	}
	return &Error{Status: Status(status), Message: C.GoString(C.kt_last_error())}
}

func closedError(what string) error {
	return &Error{Status: ErrInvalidHandle, Message: what + " is closed"}
}

// EngineOptions are the settings of an engine; the zero value of a field
// means kt's default.
type EngineOptions struct {
	NumThreads int  // worker threads; 0 = one per CPU of the affinity mask
	NoPinning  bool // do not pin workers to CPUs
	Verbosity  int  // log level to stderr; 0 = from KT_VERBOSE
	// FP32Precision keeps fp32 activations fp32 in the weight GEMMs
	// (KT_PRECISION_FP32); by default the avx512bf16 kernels round them to bf16.
	FP32Precision bool
	// HostOpenMP computes on the OpenMP threads of the calling thread
	// instead of kt's own workers (kt_engine_options.host_openmp).
	HostOpenMP bool
	// NUMA splits workers and experts over the NUMA nodes of the affinity
	// mask (KT_NUMA_AUTO; the same bits as without). NUMANodeWorkers says
	// the nodes in use.
	NUMA bool
}

// Engine owns a worker pool. Close it after every layer made on it.
type Engine struct {
	handle *C.kt_engine
}

// NewEngine creates an engine. opts may be nil.
func NewEngine(opts *EngineOptions) (*Engine, error) {
	if ABIVersion != LibraryABIVersion() {
		return nil, &Error{Status: ErrUnsupported, Message: fmt.Sprintf(
			"libkt has ABI %d, this package was built for ABI %d", LibraryABIVersion(), ABIVersion)}
	}
	var o C.kt_engine_options
	C.kt_engine_options_init(&o)
	if opts != nil {
		o.num_threads = C.int(opts.NumThreads)
		if opts.NoPinning {
			o.pin_threads = 0
		}
		if opts.Verbosity != 0 {
			o.verbosity = C.int(opts.Verbosity)
		}
		if opts.FP32Precision {
			o.precision = C.KT_PRECISION_FP32
		}
		if opts.HostOpenMP {
			o.host_openmp = 1
		}
		if opts.NUMA {
			o.numa = C.KT_NUMA_AUTO
		}
	}
	e := &Engine{}
	if err := call(func() C.kt_status { return C.kt_engine_create(&o, &e.handle) }); err != nil {
		return nil, err
	}
	return e, nil
}

// NumThreads is the engine's worker count.
func (e *Engine) NumThreads() (int, error) {
	info, err := e.info()
	return int(info.num_threads), err
}

// KernelName names the GEMM micro-kernel the engine runs.
func (e *Engine) KernelName() (string, error) {
	info, err := e.info()
	if err != nil {
		return "", err
	}
	return C.GoString(info.kernel_name), nil
}

// NUMANodeWorkers is the workers of each NUMA node the engine is split
// over, in node order (one entry unless NUMA found several nodes).
func (e *Engine) NUMANodeWorkers() ([]int, error) {
	info, err := e.info()
	if err != nil || info.numa_nodes <= 0 || info.numa_node_workers == nil {
		return nil, err
	}
	nodes := unsafe.Slice(info.numa_node_workers, int(info.numa_nodes))
	out := make([]int, len(nodes))
	for i, n := range nodes {
		out[i] = int(n)
	}
	return out, nil
}

func (e *Engine) info() (C.kt_engine_info, error) {
	var info C.kt_engine_info
	if e.handle == nil {
		return info, closedError("engine")
	}
	info.struct_size = C.size_t(unsafe.Sizeof(info))
	err := call(func() C.kt_status { return C.kt_engine_get_info(e.handle, &info) })
	return info, err
}

// Close frees the engine. Closing twice is a no-op; closing while layers
// still use the engine fails and leaves it open.
func (e *Engine) Close() error {
	if e.handle == nil {
		return nil
	}
	if err := call(func() C.kt_status { return C.kt_engine_destroy(e.handle) }); err != nil {
		return err
	}
	e.handle = nil
	return nil
}

// String is kt's name of the format ("bf16", "int8_channel", "int4_g32",
// "fp8_b128", "mxfp4", "int4_g128", "int4_g32_zp", "int4_g128_zp").
func (f WeightFormat) String() string {
	return C.GoString(C.kt_weight_format_name(C.kt_weight_format(f)))
}

// MoEOptions are a layer's shapes and settings. Zero-valued optional fields
// keep kt's defaults (MaxTokens 1024, SiLU, no clamp, inference mode, bf16).
type MoEOptions struct {
	NumExperts, TopK, Hidden, Intermediate int64
	MaxTokens                              int64
	Activation                             Activation
	ActAlpha, ActLimit                     float32
	HasBias                                bool
	Mode                                   Mode
	LoRARank                               int64
	LoRAAlpha                              float32
	UseRSLoRA                              bool   // scale alpha/sqrt(rank) instead of alpha/rank
	LoRATargets                            uint32 // ProjGate | ProjUp | ProjDown; 0 = all (ProjAll)
	WeightFormat                           WeightFormat
	// Int8Compute: an inference layer on an integer base (int8_channel,
	// int4_g32, int4_g128, int4_g32_zp, int4_g128_zp, mxfp4) multiplies int8 activations (KT_COMPUTE_INT8; forward
	// only, the error stated in kt_c_api.h, "Int8 compute").
	Int8Compute bool
}

// MoEInfo is what a layer reports of itself (kt_moe_get_info).
type MoEInfo struct {
	NumExperts, Hidden, Intermediate int64
	WeightFormat                     WeightFormat
	WeightBytes                      int64 // the stored base weights, scales and padding included
	NumWeights                       int64 // E * 3 * H * I
	NumLoaded                        int64
	Int8Compute                      bool // KT_COMPUTE_INT8
}

// toC is the kt_moe_options of opts, kt's defaults where a field is zero.
func (opts MoEOptions) toC() C.kt_moe_options {
	var o C.kt_moe_options
	C.kt_moe_options_init(&o)
	o.num_experts = C.int64_t(opts.NumExperts)
	o.top_k = C.int64_t(opts.TopK)
	o.hidden = C.int64_t(opts.Hidden)
	o.intermediate = C.int64_t(opts.Intermediate)
	if opts.MaxTokens != 0 {
		o.max_tokens = C.int64_t(opts.MaxTokens)
	}
	o.activation = C.kt_activation(opts.Activation)
	if opts.ActAlpha != 0 {
		o.act_alpha = C.float(opts.ActAlpha)
	}
	o.act_limit = C.float(opts.ActLimit)
	if opts.HasBias {
		o.has_bias = 1
	}
	o.mode = C.kt_mode(opts.Mode)
	if opts.LoRARank != 0 {
		o.lora_rank = C.int64_t(opts.LoRARank)
	}
	if opts.LoRAAlpha != 0 {
		o.lora_alpha = C.float(opts.LoRAAlpha)
	}
	if opts.UseRSLoRA {
		o.use_rslora = 1
	}
	if opts.LoRATargets != 0 {
		o.lora_targets = C.uint(opts.LoRATargets)
	}
	o.weight_format = C.kt_weight_format(opts.WeightFormat)
	if opts.Int8Compute {
		o.compute = C.KT_COMPUTE_INT8
	}
	return o
}

// MoE is one MoE layer's routed experts. Close it before its engine.
type MoE struct {
	handle *C.kt_moe
	// borrowed: the layer of a DistMoE, which frees it (Close leaves it).
	borrowed bool
}

// NewMoE creates a layer on the engine; load its weights before a forward.
func (e *Engine) NewMoE(opts MoEOptions) (*MoE, error) {
	if e.handle == nil {
		return nil, closedError("engine")
	}
	o := opts.toC()
	m := &MoE{}
	if err := call(func() C.kt_status { return C.kt_moe_create(e.handle, &o, &m.handle) }); err != nil {
		return nil, err
	}
	return m, nil
}

// Close frees the layer and its outstanding contexts (the layer of a DistMoE
// is freed by DistMoE.Close instead). Closing twice is a no-op.
func (m *MoE) Close() error {
	if m.handle != nil && !m.borrowed {
		C.kt_moe_destroy(m.handle)
		forgetGradHook(m.handle)
		m.handle = nil
	}
	return nil
}

// Tensor is a compact row-major view of a Go slice with a shape; it borrows
// the slice for the calls it is passed to.
type Tensor struct {
	data  unsafe.Pointer
	code  int
	bits  int
	count int64
	shape []int64
}

// Float32 views data as a float32 tensor of the given shape.
func Float32(data []float32, shape ...int64) Tensor {
	return view(first(data), len(data), C.kDLFloat, 32, shape)
}

// Int32 views data as an int32 tensor (expert ids).
func Int32(data []int32, shape ...int64) Tensor {
	return view(first(data), len(data), C.kDLInt, 32, shape)
}

// Int64 views data as an int64 tensor (expert ids, expert maps).
func Int64(data []int64, shape ...int64) Tensor {
	return view(first(data), len(data), C.kDLInt, 64, shape)
}

// BFloat16 views raw bf16 bit patterns as a bfloat16 tensor.
func BFloat16(data []uint16, shape ...int64) Tensor {
	return view(first(data), len(data), C.kDLBfloat, 16, shape)
}

// first is the address of a slice's first element (nil when empty: T = 0 is a
// valid call).
func first[E any](data []E) unsafe.Pointer {
	if len(data) == 0 {
		return nil
	}
	return unsafe.Pointer(&data[0])
}

func view(data unsafe.Pointer, n int, code, bits int, shape []int64) Tensor {
	return Tensor{data: data, code: code, bits: bits, count: int64(n), shape: append([]int64(nil), shape...)}
}

// Arg is one named argument.
type Arg struct {
	ID     ArgID
	Tensor Tensor
}

// run passes args through ktgo_call: descriptions in Go memory without
// pointers, data pointers as direct arguments (both allowed by cgo's rules).
func (m *MoE) run(op C.int, ctx *C.kt_context, saved **C.kt_context,
	bo *C.kt_backward_options, args []Arg) error {
	if m.handle == nil {
		return closedError("moe")
	}
	return withArgs(args, func(n C.int, meta *C.ktgo_arg, d *[C.KTGO_MAX_ARGS]unsafe.Pointer) C.kt_status {
		return C.ktgo_call(op, m.handle, ctx, saved, bo, n, meta, d[0], d[1], d[2], d[3], d[4], d[5],
			d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13], d[14], d[15])
	})
}

// withArgs describes args and runs fn with the descriptions and the data
// pointers, turning its status into an error; the slices stay alive until
// fn returned.
func withArgs(args []Arg, fn func(n C.int, meta *C.ktgo_arg, data *[C.KTGO_MAX_ARGS]unsafe.Pointer) C.kt_status) error {
	if len(args) > C.KTGO_MAX_ARGS {
		return &Error{Status: ErrInvalidArgument, Message: fmt.Sprintf("%d args; at most %d per call", len(args), C.KTGO_MAX_ARGS)}
	}
	var meta [C.KTGO_MAX_ARGS]C.ktgo_arg
	var data [C.KTGO_MAX_ARGS]unsafe.Pointer
	if err := describe(args, meta[:], data[:]); err != nil {
		return err
	}
	err := call(func() C.kt_status { return fn(C.int(len(args)), &meta[0], &data) })
	runtime.KeepAlive(args)
	return err
}

// describe fills meta (no pointers) and data for args, checking each shape
// against its slice.
func describe(args []Arg, meta []C.ktgo_arg, data []unsafe.Pointer) error {
	for i, a := range args {
		t := a.Tensor
		if len(t.shape) > C.KTGO_MAX_DIMS {
			return &Error{Status: ErrShape, Message: fmt.Sprintf("arg %d: rank %d above %d", a.ID, len(t.shape), C.KTGO_MAX_DIMS)}
		}
		elements := int64(1)
		for d, extent := range t.shape {
			meta[i].shape[d] = C.int64_t(extent)
			elements *= extent
		}
		// kt checks shapes against the layer; this checks them against the slice.
		if elements != t.count {
			return &Error{Status: ErrShape, Message: fmt.Sprintf(
				"arg %d: shape %v has %d elements, the slice %d", a.ID, t.shape, elements, t.count)}
		}
		meta[i].id = C.int(a.ID)
		meta[i].code = C.int(t.code)
		meta[i].bits = C.int(t.bits)
		meta[i].ndim = C.int(len(t.shape))
		data[i] = t.data
	}
	return nil
}

// LoadWeights loads stacked expert weights: ArgWGate, ArgWUp [E,I,H] and
// ArgWDown [E,H,I] (or ArgWGateUp), biases when the layer has them.
func (m *MoE) LoadWeights(args ...Arg) error { return m.run(C.KTGO_LOAD, nil, nil, nil, args) }

// ReadWeights copies the base weights the layer computes with (dequantized
// for a quantized base) into ArgWGate, ArgWUp [E,I,H], ArgWDown [E,H,I] and
// biases (float32 or bfloat16 slices).
func (m *MoE) ReadWeights(args ...Arg) error { return m.run(C.KTGO_READ_WEIGHTS, nil, nil, nil, args) }

// Info reports the layer's storage format, bytes and loaded experts.
func (m *MoE) Info() (MoEInfo, error) {
	if m.handle == nil {
		return MoEInfo{}, closedError("moe")
	}
	var i C.kt_moe_info
	i.struct_size = C.size_t(unsafe.Sizeof(i))
	if err := call(func() C.kt_status { return C.kt_moe_get_info(m.handle, &i) }); err != nil {
		return MoEInfo{}, err
	}
	return MoEInfo{NumExperts: int64(i.num_experts), Hidden: int64(i.hidden), Intermediate: int64(i.intermediate),
		WeightFormat: WeightFormat(i.weight_format), WeightBytes: int64(i.weight_bytes),
		NumWeights: int64(i.num_weights), NumLoaded: int64(i.num_loaded), Int8Compute: i.compute == C.KT_COMPUTE_INT8}, nil
}

// Bind binds trainable parameters and gradient buffers (LoRA or full mode).
// kt retains the memory until the same id is bound again or the layer is
// closed: keep those slices alive and unmoved (heap slices are) that long.
func (m *MoE) Bind(args ...Arg) error { return m.run(C.KTGO_BIND, nil, nil, nil, args) }

// Forward computes y = MoE(x) without saving anything for backward.
func (m *MoE) Forward(x, ids, routeWeights, y Tensor) error {
	return m.run(C.KTGO_FORWARD, nil, nil, nil, forwardArgs(x, ids, routeWeights, y))
}

// ForwardTrain computes y and returns the context a Backward needs. Close the
// context after its backward (or instead of it).
func (m *MoE) ForwardTrain(x, ids, routeWeights, y Tensor) (*Context, error) {
	c := &Context{}
	if err := m.run(C.KTGO_FORWARD, nil, &c.handle, nil, forwardArgs(x, ids, routeWeights, y)); err != nil {
		return nil, err
	}
	return c, nil
}

func forwardArgs(x, ids, routeWeights, y Tensor) []Arg {
	return []Arg{{ArgX, x}, {ArgIDs, ids}, {ArgRouteWeights, routeWeights}, {ArgY, y}}
}

// BackwardOptions scale and accumulate parameter gradients.
type BackwardOptions struct {
	GradScale    float32 // 0 = 1
	Accumulate   bool    // add into the gradient buffers instead of overwriting
	NoParamGrads bool    // only dx and routing-weight gradients
}

// Backward runs the backward of ctx's forward. args: ArgDY (required), ArgDX
// and ArgDRouteWeights (optional outputs). opts may be nil. ctx is spent.
func (m *MoE) Backward(ctx *Context, opts *BackwardOptions, args ...Arg) error {
	if ctx == nil || ctx.handle == nil {
		return &Error{Status: ErrContext, Message: "context is nil or closed"}
	}
	o := opts.toC()
	return m.run(C.KTGO_BACKWARD, ctx.handle, nil, &o, args)
}

// toC is the kt_backward_options of opts (kt's defaults for nil).
func (opts *BackwardOptions) toC() C.kt_backward_options {
	var o C.kt_backward_options
	C.kt_backward_options_init(&o)
	if opts != nil {
		if opts.GradScale != 0 {
			o.grad_scale = C.float(opts.GradScale)
		}
		if opts.Accumulate {
			o.accumulate = C.KT_GRAD_ACCUMULATE
		}
		if opts.NoParamGrads {
			o.param_grads = 0
		}
	}
	return o
}

// Context holds what a training forward saved for its backward.
type Context struct {
	handle *C.kt_context
}

// Close releases the context. Closing twice is a no-op.
func (c *Context) Close() {
	if c != nil && c.handle != nil {
		C.kt_context_release(c.handle)
		c.handle = nil
	}
}

// ------------------------------------------------ packed caches, checkpoints

// SavePacked writes the layer's packed weights to one file (atomically replaced).
func (m *MoE) SavePacked(path string) error {
	if m.handle == nil {
		return closedError("moe")
	}
	p := C.CString(path)
	defer C.free(unsafe.Pointer(p))
	return call(func() C.kt_status { return C.kt_moe_save_packed(m.handle, p) })
}

// LoadPacked replaces the layer's weights with a packed cache's (inference and
// LoRA mode read them from a read-only mapping of the file); verifyChecksums
// false checks the header only.
func (m *MoE) LoadPacked(path string, verifyChecksums bool) error {
	if m.handle == nil {
		return closedError("moe")
	}
	p := C.CString(path)
	defer C.free(unsafe.Pointer(p))
	flags := C.uint(0)
	if !verifyChecksums {
		flags = C.KT_PACKED_SKIP_CHECKSUMS
	}
	return call(func() C.kt_status { return C.kt_moe_load_packed(m.handle, p, flags) })
}

// PackedInfo is what a packed cache file holds (kt_packed_read_info).
type PackedInfo struct {
	NumExperts, Hidden, Intermediate int64
	HasBias                          bool
	WeightFormat                     WeightFormat
	NumLoaded                        int64
	WeightBytes                      int64 // the stored weights: codes, scales and padding
	FileBytes                        int64
	FormatVersion                    int
}

// ReadPackedInfo reads a packed cache's header and loaded flags.
func ReadPackedInfo(path string) (PackedInfo, error) {
	p := C.CString(path)
	defer C.free(unsafe.Pointer(p))
	var i C.kt_packed_info
	i.struct_size = C.size_t(unsafe.Sizeof(i))
	if err := call(func() C.kt_status { return C.kt_packed_read_info(p, &i) }); err != nil {
		return PackedInfo{}, err
	}
	return PackedInfo{int64(i.num_experts), int64(i.hidden), int64(i.intermediate), i.has_bias != 0,
		WeightFormat(i.weight_format), int64(i.num_loaded), int64(i.weight_bytes), int64(i.file_bytes),
		int(i.format_version)}, nil
}

// Checkpoint is an open Hugging Face checkpoint directory (memory-mapped and
// validated, read-only). Close it after use.
type Checkpoint struct {
	handle *C.kt_ckpt
}

// CheckpointInfo describes a checkpoint directory.
type CheckpointInfo struct {
	Architecture, ModelType                              string
	Layout                                               CkptLayout
	NumMoELayers, NumTensors, NumFiles, TotalBytes, TopK int64
}

// LayerInfo describes one MoE layer of a checkpoint.
type LayerInfo struct {
	Layer, NumExperts, Hidden, Intermediate int64
	HasBias                                 bool
	Layout                                  CkptLayout
	Format, WeightDType                     string // "dense", "BF16", ...
	Loadable                                bool
	Bytes                                   int64
	WeightFormat                            WeightFormat // the layer format that holds it as stored
	GroupSize                               int64        // inputs per scale (fp8: 128), 0 if dense
	NumTensors                              int64        // checkpoint tensors of its routed experts
}

// OpenCheckpoint opens the checkpoint in dir.
func OpenCheckpoint(dir string) (*Checkpoint, error) {
	d := C.CString(dir)
	defer C.free(unsafe.Pointer(d))
	c := &Checkpoint{}
	if err := call(func() C.kt_status { return C.kt_ckpt_open(d, &c.handle) }); err != nil {
		return nil, err
	}
	return c, nil
}

// Close unmaps the files. Closing twice is a no-op.
func (c *Checkpoint) Close() {
	if c.handle != nil {
		C.kt_ckpt_close(c.handle)
		c.handle = nil
	}
}

// Info summarises the checkpoint.
func (c *Checkpoint) Info() (CheckpointInfo, error) {
	if c.handle == nil {
		return CheckpointInfo{}, closedError("checkpoint")
	}
	var i C.kt_ckpt_info
	i.struct_size = C.size_t(unsafe.Sizeof(i))
	if err := call(func() C.kt_status { return C.kt_ckpt_get_info(c.handle, &i) }); err != nil {
		return CheckpointInfo{}, err
	}
	return CheckpointInfo{C.GoString(i.architecture), C.GoString(i.model_type), CkptLayout(i.layout),
		int64(i.num_moe_layers), int64(i.num_tensors), int64(i.num_files), int64(i.total_bytes),
		int64(i.top_k)}, nil
}

// Layers describes the MoE layers, ordered by layer number.
func (c *Checkpoint) Layers() ([]LayerInfo, error) {
	info, err := c.Info()
	if err != nil {
		return nil, err
	}
	out := make([]LayerInfo, 0, info.NumMoELayers)
	for index := int64(0); index < info.NumMoELayers; index++ {
		var l C.kt_ckpt_layer_info
		l.struct_size = C.size_t(unsafe.Sizeof(l))
		if err := call(func() C.kt_status { return C.kt_ckpt_get_layer_info(c.handle, C.int64_t(index), &l) }); err != nil {
			return nil, err
		}
		out = append(out, LayerInfo{int64(l.layer), int64(l.num_experts), int64(l.hidden),
			int64(l.intermediate), l.has_bias != 0, CkptLayout(l.layout),
			C.GoString(C.kt_ckpt_format_name(l.format)), C.GoString(C.kt_ckpt_dtype_name(l.weight_dtype)),
			l.loadable != 0, int64(l.bytes), WeightFormat(l.weight_format), int64(l.group_size),
			int64(l.num_tensors)})
	}
	return out, nil
}

// MoEOptions are the layer options for layer L (shapes, bias, activation,
// top_k, the weight format that holds it as stored); set Mode and LoRA
// fields before NewMoE.
func (c *Checkpoint) MoEOptions(layer int64) (MoEOptions, error) {
	if c.handle == nil {
		return MoEOptions{}, closedError("checkpoint")
	}
	var o C.kt_moe_options
	C.kt_moe_options_init(&o)
	if err := call(func() C.kt_status { return C.kt_ckpt_moe_options(c.handle, C.int64_t(layer), &o) }); err != nil {
		return MoEOptions{}, err
	}
	return MoEOptions{NumExperts: int64(o.num_experts), TopK: int64(o.top_k), Hidden: int64(o.hidden),
		Intermediate: int64(o.intermediate), MaxTokens: int64(o.max_tokens),
		Activation: Activation(o.activation), ActAlpha: float32(o.act_alpha),
		ActLimit: float32(o.act_limit), HasBias: o.has_bias != 0,
		WeightFormat: WeightFormat(o.weight_format)}, nil
}

// LoadLayer loads layer L's routed experts into m straight from the mapped
// files: LoadLayerWith with kt's defaults (a quantized layer loads only into
// a layer of its own format).
func (c *Checkpoint) LoadLayer(layer int64, m *MoE) error {
	if c.handle == nil {
		return closedError("checkpoint")
	}
	if m.handle == nil {
		return closedError("moe")
	}
	return call(func() C.kt_status {
		return C.kt_ckpt_load_layer(c.handle, C.int64_t(layer), m.handle, nil, nil)
	})
}

// LoadLayerOptions are the settings of LoadLayerWith; the zero value is
// kt's defaults (those of LoadLayer).
type LoadLayerOptions struct {
	// Dequantize lets a quantized layer (fp8 blocks, int4 groups, mxfp4)
	// load into a FormatBF16 layer, each weight dequantized and rounded to
	// bf16 once. Without it that load fails with ErrUnsupported. A quantized
	// layer loads as stored into a layer of its own format either way, and
	// is never re-quantized into another quantized format; dense layers
	// ignore it.
	Dequantize bool
	// A rank's share of the layer, for a host whose own collectives combine
	// expert- or tensor-parallel ranks (the layer is made with the share's
	// expert count and intermediate size; only the share's bytes are read).
	// Experts lists checkpoint expert ids, the layer's expert i being
	// Experts[i]; nil: every expert, in order.
	Experts []int64
	// IntermediateBegin and IntermediateEnd slice the intermediate
	// dimension (gate and up rows, down columns, gate and up biases); both
	// 0: all of it. A quantized layer loaded as stored needs both ends on
	// whole scale groups.
	IntermediateBegin, IntermediateEnd int64
	// ZeroDownBias loads the down biases as zeros: every rank of a
	// tensor-parallel group but one, whose outputs are summed.
	ZeroDownBias bool
}

// LoadLayerWith is LoadLayer with options (kt_ckpt_load_layer_with); opts
// may be nil.
func (c *Checkpoint) LoadLayerWith(layer int64, m *MoE, opts *LoadLayerOptions) error {
	if c.handle == nil {
		return closedError("checkpoint")
	}
	if m.handle == nil {
		return closedError("moe")
	}
	var o C.kt_ckpt_load_options
	C.kt_ckpt_load_options_init(&o)
	if opts != nil {
		if opts.Dequantize {
			o.dequantize = 1
		}
		if opts.Experts != nil {
			// C memory: the options struct may not point into Go's heap.
			ids := (*C.int64_t)(C.malloc(C.size_t(8 * (len(opts.Experts) + 1))))
			defer C.free(unsafe.Pointer(ids))
			for i, e := range opts.Experts {
				unsafe.Slice(ids, len(opts.Experts))[i] = C.int64_t(e)
			}
			o.experts = ids
			o.num_experts = C.int64_t(len(opts.Experts))
		}
		o.intermediate_begin = C.int64_t(opts.IntermediateBegin)
		o.intermediate_end = C.int64_t(opts.IntermediateEnd)
		if opts.ZeroDownBias {
			o.zero_down_bias = 1
		}
	}
	return call(func() C.kt_status {
		return C.kt_ckpt_load_layer_with(c.handle, C.int64_t(layer), m.handle, &o, nil, nil)
	})
}

func read(op C.int, ckpt *C.kt_ckpt, dir *C.char, layer int64, args []Arg) error {
	return withArgs(args, func(n C.int, meta *C.ktgo_arg, d *[C.KTGO_MAX_ARGS]unsafe.Pointer) C.kt_status {
		return C.ktgo_read(op, ckpt, dir, C.int64_t(layer), n, meta, d[0], d[1], d[2], d[3], d[4], d[5],
			d[6], d[7], d[8], d[9], d[10], d[11], d[12], d[13], d[14], d[15])
	})
}

// ReadLayer copies layer L's weights into tensors: ArgWGate, ArgWUp [E,I,H],
// ArgWDown [E,H,I], ArgBGate, ArgBUp [E,I], ArgBDown [E,H] (float32 or bf16).
func (c *Checkpoint) ReadLayer(layer int64, args ...Arg) error {
	if c.handle == nil {
		return closedError("checkpoint")
	}
	return read(C.KTGO_READ_LAYER, c.handle, nil, layer, args)
}

// LayerArgs are one layer's tensors for a writer.
type LayerArgs struct {
	Layer int64
	Args  []Arg
}

// write copies every tensor into C memory (a writer takes any number of
// them, and cgo lets C hold no Go pointers) and calls the writer.
func write(dir string, options *C.kt_ckpt_write_options, config *C.kt_ckpt_adapter_config, layers []LayerArgs) error {
	var all []Arg
	layerNumbers := make([]C.int64_t, len(layers)+1)
	counts := make([]C.int, len(layers)+1)
	for i, l := range layers {
		layerNumbers[i] = C.int64_t(l.Layer)
		counts[i] = C.int(len(l.Args))
		all = append(all, l.Args...)
	}
	meta := make([]C.ktgo_arg, len(all)+1)
	data := make([]unsafe.Pointer, len(all)+1)
	if err := describe(all, meta, data); err != nil {
		return err
	}
	copies := (*[1 << 28]unsafe.Pointer)(C.calloc(C.size_t(len(all)+1), C.size_t(unsafe.Sizeof(unsafe.Pointer(nil)))))
	defer func() {
		for i := range all {
			C.free(copies[i])
		}
		C.free(unsafe.Pointer(copies))
	}()
	for i, a := range all {
		n := C.size_t(a.Tensor.count * int64(a.Tensor.bits/8))
		copies[i] = C.malloc(n + 1)
		if copies[i] == nil {
			return &Error{Status: ErrOutOfMemory, Message: fmt.Sprintf("cannot copy arg %d (%d bytes)", a.ID, n)}
		}
		if n > 0 {
			C.memcpy(copies[i], data[i], n)
		}
	}
	runtime.KeepAlive(all)
	d := C.CString(dir)
	defer C.free(unsafe.Pointer(d))
	return call(func() C.kt_status {
		return C.ktgo_write(d, options, config, C.int(len(layers)), &layerNumbers[0], &counts[0],
			C.int(len(all)), &meta[0], &copies[0])
	})
}

// WriteOptions are the settings of WriteExperts; zero values keep kt's
// defaults (per-expert names, bf16, 4 GiB shards, no config.json).
type WriteOptions struct {
	Layout        CkptLayout
	DType         CkptDType
	MaxShardBytes int64
	ConfigJSON    string
}

// WriteExperts writes a full-expert checkpoint with HF key names into dir
// (published atomically). Each layer: ArgWGate, ArgWUp [E,I,H], ArgWDown
// [E,H,I], optional biases. The tensors are copied to C memory first.
func WriteExperts(dir string, opts *WriteOptions, layers ...LayerArgs) error {
	var o C.kt_ckpt_write_options
	C.kt_ckpt_write_options_init(&o)
	if opts != nil {
		if opts.Layout != 0 {
			o.layout = C.kt_ckpt_layout(opts.Layout)
		}
		if opts.DType != 0 {
			o.dtype = C.kt_ckpt_dtype(opts.DType)
		}
		if opts.MaxShardBytes != 0 {
			o.max_shard_bytes = C.int64_t(opts.MaxShardBytes)
		}
		if opts.ConfigJSON != "" {
			o.config_json = C.CString(opts.ConfigJSON)
			defer C.free(unsafe.Pointer(o.config_json))
		}
	}
	return write(dir, &o, nil, layers)
}

// AdapterConfig are a PEFT LoRA adapter's settings; zero Targets, Layout and
// DType keep kt's defaults (all projections, per-expert names, float32).
type AdapterConfig struct {
	Rank      int64
	Alpha     float32
	UseRSLoRA bool
	Targets   uint32 // ProjGate | ProjUp | ProjDown
	Layout    CkptLayout
	DType     CkptDType
	BaseModel string
}

// WriteAdapter writes a PEFT adapter into dir from each layer's ArgLoRAA*
// [E,r,in] and ArgLoRAB* [E,out,r] (published atomically).
func WriteAdapter(dir string, cfg AdapterConfig, layers ...LayerArgs) error {
	var c C.kt_ckpt_adapter_config
	C.kt_ckpt_adapter_config_init(&c)
	c.rank = C.int64_t(cfg.Rank)
	c.alpha = C.float(cfg.Alpha)
	if cfg.UseRSLoRA {
		c.use_rslora = 1
	}
	if cfg.Targets != 0 {
		c.targets = C.uint(cfg.Targets)
	}
	if cfg.Layout != 0 {
		c.layout = C.kt_ckpt_layout(cfg.Layout)
	}
	if cfg.DType != 0 {
		c.dtype = C.kt_ckpt_dtype(cfg.DType)
	}
	if cfg.BaseModel != "" {
		c.base_model = C.CString(cfg.BaseModel)
		defer C.free(unsafe.Pointer(c.base_model))
	}
	return write(dir, nil, &c, layers)
}

// ReadAdapterConfig reads an adapter's adapter_config.json.
func ReadAdapterConfig(dir string) (AdapterConfig, error) {
	d := C.CString(dir)
	defer C.free(unsafe.Pointer(d))
	var c C.kt_ckpt_adapter_config
	C.kt_ckpt_adapter_config_init(&c)
	if err := call(func() C.kt_status { return C.kt_ckpt_adapter_read_config(d, &c) }); err != nil {
		return AdapterConfig{}, err
	}
	return AdapterConfig{Rank: int64(c.rank), Alpha: float32(c.alpha), UseRSLoRA: c.use_rslora != 0,
		Targets: uint32(c.targets), Layout: CkptLayout(c.layout), DType: CkptDType(c.dtype)}, nil
}

// ReadAdapter copies layer L's LoRA factors of the adapter in dir into
// ArgLoRAA* [E,r,in] and ArgLoRAB* [E,out,r] tensors (float32 or bf16).
func ReadAdapter(dir string, layer int64, args ...Arg) error {
	d := C.CString(dir)
	defer C.free(unsafe.Pointer(d))
	return read(C.KTGO_READ_ADAPTER, nil, d, layer, args)
}
