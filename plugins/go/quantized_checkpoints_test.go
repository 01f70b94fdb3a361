package kt

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// Quantized checkpoints through the binding: an fp8 checkpoint (128x128
// blocks), a DeepSeek-V4 style MXFP4 one and an asymmetric
// compressed-tensors int4 one (zero points), written here as their models
// store them, report the format that holds each layer as stored (the int4
// layer holds exactly (q - z) * scale of its bits); the layer
// loaded in that format saves a packed cache that ReadPackedInfo reports in
// the same format, maps back with the same weights and output, and is
// refused (naming both formats) by a bf16 layer.
const (
	ckE, ckK, ckH, ckI, ckT = 3, 2, 160, 96, 5
)

type stTensor struct {
	name, dtype string
	shape       []int
	data        []byte
}

// writeSafetensors writes u64 header length, the JSON header, the data.
func writeSafetensors(t *testing.T, path string, tensors []stTensor) {
	t.Helper()
	parts := make([]string, 0, len(tensors))
	offset := 0
	for _, x := range tensors {
		dims := make([]string, len(x.shape))
		for i, d := range x.shape {
			dims[i] = fmt.Sprint(d)
		}
		parts = append(parts, fmt.Sprintf(`"%s":{"dtype":"%s","shape":[%s],"data_offsets":[%d,%d]}`,
			x.name, x.dtype, strings.Join(dims, ","), offset, offset+len(x.data)))
		offset += len(x.data)
	}
	header := "{" + strings.Join(parts, ",") + "}"
	for len(header)%8 != 0 {
		header += " "
	}
	out := make([]byte, 8, 8+len(header)+offset)
	binary.LittleEndian.PutUint64(out, uint64(len(header)))
	out = append(out, header...)
	for _, x := range tensors {
		out = append(out, x.data...)
	}
	if err := os.WriteFile(path, out, 0o644); err != nil {
		t.Fatal(err)
	}
}

// (out, in) of gate, up, down.
var ckShapes = [3][2]int{{ckI, ckH}, {ckI, ckH}, {ckH, ckI}}

// fp8Checkpoint: DeepSeek-V3's weight F8_E4M3 [out, in] (exponent fields
// <= 9: no NaN) and weight_scale_inv F32 [ceil(out/128), ceil(in/128)]; layer 1.
func fp8Checkpoint(t *testing.T, dir string, r *rand.Rand) int64 {
	var tensors []stTensor
	for e := 0; e < ckE; e++ {
		for p, name := range []string{"gate_proj", "up_proj", "down_proj"} {
			out, in := ckShapes[p][0], ckShapes[p][1]
			base := fmt.Sprintf("model.layers.1.mlp.experts.%d.%s", e, name)
			codes := make([]byte, out*in)
			for i := range codes {
				codes[i] = byte(r.Intn(2)<<7 | r.Intn(10)<<3 | r.Intn(8))
			}
			rows, cols := (out+127)/128, (in+127)/128
			scales := make([]byte, 4*rows*cols)
			for i := 0; i < rows*cols; i++ {
				s := float32((1 + r.Float64()) / (8 * math.Sqrt(float64(in))))
				binary.LittleEndian.PutUint32(scales[4*i:], math.Float32bits(s))
			}
			tensors = append(tensors, stTensor{base + ".weight", "F8_E4M3", []int{out, in}, codes},
				stTensor{base + ".weight_scale_inv", "F32", []int{rows, cols}, scales})
		}
	}
	writeSafetensors(t, filepath.Join(dir, "model.safetensors"), tensors)
	config := fmt.Sprintf(`{"num_experts_per_tok": %d, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", `+
		`"activation_scheme": "dynamic", "weight_block_size": [128, 128]}}`, ckK)
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	return 1
}

// mxfp4Checkpoint: DeepSeek-V4 style weight U8 [out, in/2] (two e2m1 codes
// a byte) and scale F8_E8M0 [out, ceil(in/32)] near 2^-4; layer 2.
func mxfp4Checkpoint(t *testing.T, dir string, r *rand.Rand) int64 {
	var tensors []stTensor
	for e := 0; e < ckE; e++ {
		for p, name := range []string{"w1", "w3", "w2"} {
			out, in := ckShapes[p][0], ckShapes[p][1]
			base := fmt.Sprintf("layers.2.ffn.experts.%d.%s", e, name)
			codes := make([]byte, out*in/2)
			r.Read(codes)
			groups := (in + 31) / 32
			scales := make([]byte, out*groups)
			for i := range scales {
				scales[i] = byte(121 + r.Intn(5))
			}
			tensors = append(tensors, stTensor{base + ".weight", "U8", []int{out, in / 2}, codes},
				stTensor{base + ".scale", "F8_E8M0", []int{out, groups}, scales})
		}
	}
	writeSafetensors(t, filepath.Join(dir, "model.safetensors"), tensors)
	config := fmt.Sprintf(`{"num_experts_per_tok": %d, "quantization_config": {"quant_method": "mxfp4"}}`, ckK)
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	return 2
}

// int4ZPCheckpoint: compressed-tensors pack-quantized int4 with zero points
// (symmetric false): weight_packed I32 [out, in/8] (element c in bits
// 4 (c % 8) of word c / 8, q + 8), weight_scale BF16 [out, in/32],
// weight_zero_point I32 [ceil(out/8), in/32] (row r in bits 4 (r % 8),
// z + 8), weight_shape. Layer 3. want gets the weights decoded here:
// (q - z) * scale, gate, up, down [E][out][in].
func int4ZPCheckpoint(want *[3][]float32) func(*testing.T, string, *rand.Rand) int64 {
	return func(t *testing.T, dir string, r *rand.Rand) int64 {
		var tensors []stTensor
		for e := 0; e < ckE; e++ {
			for p, name := range []string{"gate_proj", "up_proj", "down_proj"} {
				out, in := ckShapes[p][0], ckShapes[p][1]
				groups, zrows := in/32, (out+7)/8
				base := fmt.Sprintf("model.layers.3.mlp.experts.%d.%s", e, name)
				codes, zeros := make([]byte, out*in/2), make([]byte, zrows*groups*4)
				r.Read(codes)
				r.Read(zeros)
				scales := make([]byte, out*groups*2)
				for i := 0; i < out*groups; i++ {
					binary.LittleEndian.PutUint16(scales[2*i:], uint16(0x3c80+r.Intn(128))) // 2^-6 .. 2^-5
				}
				shape := make([]byte, 16)
				binary.LittleEndian.PutUint64(shape, uint64(out))
				binary.LittleEndian.PutUint64(shape[8:], uint64(in))
				tensors = append(tensors, stTensor{base + ".weight_packed", "I32", []int{out, in / 8}, codes},
					stTensor{base + ".weight_scale", "BF16", []int{out, groups}, scales},
					stTensor{base + ".weight_zero_point", "I32", []int{zrows, groups}, zeros},
					stTensor{base + ".weight_shape", "I64", []int{2}, shape})
				nibble := func(b []byte, word, i int) int { return int(b[word*4+i/2]>>(4*(i%2))) & 15 }
				for row := 0; row < out; row++ {
					for c := 0; c < in; c++ {
						q := nibble(codes, row*in/8+c/8, c%8)
						z := nibble(zeros, (row/8)*groups+c/32, row%8)
						s := math.Float32frombits(uint32(binary.LittleEndian.Uint16(scales[2*(row*groups+c/32):])) << 16)
						want[p] = append(want[p], float32(q-z)*s)
					}
				}
			}
		}
		writeSafetensors(t, filepath.Join(dir, "model.safetensors"), tensors)
		config := fmt.Sprintf(`{"num_experts_per_tok": %d, "quantization_config": {"quant_method": "compressed-tensors", `+
			`"format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"], "weights": `+
			`{"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": false}}}}}`, ckK)
		if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(config), 0o644); err != nil {
			t.Fatal(err)
		}
		return 3
	}
}

func ckForward(t *testing.T, m *MoE) []float32 {
	t.Helper()
	x := make([]float32, ckT*ckH)
	for i := range x {
		x[i] = float32(i%13)/8 - 0.7
	}
	ids, rw := make([]int32, ckT*ckK), make([]float32, ckT*ckK)
	for i := range ids {
		ids[i] = int32((i*2 + i/ckK) % ckE)
		rw[i] = 0.25
		if i%ckK == 0 {
			rw[i] = 0.75
		}
	}
	y := make([]float32, ckT*ckH)
	if err := m.Forward(Float32(x, ckT, ckH), Int32(ids, ckT, ckK), Float32(rw, ckT, ckK), Float32(y, ckT, ckH)); err != nil {
		t.Fatal(err)
	}
	return y
}

func ckWeights(t *testing.T, m *MoE) [3][]float32 {
	t.Helper()
	w := [3][]float32{make([]float32, ckE*ckI*ckH), make([]float32, ckE*ckI*ckH), make([]float32, ckE*ckH*ckI)}
	if err := m.ReadWeights(Arg{ArgWGate, Float32(w[0], ckE, ckI, ckH)}, Arg{ArgWUp, Float32(w[1], ckE, ckI, ckH)},
		Arg{ArgWDown, Float32(w[2], ckE, ckH, ckI)}); err != nil {
		t.Fatal(err)
	}
	return w
}

// The checkpoints these tests write: fp8 blocks, mxfp4 and int4 with zero
// points (whose weights, decoded as written, go to *int4ZPWant).
type quantCkptCase struct {
	name   string
	write  func(*testing.T, string, *rand.Rand) int64
	format WeightFormat
	group  int64
}

func quantCkptCases(int4ZPWant *[3][]float32) []quantCkptCase {
	return []quantCkptCase{{"fp8", fp8Checkpoint, FormatFP8B128, 128}, {"mxfp4", mxfp4Checkpoint, FormatMXFP4, 32},
		{"int4_zp", int4ZPCheckpoint(int4ZPWant), FormatInt4G32ZP, 32}}
}

// writtenCheckpoint writes c's checkpoint into a new directory: its path and
// the layer number it holds.
func writtenCheckpoint(t *testing.T, c quantCkptCase) (string, int64) {
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir, c.write(t, dir, rand.New(rand.NewSource(7)))
}

func TestQuantizedCheckpointsMakePackedCachesOfTheirFormat(t *testing.T) {
	engine, err := NewEngine(&EngineOptions{NumThreads: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	var int4ZPWant [3][]float32
	for _, c := range quantCkptCases(&int4ZPWant) {
		dir, layer := writtenCheckpoint(t, c)
		ck, err := OpenCheckpoint(dir)
		if err != nil {
			t.Fatal(err)
		}
		layers, err := ck.Layers()
		if err != nil || len(layers) != 1 || layers[0].WeightFormat != c.format || layers[0].GroupSize != c.group {
			t.Fatalf("%s: layers %+v, %v", c.name, layers, err)
		}
		opts, err := ck.MoEOptions(layer)
		if err != nil || opts.WeightFormat != c.format {
			t.Fatalf("%s: options %+v, %v", c.name, opts, err)
		}
		opts.MaxTokens = ckT
		loaded, err := engine.NewMoE(opts)
		if err != nil {
			t.Fatal(err)
		}
		if err := ck.LoadLayer(layer, loaded); err != nil {
			t.Fatal(err)
		}
		ck.Close()
		info, err := loaded.Info()
		if err != nil || info.WeightFormat != c.format {
			t.Fatalf("%s: info %+v, %v", c.name, info, err)
		}
		if c.format == FormatInt4G32ZP {
			if c.format.String() != "int4_g32_zp" || info.WeightBytes >= info.NumWeights {
				t.Fatalf("%s: %q, %d bytes for %d weights", c.name, c.format.String(), info.WeightBytes, info.NumWeights)
			}
			if !reflect.DeepEqual(ckWeights(t, loaded), int4ZPWant) {
				t.Fatalf("%s: the layer does not hold (q - z) * scale of the checkpoint's bits", c.name)
			}
			for _, v := range ckForward(t, loaded) {
				if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
					t.Fatalf("%s: forward gave %v", c.name, v)
				}
			}
		}
		cache := filepath.Join(t.TempDir(), "layer.ktpack")
		if err := loaded.SavePacked(cache); err != nil {
			t.Fatal(err)
		}
		p, err := ReadPackedInfo(cache)
		if err != nil {
			t.Fatal(err)
		}
		st, _ := os.Stat(cache)
		want := PackedInfo{ckE, ckH, ckI, false, c.format, ckE, info.WeightBytes, st.Size(), p.FormatVersion}
		if p != want || p.FormatVersion < 1 {
			t.Fatalf("%s: packed info %+v, want %+v", c.name, p, want)
		}
		if p.WeightFormat.String() != c.format.String() || c.format.String() == "unknown" {
			t.Fatalf("%s: format name %q", c.name, p.WeightFormat.String())
		}
		mapped, err := engine.NewMoE(opts)
		if err != nil {
			t.Fatal(err)
		}
		if err := mapped.LoadPacked(cache, true); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(ckWeights(t, mapped), ckWeights(t, loaded)) {
			t.Fatalf("%s: the cached weights differ from the checkpoint's", c.name)
		}
		if !reflect.DeepEqual(ckForward(t, mapped), ckForward(t, loaded)) {
			t.Fatalf("%s: the cached layer's output differs", c.name)
		}
		bf16Opts := opts
		bf16Opts.WeightFormat = FormatBF16
		bf16, err := engine.NewMoE(bf16Opts)
		if err != nil {
			t.Fatal(err)
		}
		err = bf16.LoadPacked(cache, true)
		msg := fmt.Sprintf("the cache holds %s weights, the layer stores bf16", c.format)
		if !errors.Is(err, &Error{Status: ErrInvalidArgument}) || !strings.Contains(err.Error(), msg) {
			t.Fatalf("%s: loading into a bf16 layer: %v", c.name, err)
		}
		for _, m := range []*MoE{loaded, mapped, bf16} {
			m.Close()
		}
	}
}

// readSafetensors returns each tensor's bytes of a file writeSafetensors wrote.
func readSafetensors(t *testing.T, path string) map[string][]byte {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	n := binary.LittleEndian.Uint64(raw)
	var header map[string]struct {
		DataOffsets [2]int `json:"data_offsets"`
	}
	if err := json.Unmarshal(raw[8:8+n], &header); err != nil {
		t.Fatal(err)
	}
	out := map[string][]byte{}
	for name, h := range header {
		out[name] = raw[8+int(n)+h.DataOffsets[0] : 8+int(n)+h.DataOffsets[1]]
	}
	return out
}

// e4m3 is the value of an fp8 e4m3 code (bias 7; exponent field 0: subnormal).
func e4m3(b byte) float32 {
	e, m := int(b>>3)&15, float64(b&7)
	v := math.Ldexp(1+m/8, e-7)
	if e == 0 {
		v = math.Ldexp(m/8, -6)
	}
	if b&0x80 != 0 {
		v = -v
	}
	return float32(v)
}

// e2m1 values by code (sign in bit 3).
var e2m1 = [16]float32{0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6}

// decodedWeights decodes gate, up, down [E][out][in] from the bits of the
// fp8 or MXFP4 checkpoint in dir: the float32 product code * scale, unrounded.
func decodedWeights(t *testing.T, dir string, format WeightFormat) [3][]float32 {
	t.Helper()
	tensors := readSafetensors(t, filepath.Join(dir, "model.safetensors"))
	var want [3][]float32
	for e := 0; e < ckE; e++ {
		for p := 0; p < 3; p++ {
			out, in := ckShapes[p][0], ckShapes[p][1]
			for r := 0; r < out; r++ {
				for c := 0; c < in; c++ {
					var v float32
					switch format {
					case FormatFP8B128:
						base := fmt.Sprintf("model.layers.1.mlp.experts.%d.%s", e, []string{"gate_proj", "up_proj", "down_proj"}[p])
						codes, scales := tensors[base+".weight"], tensors[base+".weight_scale_inv"]
						at := (r/128)*((in+127)/128) + c/128
						s := math.Float32frombits(binary.LittleEndian.Uint32(scales[4*at:]))
						v = e4m3(codes[r*in+c]) * s
					case FormatMXFP4:
						base := fmt.Sprintf("layers.2.ffn.experts.%d.%s", e, []string{"w1", "w3", "w2"}[p])
						codes, scales := tensors[base+".weight"], tensors[base+".scale"]
						b := codes[r*in/2+c/2]
						if c%2 == 1 { // the even element is in the low nibble
							b >>= 4
						}
						v = e2m1[b&15] * float32(math.Ldexp(1, int(scales[r*((in+31)/32)+c/32])-127))
					default:
						t.Fatalf("no decoder for %v", format)
					}
					want[p] = append(want[p], v)
				}
			}
		}
	}
	return want
}

// roundBF16 rounds to the nearest bf16, ties to even (no NaN here).
func roundBF16(w [3][]float32) [3][]float32 {
	var out [3][]float32
	for p := range w {
		out[p] = make([]float32, len(w[p]))
		for i, v := range w[p] {
			b := math.Float32bits(v)
			b += 0x7fff + (b>>16)&1
			out[p][i] = math.Float32frombits(b &^ 0xffff)
		}
	}
	return out
}

func sameWeights(t *testing.T, what string, got, want [3][]float32) {
	t.Helper()
	for p := range got {
		if len(got[p]) != len(want[p]) {
			t.Fatalf("%s: projection %d has %d weights, want %d", what, p, len(got[p]), len(want[p]))
		}
		for i := range got[p] {
			if got[p][i] != want[p][i] {
				t.Fatalf("%s: projection %d weight %d is %v, want %v", what, p, i, got[p][i], want[p][i])
			}
		}
	}
}

// A quantized layer loads into a bf16 layer only with
// LoadLayerOptions.Dequantize: without it (LoadLayer, LoadLayerWith with nil
// or zero options) the load fails with ErrUnsupported naming the option and
// the layer keeps nothing; with it the layer holds the weights decoded here
// from the checkpoint's bits, rounded to bf16 (the layer of the checkpoint's
// format, read back and rounded, holds the same); a layer of another
// quantized format is refused either way (never re-quantized).
func TestQuantizedCheckpointsLoadIntoBF16OnlyWhenDequantized(t *testing.T) {
	engine, err := NewEngine(&EngineOptions{NumThreads: 2})
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	var int4ZPWant [3][]float32
	for _, c := range quantCkptCases(&int4ZPWant) {
		dir, layer := writtenCheckpoint(t, c)
		decoded := int4ZPWant // (q - z) * scale: exact in float32
		if c.format != FormatInt4G32ZP {
			decoded = decodedWeights(t, dir, c.format)
		}
		ck, err := OpenCheckpoint(dir)
		if err != nil {
			t.Fatal(err)
		}
		opts, err := ck.MoEOptions(layer)
		if err != nil || opts.WeightFormat != c.format {
			t.Fatalf("%s: options %+v, %v", c.name, opts, err)
		}
		opts.MaxTokens = ckT
		bf16Opts := opts
		bf16Opts.WeightFormat = FormatBF16
		bf16, err := engine.NewMoE(bf16Opts)
		if err != nil {
			t.Fatal(err)
		}
		refusals := []struct {
			call string
			load func() error
		}{
			{"kt_ckpt_load_layer", func() error { return ck.LoadLayer(layer, bf16) }},
			{"kt_ckpt_load_layer_with", func() error { return ck.LoadLayerWith(layer, bf16, nil) }},
			{"kt_ckpt_load_layer_with", func() error { return ck.LoadLayerWith(layer, bf16, &LoadLayerOptions{}) }},
		}
		for i, r := range refusals {
			err := r.load()
			var kerr *Error
			if !errors.As(err, &kerr) || kerr.Status != ErrUnsupported {
				t.Fatalf("%s: refusal %d: %v, want ErrUnsupported", c.name, i, err)
			}
			for _, part := range []string{r.call + ": layer ", "the kt_moe stores bf16",
				"create the kt_moe with weight_format " + c.format.String(), "kt_ckpt_load_options.dequantize = 1"} {
				if !strings.Contains(kerr.Message, part) || !strings.HasPrefix(kerr.Message, r.call+": ") {
					t.Fatalf("%s: refusal %d: %q does not start with %q or lacks %q", c.name, i, kerr.Message, r.call, part)
				}
			}
			if info, err := bf16.Info(); err != nil || info.NumLoaded != 0 {
				t.Fatalf("%s: refusal %d left %+v, %v", c.name, i, info, err)
			}
		}
		if err := ck.LoadLayerWith(layer, bf16, &LoadLayerOptions{Dequantize: true}); err != nil {
			t.Fatalf("%s: dequantized load: %v", c.name, err)
		}
		info, err := bf16.Info()
		if err != nil || info.WeightFormat != FormatBF16 || info.NumLoaded != ckE || info.WeightBytes != ckE*3*ckH*ckI*2 {
			t.Fatalf("%s: dequantized layer %+v, %v", c.name, info, err)
		}
		held := ckWeights(t, bf16)
		sameWeights(t, c.name+": dequantized bf16 layer vs the checkpoint's bits rounded to bf16", held, roundBF16(decoded))

		// Dequantize permits, never forces: the layer of the checkpoint's format loads it as stored.
		native, err := engine.NewMoE(opts)
		if err != nil {
			t.Fatal(err)
		}
		if err := ck.LoadLayerWith(layer, native, &LoadLayerOptions{Dequantize: true}); err != nil {
			t.Fatal(err)
		}
		if ni, err := native.Info(); err != nil || ni.WeightFormat != c.format || ni.NumLoaded != ckE {
			t.Fatalf("%s: native layer %+v, %v", c.name, ni, err)
		}
		sameWeights(t, c.name+": dequantized bf16 layer vs the native layer rounded", held, roundBF16(ckWeights(t, native)))

		otherOpts := opts
		otherOpts.WeightFormat = FormatInt8Channel
		other, err := engine.NewMoE(otherOpts)
		if err != nil {
			t.Fatal(err)
		}
		for _, dq := range []bool{false, true} {
			err := ck.LoadLayerWith(layer, other, &LoadLayerOptions{Dequantize: dq})
			want := "the kt_moe stores int8_channel: a quantized checkpoint is never re-quantized"
			if !errors.Is(err, &Error{Status: ErrUnsupported}) || !strings.Contains(err.Error(), want) {
				t.Fatalf("%s: into int8_channel (dequantize %v): %v", c.name, dq, err)
			}
			if oi, err := other.Info(); err != nil || oi.NumLoaded != 0 {
				t.Fatalf("%s: the refused int8_channel layer has %+v, %v", c.name, oi, err)
			}
		}
		ck.Close()
		if err := ck.LoadLayerWith(layer, bf16, nil); !errors.Is(err, &Error{Status: ErrInvalidHandle}) {
			t.Fatalf("%s: LoadLayerWith on a closed checkpoint: %v", c.name, err)
		}
		for _, m := range []*MoE{bf16, native, other} {
			m.Close()
		}
	}
}
