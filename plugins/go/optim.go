package kt

/*
#include <stdlib.h>
#include <kt_c_api.h>
*/
import "C"

import "unsafe"

// OptimizerOptions are an optimizer's hyperparameters, with torch.optim's
// meanings. Start from DefaultOptimizerOptions (kt's defaults: AdamW, lr 1e-3,
// weight decay 1e-2, betas 0.9/0.999, eps 1e-8).
type OptimizerOptions struct {
	Algorithm         Algorithm
	AMSGrad           bool
	LR, WeightDecay   float64
	Beta1, Beta2, Eps float64 // AdamW
	Momentum          float64 // SGD
	Dampening         float64 // SGD
	Nesterov          bool    // SGD
	Arithmetic        Arithmetic
	// AssumeFinite: the host has checked the gradients
	// (kt_optimizer_options.assume_finite); a step reads them once and does
	// not skip on inf/NaN.
	AssumeFinite bool
}

// DefaultOptimizerOptions returns kt's defaults (kt_optimizer_options_init).
func DefaultOptimizerOptions() OptimizerOptions {
	var o C.kt_optimizer_options
	C.kt_optimizer_options_init(&o)
	return fromC(&o)
}

func fromC(o *C.kt_optimizer_options) OptimizerOptions {
	return OptimizerOptions{Algorithm: Algorithm(o.algorithm), AMSGrad: o.amsgrad != 0, LR: float64(o.lr),
		WeightDecay: float64(o.weight_decay), Beta1: float64(o.beta1), Beta2: float64(o.beta2), Eps: float64(o.eps),
		Momentum: float64(o.momentum), Dampening: float64(o.dampening), Nesterov: o.nesterov != 0,
		Arithmetic: Arithmetic(o.arithmetic), AssumeFinite: o.assume_finite != 0}
}

func (opts OptimizerOptions) toC() C.kt_optimizer_options {
	var o C.kt_optimizer_options
	C.kt_optimizer_options_init(&o)
	o.algorithm = C.kt_optim_algorithm(opts.Algorithm)
	o.amsgrad = boolInt(opts.AMSGrad)
	o.lr = C.double(opts.LR)
	o.weight_decay = C.double(opts.WeightDecay)
	o.beta1 = C.double(opts.Beta1)
	o.beta2 = C.double(opts.Beta2)
	o.eps = C.double(opts.Eps)
	o.momentum = C.double(opts.Momentum)
	o.dampening = C.double(opts.Dampening)
	o.nesterov = boolInt(opts.Nesterov)
	o.arithmetic = C.kt_optim_arithmetic(opts.Arithmetic)
	o.assume_finite = boolInt(opts.AssumeFinite)
	return o
}

func boolInt(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// Optimizer is kt's fused optimizer over a layer's trainable parameters (the
// tensors bound with Bind: LoRA factors, or full-mode weights and biases, and
// their gradient buffers). Each Step reads the gradients the layer's
// Backward wrote and leaves the layer computing with the new values (in full
// mode the packed weights are written in the same pass). fp32 parameters are
// updated in place; bf16 ones keep fp32 masters in kt. Close it before its
// layer.
type Optimizer struct {
	handle *C.kt_optimizer
}

// NewOptimizer creates an optimizer over the layer's bound parameters
// (kt_optimizer_create_for_layer).
func (m *MoE) NewOptimizer(opts OptimizerOptions) (*Optimizer, error) {
	if m.handle == nil {
		return nil, closedError("moe")
	}
	o := opts.toC()
	opt := &Optimizer{}
	if err := call(func() C.kt_status { return C.kt_optimizer_create_for_layer(m.handle, &o, &opt.handle) }); err != nil {
		return nil, err
	}
	return opt, nil
}

// Step makes one step with g = grad * gradUnscale * clipCoef (1 and 1 for a
// plain step). It returns false, changing nothing, when a gradient was not
// finite (a loss-scaled step to skip).
func (o *Optimizer) Step(gradUnscale, clipCoef float32) (bool, error) {
	if o.handle == nil {
		return false, closedError("optimizer")
	}
	so := stepOptions(gradUnscale, clipCoef)
	// found_nonfinite points into C memory: cgo lets C keep no Go pointer.
	flag := (*C.int)(C.malloc(C.size_t(unsafe.Sizeof(C.int(0)))))
	defer C.free(unsafe.Pointer(flag))
	*flag = 0
	so.found_nonfinite = flag
	if err := call(func() C.kt_status { return C.kt_optimizer_step(o.handle, &so) }); err != nil {
		return false, err
	}
	return *flag == 0, nil
}

func stepOptions(gradUnscale, clipCoef float32) C.kt_optimizer_step_options {
	var so C.kt_optimizer_step_options
	C.kt_optimizer_step_options_init(&so)
	so.grad_unscale = C.float(gradUnscale)
	so.clip_coef = C.float(clipCoef)
	return so
}

// Options returns the current hyperparameters.
func (o *Optimizer) Options() (OptimizerOptions, error) {
	if o.handle == nil {
		return OptimizerOptions{}, closedError("optimizer")
	}
	var c C.kt_optimizer_options
	C.kt_optimizer_options_init(&c)
	if err := call(func() C.kt_status { return C.kt_optimizer_get_options(o.handle, &c) }); err != nil {
		return OptimizerOptions{}, err
	}
	return fromC(&c), nil
}

// SetOptions replaces the hyperparameters for the next steps (learning-rate
// schedules); Algorithm and AMSGrad must stay as created.
func (o *Optimizer) SetOptions(opts OptimizerOptions) error {
	if o.handle == nil {
		return closedError("optimizer")
	}
	c := opts.toC()
	return call(func() C.kt_status { return C.kt_optimizer_set_options(o.handle, &c) })
}

// GradSqNorm is the sum of squares of every gradient as stored, for a
// global-norm clip across layers and ranks.
func (o *Optimizer) GradSqNorm() (float64, error) {
	if o.handle == nil {
		return 0, closedError("optimizer")
	}
	var out C.double
	err := call(func() C.kt_status { return C.kt_optimizer_grad_sq_norm(o.handle, &out) })
	return float64(out), err
}

// Steps is the number of steps made so far.
func (o *Optimizer) Steps() (int64, error) {
	if o.handle == nil {
		return 0, closedError("optimizer")
	}
	var n C.int64_t
	err := call(func() C.kt_status { return C.kt_optimizer_get_step(o.handle, &n) })
	return int64(n), err
}

// Save writes masters, moments, step count and hyperparameters to one
// safetensors file, atomically.
func (o *Optimizer) Save(path string) error { return o.withPath(path, true) }

// Load restores what Save wrote; the layer then computes with the loaded masters.
func (o *Optimizer) Load(path string) error { return o.withPath(path, false) }

func (o *Optimizer) withPath(path string, save bool) error {
	if o.handle == nil {
		return closedError("optimizer")
	}
	p := C.CString(path)
	defer C.free(unsafe.Pointer(p))
	return call(func() C.kt_status {
		if save {
			return C.kt_optimizer_save(o.handle, p)
		}
		return C.kt_optimizer_load(o.handle, p)
	})
}

// Close frees the optimizer (after its submitted steps). Closing twice is a no-op.
func (o *Optimizer) Close() {
	if o != nil && o.handle != nil {
		C.kt_optimizer_destroy(o.handle)
		o.handle = nil
	}
}
