package reload

import (
	"testing"

	"go.uber.org/goleak"
)

// The ADS server's and the file watcher's goroutines end with their
// context; none may outlive a test.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
