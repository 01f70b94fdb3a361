package kt

/*
#include <stdint.h>
#include <kt_c_api.h>

extern void ktgoGradReady(kt_moe* moe, uintptr_t user);

// The user pointer is a cgo.Handle, which Go may not turn into a pointer:
// it crosses as an integer and C casts it.
static inline void ktgo_grad_ready(kt_moe* moe, void* user) { ktgoGradReady(moe, (uintptr_t)user); }

static inline kt_status ktgo_set_grad_hook(kt_moe* moe, uintptr_t user) {
	return kt_moe_set_grad_hook(moe, user ? ktgo_grad_ready : NULL, (void*)user);
}
*/
import "C"

import (
	"runtime/cgo"
	"sync"
)

type gradHook struct {
	fn    func(*MoE)
	m     *MoE
	layer *C.kt_moe
}

// kt copies a layer's hook before calling it outside its locks, so a call
// may still arrive after the hook was replaced or the layer closed: the
// trampoline finds the handle here first (cgo.Handle.Value would panic on a
// deleted one).
var hooks struct {
	sync.RWMutex
	live    map[cgo.Handle]bool
	byLayer map[*C.kt_moe]cgo.Handle
}

//export ktgoGradReady
func ktgoGradReady(moe *C.kt_moe, user C.uintptr_t) {
	h := cgo.Handle(user)
	hooks.RLock()
	var hook *gradHook
	if hooks.live[h] {
		hook = h.Value().(*gradHook)
	}
	hooks.RUnlock()
	if hook != nil && hook.layer == moe {
		hook.fn(hook.m)
	}
}

// SetGradHook makes fn run once each backward of the layer has finished
// writing its parameter gradients (LoRA and full mode, with parameter
// gradients), with the layer as argument. fn runs on the thread that ran the
// backward: Backward's own, or a kt job thread for SubmitBackward (there it
// may run after the job's Wait returned). It may call kt, e.g. SubmitStep,
// and must not panic. nil removes the hook.
func (m *MoE) SetGradHook(fn func(*MoE)) error {
	if m.handle == nil {
		return closedError("moe")
	}
	var h cgo.Handle
	if fn != nil {
		h = cgo.NewHandle(&gradHook{fn: fn, m: m, layer: m.handle})
		hooks.Lock()
		if hooks.live == nil {
			hooks.live = map[cgo.Handle]bool{}
			hooks.byLayer = map[*C.kt_moe]cgo.Handle{}
		}
		hooks.live[h] = true
		hooks.Unlock()
	}
	if err := call(func() C.kt_status { return C.ktgo_set_grad_hook(m.handle, C.uintptr_t(h)) }); err != nil {
		if h != 0 {
			dropHook(h)
		}
		return err
	}
	hooks.Lock()
	old, had := hooks.byLayer[m.handle]
	if h != 0 {
		hooks.byLayer[m.handle] = h
	} else {
		delete(hooks.byLayer, m.handle)
	}
	hooks.Unlock()
	if had {
		dropHook(old)
	}
	return nil
}

func dropHook(h cgo.Handle) {
	hooks.Lock()
	delete(hooks.live, h)
	hooks.Unlock()
	h.Delete()
}

// forgetGradHook drops the hook of a layer that was freed.
func forgetGradHook(layer *C.kt_moe) {
	hooks.Lock()
	h, had := hooks.byLayer[layer]
	delete(hooks.byLayer, layer)
	hooks.Unlock()
	if had {
		dropHook(h)
	}
}
