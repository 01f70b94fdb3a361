package kt

import (
	"errors"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// forwardOnce runs the synthetic layer's tokens through m.
func forwardOnce(t *testing.T, m *MoE, l *layer) []float32 {
	t.Helper()
	y := make([]float32, tokens*hidden)
	if err := m.Forward(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y, tokens, hidden)); err != nil {
		t.Fatal(err)
	}
	return y
}

// A checkpoint written by kt is described, loaded into a layer (the same
// output as loading the weights by hand), read back, cached and reloaded.
func TestCheckpointLoadReadAndPackedCache(t *testing.T) {
	l := newLayer()
	dir := filepath.Join(t.TempDir(), "ckpt")
	weights := []Arg{{ArgWGate, Float32(l.wg, numExperts, intermediate, hidden)},
		{ArgWUp, Float32(l.wu, numExperts, intermediate, hidden)},
		{ArgWDown, Float32(l.wd, numExperts, hidden, intermediate)}}
	if err := WriteExperts(dir, &WriteOptions{ConfigJSON: `{"model_type": "qwen3_moe", "num_experts_per_tok": 2}`},
		LayerArgs{Layer: 4, Args: weights}); err != nil {
		t.Fatal(err)
	}
	ck, err := OpenCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	info, err := ck.Info()
	if err != nil || info.ModelType != "qwen3_moe" || info.Layout != LayoutPerExpert || info.NumMoELayers != 1 || info.TopK != topK {
		t.Fatalf("info %+v, %v", info, err)
	}
	layers, err := ck.Layers()
	if err != nil || len(layers) != 1 {
		t.Fatalf("layers %+v, %v", layers, err)
	}
	want := LayerInfo{Layer: 4, NumExperts: numExperts, Hidden: hidden, Intermediate: intermediate,
		Layout: LayoutPerExpert, Format: "dense", WeightDType: "BF16", Loadable: true,
		Bytes: 3 * numExperts * hidden * intermediate * 2, NumTensors: 3 * numExperts}
	if layers[0] != want {
		t.Fatalf("layer %+v, want %+v", layers[0], want)
	}
	engine, err := NewEngine(&EngineOptions{NumThreads: 1, NoPinning: true})
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	opts, err := ck.MoEOptions(4)
	if err != nil {
		t.Fatal(err)
	}
	fromCkpt, err := engine.NewMoE(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer fromCkpt.Close()
	if err := ck.LoadLayer(4, fromCkpt); err != nil {
		t.Fatal(err)
	}
	byHand, _ := engine.NewMoE(opts)
	defer byHand.Close()
	if err := byHand.LoadWeights(weights...); err != nil {
		t.Fatal(err)
	}
	y := forwardOnce(t, byHand, l)
	if got := forwardOnce(t, fromCkpt, l); !reflect.DeepEqual(got, y) {
		t.Fatalf("checkpoint-loaded output differs")
	}
	back := make([]float32, len(l.wd))
	if err := ck.ReadLayer(4, Arg{ArgWDown, Float32(back, numExperts, hidden, intermediate)}); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, l.wd) { // the pattern is exact in bf16
		t.Fatalf("read_layer differs")
	}
	cache := filepath.Join(t.TempDir(), "layer-4.ktpack")
	if err := fromCkpt.SavePacked(cache); err != nil {
		t.Fatal(err)
	}
	cached, _ := engine.NewMoE(opts)
	defer cached.Close()
	if err := cached.LoadPacked(cache, true); err != nil {
		t.Fatal(err)
	}
	if got := forwardOnce(t, cached, l); !reflect.DeepEqual(got, y) {
		t.Fatalf("packed-cache output differs")
	}
	err = ck.LoadLayer(7, cached)
	if !errors.Is(err, &Error{Status: ErrInvalidArgument}) || !strings.Contains(err.Error(), "kt_ckpt_load_layer") {
		t.Fatalf("missing layer: %v", err)
	}
	_, err = OpenCheckpoint(filepath.Join(dir, "missing"))
	if !errors.Is(err, &Error{Status: ErrIO}) || !strings.Contains(err.Error(), "kt_ckpt_open") {
		t.Fatalf("missing dir: %v", err)
	}
}

func TestAdapterRoundTrip(t *testing.T) {
	const rank = 2
	a := make([]float32, numExperts*rank*hidden)
	b := make([]float32, numExperts*intermediate*rank)
	for i := range a {
		a[i] = float32(i) / 64
	}
	for i := range b {
		b[i] = -float32(i) / 32
	}
	dir := filepath.Join(t.TempDir(), "adapter")
	cfg := AdapterConfig{Rank: rank, Alpha: 4, Targets: ProjGate, Layout: LayoutMixtral, BaseModel: "tiny"}
	if err := WriteAdapter(dir, cfg, LayerArgs{Layer: 3, Args: []Arg{
		{ArgLoRAAGate, Float32(a, numExperts, rank, hidden)},
		{ArgLoRABGate, Float32(b, numExperts, intermediate, rank)}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "adapter_config.json")); err != nil {
		t.Fatal(err)
	}
	got, err := ReadAdapterConfig(dir)
	wantCfg := AdapterConfig{Rank: rank, Alpha: 4, Targets: ProjGate, Layout: LayoutMixtral, DType: DTypeF32}
	if err != nil || got != wantCfg {
		t.Fatalf("config %+v, %v", got, err)
	}
	back := make([]float32, len(b))
	if err := ReadAdapter(dir, 3, Arg{ArgLoRABGate, Float32(back, numExperts, intermediate, rank)}); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(back, b) {
		t.Fatalf("LoRA B differs")
	}
	err = ReadAdapter(dir, 3, Arg{ArgLoRAAUp, Float32(a, numExperts, rank, hidden)})
	if !errors.Is(err, &Error{Status: ErrInvalidArgument}) || !strings.Contains(err.Error(), "kt_ckpt_adapter_read") {
		t.Fatalf("untargeted projection: %v", err)
	}
}

// An expert- and tensor-parallel rank's share (experts 3 and 1, intermediate
// rows 2-5) loads as those weights loaded by hand; a bad share is refused
// with kt's message and leaves the layer empty.
func TestCheckpointShareLoadsItsExpertsAndSlice(t *testing.T) {
	l := newLayer()
	dir := filepath.Join(t.TempDir(), "ckpt")
	if err := WriteExperts(dir, nil, LayerArgs{Layer: 0, Args: []Arg{
		{ArgWGate, Float32(l.wg, numExperts, intermediate, hidden)},
		{ArgWUp, Float32(l.wu, numExperts, intermediate, hidden)},
		{ArgWDown, Float32(l.wd, numExperts, hidden, intermediate)}}}); err != nil {
		t.Fatal(err)
	}
	ck, err := OpenCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	experts, i0, i1 := []int64{3, 1}, 2, 6
	es, is := len(experts), i1-i0
	var sg, su, sd []float32
	for _, e := range experts {
		for r := i0; r < i1; r++ {
			sg = append(sg, l.wg[(int(e)*intermediate+r)*hidden:(int(e)*intermediate+r+1)*hidden]...)
			su = append(su, l.wu[(int(e)*intermediate+r)*hidden:(int(e)*intermediate+r+1)*hidden]...)
		}
		for h := 0; h < hidden; h++ {
			sd = append(sd, l.wd[(int(e)*hidden+h)*intermediate+i0:(int(e)*hidden+h)*intermediate+i1]...)
		}
	}
	engine, err := NewEngine(&EngineOptions{NumThreads: 1, NoPinning: true})
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()
	opts := MoEOptions{NumExperts: int64(es), TopK: topK, Hidden: hidden, Intermediate: int64(is)}
	share, err := engine.NewMoE(opts)
	if err != nil {
		t.Fatal(err)
	}
	defer share.Close()
	part := &LoadLayerOptions{Experts: experts, IntermediateBegin: int64(i0), IntermediateEnd: int64(i1)}
	if err := ck.LoadLayerWith(0, share, part); err != nil {
		t.Fatal(err)
	}
	byHand, _ := engine.NewMoE(opts)
	defer byHand.Close()
	if err := byHand.LoadWeights(Arg{ArgWGate, Float32(sg, int64(es), int64(is), hidden)},
		Arg{ArgWUp, Float32(su, int64(es), int64(is), hidden)},
		Arg{ArgWDown, Float32(sd, int64(es), hidden, int64(is))}); err != nil {
		t.Fatal(err)
	}
	local := *l
	local.ids = []int32{0, 1, 1, -1, 0, 1, -1, 0, 1, 0} // this rank's two experts
	y := forwardOnce(t, byHand, &local)
	if got := forwardOnce(t, share, &local); !reflect.DeepEqual(got, y) {
		t.Fatalf("the share's output differs from its weights loaded by hand")
	}
	empty, _ := engine.NewMoE(opts)
	defer empty.Close()
	err = ck.LoadLayerWith(0, empty, &LoadLayerOptions{Experts: []int64{0, 0}, IntermediateBegin: 2, IntermediateEnd: 6})
	if !errors.Is(err, &Error{Status: ErrInvalidArgument}) || !strings.Contains(err.Error(), "experts[1] = 0 is listed twice") {
		t.Fatalf("a repeated expert: %v", err)
	}
	if info, _ := empty.Info(); info.NumLoaded != 0 {
		t.Fatalf("%d experts loaded by a refused share", info.NumLoaded)
	}
}
