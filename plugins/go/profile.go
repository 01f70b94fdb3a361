package kt

/*
#include <kt_c_api.h>
*/
import "C"

// StageProfile is one stage's accumulated calls and wall time since the
// engine's creation or the last ResetProfile.
type StageProfile struct {
	Name    string
	Calls   int64
	Seconds float64
}

// SetProfiling turns the per-stage profile of the engine's computations on or
// off (off by default).
func (e *Engine) SetProfiling(enabled bool) error {
	if e.handle == nil {
		return closedError("engine")
	}
	on := C.int(0)
	if enabled {
		on = 1
	}
	return call(func() C.kt_status { return C.kt_engine_set_profiling(e.handle, on) })
}

// ResetProfile zeroes every stage's time and count.
func (e *Engine) ResetProfile() error {
	if e.handle == nil {
		return closedError("engine")
	}
	return call(func() C.kt_status { return C.kt_engine_reset_profile(e.handle) })
}

// Profile is every stage's calls and time, in kt's stage order.
func (e *Engine) Profile() ([]StageProfile, error) {
	if e.handle == nil {
		return nil, closedError("engine")
	}
	var out []StageProfile
	for stage := C.int(0); ; stage++ {
		name := C.kt_stage_name(stage)
		if name == nil {
			return out, nil
		}
		var calls C.int64_t
		var seconds C.double
		if err := call(func() C.kt_status {
			return C.kt_engine_profile_stage(e.handle, stage, &calls, &seconds)
		}); err != nil {
			return nil, err
		}
		out = append(out, StageProfile{C.GoString(name), int64(calls), float64(seconds)})
	}
}
