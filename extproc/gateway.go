package extproc

import (
	"errors"
	"strings"

	"google.golang.org/protobuf/types/known/structpb"

	"github.com/tetherproxy/tether/affinity"
)

// The endpoint picker protocol of the Gateway API Inference Extension
// (its proposal 004, v1.0.0). A gateway that serves an InferencePool
// routes on the destination tether names, in a header and in the
// request's dynamic metadata, alike. tether answers in this vocabulary on
// every routing reply, beside its own routing header, so one tether serves
// its own Envoy and any such gateway without a switch.
const (
	// HeaderDestination names the endpoints a gateway sends the request
	// to: ip:port, then the fallbacks a retry takes, comma-separated.
	// tether sets it on every routed request and removes a client's own:
	// an ORIGINAL_DST cluster would send the request wherever it says.
	HeaderDestination = "x-gateway-destination-endpoint"
	// MetadataLB is the dynamic metadata namespace the destination goes
	// in, under the key HeaderDestination.
	MetadataLB = "envoy.lb"
	// MetadataSubsetHint is the namespace of the request's metadata in
	// which a gateway may name the endpoints the pick must come from,
	// under the key SubsetKey, as a list of ip:port.
	MetadataSubsetHint = "envoy.lb.subset_hint"
	SubsetKey          = "x-gateway-destination-endpoint-subset"
	// ServedKey is where, in the response's metadata in MetadataLB, a
	// gateway reports the endpoint that served the request.
	ServedKey = "x-gateway-destination-endpoint-served"
)

// DefaultFallbacks is how many instances a routing reply names after its
// own when fallbacks are asked for (Options.Fallbacks). They are off by
// default: Envoy's ORIGINAL_DST cluster reads one address from the header
// and fails a request whose header lists more.
const DefaultFallbacks = 2

// maxSubset bounds the endpoints of a subset hint tether reads. A longer
// hint is refused.
const maxSubset = 4096

// errBadSubset is a subset hint tether cannot read: neither a string nor
// a list of strings, or too long.
var errBadSubset = errors.New("subset hint is not a list of ip:port strings")

// subsetOf reads the request's subset hint. present says the gateway sent
// one. It is a list of ip:port strings, or one string; each string may
// hold several, comma-separated, as a header copied into the metadata
// does. names are the instances at its endpoints; an endpoint tether does
// not know names none. An empty hint, or one of unknown endpoints, leaves
// names empty with present true: nothing is eligible.
func (s *Server) subsetOf(md map[string]*structpb.Struct) (names []string, present bool, err error) {
	v, ok := md[MetadataSubsetHint].GetFields()[SubsetKey]
	if !ok {
		return nil, false, nil
	}
	values := []*structpb.Value{v}
	if list := v.GetListValue(); list != nil {
		values = list.GetValues()
	}
	for _, e := range values {
		str, ok := e.GetKind().(*structpb.Value_StringValue)
		if !ok {
			return nil, true, errBadSubset
		}
		for addr := range strings.SplitSeq(str.StringValue, ",") {
			if len(names) == maxSubset {
				return nil, true, errBadSubset
			}
			if in, ok := s.instanceAt(strings.TrimSpace(addr)); ok {
				names = append(names, in)
			}
		}
	}
	return names, true, nil
}

// instanceAt is the name of the instance at addr, if tether knows one.
func (s *Server) instanceAt(addr string) (string, bool) {
	if s.opts.Instances == nil || addr == "" {
		return "", false
	}
	in, ok := s.opts.Instances.AtAddress(addr)
	return in.Name, ok
}

// destination is the value of HeaderDestination for d: its instance's
// address, then its fallbacks'. "" when its instance has no address.
func destination(d *affinity.Decision) string {
	if len(d.Fallbacks) == 0 || d.Instance.Address == "" {
		return d.Instance.Address
	}
	var b strings.Builder
	b.WriteString(d.Instance.Address)
	for _, in := range d.Fallbacks {
		if in.Address != "" {
			b.WriteByte(',')
			b.WriteString(in.Address)
		}
	}
	return b.String()
}

// servedOf reads the endpoint a gateway reports as the one that served
// the request, from the response's metadata. "" when it reports none.
func servedOf(md map[string]*structpb.Struct) string {
	return md[MetadataLB].GetFields()[ServedKey].GetStringValue()
}
