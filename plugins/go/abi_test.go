package kt

import "testing"

// The generated layer (abi.go) against the header as cgo compiles it: every
// struct has the size, alignment and field offsets of the ABI record, and
// every function of the record links.
func TestRecordedABI(t *testing.T) {
	for _, s := range abiLayout {
		if s.gotSize != s.size || s.gotAlign != s.align {
			t.Errorf("%s: cgo size %d align %d, the record %d and %d", s.name, s.gotSize, s.gotAlign, s.size, s.align)
		}
		for i, off := range s.offsets {
			if s.gotOffsets[i] != off {
				t.Errorf("%s: field %d at offset %d, the record says %d", s.name, i, s.gotOffsets[i], off)
			}
		}
	}
	for _, f := range abiFunctions {
		if f.addr == nil {
			t.Errorf("%s does not resolve", f.name)
		}
	}
	t.Logf("%d structs, %d functions", len(abiLayout), len(abiFunctions))
}
