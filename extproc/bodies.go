package extproc

import (
	extprocv3filter "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
)

// bodies is how a data plane sends a stream's bodies. Envoy says so in the
// stream's first message (protocol_config). tether's own Envoy sends none
// unless a reply asks for the request's. A gateway's filter may send both,
// whole (BUFFERED) or chunk by chunk (FULL_DUPLEX_STREAMED).
type bodies struct {
	request, response extprocv3filter.ProcessingMode_BodySendMode
}

func bodiesOf(pc *extprocv3.ProtocolConfiguration) bodies {
	return bodies{request: pc.GetRequestBodyMode(), response: pc.GetResponseBodyMode()}
}

// sent says the data plane sends the request body without being asked.
func (b bodies) sent() bool { return b.request != extprocv3filter.ProcessingMode_NONE }

// whole says the request body comes in one message, as a reply to the
// body can still route the request.
func (b bodies) whole() bool {
	return b.request == extprocv3filter.ProcessingMode_BUFFERED || b.request == extprocv3filter.ProcessingMode_BUFFERED_PARTIAL
}

// duplex says the request body streams both ways: each chunk must come
// back, and the headers reply may wait for the body.
func (b bodies) duplex() bool {
	return b.request == extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED
}

// duplexResponse says the same of the response body.
func (b bodies) duplexResponse() bool {
	return b.response == extprocv3filter.ProcessingMode_FULL_DUPLEX_STREAMED
}

// echoRequest answers a streamed request body chunk with the chunk
// unchanged.
func echoRequest(body []byte, end bool) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{
		RequestBody: echo(body, end),
	}}
}

// echoResponse answers a streamed response body chunk with the chunk
// unchanged.
func echoResponse(body []byte, end bool) *extprocv3.ProcessingResponse {
	return &extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{
		ResponseBody: echo(body, end),
	}}
}

func echo(body []byte, end bool) *extprocv3.BodyResponse {
	return &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{
		BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
			StreamedResponse: &extprocv3.StreamedBodyResponse{Body: body, EndOfStream: end},
		}},
	}}
}
