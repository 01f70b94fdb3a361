package kt

import (
	"testing"
	"time"
)

func TestGradHook(t *testing.T) {
	l := newLayer()
	engine, moe, _, _ := fullLayerWithGrads(t, l)
	defer engine.Close()
	defer moe.Close()

	type event struct {
		layer *MoE
		err   error // of a kt call made from the hook
	}
	events := make(chan event, 16)
	if err := moe.SetGradHook(func(m *MoE) {
		_, err := m.Info() // kt released the layer: the hook may call it
		events <- event{m, err}
	}); err != nil {
		t.Fatal(err)
	}
	x, ids, rw := Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK), Float32(l.rw, tokens, topK)
	dy := Arg{ArgDY, Float32(l.dy, tokens, hidden)}
	y := Float32(make([]float32, tokens*hidden), tokens, hidden)
	backward := func(opts *BackwardOptions) {
		t.Helper()
		ctx, err := moe.ForwardTrain(x, ids, rw, y)
		if err != nil {
			t.Fatal(err)
		}
		defer ctx.Close()
		if err := moe.Backward(ctx, opts, dy); err != nil {
			t.Fatal(err)
		}
	}
	expectEvents := func(what string, n int) {
		t.Helper()
		for i := 0; i < n; i++ {
			select {
			case e := <-events:
				if e.layer != moe || e.err != nil {
					t.Fatalf("%s: hook got layer %p (want %p), Info: %v", what, e.layer, moe, e.err)
				}
			case <-time.After(10 * time.Second):
				t.Fatalf("%s: %d of %d hook calls", what, i, n)
			}
		}
		select {
		case <-events:
			t.Fatalf("%s: more than %d hook calls", what, n)
		case <-time.After(100 * time.Millisecond):
		}
	}

	// Once per backward that wrote parameter gradients, on the backward's thread.
	backward(nil)
	expectEvents("backward", 1)
	backward(&BackwardOptions{Accumulate: true})
	backward(nil)
	expectEvents("two backwards", 2)
	backward(&BackwardOptions{NoParamGrads: true})
	expectEvents("backward without parameter gradients", 0)

	// On a kt job thread for a submitted backward (possibly after Wait returned).
	ctx, err := moe.ForwardTrain(x, ids, rw, y)
	if err != nil {
		t.Fatal(err)
	}
	job, err := moe.SubmitBackward(ctx, nil, nil, dy)
	if err != nil {
		t.Fatal(err)
	}
	if err := job.Close(); err != nil {
		t.Fatal(err)
	}
	ctx.Close()
	expectEvents("submitted backward", 1)

	// Cleared, the hook is not called.
	if err := moe.SetGradHook(nil); err != nil {
		t.Fatal(err)
	}
	backward(nil)
	expectEvents("cleared hook", 0)

	// A replaced hook is not called either; the new one is.
	replaced := make(chan struct{}, 4)
	if err := moe.SetGradHook(func(*MoE) { events <- event{moe, nil} }); err != nil {
		t.Fatal(err)
	}
	if err := moe.SetGradHook(func(*MoE) { replaced <- struct{}{} }); err != nil {
		t.Fatal(err)
	}
	backward(nil)
	expectEvents("replaced hook", 0)
	if len(replaced) != 1 {
		t.Fatalf("the new hook ran %d times", len(replaced))
	}

	moe.Close()
	if err := moe.SetGradHook(nil); err == nil {
		t.Fatal("SetGradHook on a closed layer succeeded")
	}
}
