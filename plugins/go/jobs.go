package kt

/*
#include <stdlib.h>
#include "ktgo.h"

enum { KTGO_SUBMIT_FORWARD = 0, KTGO_SUBMIT_BACKWARD = 1 };

// data are copies in C memory (kt reads and writes them until the job ends),
// so a Go array of them may cross: it holds no Go pointers.
static kt_status ktgo_submit(int op, kt_moe* moe, kt_context* ctx, kt_context** saved,
                             const kt_backward_options* backward_options, unsigned flags, kt_job** job,
                             int n, const ktgo_arg* meta, void* const* data) {
	DLTensor tensors[KTGO_MAX_ARGS];
	int64_t shapes[KTGO_MAX_ARGS][KTGO_MAX_DIMS];
	kt_arg args[KTGO_MAX_ARGS];
	ktgo_fill(n, meta, data, tensors, shapes, args);
	if (op == KTGO_SUBMIT_FORWARD) return kt_moe_forward_submit(moe, args, (size_t)n, saved, flags, job);
	return kt_moe_backward_submit(moe, ctx, backward_options, args, (size_t)n, flags, job);
}
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

// SubmitOptions are the settings of a submitted job; nil or the zero value
// starts it at once on the engine's job thread.
type SubmitOptions struct {
	// Deferred: the job does not start until Run, Wait or Close runs it on
	// the calling goroutine (KT_SUBMIT_DEFERRED).
	Deferred bool
}

func (o *SubmitOptions) flags() C.uint {
	if o != nil && o.Deferred {
		return C.KT_SUBMIT_DEFERRED
	}
	return 0
}

// jobOutput is a tensor a job writes: its C copy and the Go memory it goes
// back to once the job succeeded.
type jobOutput struct {
	dst   unsafe.Pointer
	src   unsafe.Pointer
	bytes int
}

// Job is a submitted forward, backward or optimizer step. kt may not keep
// Go memory past a call, so a job computes on copies of its tensors in C
// memory: its outputs reach the Go slices at Wait (or Close), and only when
// the job succeeded. The slices stay referenced (alive) until then. Close
// every job; Wait, Done and Close may be called from any goroutine.
type Job struct {
	mu      sync.Mutex
	handle  *C.kt_job
	ended   bool  // Wait saw the job end and copied its outputs
	err     error // the job's result, once ended
	copies  []unsafe.Pointer
	outputs []jobOutput
	// Step jobs: kt writes found_nonfinite (C memory) when the job ends.
	nonfinite *C.int
	stepped   bool
}

// Run runs a deferred job on the calling goroutine (nothing for a job that
// already ended or is not deferred).
func (j *Job) Run() {
	j.mu.Lock()
	h := j.handle
	j.mu.Unlock()
	if h != nil {
		C.kt_job_run(unsafe.Pointer(h))
	}
}

// Done reports whether the job ended (true for a closed job).
func (j *Job) Done() bool {
	j.mu.Lock()
	h, ended := j.handle, j.ended
	j.mu.Unlock()
	return ended || h == nil || C.kt_job_done(h) != 0
}

// Wait waits until the job ended (running a deferred job nobody ran), copies
// its outputs into the Go slices when it succeeded and returns its result.
// Waiting again returns the same result.
func (j *Job) Wait() error {
	j.mu.Lock()
	h, ended, err := j.handle, j.ended, j.err
	j.mu.Unlock()
	if ended {
		return err
	}
	if h == nil {
		return closedError("job")
	}
	// kt_job_wait may block; the lock is not held so Done answers meanwhile.
	err = call(func() C.kt_status { return C.kt_job_wait(h) })
	j.mu.Lock()
	defer j.mu.Unlock()
	if !j.ended {
		j.ended, j.err = true, err
		if err == nil {
			for _, o := range j.outputs {
				copy(unsafe.Slice((*byte)(o.dst), o.bytes), unsafe.Slice((*byte)(o.src), o.bytes))
			}
			j.stepped = j.nonfinite != nil && *j.nonfinite == 0
		}
		j.outputs = nil
	}
	return j.err
}

// Stepped reports, for an optimizer step job that ended successfully, whether
// the step was made (false: a gradient was not finite and nothing changed).
func (j *Job) Stepped() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.stepped
}

// Close waits for the job as Wait does, then frees it and its copies; it
// returns the job's result. Closing twice returns nil.
func (j *Job) Close() error {
	j.mu.Lock()
	live := j.handle != nil
	j.mu.Unlock()
	if !live {
		return nil
	}
	err := j.Wait()
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.handle != nil {
		C.kt_job_destroy(j.handle)
		j.handle = nil
		j.free()
	}
	return err
}

func (j *Job) free() {
	for _, p := range j.copies {
		C.free(p)
	}
	j.copies = nil
	if j.nonfinite != nil {
		C.free(unsafe.Pointer(j.nonfinite))
		j.nonfinite = nil
	}
}

// isOutput says which arguments a forward or backward job writes.
func isOutput(id ArgID) bool { return id == ArgY || id == ArgDX || id == ArgDRouteWeights }

// copyArgs copies every tensor into C memory (outputs too: a failed job
// leaves them as they were) and returns the args viewing the copies.
func (j *Job) copyArgs(args []Arg) ([]Arg, error) {
	out := make([]Arg, len(args))
	for i, a := range args {
		out[i] = a
		n := int(a.Tensor.count) * a.Tensor.bits / 8
		if a.Tensor.data == nil || n == 0 {
			continue // T = 0: kt sees what a synchronous call sees
		}
		p := C.malloc(C.size_t(n))
		if p == nil {
			return nil, &Error{Status: ErrOutOfMemory, Message: fmt.Sprintf("cannot copy arg %d (%d bytes)", a.ID, n)}
		}
		j.copies = append(j.copies, p)
		copy(unsafe.Slice((*byte)(p), n), unsafe.Slice((*byte)(a.Tensor.data), n))
		out[i].Tensor.data = p
		if isOutput(a.ID) {
			j.outputs = append(j.outputs, jobOutput{dst: a.Tensor.data, src: p, bytes: n})
		}
	}
	return out, nil
}

func (m *MoE) submit(op C.int, ctx *C.kt_context, saved **C.kt_context, bo *C.kt_backward_options,
	so *SubmitOptions, args []Arg) (*Job, error) {
	if m.handle == nil {
		return nil, closedError("moe")
	}
	if len(args) > C.KTGO_MAX_ARGS {
		return nil, &Error{Status: ErrInvalidArgument, Message: fmt.Sprintf("%d args; at most %d per call", len(args), C.KTGO_MAX_ARGS)}
	}
	j := &Job{}
	copies, err := j.copyArgs(args)
	if err == nil {
		err = withArgs(copies, func(n C.int, meta *C.ktgo_arg, d *[C.KTGO_MAX_ARGS]unsafe.Pointer) C.kt_status {
			// The array holds C pointers only; cgo cannot check &d[0] of an
			// array pointer, so it crosses as the array's address.
			return C.ktgo_submit(op, m.handle, ctx, saved, bo, so.flags(), &j.handle, n, meta, (*unsafe.Pointer)(unsafe.Pointer(d)))
		})
	}
	if err != nil {
		j.free()
		return nil, err
	}
	return j, nil
}

// SubmitForward submits an inference forward (y = MoE(x)); y is written at
// the job's Wait. opts may be nil.
func (m *MoE) SubmitForward(x, ids, routeWeights, y Tensor, opts *SubmitOptions) (*Job, error) {
	return m.submit(C.KTGO_SUBMIT_FORWARD, nil, nil, nil, opts, forwardArgs(x, ids, routeWeights, y))
}

// SubmitForwardTrain submits a training forward and returns its context,
// which a Backward or SubmitBackward may take before the job ended (kt
// orders them). Close the context as after ForwardTrain.
func (m *MoE) SubmitForwardTrain(x, ids, routeWeights, y Tensor, opts *SubmitOptions) (*Job, *Context, error) {
	c := &Context{}
	j, err := m.submit(C.KTGO_SUBMIT_FORWARD, nil, &c.handle, nil, opts, forwardArgs(x, ids, routeWeights, y))
	if err != nil {
		return nil, nil, err
	}
	return j, c, nil
}

// SubmitBackward submits the backward of ctx's forward (args as Backward);
// DX and DRouteWeights are written at the job's Wait, the bound gradient
// buffers when the job ends. bo and opts may be nil.
func (m *MoE) SubmitBackward(ctx *Context, bo *BackwardOptions, opts *SubmitOptions, args ...Arg) (*Job, error) {
	if ctx == nil || ctx.handle == nil {
		return nil, &Error{Status: ErrContext, Message: "context is nil or closed"}
	}
	o := bo.toC()
	return m.submit(C.KTGO_SUBMIT_BACKWARD, ctx.handle, nil, &o, opts, args)
}

// SubmitStep submits Step(gradUnscale, clipCoef) as a job on the engine's job
// thread, after the jobs submitted before it; Job.Stepped says after Wait
// whether the step was made. opts may be nil.
func (o *Optimizer) SubmitStep(gradUnscale, clipCoef float32, opts *SubmitOptions) (*Job, error) {
	if o.handle == nil {
		return nil, closedError("optimizer")
	}
	so := stepOptions(gradUnscale, clipCoef)
	j := &Job{nonfinite: (*C.int)(C.malloc(C.size_t(unsafe.Sizeof(C.int(0)))))}
	*j.nonfinite = 0
	so.found_nonfinite = j.nonfinite
	if err := call(func() C.kt_status { return C.kt_optimizer_step_submit(o.handle, &so, opts.flags(), &j.handle) }); err != nil {
		j.free()
		return nil, err
	}
	return j, nil
}
