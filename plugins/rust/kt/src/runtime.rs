//! Asynchronous jobs, the gradient hook and the per-stage profile.
use std::ffi::CStr;
use std::marker::PhantomData;
use std::os::raw::{c_int, c_void};
use std::ptr;

use crate::{check, Engine, Moe, Result, TensorMut, TensorRef};
use kt_sys as sys;

pub(crate) type GradHook = Box<dyn FnMut() + Send>;

/// A submitted forward: it borrows its tensors until it ends. `wait` returns
/// its status; dropping it waits too.
pub struct Job<'a> {
    raw: *mut sys::kt_job,
    _borrows: PhantomData<&'a mut ()>,
}

unsafe impl Send for Job<'_> {}

impl Job<'_> {
    /// Whether the job has ended.
    pub fn is_done(&self) -> bool {
        unsafe { sys::kt_job_done(self.raw) != 0 }
    }

    /// Waits until the job ended (runs it here if it was deferred) and returns its status.
    pub fn wait(self) -> Result<()> {
        check(unsafe { sys::kt_job_wait(self.raw) })
    }
}

impl Drop for Job<'_> {
    fn drop(&mut self) {
        unsafe { sys::kt_job_destroy(self.raw) };
    }
}

/// Wall time and calls of one stage of forward and backward since the last reset.
#[derive(Clone, Debug, PartialEq)]
pub struct StageProfile {
    pub name: String,
    pub calls: i64,
    pub seconds: f64,
}

impl Engine {
    /// Turns the per-stage profile on or off (off by default).
    pub fn set_profiling(&self, enabled: bool) -> Result<()> {
        check(unsafe { sys::kt_engine_set_profiling(self.raw, enabled as c_int) })
    }

    /// Zeroes every stage's time and count.
    pub fn reset_profile(&self) -> Result<()> {
        check(unsafe { sys::kt_engine_reset_profile(self.raw) })
    }

    /// Every stage's accumulated calls and time, in kt's stage order.
    pub fn profile(&self) -> Result<Vec<StageProfile>> {
        let mut out = Vec::new();
        for stage in 0.. {
            let name = unsafe { sys::kt_stage_name(stage) };
            if name.is_null() {
                break;
            }
            let (mut calls, mut seconds) = (0i64, 0f64);
            check(unsafe { sys::kt_engine_profile_stage(self.raw, stage, &mut calls, &mut seconds) })?;
            let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
            out.push(StageProfile { name, calls, seconds });
        }
        Ok(out)
    }
}

unsafe extern "C" fn call_hook(_moe: *mut sys::kt_moe, user: *mut c_void) {
    let hook = &mut *(user as *mut GradHook);
    hook();
}

impl<'e> Moe<'e> {
    /// Submits y = MoE(x) to the engine's job thread; the tensors stay
    /// borrowed by the returned job until it ends.
    pub fn forward_submit<'a>(
        &'a self,
        x: &'a TensorRef<'a>,
        ids: &'a TensorRef<'a>,
        route_weights: &'a TensorRef<'a>,
        y: &'a mut TensorMut<'a>,
    ) -> Result<Job<'a>> {
        let args = crate::forward_args(x, ids, route_weights, y);
        let mut raw = ptr::null_mut();
        check(unsafe { sys::kt_moe_forward_submit(self.raw, args.as_ptr(), args.len(), ptr::null_mut(), 0, &mut raw) })?;
        Ok(Job { raw, _borrows: PhantomData })
    }

    /// Calls `hook` each time a backward has written this layer's parameter
    /// gradients (on the thread that ran the backward); None removes it.
    pub fn set_grad_hook(&self, hook: Option<GradHook>) -> Result<()> {
        let mut slot = self.hook.lock().unwrap_or_else(|e| e.into_inner());
        match hook {
            None => {
                check(unsafe { sys::kt_moe_set_grad_hook(self.raw, None, ptr::null_mut()) })?;
                *slot = None;
            }
            Some(f) => {
                let mut boxed = Box::new(f);
                let user = &mut *boxed as *mut GradHook as *mut c_void;
                check(unsafe { sys::kt_moe_set_grad_hook(self.raw, Some(call_hook), user) })?;
                *slot = Some(boxed);
            }
        }
        Ok(())
    }
}
