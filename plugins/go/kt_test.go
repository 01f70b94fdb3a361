package kt

import (
	"errors"
	"math"
	"strings"
	"testing"
)

// A small synthetic layer whose values are exact in bf16 (kt stores weights
// as bf16), checked against a float64 reference computed here.
const (
	numExperts   = 4
	topK         = 2
	hidden       = 16
	intermediate = 8
	tokens       = 5
)

func pattern(index, mult, mod int, scale float32) float32 {
	return float32((index*mult+7)%mod-mod/2) * scale
}

type layer struct {
	wg, wu, wd []float32 // [E,I,H], [E,I,H], [E,H,I]
	x, rw, dy  []float32 // [T,H], [T,K], [T,H]
	ids        []int32   // [T,K]
}

func newLayer() *layer {
	l := &layer{
		wg: make([]float32, numExperts*intermediate*hidden),
		wu: make([]float32, numExperts*intermediate*hidden),
		wd: make([]float32, numExperts*hidden*intermediate),
		x:  make([]float32, tokens*hidden),
		dy: make([]float32, tokens*hidden),
		rw: make([]float32, tokens*topK),
		// Token 2 has one route only (-1: no route).
		ids: []int32{0, 1, 2, 3, 1, -1, 3, 0, 2, 1},
	}
	for n := range l.wg {
		l.wg[n] = pattern(n, 37, 17, 1.0/32)
		l.wu[n] = pattern(n, 29, 13, 1.0/32)
	}
	for e := 0; e < numExperts; e++ {
		for i := 0; i < intermediate; i++ {
			for h := 0; h < hidden; h++ {
				n := (e*intermediate+i)*hidden + h
				l.wd[(e*hidden+h)*intermediate+i] = pattern(n, 23, 19, 1.0/32)
			}
		}
	}
	for n := range l.x {
		l.x[n] = pattern(n, 13, 11, 1.0/4)
		l.dy[n] = pattern(n, 7, 9, 1.0/8)
	}
	for t := 0; t < tokens; t++ {
		l.rw[t*topK], l.rw[t*topK+1] = 0.625, 0.375
	}
	return l
}

func silu(g float64) float64 { return g / (1 + math.Exp(-g)) }

// reference computes y, dx and the routing-weight gradient in float64.
func (l *layer) reference() (y, dx, drw []float64) {
	y = make([]float64, tokens*hidden)
	dx = make([]float64, tokens*hidden)
	drw = make([]float64, tokens*topK)
	for t := 0; t < tokens; t++ {
		for j := 0; j < topK; j++ {
			e := int(l.ids[t*topK+j])
			if e < 0 {
				continue
			}
			w := float64(l.rw[t*topK+j])
			g := make([]float64, intermediate)
			u := make([]float64, intermediate)
			for i := 0; i < intermediate; i++ {
				for h := 0; h < hidden; h++ {
					xv := float64(l.x[t*hidden+h])
					g[i] += float64(l.wg[(e*intermediate+i)*hidden+h]) * xv
					u[i] += float64(l.wu[(e*intermediate+i)*hidden+h]) * xv
				}
			}
			for h := 0; h < hidden; h++ {
				o := 0.0
				for i := 0; i < intermediate; i++ {
					o += float64(l.wd[(e*hidden+h)*intermediate+i]) * silu(g[i]) * u[i]
				}
				y[t*hidden+h] += w * o
				drw[t*topK+j] += float64(l.dy[t*hidden+h]) * o
			}
			for i := 0; i < intermediate; i++ {
				da := 0.0
				for h := 0; h < hidden; h++ {
					da += float64(l.wd[(e*hidden+h)*intermediate+i]) * float64(l.dy[t*hidden+h])
				}
				da *= w
				s := 1 / (1 + math.Exp(-g[i]))
				dg := da * u[i] * s * (1 + g[i]*(1-s))
				du := da * silu(g[i])
				for h := 0; h < hidden; h++ {
					dx[t*hidden+h] += float64(l.wg[(e*intermediate+i)*hidden+h])*dg +
						float64(l.wu[(e*intermediate+i)*hidden+h])*du
				}
			}
		}
	}
	return y, dx, drw
}

// expectClose compares against the reference's largest magnitude: the bf16
// activation between the two GEMMs bounds the error near 2^-8 of it.
func expectClose(t *testing.T, name string, got []float32, want []float64) {
	t.Helper()
	maxRef, maxErr := 0.0, 0.0
	for i := range want {
		maxRef = math.Max(maxRef, math.Abs(want[i]))
		maxErr = math.Max(maxErr, math.Abs(float64(got[i])-want[i]))
	}
	if maxRef == 0 || maxErr > 1e-2*maxRef || math.IsNaN(maxErr) {
		t.Fatalf("%s: max error %.3g against max |ref| %.3g", name, maxErr, maxRef)
	}
	t.Logf("%s: max error %.3g, max |ref| %.3g", name, maxErr, maxRef)
}

func newTestLayer(t *testing.T, l *layer) (*Engine, *MoE) {
	t.Helper()
	return newTestLayerOn(t, l, &EngineOptions{NumThreads: 2, NoPinning: true})
}

func newTestLayerOn(t *testing.T, l *layer, opts *EngineOptions) (*Engine, *MoE) {
	t.Helper()
	engine, err := NewEngine(opts)
	if err != nil {
		t.Fatal(err)
	}
	moe, err := engine.NewMoE(MoEOptions{NumExperts: numExperts, TopK: topK, Hidden: hidden,
		Intermediate: intermediate, MaxTokens: 64})
	if err != nil {
		engine.Close()
		t.Fatal(err)
	}
	err = moe.LoadWeights(
		Arg{ArgWGate, Float32(l.wg, numExperts, intermediate, hidden)},
		Arg{ArgWUp, Float32(l.wu, numExperts, intermediate, hidden)},
		Arg{ArgWDown, Float32(l.wd, numExperts, hidden, intermediate)})
	if err != nil {
		moe.Close()
		engine.Close()
		t.Fatal(err)
	}
	return engine, moe
}

func TestVersion(t *testing.T) {
	if LibraryABIVersion() != ABIVersion {
		t.Fatalf("libkt ABI %d, package ABI %d", LibraryABIVersion(), ABIVersion)
	}
	if Version() == "" || BuildInfo() == "" {
		t.Fatal("empty version or build info")
	}
	t.Logf("kt %s: %s", Version(), BuildInfo())
}

func TestNUMAOptionReportsNodesAndKeepsTheBits(t *testing.T) {
	l := newLayer()
	var outs [2][]float32
	for i, numa := range []bool{false, true} {
		engine, moe := newTestLayerOn(t, l, &EngineOptions{NumThreads: 2, NUMA: numa})
		workers, err := engine.NUMANodeWorkers()
		sum := 0
		for _, w := range workers {
			sum += w
		}
		if err != nil || sum != 2 || len(workers) == 0 || (!numa && len(workers) != 1) {
			t.Fatalf("NUMA %v: node workers %v, %v", numa, workers, err)
		}
		outs[i] = make([]float32, tokens*hidden)
		if err := moe.Forward(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
			Float32(l.rw, tokens, topK), Float32(outs[i], tokens, hidden)); err != nil {
			t.Fatal(err)
		}
		moe.Close()
		engine.Close()
	}
	sameBits(t, "y with NUMA on", outs[1], outs[0])
}

func TestForwardBackward(t *testing.T) {
	l := newLayer()
	engine, moe := newTestLayer(t, l)
	defer engine.Close()
	defer moe.Close()
	if n, err := engine.NumThreads(); err != nil || n != 2 {
		t.Fatalf("NumThreads = %d, %v", n, err)
	}

	y := make([]float32, tokens*hidden)
	ctx, err := moe.ForwardTrain(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y, tokens, hidden))
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	dx := make([]float32, tokens*hidden)
	drw := make([]float32, tokens*topK)
	if err := moe.Backward(ctx, nil, Arg{ArgDY, Float32(l.dy, tokens, hidden)},
		Arg{ArgDX, Float32(dx, tokens, hidden)}, Arg{ArgDRouteWeights, Float32(drw, tokens, topK)}); err != nil {
		t.Fatal(err)
	}
	wantY, wantDX, wantDRW := l.reference()
	expectClose(t, "y", y, wantY)
	expectClose(t, "dx", dx, wantDX)
	expectClose(t, "d(route weights)", drw, wantDRW)
	if drw[2*topK+1] != 0 {
		t.Fatalf("the unrouted slot got routing gradient %g", drw[2*topK+1])
	}

	// A context is spent by its backward.
	err = moe.Backward(ctx, nil, Arg{ArgDY, Float32(l.dy, tokens, hidden)})
	var ktErr *Error
	if !errors.As(err, &ktErr) || ktErr.Status != ErrContext {
		t.Fatalf("second backward: got %v, want a KT_ERR_CONTEXT error", err)
	}

	// Inference forward gives the same y.
	y2 := make([]float32, tokens*hidden)
	if err := moe.Forward(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y2, tokens, hidden)); err != nil {
		t.Fatal(err)
	}
	expectClose(t, "y (inference)", y2, wantY)
}

func TestErrorsCarryKtMessage(t *testing.T) {
	l := newLayer()
	engine, moe := newTestLayer(t, l)
	defer engine.Close()

	// y with the wrong hidden size: kt refuses it and says which argument.
	y := make([]float32, tokens*(hidden+1))
	err := moe.Forward(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y, tokens, hidden+1))
	if !errors.Is(err, &Error{Status: ErrShape}) {
		t.Fatalf("got %v, want a KT_ERR_SHAPE error", err)
	}
	var ktErr *Error
	if !errors.As(err, &ktErr) || ktErr.Message == "" {
		t.Fatalf("error without kt's message: %v", err)
	}
	t.Logf("kt says: %v", err)

	// An expert id outside [-1, E).
	bad := append([]int32(nil), l.ids...)
	bad[0] = numExperts
	err = moe.Forward(Float32(l.x, tokens, hidden), Int32(bad, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(make([]float32, tokens*hidden), tokens, hidden))
	if !errors.Is(err, &Error{Status: ErrExpertID}) {
		t.Fatalf("got %v, want a KT_ERR_EXPERT_ID error", err)
	}

	// The engine refuses to close under a live layer, then closes once it is gone.
	if err := engine.Close(); !errors.Is(err, &Error{Status: ErrInvalidArgument}) {
		t.Fatalf("closing an engine in use: got %v", err)
	}
	moe.Close()
	moe.Close()
	if err := engine.Close(); err != nil {
		t.Fatal(err)
	}
	if err := moe.Forward(Tensor{}, Tensor{}, Tensor{}, Tensor{}); !errors.Is(err, &Error{Status: ErrInvalidHandle}) {
		t.Fatalf("closed layer: got %v", err)
	}
}

// MoEOptions' UseRSLoRA and LoRATargets reach kt_moe_options: kt checks the
// targets of a LoRA layer (a bit outside ProjAll is refused, naming the field).
func TestLoRAOptionsReachKt(t *testing.T) {
	engine, err := NewEngine(&EngineOptions{NumThreads: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	opts := MoEOptions{NumExperts: numExperts, TopK: topK, Hidden: hidden, Intermediate: intermediate,
		Mode: ModeLoRA, LoRARank: 2, LoRAAlpha: 4, UseRSLoRA: true, LoRATargets: ProjGate | ProjDown}
	moe, err := engine.NewMoE(opts)
	if err != nil {
		t.Fatal(err)
	}
	moe.Close()
	opts.LoRATargets = ProjAll << 1
	_, err = engine.NewMoE(opts)
	var ktErr *Error
	if !errors.As(err, &ktErr) || ktErr.Status != ErrInvalidArgument || !strings.Contains(ktErr.Message, "lora_targets") {
		t.Fatalf("LoRATargets %d: got %v, want KT_ERR_INVALID_ARGUMENT naming lora_targets", opts.LoRATargets, err)
	}
}
