package extproc

import (
	"strconv"
	"testing"
	"time"
)

// TestSeenTicketsBounded: however many distinct tickets arrive, at most
// two generations of seenMax are remembered; a duplicate within the window
// is refused, one from the generation before too.
func TestSeenTicketsBounded(t *testing.T) {
	var s seenTickets
	now := time.Now()
	if !s.add("first", now) || s.add("first", now) {
		t.Fatal("first: new, then a duplicate")
	}
	for i := 0; i < 3*seenMax; i++ {
		s.add(strconv.Itoa(i), now)
		if n := len(s.cur) + len(s.prev); n > 2*seenMax {
			t.Fatalf("after %d tickets: %d remembered, bound %d", i+1, n, 2*seenMax)
		}
	}
	last := strconv.Itoa(3*seenMax - 1)
	if s.add(last, now) {
		t.Fatal("a duplicate of the latest ticket was accepted")
	}
	// Two windows later both generations have turned over.
	later := now.Add(2 * seenWindow)
	s.add("x", later)
	s.add("y", later.Add(seenWindow))
	if !s.add(last, later.Add(seenWindow)) {
		t.Fatal("a ticket two windows old is still remembered")
	}
}
