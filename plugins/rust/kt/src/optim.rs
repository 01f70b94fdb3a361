//! kt's fused optimizer (AdamW or SGD with torch.optim's arithmetic) over a
//! layer's bound trainable parameters.
use std::marker::PhantomData;
use std::os::raw::c_int;
use std::ptr;

use crate::{c_path, check, sys, Moe, Result};

/// The optimizer algorithm (kt_optim_algorithm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Algorithm {
    /// Decoupled weight decay, bias correction, optional AMSGrad.
    AdamW,
    /// Momentum, dampening, Nesterov, L2 weight decay.
    Sgd,
}

/// Whose operation order the steps reproduce bit for bit (kt_optim_arithmetic).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arithmetic {
    /// torch 1.x: AdamW moves exp_avg by mul and add.
    Torch1,
    /// torch 2.x: AdamW moves exp_avg by lerp.
    Torch2,
}

/// Hyperparameters with torch.optim's meanings; `Default` is kt's defaults
/// (AdamW, lr 1e-3, weight decay 1e-2, betas 0.9/0.999, eps 1e-8).
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerOptions {
    pub algorithm: Algorithm,
    pub amsgrad: bool,
    pub lr: f64,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub nesterov: bool,
    pub arithmetic: Arithmetic,
    /// The host has checked the gradients (kt_optimizer_options.assume_finite):
    /// a step reads them once and does not skip on inf/NaN.
    pub assume_finite: bool,
}

fn raw_defaults() -> sys::kt_optimizer_options {
    let mut o = std::mem::MaybeUninit::<sys::kt_optimizer_options>::uninit();
    unsafe {
        sys::kt_optimizer_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_optimizer_options>());
        o.assume_init()
    }
}

impl From<&sys::kt_optimizer_options> for OptimizerOptions {
    fn from(o: &sys::kt_optimizer_options) -> Self {
        OptimizerOptions {
            algorithm: if o.algorithm == sys::KT_OPTIM_SGD { Algorithm::Sgd } else { Algorithm::AdamW },
            amsgrad: o.amsgrad != 0,
            lr: o.lr,
            weight_decay: o.weight_decay,
            beta1: o.beta1,
            beta2: o.beta2,
            eps: o.eps,
            momentum: o.momentum,
            dampening: o.dampening,
            nesterov: o.nesterov != 0,
            arithmetic: if o.arithmetic == sys::KT_OPTIM_TORCH2 { Arithmetic::Torch2 } else { Arithmetic::Torch1 },
            assume_finite: o.assume_finite != 0,
        }
    }
}

impl OptimizerOptions {
    fn raw(&self) -> sys::kt_optimizer_options {
        let mut o = raw_defaults();
        o.algorithm = match self.algorithm {
            Algorithm::AdamW => sys::KT_OPTIM_ADAMW,
            Algorithm::Sgd => sys::KT_OPTIM_SGD,
        };
        o.amsgrad = self.amsgrad as c_int;
        o.lr = self.lr;
        o.weight_decay = self.weight_decay;
        o.beta1 = self.beta1;
        o.beta2 = self.beta2;
        o.eps = self.eps;
        o.momentum = self.momentum;
        o.dampening = self.dampening;
        o.nesterov = self.nesterov as c_int;
        o.arithmetic = match self.arithmetic {
            Arithmetic::Torch1 => sys::KT_OPTIM_TORCH1,
            Arithmetic::Torch2 => sys::KT_OPTIM_TORCH2,
        };
        o.assume_finite = self.assume_finite as c_int;
        o
    }
}

impl Default for OptimizerOptions {
    fn default() -> Self {
        OptimizerOptions::from(&raw_defaults())
    }
}

/// kt's optimizer over a layer's bound parameters (LoRA factors, or
/// full-mode weights and biases) and their bound gradient buffers. A step
/// reads the gradients the layer's backward wrote, updates fp32 parameters
/// in place (bf16 ones keep fp32 masters in kt), and leaves the layer
/// computing with the new values (full mode: the packed weights are written
/// in the same pass). It borrows the layer, which therefore outlives it.
pub struct Optimizer<'m> {
    pub(crate) raw: *mut sys::kt_optimizer,
    _moe: PhantomData<&'m ()>,
}

unsafe impl Send for Optimizer<'_> {}

impl<'e> Moe<'e> {
    /// An optimizer over this layer's bound parameters (kt_optimizer_create_for_layer).
    pub fn optimizer(&self, options: &OptimizerOptions) -> Result<Optimizer<'_>> {
        let o = options.raw();
        let mut raw = ptr::null_mut();
        check(unsafe { sys::kt_optimizer_create_for_layer(self.raw, &o, &mut raw) })?;
        Ok(Optimizer { raw, _moe: PhantomData })
    }
}

impl Optimizer<'_> {
    /// One step with g = grad * grad_unscale * clip_coef (1 and 1 for a plain
    /// step). Ok(false), with nothing changed, when a gradient was not finite.
    /// It writes the bound parameters: see [`Moe::bind`].
    pub fn step(&mut self, grad_unscale: f32, clip_coef: f32) -> Result<bool> {
        let mut o = std::mem::MaybeUninit::<sys::kt_optimizer_step_options>::uninit();
        let mut o = unsafe {
            sys::kt_optimizer_step_options_defaults(o.as_mut_ptr(), std::mem::size_of::<sys::kt_optimizer_step_options>());
            o.assume_init()
        };
        let mut nonfinite: c_int = 0;
        o.grad_unscale = grad_unscale;
        o.clip_coef = clip_coef;
        o.found_nonfinite = &mut nonfinite;
        check(unsafe { sys::kt_optimizer_step(self.raw, &o) })?;
        Ok(nonfinite == 0)
    }

    /// The current hyperparameters.
    pub fn options(&self) -> Result<OptimizerOptions> {
        let mut o = raw_defaults();
        check(unsafe { sys::kt_optimizer_get_options(self.raw, &mut o) })?;
        Ok(OptimizerOptions::from(&o))
    }

    /// New hyperparameters for the next steps (learning-rate schedules); the
    /// algorithm and AMSGrad must stay as created.
    pub fn set_options(&mut self, options: &OptimizerOptions) -> Result<()> {
        let o = options.raw();
        check(unsafe { sys::kt_optimizer_set_options(self.raw, &o) })
    }

    /// Sum of squares of every gradient as stored (global-norm clipping).
    pub fn grad_sq_norm(&mut self) -> Result<f64> {
        let mut out = 0.0;
        check(unsafe { sys::kt_optimizer_grad_sq_norm(self.raw, &mut out) })?;
        Ok(out)
    }

    /// Steps made so far.
    pub fn steps(&self) -> Result<i64> {
        let mut n = 0;
        check(unsafe { sys::kt_optimizer_get_step(self.raw, &mut n) })?;
        Ok(n)
    }

    /// Writes masters, moments, the step count and hyperparameters to one
    /// safetensors file, atomically.
    pub fn save(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let p = c_path(path.as_ref(), "path")?;
        check(unsafe { sys::kt_optimizer_save(self.raw, p.as_ptr()) })
    }

    /// Restores what `save` wrote; the layer computes with the loaded masters.
    pub fn load(&mut self, path: impl AsRef<std::path::Path>) -> Result<()> {
        let p = c_path(path.as_ref(), "path")?;
        check(unsafe { sys::kt_optimizer_load(self.raw, p.as_ptr()) })
    }
}

impl Drop for Optimizer<'_> {
    fn drop(&mut self) {
        unsafe { sys::kt_optimizer_destroy(self.raw) };
    }
}
