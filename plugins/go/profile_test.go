package kt

import "testing"

// The per-stage profile counts a forward's stages while on and is zeroed by a reset.
func TestProfileCountsStages(t *testing.T) {
	l := newLayer()
	engine, moe := newTestLayer(t, l)
	defer engine.Close()
	defer moe.Close()
	if err := engine.SetProfiling(true); err != nil {
		t.Fatal(err)
	}
	y := make([]float32, tokens*hidden)
	if err := moe.Forward(Float32(l.x, tokens, hidden), Int32(l.ids, tokens, topK),
		Float32(l.rw, tokens, topK), Float32(y, tokens, hidden)); err != nil {
		t.Fatal(err)
	}
	profile, err := engine.Profile()
	if err != nil {
		t.Fatal(err)
	}
	counted := false
	for _, s := range profile {
		counted = counted || (s.Name == "gate_up" && s.Calls >= 1)
	}
	if !counted {
		t.Fatalf("no gate_up call in %+v", profile)
	}
	if err := engine.ResetProfile(); err != nil {
		t.Fatal(err)
	}
	profile, _ = engine.Profile()
	for _, s := range profile {
		if s.Calls != 0 {
			t.Fatalf("%s kept %d calls after the reset", s.Name, s.Calls)
		}
	}
}
