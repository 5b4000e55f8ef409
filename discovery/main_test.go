package discovery

import (
	"testing"

	"go.uber.org/goleak"
)

// Each group's loop ends with Run's context; none may outlive a test.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
