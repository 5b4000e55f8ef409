package server

import (
	"bytes"
	"testing"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// TestCodecRoundTrip: a message below the pooling threshold, ones of 1 KB,
// 33 KB and 300 KB, and one over the largest tier come back whole, decoded
// from one buffer or from the frames they arrive in; the decoded body does
// not share the buffers it was decoded from.
func TestCodecRoundTrip(t *testing.T) {
	c := codec{bufferPool()}
	for _, size := range []int{10, 1 << 10, 33 << 10, 300 << 10, 2 << 20} {
		in := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{
			RequestBody: &extprocv3.HttpBody{Body: bytes.Repeat([]byte("x"), size), EndOfStream: true}}}
		data, err := c.Marshal(in)
		if err != nil {
			t.Fatalf("%d bytes: %v", size, err)
		}
		whole := data.Materialize()
		data.Free()
		// As the transport hands them over: one buffer, or 16 KB frames.
		frames := mem.BufferSlice{}
		for b := whole; len(b) > 0; {
			n := min(len(b), 16<<10)
			frames = append(frames, mem.SliceBuffer(bytes.Clone(b[:n])))
			b = b[n:]
		}
		for _, got := range []mem.BufferSlice{{mem.SliceBuffer(bytes.Clone(whole))}, frames} {
			out := &extprocv3.ProcessingRequest{}
			if err := c.Unmarshal(got, out); err != nil {
				t.Fatalf("%d bytes in %d buffers: %v", size, len(got), err)
			}
			for _, b := range got {
				clear(b.ReadOnlyData()) // the frames go back to a pool
			}
			if !proto.Equal(in, out) {
				t.Fatalf("%d bytes in %d buffers: the message changed on the way", size, len(got))
			}
		}
	}
}

// TestCodecRefusesOtherTypes: a value that is not a protobuf message is an
// error, not a panic.
func TestCodecRefusesOtherTypes(t *testing.T) {
	c := codec{bufferPool()}
	if _, err := c.Marshal("text"); err == nil {
		t.Error("Marshal of a string: no error")
	}
	if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer([]byte{1})}, new(int)); err == nil {
		t.Error("Unmarshal into an int: no error")
	}
	if err := c.Unmarshal(mem.BufferSlice{mem.SliceBuffer([]byte{0xff, 0xff})}, &extprocv3.ProcessingRequest{}); err == nil {
		t.Error("Unmarshal of garbage: no error")
	}
}
