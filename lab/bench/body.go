package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/tetherproxy/tether/config"
)

// The body rows of the overhead scenario: what a chat body costs on the
// path, carried (Envoy alone; tether deciding on the headers, content
// off) and read (tether with cache-aware placement, [content], asking
// Envoy for the body of every request because every request's placement
// is open).

// BodyRow is one configuration sending one body size.
type BodyRow struct {
	Name string
	// BodyBytes is the size of each request's body, in bytes.
	BodyBytes int
	// OnPath: tether is on the request path; Content: with [content] on.
	OnPath, Content bool
	// One connection, Serial requests one after another.
	Serial               int
	SerialP50, SerialP99 time.Duration
	// At a fixed open-loop rate, Rate a second: bodyRateShare of Envoy
	// alone's closed-loop throughput with the same body, at most
	// Scale.OverheadRate, the same for the three configurations.
	Rate            float64
	P50, P99        time.Duration
	Failed, Dropped int
	// The closed loop: Scale.OverheadWorkers connections as fast as
	// answers come back.
	Throughput float64
	Requests   int64
	// CPU per request in the closed loop; tether's is 0 off the path.
	EnvoyCPUPerRequest, TetherCPUPerRequest time.Duration
	// Tether's decisions in the closed loop (on-path rows), and what the
	// bodies tether asked for did, by result of
	// tether_content_decisions_total (placed, identity, short, …).
	Decisions      int
	ContentResults map[string]float64
}

// BodiesRead is the number of content decisions in the closed loop: the
// requests whose body tether asked Envoy for.
func (b BodyRow) BodiesRead() int {
	var n float64
	for _, v := range b.ContentResults {
		n += v
	}
	return int(n)
}

// chatBody is an OpenAI chat completion request: a system message holding
// a document, the same in every request (a shared prompt: the instructions
// and reference text of an application), then the user's question, which
// changes with every request, as the Python client sends it (compact JSON
// with model, messages, max_tokens, temperature, stream).
type chatBody struct {
	head, tail []byte // around the question
	size       int    // the whole body's length
}

// questionOf is the n-th question; every one has the same length.
func questionOf(n int) string {
	return fmt.Sprintf("Question %08d: according to the document above, which clause sets the retention period, and what is it?", n%100_000_000)
}

// chatRequest is the body's JSON, field order as the OpenAI Python
// client's.
type chatRequest struct {
	Messages    []chatMessage `json:"messages"`
	Model       string        `json:"model"`
	MaxTokens   int           `json:"max_tokens"`
	Stream      bool          `json:"stream"`
	Temperature float64       `json:"temperature"`
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// newChatBody is a body of size bytes (at least the size of one with an
// empty document).
func newChatBody(size int) (chatBody, error) {
	const mark = "\x00question\x00" // marshals to a string found nowhere else
	enc := func(doc string) ([]byte, error) {
		return json.Marshal(chatRequest{Model: "bench", MaxTokens: 1, Messages: []chatMessage{
			{Role: "system", Content: doc}, {Role: "user", Content: mark}}})
	}
	empty, err := enc("")
	if err != nil {
		return chatBody{}, err
	}
	qmark, err := json.Marshal(mark)
	if err != nil {
		return chatBody{}, err
	}
	fixed := len(empty) - (len(qmark) - 2) + len(questionOf(0))
	doc := document(max(0, size-fixed))
	b, err := enc(doc)
	if err != nil {
		return chatBody{}, err
	}
	inner := qmark[1 : len(qmark)-1]
	i := bytes.Index(b, inner)
	if i < 0 {
		return chatBody{}, fmt.Errorf("chat body: question mark not found")
	}
	c := chatBody{head: b[:i], tail: b[i+len(inner):]}
	c.size = len(c.head) + len(questionOf(0)) + len(c.tail)
	return c, nil
}

// document is n bytes of prose-like text that JSON carries unescaped:
// words from a small vocabulary, sentences, no newlines.
func document(n int) string {
	words := strings.Fields(`the service retains records of each account for seven years after closing unless a regulator
		requires longer storage customers may request a copy of their data within thirty days and the operator must answer
		in writing clause section schedule policy term notice party agreement shall include exclude apply period review`)
	var b strings.Builder
	b.Grow(n + 16)
	for i := 0; b.Len() < n; i++ {
		w := words[(i*7+i/len(words))%len(words)]
		switch {
		case i%13 == 12:
			b.WriteString(w + ". ")
		default:
			b.WriteString(w + " ")
		}
	}
	return b.String()[:n]
}

// send posts the n-th body for session, in the session header; with
// session "" anonymous (no session id, token or device and user), so that
// every request's placement is open.
func (c chatBody) send(ctx context.Context, client *http.Client, url string, n int, session string) error {
	_, err := c.post(ctx, client, url, n, session)
	return err
}

// post is send, returning the answer's headers.
func (c chatBody) post(ctx context.Context, client *http.Client, url string, n int, session string) (http.Header, error) {
	body := io.MultiReader(bytes.NewReader(c.head), strings.NewReader(questionOf(n)), bytes.NewReader(c.tail))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", body)
	if err != nil {
		return nil, err
	}
	req.ContentLength = int64(c.size)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	req.Header.Set("User-Agent", "OpenAI/Python 1.54.0")
	if session != "" {
		req.Header.Set(config.DefaultSessionHeader, session)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, statusError(resp.StatusCode)
	}
	return resp.Header, nil
}

// request is c.send as a loop's request: worker w's i-th sends a question
// no other request of the loop sends.
func (c chatBody) request() request {
	return func(ctx context.Context, client *http.Client, url string, w, i int) error {
		return c.send(ctx, client, url, i*4096+w, "")
	}
}

// sessionRequest is c.send as a loop's request for session(w, i).
func (c chatBody) sessionRequest(session func(w, i int) string) request {
	return func(ctx context.Context, client *http.Client, url string, w, i int) error {
		return c.send(ctx, client, url, i*4096+w, session(w, i))
	}
}

// The configurations of the body rows: Envoy alone; tether sticky (the
// default), its anonymous requests placed on the headers; and the same
// with [content] on, which asks for every anonymous request's body.
var (
	bodyEnvoyAlone = policy{name: "Envoy alone", offPath: true, edit: envoyOnly("round_robin")}
	bodyContentOff = policy{name: "tether sticky, content off", store: true, edit: func(*config.Config) {}}
	bodyContentOn  = policy{name: "tether sticky, content on", store: true, content: true, edit: func(c *config.Config) { c.Content.Enabled = true }}
)

// runBodies starts the three stacks side by side and measures each body
// size through the three in turn, so that the rows of a size are seconds
// apart rather than the minutes one stack after another would put them.
func runBodies(ctx context.Context, opts Options, dir string, instances []config.Instance) ([]BodyRow, error) {
	sc := opts.Scale
	if len(sc.BodySizes) == 0 {
		return nil, nil
	}
	var bodies []chatBody
	for _, n := range sc.BodySizes {
		b, err := newChatBody(n)
		if err != nil {
			return nil, err
		}
		bodies = append(bodies, b)
	}
	pols := []policy{bodyEnvoyAlone, bodyContentOff, bodyContentOn}
	stacks, err := startStacks(ctx, opts, dir, pols, instances)
	defer closeStacks(stacks)
	if err != nil {
		return nil, err
	}
	var rows []BodyRow
	for _, b := range bodies {
		rate := 0.0 // Envoy alone's sets it for the size
		for i, p := range pols {
			fmt.Fprintf(opts.Log, "overhead: %s, %d-byte body\n", p.name, b.size)
			row, err := bodyOnce(ctx, stacks[i], p, b, sc, rate)
			if err != nil {
				return rows, fmt.Errorf("%s, %d-byte body: %w", p.name, b.size, err)
			}
			rate = row.Rate
			rows = append(rows, row)
		}
	}
	return rows, nil
}

// startStacks starts a stack for each policy at once, each in a
// directory of its own under dir (each tether watches its own file). On an
// error it returns the stacks it started.
func startStacks(ctx context.Context, opts Options, dir string, pols []policy, instances []config.Instance) ([]*stack, error) {
	stacks := make([]*stack, len(pols))
	errs := make([]error, len(pols))
	var wg sync.WaitGroup
	for i, p := range pols {
		sub, err := os.MkdirTemp(dir, "stack")
		if err != nil {
			return stacks, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if stacks[i], errs[i] = startStack(ctx, opts, sub, p, instances); errs[i] != nil {
				errs[i] = fmt.Errorf("%s: %w", p.name, errs[i])
			}
		}()
	}
	wg.Wait()
	return stacks, errors.Join(errs...)
}

// closeStacks closes the stacks that started, at once.
func closeStacks(stacks []*stack) {
	var wg sync.WaitGroup
	for _, st := range stacks {
		if st != nil {
			wg.Add(1)
			go func() {
				defer wg.Done()
				st.close()
			}()
		}
	}
	wg.Wait()
}

// bodyWarm is how long connections are warmed before a body row, at most.
const bodyWarm = 500 * time.Millisecond

// bodyRateShare is the share of Envoy alone's closed-loop throughput with a
// body that the open loop sends at, at most Scale.OverheadRate.
const bodyRateShare = 0.5

// bodyOnce measures body b through st: in the closed loop with CPU and
// tether's counts, on one connection, then in the open loop at rate a
// second (0: bodyRateShare of this row's closed-loop throughput, at most
// Scale.OverheadRate).
func bodyOnce(ctx context.Context, st *stack, p policy, b chatBody, sc Scale, rate float64) (BodyRow, error) {
	row := BodyRow{Name: p.name, BodyBytes: b.size, OnPath: !p.offPath, Content: p.content}
	url := st.envoy.URL()
	req := b.request()
	client := newLoadClient()
	defer client.CloseIdleConnections()
	closedLoop(ctx, client, url, 4, min(bodyWarm, sc.BodyDuration), req)

	var d0, c0 map[string]float64
	var err error
	if row.OnPath {
		if d0, c0, err = decisionsAndContent(ctx, st.tether.Admin); err != nil {
			return row, err
		}
	}
	cpu0, err := st.cpu()
	if err != nil {
		return row, err
	}
	t0 := time.Now()
	ok, bad := closedLoop(ctx, client, url, sc.OverheadWorkers, sc.BodyDuration, req)
	took := time.Since(t0)
	cpu1, err := st.cpu()
	if err != nil {
		return row, err
	}
	row.Failed += int(bad)
	row.Requests = ok
	if ok > 0 {
		row.Throughput = float64(ok) / took.Seconds()
		cpu := cpu1.sub(cpu0)
		perReq := func(sec float64) time.Duration { return time.Duration(sec / float64(ok) * float64(time.Second)) }
		row.EnvoyCPUPerRequest = perReq(cpu.Envoy)
		if row.OnPath {
			row.TetherCPUPerRequest = perReq(cpu.Tether)
		}
	}
	if row.OnPath {
		d1, c1, err := decisionsAndContent(ctx, st.tether.Admin)
		if err != nil {
			return row, err
		}
		for _, v := range subCounts(d1, d0) {
			row.Decisions += int(v)
		}
		row.ContentResults = map[string]float64{}
		for k, v := range subCounts(c1, c0) {
			if v > 0 {
				row.ContentResults[k] = v
			}
		}
	}

	one := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 1, MaxConnsPerHost: 1}}
	defer one.CloseIdleConnections()
	lat, failed := serial(ctx, one, url, sc.BodySerial, req)
	sortDurations(lat)
	row.Serial, row.SerialP50, row.SerialP99, row.Failed = len(lat), percentile(lat, 0.5), percentile(lat, 0.99), row.Failed+failed

	// The open loop runs below what Envoy alone answers with this body:
	// past it, every configuration only queues.
	row.Rate = rate
	if row.Rate <= 0 {
		row.Rate = min(sc.OverheadRate, math.Round(row.Throughput*bodyRateShare))
	}
	if row.Rate < 1 {
		return row, fmt.Errorf("open-loop rate %.1f/s: the closed loop answered %.1f/s", row.Rate, row.Throughput)
	}
	lat, failed, dropped, err := fixedRate(ctx, client, url, row.Rate, sc.BodyDuration, req)
	if err != nil {
		return row, err
	}
	sortDurations(lat)
	row.P50, row.P99, row.Failed, row.Dropped = percentile(lat, 0.5), percentile(lat, 0.99), row.Failed+failed, dropped
	return row, nil
}

// decisionsAndContent reads tether's decisions by kind and its content
// decisions by result.
func decisionsAndContent(ctx context.Context, admin string) (decisions, content map[string]float64, err error) {
	m, err := scrape(ctx, admin)
	if err != nil {
		return nil, nil, err
	}
	if decisions, err = decisionCounts(m); err != nil {
		return nil, nil, err
	}
	return decisions, m.SumBy("tether_content_decisions_total", "result"), nil
}
