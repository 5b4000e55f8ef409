package engine

import (
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// serve starts a server on 127.0.0.1 (httptest's default) that the test
// closes.
func serve(t testing.TB, h http.HandlerFunc) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func exposition(body []byte) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		_, _ = w.Write(body)
	}
}

func TestScrape(t *testing.T) {
	for _, tt := range []struct {
		file string
		kind Kind
	}{
		{"vllm-0.12-dp2.txt", VLLM}, {"vllm-0.8.txt", VLLM}, {"vllm-0.5-v0.txt", VLLM},
		{"sglang-dp2.txt", SGLang}, {"sglang-old.txt", SGLang},
	} {
		t.Run(tt.file, func(t *testing.T) {
			body := fixture(t, tt.file)
			var accept atomic.Value
			srv := serve(t, func(w http.ResponseWriter, r *http.Request) {
				accept.Store(r.Header.Get("Accept"))
				exposition(body)(w, r)
			})
			want, err := Parse(tt.kind, bytes.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			s := &Scraper{}
			// Concurrent scrapes through one Scraper and its lazily made client.
			var wg sync.WaitGroup
			for range 8 {
				wg.Go(func() {
					for range 3 {
						got, err := s.Scrape(t.Context(), tt.kind, srv.URL+"/metrics")
						if err != nil {
							t.Error(err)
							return
						}
						if got != want {
							t.Errorf("Scrape = %+v, want %+v", got, want)
						}
					}
				})
			}
			wg.Wait()
			if a, _ := accept.Load().(string); !strings.HasPrefix(a, "text/plain;version=0.0.4") {
				t.Errorf("Accept %q: want the text format first", a)
			}
		})
	}
}

func TestScrapeRefuses(t *testing.T) {
	vllm := fixture(t, "vllm-0.12-dp2.txt")
	big := func(declare bool) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			const size = 10 << 20 // 10 MB: a valid beginning, then far too much
			if declare {
				w.Header().Set("Content-Length", strconv.Itoa(size))
			}
			line := bytes.Repeat([]byte("vllm:num_requests_waiting{engine=\"0\"} 1\n"), 1000)
			_, _ = w.Write(vllm[:4096])
			for written := 4096; written < size; written += len(line) {
				if _, err := w.Write(line[:min(len(line), size-written)]); err != nil {
					return // the scraper hung up, as it should
				}
			}
		}
	}
	for _, tt := range []struct {
		name, reason string
		handler      http.HandlerFunc
		scraper      *Scraper
	}{
		{"404", ReasonStatus, http.NotFound, &Scraper{}},
		{"500", ReasonStatus, func(w http.ResponseWriter, r *http.Request) {
			http.Error(w, "engine dead", http.StatusInternalServerError)
		}, &Scraper{}},
		{"redirect loop", ReasonConnect, func(w http.ResponseWriter, r *http.Request) {
			http.Redirect(w, r, r.URL.Path, http.StatusFound)
		}, &Scraper{}},
		{"html page", ReasonParse, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/html; charset=utf-8")
			_, _ = w.Write([]byte("<html><body>metrics are elsewhere</body></html>"))
		}, &Scraper{}},
		{"html page served as text", ReasonParse, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/plain")
			_, _ = w.Write([]byte("<html><body>metrics are elsewhere</body></html>"))
		}, &Scraper{}},
		{"json", ReasonParse, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"object":"error","message":"Not Found"}`))
		}, &Scraper{}},
		// A generous timeout: on a loaded machine the default one ran out
		// before the limit was read past (CI, 2026-12-02).
		{"10 MB chunked", ReasonTooLarge, big(false), &Scraper{Timeout: 2 * time.Second}},
		{"10 MB declared", ReasonTooLarge, big(true), &Scraper{Timeout: 2 * time.Second}},
		{"over a small limit", ReasonTooLarge, exposition(vllm), &Scraper{MaxBody: 1000}},
		{"hangs before answering", ReasonTimeout, func(w http.ResponseWriter, r *http.Request) {
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		}, &Scraper{Timeout: 100 * time.Millisecond}},
		{"hangs in the body", ReasonTimeout, func(w http.ResponseWriter, r *http.Request) {
			_, _ = w.Write(vllm[:2000])
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
			case <-time.After(5 * time.Second):
			}
		}, &Scraper{Timeout: 100 * time.Millisecond}},
		{"connection cut in the body", ReasonConnect, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(vllm)))
			_, _ = w.Write(vllm[:2000])
			w.(http.Flusher).Flush()
			conn, _, err := w.(http.Hijacker).Hijack()
			if err == nil {
				_ = conn.Close()
			}
		}, &Scraper{}},
		{"empty answer", ReasonMissing, func(w http.ResponseWriter, r *http.Request) {}, &Scraper{}},
		{"garbage values", ReasonBadValue, exposition([]byte(vllmHead + "vllm:kv_cache_usage_perc{engine=\"0\"} 7\n")), &Scraper{}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			srv := serve(t, tt.handler)
			start := time.Now()
			s, err := tt.scraper.Scrape(t.Context(), VLLM, srv.URL+"/metrics")
			if Reason(err) != tt.reason {
				t.Fatalf("Scrape = %+v, %v; want reason %s", s, err, tt.reason)
			}
			if s != (Sample{}) {
				t.Errorf("a refused scrape gave %+v", s)
			}
			if d := time.Since(start); d > 3*time.Second {
				t.Errorf("took %v", d)
			}
		})
	}
}

func TestScrapeConnectionRefused(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	_, err = (&Scraper{}).Scrape(t.Context(), SGLang, "http://"+addr+"/metrics")
	if Reason(err) != ReasonConnect {
		t.Errorf("Scrape of a closed port: %v, want reason connect", err)
	}
}

func TestScrapeCallerCancels(t *testing.T) {
	srv := serve(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	})
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(50*time.Millisecond, cancel)
	_, err := (&Scraper{Timeout: 5 * time.Second}).Scrape(ctx, VLLM, srv.URL)
	if !errors.Is(err, context.Canceled) || Reason(err) != ReasonOther {
		t.Errorf("Scrape cancelled by its caller: %v (reason %s)", err, Reason(err))
	}
}

func TestScrapeGenericMakesNoRequest(t *testing.T) {
	var hits atomic.Int32
	srv := serve(t, func(w http.ResponseWriter, r *http.Request) { hits.Add(1) })
	for _, k := range []Kind{Generic, "tgi"} {
		if _, err := (&Scraper{}).Scrape(t.Context(), k, srv.URL); err == nil {
			t.Errorf("Scrape(%q) succeeded", k)
		}
	}
	if _, err := (&Scraper{}).Scrape(t.Context(), VLLM, "http://bad host/metrics"); err == nil || Reason(err) != ReasonOther {
		t.Errorf("Scrape of a bad URL: %v", err)
	}
	if hits.Load() != 0 {
		t.Errorf("%d requests for kinds that are not scraped", hits.Load())
	}
}

func TestScrapeOwnClient(t *testing.T) {
	srv := serve(t, exposition(fixture(t, "vllm-0.5-v0.txt")))
	var used atomic.Int32
	client := &http.Client{Transport: roundTripper(func(r *http.Request) (*http.Response, error) {
		used.Add(1)
		return http.DefaultTransport.RoundTrip(r)
	})}
	if _, err := (&Scraper{Client: client}).Scrape(t.Context(), VLLM, srv.URL); err != nil {
		t.Fatal(err)
	}
	if used.Load() != 1 {
		t.Errorf("the Scraper's Client made %d requests", used.Load())
	}
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func TestTransport(t *testing.T) {
	tr := newTransport()
	if tr.Proxy != nil || !tr.DisableCompression || tr.MaxIdleConnsPerHost != 2 || tr.MaxIdleConns != 0 || tr.DisableKeepAlives {
		t.Errorf("transport: proxy %v, compression off %v, idle %d per host and %d in all, keep-alives off %v",
			tr.Proxy != nil, tr.DisableCompression, tr.MaxIdleConnsPerHost, tr.MaxIdleConns, tr.DisableKeepAlives)
	}
}
