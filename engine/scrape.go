package engine

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"sync"
	"time"
)

// The Scraper's defaults, the config's engines.scrape_timeout and
// engines.max_body_bytes.
const (
	DefaultTimeout = 500 * time.Millisecond
	DefaultMaxBody = 4 << 20
)

// accept asks for the Prometheus text format. client_python, which vLLM and
// SGLang use, answers in OpenMetrics only when asked for it. OpenMetrics may
// carry exemplars, which the text parser refuses.
const accept = "text/plain;version=0.0.4;q=1,*/*;q=0.1"

// Scraper reads instances' /metrics. Its fields are read at each Scrape and
// must not change while scrapes run. It is safe for concurrent use.
type Scraper struct {
	// Client makes the requests. Nil means a client of the Scraper's own:
	//
	//   - It keeps a few idle connections per instance alive.
	//   - It goes straight to the instance, whatever HTTP_PROXY says. The
	//     metrics URLs are on the serving network.
	//   - It does not ask for gzip. That would cost the engine's API server
	//     more CPU than the bytes cost the network.
	Client *http.Client
	// Timeout bounds one scrape, from the request to the end of the body.
	// Zero or negative means DefaultTimeout.
	Timeout time.Duration
	// MaxBody is the largest body read. A larger one is refused whole with
	// ReasonTooLarge. Zero or negative means DefaultMaxBody.
	MaxBody int64

	once    sync.Once
	client  *http.Client
	buffers sync.Pool // of *bytes.Buffer
}

// Scrape GETs url and parses the answer as an exposition of kind.
//
// Errors are *Error, with ReasonConnect, ReasonTimeout, ReasonStatus,
// ReasonTooLarge or one of Parse's reasons. The exception is ctx itself
// being cancelled. Then the error wraps ctx's, and its Reason is
// ReasonOther. The generic kind is never scraped: it gives an error and
// makes no request.
func (s *Scraper) Scrape(ctx context.Context, kind Kind, url string) (Sample, error) {
	sp, err := specOf(kind)
	if err != nil {
		return Sample{}, err
	}
	timeout := s.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	limit := s.MaxBody
	if limit <= 0 {
		limit = DefaultMaxBody
	}
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return Sample{}, fmt.Errorf("engine: scrape %q: %w", url, err)
	}
	req.Header.Set("Accept", accept)
	resp, err := s.httpClient().Do(req)
	if err != nil {
		return Sample{}, transportError(parent, url, err)
	}
	defer func() {
		// Read a little of what is left, so that a short unread tail does
		// not cost the connection. A long one does.
		_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
		_ = resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		return Sample{}, errorf(ReasonStatus, "GET %s: %s", url, resp.Status)
	}
	if resp.ContentLength > limit {
		return Sample{}, errorf(ReasonTooLarge, "GET %s: a body of %d bytes, over the limit of %d", url, resp.ContentLength, limit)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "" {
		if mt, _, err := mime.ParseMediaType(ct); err == nil && (mt == "text/html" || mt == "application/json") {
			return Sample{}, errorf(ReasonParse, "GET %s: a %s body, not the Prometheus text format", url, mt)
		}
	}
	// The body is read whole, up to the limit, before it is parsed. So a
	// body over the limit costs a copy, not the parse of MaxBody bytes.
	buf := s.buffer()
	defer s.release(buf)
	_, err = buf.ReadFrom(io.LimitReader(resp.Body, limit+1))
	switch {
	case int64(buf.Len()) > limit:
		return Sample{}, errorf(ReasonTooLarge, "GET %s: a body over the limit of %d bytes", url, limit)
	case err != nil:
		return Sample{}, transportError(parent, url, err)
	}
	return sp.parse(buf.Bytes())
}

// transportError classifies a failed request or body read. The caller's own
// cancellation stays itself. A deadline is ReasonTimeout. The rest is
// ReasonConnect.
func transportError(parent context.Context, url string, err error) error {
	if errors.Is(parent.Err(), context.Canceled) {
		return fmt.Errorf("engine: scrape %s: %w", url, parent.Err())
	}
	var ne net.Error
	if errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout()) {
		return &Error{Reason: ReasonTimeout, Err: err}
	}
	return &Error{Reason: ReasonConnect, Err: err}
}

// keptBuffer is the largest body buffer kept for the next scrape. A larger
// one, from a fleet's odd instance, is left to the garbage collector.
const keptBuffer = 1 << 20

func (s *Scraper) buffer() *bytes.Buffer {
	if b, ok := s.buffers.Get().(*bytes.Buffer); ok {
		return b
	}
	return new(bytes.Buffer)
}

func (s *Scraper) release(b *bytes.Buffer) {
	if b.Cap() <= keptBuffer {
		b.Reset()
		s.buffers.Put(b)
	}
}

func (s *Scraper) httpClient() *http.Client {
	if s.Client != nil {
		return s.Client
	}
	s.once.Do(func() { s.client = &http.Client{Transport: newTransport()} })
	return s.client
}

func newTransport() *http.Transport {
	var t *http.Transport
	if d, ok := http.DefaultTransport.(*http.Transport); ok {
		t = d.Clone()
	} else {
		t = &http.Transport{}
	}
	t.Proxy = nil
	t.DisableCompression = true
	// There is one scrape per instance at a time, every scrape_interval. So
	// two idle connections per instance are plenty. There is no cap over the
	// fleet: the default 100 would churn connections past 100 instances.
	t.MaxIdleConns = 0
	t.MaxIdleConnsPerHost = 2
	t.IdleConnTimeout = 90 * time.Second
	return t
}
