package kt

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Multi-process tests: TestDist starts two copies of this test binary as
// ranks (TestDistRank, told its scenario, rank and directory by environment
// variables), which meet over Gloo on loopback.

const distWorld = 2

func TestDist(t *testing.T) {
	if !strings.Contains(BuildInfo(), "gloo") {
		t.Skip("libkt was built without Gloo: " + BuildInfo())
	}
	for _, scenario := range []string{"collectives", "owner", "expert_parallel", "checkpoint"} {
		t.Run(scenario, func(t *testing.T) {
			dir := t.TempDir()
			for _, store := range []string{"store", "gostore"} { // made before either rank looks
				if err := os.Mkdir(filepath.Join(dir, store), 0o755); err != nil {
					t.Fatal(err)
				}
			}
			ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
			defer cancel()
			cmds := make([]*exec.Cmd, distWorld)
			outs := make([]strings.Builder, distWorld)
			for r := range cmds {
				cmds[r] = exec.CommandContext(ctx, os.Args[0], "-test.run=^TestDistRank$", "-test.count=1", "-test.v")
				cmds[r].Env = append(os.Environ(), "KTGO_DIST_SCENARIO="+scenario, "KTGO_DIST_DIR="+dir,
					"KTGO_DIST_RANK="+strconv.Itoa(r))
				cmds[r].Stdout, cmds[r].Stderr = &outs[r], &outs[r]
				if err := cmds[r].Start(); err != nil {
					t.Fatal(err)
				}
			}
			for r, cmd := range cmds {
				if err := cmd.Wait(); err != nil {
					t.Errorf("rank %d: %v\n%s", r, err, outs[r].String())
				}
			}
		})
	}
}

// NCCL without a CUDA device (or without NCCL in the build) is a clean
// ErrUnsupported, never a hang.
func TestNCCLIsReportedCleanly(t *testing.T) {
	id, err := NCCLUniqueID()
	if err == nil && len(id) != NCCLUniqueIDBytes {
		t.Fatalf("NCCL id of %d bytes", len(id))
	}
	if err != nil && !errors.Is(err, &Error{Status: ErrUnsupported}) {
		t.Fatalf("NCCLUniqueID: %v", err)
	}
	if !strings.Contains(BuildInfo(), "gloo") {
		t.Skip("libkt was built without Gloo: " + BuildInfo())
	}
	comm, err := NewComm(CommOptions{Backend: "cuda:nccl,cpu:gloo", StorePath: t.TempDir(), Timeout: 5 * time.Second})
	if err != nil {
		if !errors.Is(err, &Error{Status: ErrUnsupported}) {
			t.Fatalf("NCCL communicator: %v", err)
		}
		t.Logf("no NCCL here: %v", err)
		return
	}
	defer comm.Close()
	if info, err := comm.Info(); err != nil || info.Backends.Device != DeviceCUDA {
		t.Fatalf("NCCL communicator: %+v, %v", info, err)
	}
}

func TestDistRank(t *testing.T) {
	rank, err := strconv.Atoi(os.Getenv("KTGO_DIST_RANK"))
	if err != nil {
		t.Skip("runs as a rank started by TestDist")
	}
	dir := os.Getenv("KTGO_DIST_DIR")
	switch scenario := os.Getenv("KTGO_DIST_SCENARIO"); scenario {
	case "collectives":
		distCollectives(t, rank, dir)
	case "owner":
		distMatchesOneProcess(t, rank, dir, DistOwner)
	case "expert_parallel":
		distMatchesOneProcess(t, rank, dir, DistExpertParallel)
	case "checkpoint":
		distCheckpoint(t, rank, dir)
	default:
		t.Fatalf("unknown scenario %q", scenario)
	}
}

func newComm(t *testing.T, rank int, opts CommOptions) *Comm {
	t.Helper()
	opts.Rank, opts.WorldSize, opts.Timeout = rank, distWorld, 30*time.Second
	c, err := NewComm(opts)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// dirStore is a Store over files of a directory, each published by a rename.
type dirStore string

func (d dirStore) path(key string) string { return filepath.Join(string(d), hex.EncodeToString([]byte(key))) }

func (d dirStore) Set(key string, value []byte) error {
	tmp := d.path(key) + ".tmp"
	if err := os.WriteFile(tmp, value, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, d.path(key))
}

// Get answers at once, "not there" for a missing key: kt waits for it.
func (d dirStore) Get(key string) ([]byte, bool, error) {
	v, err := os.ReadFile(d.path(key))
	if errors.Is(err, os.ErrNotExist) {
		return nil, false, nil
	}
	return v, err == nil, err
}

func distCollectives(t *testing.T, rank int, dir string) {
	comm := newComm(t, rank, CommOptions{StorePath: filepath.Join(dir, "store")})
	defer comm.Close()
	info, err := comm.Info()
	if err != nil {
		t.Fatal(err)
	}
	want := CommInfo{Rank: rank, WorldSize: distWorld, Backends: Backends{CPU: CommBackendGloo, Device: DeviceCPU},
		Timeout: 30 * time.Second, Usable: true}
	if info != want {
		t.Fatalf("Info = %+v, want %+v", info, want)
	}
	if err := comm.Barrier(); err != nil {
		t.Fatal(err)
	}
	v := make([]float32, 3)
	if rank == 1 {
		v = []float32{1.5, -2, 3}
	}
	if err := comm.Broadcast(Float32(v, 3), 1); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(v) != "[1.5 -2 3]" {
		t.Fatalf("broadcast from rank 1: %v", v)
	}
	in := []int64{int64(10*rank + 1), int64(10*rank + 2)}
	out := make([]int64, distWorld*2)
	if err := comm.Allgather(Int64(in, 2), Int64(out, distWorld, 2)); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(out) != "[1 2 11 12]" {
		t.Fatalf("allgather: %v", out)
	}

	// Bad input: a root outside the ranks, and an out that does not hold every rank's in.
	if err := comm.Broadcast(Float32(v, 3), distWorld); !errors.Is(err, &Error{Status: ErrInvalidArgument}) {
		t.Fatalf("broadcast from rank %d: got %v, want KT_ERR_INVALID_ARGUMENT", distWorld, err)
	}
	if err := comm.Allgather(Int64(in, 2), Int64(out[:2], 1, 2)); !errors.Is(err, &Error{Status: ErrShape}) {
		t.Fatalf("allgather into [1,2]: got %v, want KT_ERR_SHAPE", err)
	}
	if info, err := comm.Info(); err != nil || !info.Usable {
		t.Fatalf("after refused calls: %+v, %v", info, err)
	}
	if err := comm.Barrier(); err != nil {
		t.Fatal(err)
	}

	// A host's store instead of a directory (Go callbacks called by kt).
	store := filepath.Join(dir, "gostore")
	hosted := newComm(t, rank, CommOptions{Store: dirStore(store), StorePrefix: "go"})
	defer hosted.Close()
	if err := hosted.Allgather(Int64(in, 2), Int64(out, distWorld, 2)); err != nil || fmt.Sprint(out) != "[1 2 11 12]" {
		t.Fatalf("allgather over a Go store: %v, %v", out, err)
	}

	// Backend strings and options kt refuses before any rendezvous.
	if b, err := ParseBackend("cuda:nccl,cpu:gloo"); err != nil ||
		b != (Backends{CPU: CommBackendGloo, CUDA: CommBackendNCCL, Device: DeviceCUDA}) {
		t.Fatalf("ParseBackend: %+v, %v", b, err)
	}
	if _, err := ParseBackend("mpi"); !errors.Is(err, &Error{Status: ErrInvalidArgument}) {
		t.Fatalf("ParseBackend(mpi): %v", err)
	}
	if _, err := NewComm(CommOptions{Rank: 2, WorldSize: 2, StorePath: store}); !errors.Is(err, &Error{Status: ErrInvalidArgument}) {
		t.Fatalf("rank 2 of 2: %v", err)
	}
	if _, err := NewComm(CommOptions{}); !errors.Is(err, &Error{Status: ErrInvalidArgument}) {
		t.Fatalf("no store: %v", err)
	}
}

// distLayer is this rank's part of the test layer: its tokens [t0, t0+n).
func distTokens(rank int) (t0, n int) {
	if rank == 0 {
		return 0, 3
	}
	return 3, tokens - 3
}

// loadLocal loads the experts this rank holds (local order) from l.
func loadLocal(t *testing.T, d *DistMoE, l *layer) {
	t.Helper()
	experts, err := d.LocalExperts()
	if err != nil {
		t.Fatal(err)
	}
	if d.Layer() == nil {
		if len(experts) != 0 {
			t.Fatalf("no local layer but experts %v", experts)
		}
		return
	}
	n := int64(len(experts))
	per := intermediate * hidden
	var wg, wu, wd []float32
	for _, e := range experts {
		wg = append(wg, l.wg[int(e)*per:int(e+1)*per]...)
		wu = append(wu, l.wu[int(e)*per:int(e+1)*per]...)
		wd = append(wd, l.wd[int(e)*per:int(e+1)*per]...)
	}
	if err := d.Layer().LoadWeights(Arg{ArgWGate, Float32(wg, n, intermediate, hidden)},
		Arg{ArgWUp, Float32(wu, n, intermediate, hidden)}, Arg{ArgWDown, Float32(wd, n, hidden, intermediate)}); err != nil {
		t.Fatal(err)
	}
}

type rows struct{ y, dx, drw []float32 }

// oneProcess is the forward and backward of every rank's tokens in one layer.
func oneProcess(t *testing.T, l *layer) rows {
	engine, moe := newTestLayer(t, l)
	defer engine.Close()
	defer moe.Close()
	r := rows{make([]float32, tokens*hidden), make([]float32, tokens*hidden), make([]float32, tokens*topK)}
	ctx, err := moe.ForwardTrain(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(r.y, tokens, hidden))
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	if err := moe.Backward(ctx, nil, Arg{ArgDY, Float32(l.dy, tokens, hidden)},
		Arg{ArgDX, Float32(r.dx, tokens, hidden)}, Arg{ArgDRouteWeights, Float32(r.drw, tokens, topK)}); err != nil {
		t.Fatal(err)
	}
	return r
}

func newDistMoE(t *testing.T, comm *Comm, rank int, mode DistMode) (*Engine, *DistMoE) {
	t.Helper()
	var engine *Engine
	if mode == DistExpertParallel || rank == 0 {
		var err error
		if engine, err = NewEngine(&EngineOptions{NumThreads: 2, NoPinning: true}); err != nil {
			t.Fatal(err)
		}
	}
	d, err := comm.NewDistMoE(engine, MoEOptions{NumExperts: numExperts, TopK: topK, Hidden: hidden,
		Intermediate: intermediate, MaxTokens: 8}, &DistMoEOptions{Mode: mode})
	if err != nil {
		t.Fatal(err)
	}
	return engine, d
}

// distForward runs this rank's tokens through d (forward, backward).
func distForward(t *testing.T, d *DistMoE, l *layer, rank int) rows {
	t.Helper()
	t0, n := distTokens(rank)
	T := int64(n)
	r := rows{make([]float32, n*hidden), make([]float32, n*hidden), make([]float32, n*topK)}
	ctx, err := d.ForwardTrain(Float32(l.x[t0*hidden:(t0+n)*hidden], T, hidden),
		Int32(l.ids[t0*topK:(t0+n)*topK], T, topK), Float32(l.rw[t0*topK:(t0+n)*topK], T, topK), Float32(r.y, T, hidden))
	if err != nil {
		t.Fatal(err)
	}
	defer ctx.Close()
	if err := d.Backward(ctx, nil, Arg{ArgDY, Float32(l.dy[t0*hidden:(t0+n)*hidden], T, hidden)},
		Arg{ArgDX, Float32(r.dx, T, hidden)}, Arg{ArgDRouteWeights, Float32(r.drw, T, topK)}); err != nil {
		t.Fatal(err)
	}
	return r
}

func expectRows(t *testing.T, got, all rows, rank int) {
	t.Helper()
	t0, n := distTokens(rank)
	sameBits(t, "y", got.y, all.y[t0*hidden:(t0+n)*hidden])
	sameBits(t, "dx", got.dx, all.dx[t0*hidden:(t0+n)*hidden])
	sameBits(t, "d(route weights)", got.drw, all.drw[t0*topK:(t0+n)*topK])
}

func distMatchesOneProcess(t *testing.T, rank int, dir string, mode DistMode) {
	l := newLayer()
	want := oneProcess(t, l)
	comm := newComm(t, rank, CommOptions{StorePath: filepath.Join(dir, "store")})
	defer comm.Close()
	engine, d := newDistMoE(t, comm, rank, mode)
	defer func() {
		d.Close()
		if engine != nil {
			engine.Close()
		}
	}()
	experts, err := d.LocalExperts()
	if err != nil {
		t.Fatal(err)
	}
	wantExperts := "[0 1 2 3]"
	switch {
	case mode == DistExpertParallel:
		wantExperts = fmt.Sprint([]int64{int64(2 * rank), int64(2*rank + 1)})
	case rank != 0:
		wantExperts = "[]"
	}
	if fmt.Sprint(experts) != wantExperts || (d.Layer() == nil) != (wantExperts == "[]") {
		t.Fatalf("local experts %v (layer %v), want %s", experts, d.Layer() != nil, wantExperts)
	}
	loadLocal(t, d, l)
	expectRows(t, distForward(t, d, l, rank), want, rank)

	// One rank's bad expert id fails the forward on every rank with its status.
	t0, n := distTokens(rank)
	ids := append([]int32(nil), l.ids[t0*topK:(t0+n)*topK]...)
	if rank == 1 {
		ids[0] = numExperts
	}
	y := make([]float32, n*hidden)
	err = d.Forward(Float32(l.x[t0*hidden:(t0+n)*hidden], int64(n), hidden), Int32(ids, int64(n), topK),
		Float32(l.rw[t0*topK:(t0+n)*topK], int64(n), topK), Float32(y, int64(n), hidden))
	if !errors.Is(err, &Error{Status: ErrExpertID}) {
		t.Fatalf("rank 1's expert id %d: got %v, want KT_ERR_EXPERT_ID", numExperts, err)
	}
	if err := d.Backward(nil, nil); !errors.Is(err, &Error{Status: ErrContext}) {
		t.Fatalf("nil context: %v", err)
	}
	// The communicator is still usable: the same tokens again give the same bits.
	expectRows(t, distForward(t, d, l, rank), want, rank)
}

func distCheckpoint(t *testing.T, rank int, dir string) {
	l := newLayer()
	want := oneProcess(t, l)
	comm := newComm(t, rank, CommOptions{StorePath: filepath.Join(dir, "store")})
	defer comm.Close()
	ckpt := filepath.Join(dir, "ckpt")

	// Expert-parallel ranks save their shards...
	engine, d := newDistMoE(t, comm, rank, DistExpertParallel)
	loadLocal(t, d, l)
	progressed := 0
	err := comm.SaveCheckpoint(ckpt, []DistCheckpointLayer{{Layer: 0, Dist: d}},
		&DistCheckpointOptions{Progress: func(done, total int64) { progressed++ }})
	d.Close()
	engine.Close()
	if err != nil {
		t.Fatal(err)
	}
	if progressed == 0 {
		t.Fatal("no progress reported")
	}
	if _, err := os.Stat(filepath.Join(ckpt, "kt_dist_checkpoint.json")); err != nil {
		t.Fatal(err)
	}

	// ...and owner-mode ranks load them: the owner's layer computes as one process.
	engine, d = newDistMoE(t, comm, rank, DistOwner)
	defer func() {
		d.Close()
		if engine != nil {
			engine.Close()
		}
	}()
	layers := []DistCheckpointLayer{{Layer: 0, Dist: d}}
	if err := comm.LoadCheckpoint(filepath.Join(dir, "missing"), layers, nil); err == nil {
		t.Fatal("loading a missing checkpoint succeeded")
	}
	if err := comm.LoadCheckpoint(ckpt, []DistCheckpointLayer{{Layer: 7, Dist: d}}, nil); err == nil {
		t.Fatal("loading a layer the checkpoint lacks succeeded")
	}
	if err := comm.LoadCheckpoint(ckpt, layers, nil); err != nil {
		t.Fatal(err)
	}
	expectRows(t, distForward(t, d, l, rank), want, rank)
}
