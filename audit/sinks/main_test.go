package sinks

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/tetherproxy/tether/internal/testenv"
)

// pg is the PostgreSQL server of this package's tests, started by the
// first test that asks for it (each test works in tables of its own).
var pg testenv.SharedPostgres

func TestMain(m *testing.M) { goleak.VerifyTestMain(stopPostgres{m}) }

// stopPostgres runs the tests, then stops the shared PostgreSQL server
// before goleak looks for goroutines left behind.
type stopPostgres struct{ m *testing.M }

func (s stopPostgres) Run() int {
	defer pg.Stop()
	return s.m.Run()
}
