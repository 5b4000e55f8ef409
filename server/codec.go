package server

import (
	"fmt"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"
)

// bufferTiers are the capacities, as powers of two, of the buffers the
// ext_proc server reads messages into and marshals replies in. gRPC's
// default pool jumps from 32 KB to 1 MB and clears a buffer's whole
// capacity each time it hands one out. A gateway streams prompt chunks of
// tens of kilobytes through tether, each read once and echoed once: with
// the default tiers a 33 KB chunk cleared 2 MB per request, the largest
// single item in tether's profile behind a gateway (BENCHMARKS.md, "Behind
// a gateway"). With a tier at every power of two from 4 KB to 1 MB, a
// message of 4 KB to 1 MB takes a buffer at most twice its size; one of
// 1 to 4 KB takes 4 KB (gRPC pools nothing smaller), one over 1 MB gRPC's
// fallback pool. Buffers are still cleared before reuse, so no prompt
// shows through another request's.
var bufferTiers = []uint8{8, 12, 13, 14, 15, 16, 17, 18, 19, 20}

func bufferPool() mem.BufferPool {
	p, err := mem.NewBinaryTieredBufferPool(bufferTiers...)
	if err != nil {
		panic(err) // the tiers are constant and valid on every word size
	}
	return p
}

// codec is gRPC's protobuf codec on a pool of the server's own: gRPC's
// marshals and materializes messages with its process-wide default pool,
// whatever pool the server is given.
type codec struct{ pool mem.BufferPool }

func (codec) Name() string { return "proto" }

// Marshal writes v into a pooled buffer, or a new one below gRPC's pooling
// threshold.
func (c codec) Marshal(v any) (mem.BufferSlice, error) {
	m := messageOf(v)
	if m == nil {
		return nil, fmt.Errorf("codec: %T is not a protobuf message", v)
	}
	size := proto.Size(m)
	if mem.IsBelowBufferPoolingThreshold(size) {
		b, err := proto.Marshal(m)
		return mem.BufferSlice{mem.SliceBuffer(b)}, err
	}
	buf := c.pool.Get(size)
	// Size has cached every submessage's size for this call.
	if _, err := (proto.MarshalOptions{UseCachedSize: true}).MarshalAppend((*buf)[:0], m); err != nil {
		c.pool.Put(buf)
		return nil, err
	}
	return mem.BufferSlice{mem.NewBuffer(buf, c.pool)}, nil
}

// Unmarshal decodes data into v. A message that came in one buffer is
// decoded where it lies: protobuf copies the bytes it keeps.
func (c codec) Unmarshal(data mem.BufferSlice, v any) error {
	m := messageOf(v)
	if m == nil {
		return fmt.Errorf("codec: %T is not a protobuf message", v)
	}
	if len(data) == 1 {
		return proto.Unmarshal(data[0].ReadOnlyData(), m)
	}
	buf := data.MaterializeToBuffer(c.pool)
	defer buf.Free()
	return proto.Unmarshal(buf.ReadOnlyData(), m)
}

// messageOf is v as a protobuf message of today's API, as gRPC's own codec
// takes it: an older API's message is wrapped. nil: v is neither.
func messageOf(v any) proto.Message {
	switch v := v.(type) {
	case protoadapt.MessageV2:
		return v
	case protoadapt.MessageV1:
		return protoadapt.MessageV2Of(v)
	}
	return nil
}
