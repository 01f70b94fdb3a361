package kt

import (
	"errors"
	"math"
	"testing"
)

func sameBits(t *testing.T, what string, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s[%d] = %g, want %g (bit for bit)", what, i, got[i], want[i])
		}
	}
}

func allZero(v []float32) bool {
	for _, x := range v {
		if x != 0 {
			return false
		}
	}
	return true
}

func TestJobForwardEqualsSynchronousForward(t *testing.T) {
	l := newLayer()
	engine, moe := newTestLayer(t, l)
	defer engine.Close()
	defer moe.Close()
	want := forwardOnce(t, moe, l)

	y := make([]float32, tokens*hidden)
	job, err := moe.SubmitForward(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y, tokens, hidden), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := job.Wait(); err != nil {
		t.Fatal(err)
	}
	if !job.Done() {
		t.Fatal("Done is false after Wait")
	}
	sameBits(t, "y (job)", y, want)
	if err := job.Wait(); err != nil {
		t.Fatalf("second Wait: %v", err)
	}
	if err := job.Close(); err != nil {
		t.Fatal(err)
	}
	if err := job.Close(); err != nil || !job.Done() {
		t.Fatalf("closed job: Close %v, Done %v", err, job.Done())
	}

	// A deferred job waits for the host: nothing runs until Run, and y is
	// written at Wait.
	y = make([]float32, tokens*hidden)
	job, err = moe.SubmitForward(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y, tokens, hidden), &SubmitOptions{Deferred: true})
	if err != nil {
		t.Fatal(err)
	}
	defer job.Close()
	if job.Done() {
		t.Fatal("a deferred job is done before it ran")
	}
	job.Run()
	if !job.Done() {
		t.Fatal("Done is false after Run")
	}
	if !allZero(y) {
		t.Fatal("y changed before Wait")
	}
	if err := job.Wait(); err != nil {
		t.Fatal(err)
	}
	sameBits(t, "y (deferred job)", y, want)

	// Closing an unwaited job waits for it and delivers y.
	y = make([]float32, tokens*hidden)
	job, err = moe.SubmitForward(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y, tokens, hidden), &SubmitOptions{Deferred: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := job.Close(); err != nil {
		t.Fatal(err)
	}
	sameBits(t, "y (closed job)", y, want)
}

func TestJobBackwardEqualsSynchronousBackward(t *testing.T) {
	l := newLayer()
	engine, moe := newTestLayer(t, l)
	defer engine.Close()
	defer moe.Close()
	x, ids, rw := Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK), Float32(l.rw, tokens, topK)

	y, dx, drw := make([]float32, tokens*hidden), make([]float32, tokens*hidden), make([]float32, tokens*topK)
	ctx, err := moe.ForwardTrain(x, ids, rw, Float32(y, tokens, hidden))
	if err != nil {
		t.Fatal(err)
	}
	err = moe.Backward(ctx, nil, Arg{ArgDY, Float32(l.dy, tokens, hidden)},
		Arg{ArgDX, Float32(dx, tokens, hidden)}, Arg{ArgDRouteWeights, Float32(drw, tokens, topK)})
	ctx.Close()
	if err != nil {
		t.Fatal(err)
	}

	// Both deferred; waiting on the backward first runs the forward it needs.
	jy, jdx, jdrw := make([]float32, tokens*hidden), make([]float32, tokens*hidden), make([]float32, tokens*topK)
	deferred := &SubmitOptions{Deferred: true}
	fwd, jctx, err := moe.SubmitForwardTrain(x, ids, rw, Float32(jy, tokens, hidden), deferred)
	if err != nil {
		t.Fatal(err)
	}
	defer fwd.Close()
	defer jctx.Close()
	bwd, err := moe.SubmitBackward(jctx, nil, deferred, Arg{ArgDY, Float32(l.dy, tokens, hidden)},
		Arg{ArgDX, Float32(jdx, tokens, hidden)}, Arg{ArgDRouteWeights, Float32(jdrw, tokens, topK)})
	if err != nil {
		t.Fatal(err)
	}
	defer bwd.Close()
	if err := bwd.Wait(); err != nil {
		t.Fatal(err)
	}
	if !fwd.Done() {
		t.Fatal("the forward job is not done after the backward that needed it")
	}
	if err := fwd.Wait(); err != nil {
		t.Fatal(err)
	}
	sameBits(t, "y", jy, y)
	sameBits(t, "dx", jdx, dx)
	sameBits(t, "d(route weights)", jdrw, drw)
}

func TestJobErrors(t *testing.T) {
	l := newLayer()
	engine, moe := newTestLayer(t, l)
	defer engine.Close()
	x, ids, rw := Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK), Float32(l.rw, tokens, topK)

	// Arguments are checked at submission.
	y := make([]float32, tokens*(hidden+1))
	if _, err := moe.SubmitForward(x, ids, rw, Float32(y, tokens, hidden+1), nil); !errors.Is(err, &Error{Status: ErrShape}) {
		t.Fatalf("wrong y: got %v, want KT_ERR_SHAPE", err)
	}
	if _, err := moe.SubmitBackward(nil, nil, nil, Arg{ArgDY, Float32(l.dy, tokens, hidden)}); !errors.Is(err, &Error{Status: ErrContext}) {
		t.Fatalf("nil context: got %v, want KT_ERR_CONTEXT", err)
	}

	// A deferred job of a layer closed before the job ran is cancelled: it
	// fails when waited for, and y stays as it was.
	y = make([]float32, tokens*hidden)
	fwd, ctx, err := moe.SubmitForwardTrain(x, ids, rw, Float32(y, tokens, hidden), &SubmitOptions{Deferred: true})
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	moe.Close()
	if err := fwd.Wait(); !errors.Is(err, &Error{Status: ErrInvalidHandle}) {
		t.Fatalf("a deferred job of a closed layer: got %v, want KT_ERR_INVALID_HANDLE", err)
	}
	if !allZero(y) {
		t.Fatal("a cancelled job wrote y")
	}
	if err := fwd.Close(); !errors.Is(err, &Error{Status: ErrInvalidHandle}) {
		t.Fatalf("Close of the cancelled job: got %v", err)
	}
	if _, err := moe.SubmitForward(x, ids, rw, Float32(y, tokens, hidden), nil); !errors.Is(err, &Error{Status: ErrInvalidHandle}) {
		t.Fatalf("closed layer: got %v, want KT_ERR_INVALID_HANDLE", err)
	}
}

func TestJobOptimizerStep(t *testing.T) {
	l := newLayer()
	engine, moe, w, g := fullLayerWithGrads(t, l)
	defer engine.Close()
	defer moe.Close()
	opt, err := moe.NewOptimizer(DefaultOptimizerOptions())
	if err != nil {
		t.Fatal(err)
	}
	defer opt.Close()
	before := append([]float32(nil), w[0]...)
	job, err := opt.SubmitStep(1, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := job.Close(); err != nil || !job.Stepped() {
		t.Fatalf("step job: %v, stepped %v", err, job.Stepped())
	}
	if n, err := opt.Steps(); err != nil || n != 1 {
		t.Fatalf("Steps = %d, %v", n, err)
	}
	changed := false
	for i := range before {
		changed = changed || w[0][i] != before[i]
	}
	if !changed {
		t.Fatal("the step job did not change the weights")
	}

	// A non-finite gradient skips the step.
	g[1][3] = float32(math.Inf(1))
	job, err = opt.SubmitStep(1, 1, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := job.Wait(); err != nil || job.Stepped() {
		t.Fatalf("non-finite step job: %v, stepped %v", err, job.Stepped())
	}
	job.Close()
	if n, _ := opt.Steps(); n != 1 {
		t.Fatalf("Steps = %d after a skipped step", n)
	}
}
