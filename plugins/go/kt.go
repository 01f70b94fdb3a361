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

// Go memory handed to C must not contain Go pointers, so tensors cross as
// plain descriptions (ktgo_arg) plus their data pointers as direct arguments;
// the DLTensors and kt_args are built here, on the C stack, for the call.
enum { KTGO_MAX_ARGS = 16, KTGO_MAX_DIMS = 4 };
enum { KTGO_LOAD = 0, KTGO_FORWARD = 1, KTGO_BACKWARD = 2, KTGO_BIND = 3 };

typedef struct ktgo_arg {
	int id;
	int code;
	int bits;
	int ndim;
	int64_t shape[KTGO_MAX_DIMS];
} ktgo_arg;

static kt_status ktgo_call(int op, kt_moe* moe, kt_context* ctx, kt_context** saved,
                           const kt_backward_options* backward_options, int n, const ktgo_arg* meta,
                           void* d0, void* d1, void* d2, void* d3, void* d4, void* d5, void* d6,
                           void* d7, void* d8, void* d9, void* d10, void* d11, void* d12,
                           void* d13, void* d14, void* d15) {
	void* data[KTGO_MAX_ARGS] = {d0, d1, d2, d3, d4, d5, d6, d7, d8, d9, d10, d11, d12, d13, d14, d15};
	DLTensor tensors[KTGO_MAX_ARGS];
	int64_t shapes[KTGO_MAX_ARGS][KTGO_MAX_DIMS];
	kt_arg args[KTGO_MAX_ARGS];
	for (int i = 0; i < n; ++i) {
		memset(&tensors[i], 0, sizeof(tensors[i]));
		memcpy(shapes[i], meta[i].shape, sizeof(shapes[i]));
		tensors[i].data = data[i];
		tensors[i].device.device_type = kDLCPU;
		tensors[i].ndim = meta[i].ndim;
		tensors[i].dtype.code = (uint8_t)meta[i].code;
		tensors[i].dtype.bits = (uint8_t)meta[i].bits;
		tensors[i].dtype.lanes = 1;
		tensors[i].shape = shapes[i];
		args[i].id = meta[i].id;
		args[i].tensor = &tensors[i];
	}
	switch (op) {
	case KTGO_LOAD: return kt_moe_load_weights(moe, NULL, args, (size_t)n);
	case KTGO_FORWARD: return kt_moe_forward(moe, args, (size_t)n, saved);
	case KTGO_BACKWARD: return kt_moe_backward(moe, ctx, backward_options, args, (size_t)n);
	case KTGO_BIND: return kt_moe_bind(moe, args, (size_t)n);
	}
	return KT_ERR_INVALID_ARGUMENT;
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

// Status is a kt_status code; its values are those of the C ABI.
type Status int

// Status codes (pinned values of kt_status).
const (
	OK                 Status = C.KT_OK
	ErrInvalidArgument Status = C.KT_ERR_INVALID_ARGUMENT
	ErrNullPointer     Status = C.KT_ERR_NULL_POINTER
	ErrInvalidHandle   Status = C.KT_ERR_INVALID_HANDLE
	ErrDType           Status = C.KT_ERR_DTYPE
	ErrShape           Status = C.KT_ERR_SHAPE
	ErrStride          Status = C.KT_ERR_STRIDE
	ErrDevice          Status = C.KT_ERR_DEVICE
	ErrExpertID        Status = C.KT_ERR_EXPERT_ID
	ErrTooManyTokens   Status = C.KT_ERR_TOO_MANY_TOKENS
	ErrContext         Status = C.KT_ERR_CONTEXT
	ErrNotBound        Status = C.KT_ERR_NOT_BOUND
	ErrNotLoaded       Status = C.KT_ERR_NOT_LOADED
	ErrMode            Status = C.KT_ERR_MODE
	ErrUnsupported     Status = C.KT_ERR_UNSUPPORTED
	ErrOutOfMemory     Status = C.KT_ERR_OUT_OF_MEMORY
	ErrIO              Status = C.KT_ERR_IO
	ErrInternal        Status = C.KT_ERR_INTERNAL
	ErrComm            Status = C.KT_ERR_COMM
)

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

// Activation selects the expert activation.
type Activation int

// Activations of kt_activation.
const (
	ActSiLU      Activation = C.KT_ACT_SILU
	ActSwiGLUOAI Activation = C.KT_ACT_SWIGLU_OAI
)

// Mode is a layer's training mode.
type Mode int

// Modes of kt_mode.
const (
	ModeInference Mode = C.KT_MODE_INFERENCE
	ModeLoRA      Mode = C.KT_MODE_LORA
	ModeFull      Mode = C.KT_MODE_FULL
)

// MoEOptions are a layer's shapes and settings. Zero-valued optional fields
// keep kt's defaults (MaxTokens 1024, SiLU, no clamp, inference mode).
type MoEOptions struct {
	NumExperts, TopK, Hidden, Intermediate int64
	MaxTokens                              int64
	Activation                             Activation
	ActAlpha, ActLimit                     float32
	HasBias                                bool
	Mode                                   Mode
	LoRARank                               int64
	LoRAAlpha                              float32
}

// MoE is one MoE layer's routed experts. Close it before its engine.
type MoE struct {
	handle *C.kt_moe
}

// NewMoE creates a layer on the engine; load its weights before a forward.
func (e *Engine) NewMoE(opts MoEOptions) (*MoE, error) {
	if e.handle == nil {
		return nil, closedError("engine")
	}
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
	m := &MoE{}
	if err := call(func() C.kt_status { return C.kt_moe_create(e.handle, &o, &m.handle) }); err != nil {
		return nil, err
	}
	return m, nil
}

// Close frees the layer and its outstanding contexts. Closing twice is a no-op.
func (m *MoE) Close() error {
	if m.handle != nil {
		C.kt_moe_destroy(m.handle)
		m.handle = nil
	}
	return nil
}

// ArgID names an argument of a call (kt_arg_id).
type ArgID int

// Argument ids (pinned values of kt_arg_id).
const (
	ArgX             ArgID = C.KT_ARG_X
	ArgIDs           ArgID = C.KT_ARG_IDS
	ArgRouteWeights  ArgID = C.KT_ARG_ROUTE_WEIGHTS
	ArgY             ArgID = C.KT_ARG_Y
	ArgDY            ArgID = C.KT_ARG_DY
	ArgDX            ArgID = C.KT_ARG_DX
	ArgDRouteWeights ArgID = C.KT_ARG_DROUTE_WEIGHTS
	ArgWGate         ArgID = C.KT_ARG_W_GATE
	ArgWUp           ArgID = C.KT_ARG_W_UP
	ArgWDown         ArgID = C.KT_ARG_W_DOWN
	ArgWGateUp       ArgID = C.KT_ARG_W_GATE_UP
	ArgBGate         ArgID = C.KT_ARG_B_GATE
	ArgBUp           ArgID = C.KT_ARG_B_UP
	ArgBDown         ArgID = C.KT_ARG_B_DOWN
	ArgExpertMap     ArgID = C.KT_ARG_EXPERT_MAP
	ArgLoRAAGate     ArgID = C.KT_ARG_LORA_A_GATE
	ArgLoRABGate     ArgID = C.KT_ARG_LORA_B_GATE
	ArgLoRAAUp       ArgID = C.KT_ARG_LORA_A_UP
	ArgLoRABUp       ArgID = C.KT_ARG_LORA_B_UP
	ArgLoRAADown     ArgID = C.KT_ARG_LORA_A_DOWN
	ArgLoRABDown     ArgID = C.KT_ARG_LORA_B_DOWN
	ArgGradLoRAAGate ArgID = C.KT_ARG_GRAD_LORA_A_GATE
	ArgGradLoRABGate ArgID = C.KT_ARG_GRAD_LORA_B_GATE
	ArgGradLoRAAUp   ArgID = C.KT_ARG_GRAD_LORA_A_UP
	ArgGradLoRABUp   ArgID = C.KT_ARG_GRAD_LORA_B_UP
	ArgGradLoRAADown ArgID = C.KT_ARG_GRAD_LORA_A_DOWN
	ArgGradLoRABDown ArgID = C.KT_ARG_GRAD_LORA_B_DOWN
	ArgGradWGate     ArgID = C.KT_ARG_GRAD_W_GATE
	ArgGradWUp       ArgID = C.KT_ARG_GRAD_W_UP
	ArgGradWDown     ArgID = C.KT_ARG_GRAD_W_DOWN
)

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
	if len(args) > C.KTGO_MAX_ARGS {
		return &Error{Status: ErrInvalidArgument, Message: fmt.Sprintf("%d args; at most %d per call", len(args), C.KTGO_MAX_ARGS)}
	}
	var meta [C.KTGO_MAX_ARGS]C.ktgo_arg
	var data [C.KTGO_MAX_ARGS]unsafe.Pointer
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
	err := call(func() C.kt_status {
		return C.ktgo_call(op, m.handle, ctx, saved, bo, C.int(len(args)), &meta[0],
			data[0], data[1], data[2], data[3], data[4], data[5], data[6], data[7],
			data[8], data[9], data[10], data[11], data[12], data[13], data[14], data[15])
	})
	runtime.KeepAlive(args)
	return err
}

// LoadWeights loads stacked expert weights: ArgWGate, ArgWUp [E,I,H] and
// ArgWDown [E,H,I] (or ArgWGateUp), biases when the layer has them.
func (m *MoE) LoadWeights(args ...Arg) error { return m.run(C.KTGO_LOAD, nil, nil, nil, args) }

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
	return m.run(C.KTGO_BACKWARD, ctx.handle, nil, &o, args)
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
