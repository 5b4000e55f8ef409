// Package syncbuf is a bytes.Buffer safe for concurrent writers. It holds
// the output of a child process, read while the process still runs. exec
// copies the child's stdout and stderr on separate goroutines.
package syncbuf

import (
	"bytes"
	"sync"
)

// Buffer collects writes under a lock. The zero value is ready to use.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

// Write implements io.Writer.
func (s *Buffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

// String returns everything written so far.
func (s *Buffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
