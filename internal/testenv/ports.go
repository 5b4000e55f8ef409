package testenv

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"

	"github.com/tetherproxy/tether/internal/launch"
)

const (
	// Cluster and sentinel ports are drawn from [clusterPortMin,
	// clusterPortMin+clusterPorts). A cluster node's bus port is its port
	// + 10000. Both ranges stay below Linux's ephemeral range, 32768 and
	// up. So outgoing connections do not take them.
	clusterPortMin = 20000
	clusterPorts   = 2700
	// portAttempts bounds the ports a start draws while it finds them
	// taken.
	portAttempts = 20
)

// drawClusterPort draws a random port for a redis-server a test starts on
// TCP.
func drawClusterPort() (int, error) { return clusterPortMin + rand.IntN(clusterPorts), nil }

// loopbackPort returns a port that was free on 127.0.0.1 a moment ago.
// PostgreSQL and Prometheus cannot take a listener from the test. So
// another process may bind the port before them. onFreePort then draws
// again.
func loopbackPort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("free loopback port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// onFreePort calls start with ports from draw, at most portAttempts
// times. It stops when a server starts on one and proves it is the one
// started. start reports a port another process holds with an error
// wrapping launch.ErrPortTaken, after killing its server. onFreePort then
// draws another port. Any other error ends the search.
func onFreePort[T any](draw func() (int, error), start func(port int) (T, error)) (T, error) {
	var zero T
	var taken []int
	for range portAttempts {
		port, err := draw()
		if err != nil {
			return zero, err
		}
		v, err := start(port)
		if err == nil {
			return v, nil
		}
		if !errors.Is(err, launch.ErrPortTaken) {
			return zero, err
		}
		taken = append(taken, port)
	}
	return zero, fmt.Errorf("no free port in %d attempts (taken: %v): %w", portAttempts, taken, launch.ErrPortTaken)
}
