package kt

import (
	"errors"
	"math"
	"path/filepath"
	"testing"
)

// A full-mode layer with fp32 weights and gradient buffers bound; one
// forward and backward fills the gradients.
func fullLayerWithGrads(t *testing.T, l *layer) (*Engine, *MoE, [3][]float32, [3][]float32) {
	t.Helper()
	engine, err := NewEngine(&EngineOptions{NumThreads: 2, NoPinning: true})
	if err != nil {
		t.Fatal(err)
	}
	moe, err := engine.NewMoE(MoEOptions{NumExperts: numExperts, TopK: topK, Hidden: hidden,
		Intermediate: intermediate, MaxTokens: 64, Mode: ModeFull})
	if err != nil {
		engine.Close()
		t.Fatal(err)
	}
	w := [3][]float32{append([]float32(nil), l.wg...), append([]float32(nil), l.wu...), append([]float32(nil), l.wd...)}
	var g [3][]float32
	for p := range g {
		g[p] = make([]float32, len(w[p]))
	}
	in, out := [3]int64{hidden, hidden, intermediate}, [3]int64{intermediate, intermediate, hidden}
	var args []Arg
	for p := 0; p < 3; p++ {
		args = append(args, Arg{ArgWGate + ArgID(p), Float32(w[p], numExperts, out[p], in[p])},
			Arg{ArgGradWGate + ArgID(p), Float32(g[p], numExperts, out[p], in[p])})
	}
	// Loading packs the weights the layer computes with; binding makes the
	// same tensors its trainable parameters.
	if err := moe.LoadWeights(args[0], args[2], args[4]); err != nil {
		t.Fatal(err)
	}
	if err := moe.Bind(args...); err != nil {
		t.Fatal(err)
	}
	y := make([]float32, tokens*hidden)
	ctx, err := moe.ForwardTrain(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y, tokens, hidden))
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	if err := moe.Backward(ctx, nil, Arg{ArgDY, Float32(l.dy, tokens, hidden)}); err != nil {
		t.Fatal(err)
	}
	return engine, moe, w, g
}

// torch.optim.AdamW's step on one element (double for the scalars, as kt).
func adamwReference(p, g, m, v float32, step int, o OptimizerOptions) (float32, float32, float32) {
	p = p * float32(1-o.LR*o.WeightDecay)
	m = float32(math.FMA(float64(g), float64(float32(1-o.Beta1)), float64(m*float32(o.Beta1))))
	v = float32(math.FMA(float64(float32(1-o.Beta2)*g), float64(g), float64(v*float32(o.Beta2))))
	bc1 := 1 - math.Pow(o.Beta1, float64(step))
	bc2 := 1 - math.Pow(o.Beta2, float64(step))
	denom := float32(math.Sqrt(float64(v)))/float32(math.Sqrt(bc2)) + float32(o.Eps)
	return p + (float32(-(o.LR/bc1))*m)/denom, m, v
}

func TestLayerOptimizer(t *testing.T) {
	l := newLayer()
	engine, moe, w, g := fullLayerWithGrads(t, l)
	defer engine.Close()
	defer moe.Close()
	opts := DefaultOptimizerOptions()
	if opts.Algorithm != AdamW || opts.LR != 1e-3 || opts.Beta2 != 0.999 {
		t.Fatalf("defaults %+v", opts)
	}
	opts.LR = 1e-2
	opt, err := moe.NewOptimizer(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer opt.Close()

	before := append([]float32(nil), w[0]...)
	norm, err := opt.GradSqNorm()
	if err != nil {
		t.Fatal(err)
	}
	want := 0.0
	for p := range g {
		for _, x := range g[p] {
			want += float64(x) * float64(x)
		}
	}
	if want == 0 || math.Abs(norm-want) > 1e-9*want {
		t.Fatalf("GradSqNorm %g, want %g", norm, want)
	}

	// Two steps against the element-wise reference.
	dir := t.TempDir()
	m, v := make([]float32, len(before)), make([]float32, len(before))
	ref := append([]float32(nil), before...)
	for step := 1; step <= 2; step++ {
		made, err := opt.Step(1, 1)
		if err != nil || !made {
			t.Fatalf("step %d: made %v, %v", step, made, err)
		}
		for i := range ref {
			ref[i], m[i], v[i] = adamwReference(ref[i], g[0][i], m[i], v[i], step, opts)
		}
		for i := range ref {
			if d := math.Abs(float64(w[0][i] - ref[i])); d > 1e-6*math.Abs(float64(ref[i]))+1e-9 {
				t.Fatalf("step %d: w_gate[%d] = %g, reference %g", step, i, w[0][i], ref[i])
			}
		}
		if step == 1 {
			if err := opt.Save(filepath.Join(dir, "state.safetensors")); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n, err := opt.Steps(); err != nil || n != 2 {
		t.Fatalf("Steps = %d, %v", n, err)
	}

	// Load goes back to the saved step: masters (the fp32 weights) and count.
	afterOne := make([]float32, len(before))
	mm, vv := make([]float32, len(before)), make([]float32, len(before))
	for i := range afterOne {
		afterOne[i], mm[i], vv[i] = adamwReference(before[i], g[0][i], 0, 0, 1, opts)
	}
	if err := opt.Load(filepath.Join(dir, "state.safetensors")); err != nil {
		t.Fatal(err)
	}
	if n, _ := opt.Steps(); n != 1 {
		t.Fatalf("Steps after Load = %d, want 1", n)
	}
	for i := range afterOne {
		if d := math.Abs(float64(w[0][i] - afterOne[i])); d > 1e-6*math.Abs(float64(afterOne[i]))+1e-9 {
			t.Fatalf("after Load: w_gate[%d] = %g, want %g", i, w[0][i], afterOne[i])
		}
	}

	// A learning-rate schedule changes lr; the algorithm cannot change.
	opts.LR = 5e-3
	if err := opt.SetOptions(opts); err != nil {
		t.Fatal(err)
	}
	if got, _ := opt.Options(); got.LR != 5e-3 {
		t.Fatalf("lr %g after SetOptions", got.LR)
	}
	bad := opts
	bad.Algorithm = SGD
	var ktErr *Error
	if err := opt.SetOptions(bad); !errors.As(err, &ktErr) || ktErr.Status != ErrInvalidArgument {
		t.Fatalf("changing the algorithm: %v", err)
	}

	// A non-finite gradient skips the step and changes nothing.
	g[1][3] = float32(math.Inf(1))
	kept := append([]float32(nil), w[1]...)
	made, err := opt.Step(1, 1)
	if err != nil || made {
		t.Fatalf("step over an inf gradient: made %v, %v", made, err)
	}
	for i := range kept {
		if w[1][i] != kept[i] {
			t.Fatalf("w_up[%d] changed by a skipped step", i)
		}
	}
	opt.Close()
	if _, err := opt.Step(1, 1); !errors.As(err, &ktErr) {
		t.Fatalf("step after Close: %v", err)
	}
}

func TestOptimizerOfAnInferenceLayerIsRefused(t *testing.T) {
	l := newLayer()
	engine, moe := newTestLayer(t, l)
	defer engine.Close()
	defer moe.Close()
	_, err := moe.NewOptimizer(DefaultOptimizerOptions())
	var ktErr *Error
	if !errors.As(err, &ktErr) || ktErr.Status != ErrMode {
		t.Fatalf("got %v, want KT_ERR_MODE", err)
	}
}
