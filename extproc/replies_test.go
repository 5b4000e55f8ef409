package extproc_test

import (
	"context"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"github.com/google/go-cmp/cmp"
	"github.com/rs/zerolog"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/tetherproxy/tether/affinity"
	"github.com/tetherproxy/tether/bindings"
	"github.com/tetherproxy/tether/extproc"
	"github.com/tetherproxy/tether/fleet"
	"github.com/tetherproxy/tether/identity"
	"github.com/tetherproxy/tether/store/memory"
)

// TestRepliesAreEachRequests: replies to one instance share its routing
// header's mutation, never a request's own part. Concurrent requests of
// one session, over gRPC, each get the instance's routing header and a
// ticket of their own, and tether ends each such stream once it has
// replied; the response phase's reply (inline) is the same for all.
func TestRepliesAreEachRequests(t *testing.T) {
	secret := []byte("0123456789abcdef")
	ids, err := identity.New(identity.Config{Secret: secret})
	if err != nil {
		t.Fatal(err)
	}
	instances := fleet.New(two)
	dec := affinity.New(memory.New(), instances, affinity.Policy{
		Mode: affinity.Sticky, Lifetime: bindings.Lifetime{Idle: time.Minute, Max: time.Hour},
	})
	c := serve(t, extproc.New(ids, dec, &recorded{}, extproc.Options{
		ClusterHeader: "x-tether-cluster", Logger: zerolog.Nop(),
		Tickets: extproc.NewTickets(secret), Instances: instances,
	}))
	first := exchange(t, c, reqHeaders("x-session-id", "conv-1"), respHeaders(":status", "200"))
	route := first[0].GetRequestHeaders()
	const n = 40
	got := make([][]*extprocv3.ProcessingResponse, n)
	var wg sync.WaitGroup
	// stream runs one request's stream: its messages, each answered; an
	// apart stream (its end reported apart) is ended by tether after the
	// request headers' reply.
	stream := func(i int, apart bool, msgs ...*extprocv3.ProcessingRequest) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if apart {
			ctx = metadata.AppendToOutgoingContext(ctx, extproc.ApartMarker, "1")
		}
		s, err := c.Process(ctx)
		if err != nil {
			t.Error(err)
			return
		}
		for _, m := range msgs {
			if err := s.Send(m); err != nil {
				t.Error(err)
				return
			}
			r, err := s.Recv()
			if err != nil {
				t.Error(err)
				return
			}
			got[i] = append(got[i], r)
		}
		if _, err := s.Recv(); apart && !errors.Is(err, io.EOF) {
			t.Errorf("request %d: after the reply the stream ended with %v, want tether to end it (EOF)", i, err)
		}
		_ = s.CloseSend()
	}
	for i := range n {
		wg.Go(func() {
			stream(i, true, reqHeaders("x-session-id", "conv-1"))
			stream(i, false, reqHeaders("x-session-id", "conv-1"), respHeaders(":status", "200"))
		})
	}
	wg.Wait()
	tickets := map[string]bool{ticket(first[0]): true}
	for i, rs := range got {
		if len(rs) != 3 {
			t.Fatalf("request %d: %d replies", i, len(rs))
		}
		if diff := cmp.Diff(route, rs[0].GetRequestHeaders(), protocmp.Transform()); diff != "" {
			t.Errorf("request %d routed otherwise (-first +got):\n%s", i, diff)
		}
		tk := ticket(rs[0])
		if tk == "" || tickets[tk] {
			t.Errorf("request %d: ticket %q missing or another request's", i, tk)
		}
		tickets[tk] = true
		if diff := cmp.Diff(first[1], rs[2], protocmp.Transform()); diff != "" {
			t.Errorf("request %d: response-phase reply (-first +got):\n%s", i, diff)
		}
	}
}

func ticket(r *extprocv3.ProcessingResponse) string {
	return r.GetDynamicMetadata().GetFields()[extproc.MetadataNamespace].GetStructValue().GetFields()["t"].GetStringValue()
}
