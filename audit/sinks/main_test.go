package sinks

import (
	"testing"

	"github.com/tetherproxy/tether/audit/audittest"
	"github.com/tetherproxy/tether/internal/testenv"
)

// pg is the PostgreSQL server of this package's tests, started by the
// first test that asks for it (each test works in tables of its own).
var pg testenv.SharedPostgres

func TestMain(m *testing.M) { audittest.Main(m, &pg) }
