"""Every accuracy bound of the Python tests, in one place, with its reason.

Errors are relative L2 norms ||kt - ref|| / ||ref|| against the float64
reference of reference.py computed from the same (bf16-rounded) weights.

FP32: activations, LoRA factors and gradients in fp32 on kt's fp32-operand
kernels (an engine created with precision="fp32"): the only difference left is fp32 vs fp64
summation order over H or I terms, ~1e-7 per element; 2e-5 leaves room for
the longest sums (K up to 2048) and for cancellation in small gradients.

BF16: x, routing weights and outputs are bf16 and the dot products read bf16
operands. One bf16 rounding has a relative error up to 2^-9 = 0.2 % (RMS about
0.1 %); an output passes through a few such roundings (input, intermediate
activation fed to the down projection, the stored result), so 1 % is a bound
that a real error (a wrong index, a missed term) cannot meet. The goals of
docs/math.md (forward 0.3 %, dx 0.5 %, grads 0.3 %) are for fp32-accumulated
real shapes; the tests print the measured numbers next to them.

TRAINING: losses of the same model trained with kt experts (fp32 kernels) vs
pure torch experts, per step, relative. Both start from the same bf16-rounded
weights, so they differ only by fp32 summation order (~1e-7), which 30+ AdamW
steps amplify a little (AdamW divides by sqrt of the second moment, so tiny
gradients are not damped): 1e-4 is far above that (1.8e-7 measured) and far
below what one wrong gradient term gives (the curves part within a few steps).

BF16_TORCH: kt's output vs a bf16 *torch* model (test_hf): torch rounds every
intermediate (g, u, the activation, each expert's output before the weighted
sum) to bf16 where kt keeps fp32, so the gap is torch's extra roundings on top
of kt's: twice BF16.

FINITE_DIFFERENCE: central differences of kt's own fp32 forward with step
1e-2 along a fixed random direction v, summed in float64, compared with
<grad, v> relative to |grad| |v| (the largest a directional derivative can
be): truncation O(step^2) plus fp32 rounding of the outputs over 2 * step
measured at most 8e-6 over 300 directions; a missing or wrong term of the
gradient moves it by a sizeable fraction of |grad| |v| (a 5 % error in one
quantity already by ~1.6e-3 here), far above 1e-4.
"""
FP32 = 2e-5
BF16 = 1e-2
TRAINING = 1e-4
BF16_TORCH = 2 * BF16
FINITE_DIFFERENCE = 1e-4
