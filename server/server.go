// Package server assembles a running tether from a configuration and runs
// it. A running tether is a list of components: the binding store, the
// routing audit, live reload, the background loops, and three servers
// (ext_proc and ADS over gRPC, the admin HTTP API). Run starts them, waits
// for the end, and stops them in a stated order. cmd/tether parses flags
// and calls Run.
package server

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"google.golang.org/grpc"

	"github.com/tetherproxy/tether/config"
)

// Options are what Run needs besides the configuration.
type Options struct {
	Logger zerolog.Logger
	// ConfigPath, when set, is watched: a change to the file updates the
	// fleet and the Envoy resources while tether runs.
	ConfigPath string
	// Overrides re-applies command-line flags to every configuration read
	// from ConfigPath, so a reload does not undo them.
	Overrides func(*config.Config)
	// WrapRegisterer, when set, wraps the registerer every collector is
	// registered with (tests list tether's metrics through it); /metrics
	// serves what reaches the registry underneath.
	WrapRegisterer func(prometheus.Registerer) prometheus.Registerer
}

// component is one long-lived part of a running tether. Its constructor
// opens what it holds, so a start fails before anything serves. Start
// begins its work and returns; a server reports a later failure on the
// channel its constructor was given. Stop ends the work within ctx.
type component interface {
	Name() string
	Start(ctx context.Context)
	Stop(ctx context.Context) error
}

// Run serves until ctx ends or a server fails, then stops in four steps:
//
//  1. Lame duck: /readyz and the gRPC health service report the replica
//     down. The ext_proc server still decides for server.drain_delay,
//     while Envoy's health checks take the replica out of rotation. A
//     server's failure skips or ends this step.
//  2. Settle: the ext_proc server serves on until every request it routed
//     has ended, at most server.drain_timeout. Then it stops.
//  3. The rest stop in order: the background loops, the DNS discovery,
//     the file watch, the xDS server (its streams cut after 1 s), the
//     admin server (2 s), the routing audit (its records flushed, 5 s),
//     the binding store.
//  4. Run logs "tether stopped" and returns.
//
// Run returns an error only when tether cannot start or a server fails.
// cfg has passed config.Validate.
func Run(ctx context.Context, cfg config.Config, opts Options) error {
	t, err := assemble(ctx, cfg, opts)
	if err != nil {
		return err
	}
	// Servers start last: what they call runs by then.
	for _, c := range []component{t.store, t.audit, t.reload, t.discovery, t.loops, t.xds, t.admin, t.extproc} {
		c.Start(ctx)
	}
	t.logReady()

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-t.errc:
	}
	t.admin.ready.Drain()
	t.extproc.drain()
	if d := t.drain.Delay; d > 0 && runErr == nil {
		runErr = lameDuck(d, t.errc, t.log)
	}
	t.log.Info().Dur("timeout", t.drain.Timeout).Msg("draining ext_proc streams")
	// The ext_proc server stops first: while it decides, it uses every
	// other part. The admin server stops late, so /readyz says "draining"
	// to the end. The store stops last: the audit may write to it.
	for _, s := range []struct {
		c      component
		within time.Duration // 0: no bound
	}{
		{t.extproc, t.drain.Timeout},
		{t.loops, 0},
		{t.discovery, 0},
		{t.reload, 0},
		{t.xds, time.Second},
		{t.admin, 2 * time.Second},
		{t.audit, auditCloseTimeout},
		{t.store, 0},
	} {
		stop(s.c, s.within, t.log)
	}
	t.log.Info().Msg("tether stopped")
	return runErr
}

// stop stops c, giving it within when that is not 0.
func stop(c component, within time.Duration, log zerolog.Logger) {
	ctx := context.Background()
	if within > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, within)
		defer cancel()
	}
	if err := c.Stop(ctx); err != nil {
		log.Warn().Err(err).Msg(c.Name() + " close")
	}
}

// lameDuck waits out server.drain_delay with the replica reported down
// but its ext_proc listener still open. Envoy's health checks (twice a
// second, out after two failures) and Kubernetes' endpoints take it out
// of rotation meanwhile, so no new stream meets a closed port and skips
// tether. A server that fails in the meantime ends the wait with its
// error.
func lameDuck(d time.Duration, errc <-chan error, log zerolog.Logger) error {
	log.Info().Dur("delay", d).Msg("not ready; still deciding until Envoy stops sending streams")
	t := time.NewTimer(d)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			return nil
		case err := <-errc:
			if err != nil {
				return err
			}
		}
	}
}

// settleEvery is how often settle looks at what is still to come.
const settleEvery = 10 * time.Millisecond

// settle returns once every request this replica routed has ended, or
// when ctx ends. The ext_proc server serves on meanwhile: an end may come
// on an access-log stream Envoy opens only then. Envoy never closes its
// access-log streams, so settle counts the ends still pending instead.
// An end reported apart is not waited for when another replica is live
// (Envoy moves its streams there) or when idle says the engines run
// nothing (that end will not come).
func settle(ctx context.Context, p interface{ Pending() (apart, stream int) }, others interface{ Replicas() int }, idle func() bool, log zerolog.Logger) {
	began := time.Now()
	tick := time.NewTicker(settleEvery)
	defer tick.Stop()
	for {
		apart, stream := p.Pending()
		switch {
		case stream > 0:
		case apart == 0 || others.Replicas() > 0:
			log.Info().Dur("waited", time.Since(began)).Int("other_replicas", others.Replicas()).Msg("every request's end heard (or left to another replica)")
			return
		case idle():
			log.Info().Dur("waited", time.Since(began)).Int("apart", apart).
				Msg("every engine idle since the last decision: the ends still pending will not come (requests cancelled while tether decided)")
			return
		}
		select {
		case <-tick.C:
		case <-ctx.Done():
			apart, stream := p.Pending()
			log.Warn().Int("apart", apart).Int("stream", stream).Msg("drain timeout: the ends of requests still pending are not heard here")
			return
		}
	}
}

// serveErr is a server's failure, or nil when it stopped as asked.
func serveErr(name string, err error) error {
	if err == nil || errors.Is(err, http.ErrServerClosed) || errors.Is(err, grpc.ErrServerStopped) {
		return nil
	}
	return fmt.Errorf("%s: %w", name, err)
}
