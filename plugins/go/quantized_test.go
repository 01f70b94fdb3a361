package kt

import (
	"errors"
	"math"
	"math/rand"
	"testing"
)

// Quantized frozen bases through the binding: int8-per-channel and
// int4-group-32 layers report their format and bytes, compute with their
// dequantized weights (against a float64 reference of the weights read
// back), and stay within the quantization error kt_c_api.h states of a bf16
// layer with the same weights.
const (
	qE, qK, qH, qI, qT = 4, 2, 64, 48, 12
)

type qWeights struct{ wg, wu, wd []float32 }

func gaussian(r *rand.Rand, n int, scale float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64() * scale)
	}
	return v
}

func qSilu(g float64) float64 { return g / (1 + math.Exp(-g)) }

func qReference(w qWeights, x []float32, ids []int32, rw []float32) []float64 {
	y := make([]float64, qT*qH)
	for t := 0; t < qT; t++ {
		for j := 0; j < qK; j++ {
			e := int(ids[t*qK+j])
			g, u := make([]float64, qI), make([]float64, qI)
			for i := 0; i < qI; i++ {
				for h := 0; h < qH; h++ {
					g[i] += float64(w.wg[(e*qI+i)*qH+h]) * float64(x[t*qH+h])
					u[i] += float64(w.wu[(e*qI+i)*qH+h]) * float64(x[t*qH+h])
				}
			}
			for h := 0; h < qH; h++ {
				o := 0.0
				for i := 0; i < qI; i++ {
					o += float64(w.wd[(e*qH+h)*qI+i]) * qSilu(g[i]) * u[i]
				}
				y[t*qH+h] += float64(rw[t*qK+j]) * o
			}
		}
	}
	return y
}

func relL2(got, want []float64) float64 {
	num, den := 0.0, 0.0
	for i := range got {
		num += (got[i] - want[i]) * (got[i] - want[i])
		den += want[i] * want[i]
	}
	return math.Sqrt(num / den)
}

func align64(n int64) int64 { return (n + 63) / 64 * 64 }

// Bytes of one projection [n, k] of one expert (formats/packed_quant.h).
func quantBlockBytes(f WeightFormat, n, k int64) int64 {
	panels, kq := (n+15)/16, (k+31)/32*32
	bits, groups := int64(4), kq/32
	if f == FormatInt8Channel {
		bits, groups = 8, 1
	}
	return align64(align64(panels*16*kq*bits/8) + panels*groups*16*2)
}

func TestQuantizedLayersReportTheirFormatAndStayWithinTheStatedError(t *testing.T) {
	engine, err := NewEngine(&EngineOptions{NumThreads: 1, NoPinning: true, FP32Precision: true})
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	r := rand.New(rand.NewSource(5))
	w := qWeights{gaussian(r, qE*qI*qH, 1/math.Sqrt(qH)), gaussian(r, qE*qI*qH, 1/math.Sqrt(qH)),
		gaussian(r, qE*qH*qI, 1/math.Sqrt(qI))}
	x := gaussian(r, qT*qH, 1)
	ids := make([]int32, qT*qK)
	rw := make([]float32, qT*qK)
	for n := range ids {
		ids[n] = int32(((n/qK)*3 + n%qK) % qE)
		rw[n] = 0.25 + 0.5*float32(1-n%2)
	}
	run := func(f WeightFormat, int8 bool) ([]float64, qWeights, MoEInfo) {
		moe, err := engine.NewMoE(MoEOptions{NumExperts: qE, TopK: qK, Hidden: qH, Intermediate: qI,
			MaxTokens: qT, WeightFormat: f, Int8Compute: int8})
		if err != nil {
			t.Fatal(err)
		}
		defer moe.Close()
		if err := moe.LoadWeights(Arg{ArgWGate, Float32(w.wg, qE, qI, qH)}, Arg{ArgWUp, Float32(w.wu, qE, qI, qH)},
			Arg{ArgWDown, Float32(w.wd, qE, qH, qI)}); err != nil {
			t.Fatal(err)
		}
		y := make([]float32, qT*qH)
		if err := moe.Forward(Float32(x, qT, qH), Int32(ids, qT, qK), Float32(rw, qT, qK), Float32(y, qT, qH)); err != nil {
			t.Fatal(err)
		}
		back := qWeights{make([]float32, qE*qI*qH), make([]float32, qE*qI*qH), make([]float32, qE*qH*qI)}
		if err := moe.ReadWeights(Arg{ArgWGate, Float32(back.wg, qE, qI, qH)}, Arg{ArgWUp, Float32(back.wu, qE, qI, qH)},
			Arg{ArgWDown, Float32(back.wd, qE, qH, qI)}); err != nil {
			t.Fatal(err)
		}
		info, err := moe.Info()
		if err != nil {
			t.Fatal(err)
		}
		y64 := make([]float64, len(y))
		for i, v := range y {
			y64[i] = float64(v)
		}
		return y64, back, info
	}
	yBF16, _, info := run(FormatBF16, false)
	if info.WeightFormat != FormatBF16 || info.WeightBytes != qE*3*qH*qI*2 {
		t.Fatalf("bf16 layer reports %+v", info)
	}
	all := func(w qWeights) []float64 {
		var v []float64
		for _, s := range [][]float32{w.wg, w.wu, w.wd} {
			for _, e := range s {
				v = append(v, float64(e))
			}
		}
		return v
	}
	// kt_c_api.h: W' is within 0.8 % (int8) and 9.7 % (int4) of W in
	// relative L2 on Gaussian rows; y, through three projections whose
	// first-order errors add, within 3x that of the bf16 layer's y.
	for _, c := range []struct {
		f      WeightFormat
		stated float64
	}{{FormatInt8Channel, 0.008}, {FormatInt4G32, 0.097}} {
		y, back, info := run(c.f, false)
		want := qE * (2*quantBlockBytes(c.f, qI, qH) + quantBlockBytes(c.f, qH, qI))
		if info.WeightFormat != c.f || info.WeightBytes != want || info.NumLoaded != qE || info.NumWeights != qE*3*qH*qI {
			t.Fatalf("%s: info %+v, expected %d bytes", c.f, info, want)
		}
		exact := relL2(y, qReference(back, x, ids, rw))
		weightErr := relL2(all(back), all(w))
		outputErr := relL2(y, yBF16)
		t.Logf("%s: %d bytes, y vs reference of W' %.2e, W' vs W %.4f, y vs bf16 layer %.4f", c.f, info.WeightBytes,
			exact, weightErr, outputErr)
		if exact > 2e-5 || weightErr > 1.1*c.stated || outputErr <= 0 || outputErr > 3*c.stated {
			t.Fatalf("%s: out of bounds", c.f)
		}
	}
	// Int8 activations (kt_c_api.h, "Int8 compute"): y within 1-2 % of the
	// same base with bf16 activations on Gaussian inputs, never equal to it.
	for _, f := range []WeightFormat{FormatInt8Channel, FormatInt4G32} {
		yPlain, _, plain := run(f, false)
		yInt8, _, info := run(f, true)
		outputErr := relL2(yInt8, yPlain)
		t.Logf("%s with int8 activations: y vs bf16 activations %.4f", f, outputErr)
		if !info.Int8Compute || plain.Int8Compute || outputErr <= 1e-3 || outputErr > 0.03 {
			t.Fatalf("%s with int8 activations: info %+v, error %.4f", f, info, outputErr)
		}
	}
	_, err = engine.NewMoE(MoEOptions{NumExperts: qE, TopK: qK, Hidden: qH, Intermediate: qI, Mode: ModeLoRA,
		LoRARank: 4, WeightFormat: FormatInt4G32, Int8Compute: true})
	var modeErr *Error
	if !errors.As(err, &modeErr) || modeErr.Status != ErrMode {
		t.Fatalf("int8 compute in LoRA mode: %v", err)
	}
	if FormatInt4G32.String() != "int4_g32" {
		t.Fatalf("name %q", FormatInt4G32.String())
	}
	_, err = engine.NewMoE(MoEOptions{NumExperts: qE, TopK: qK, Hidden: qH, Intermediate: qI, Mode: ModeFull,
		WeightFormat: FormatInt8Channel})
	var kerr *Error
	if !errors.As(err, &kerr) || kerr.Status != ErrMode {
		t.Fatalf("full mode of a quantized base: %v", err)
	}
}
