package simulator

// eventKind says what happens at an event.
type eventKind uint8

const (
	// eventDone: the request in flight of a conversation ends.
	eventDone eventKind = iota + 1
	// eventSend: a conversation sends its next turn (its think time is over).
	eventSend
	// eventAnswered: the response headers of a conversation's request in
	// flight reach tether (the tether router's own queue, see
	// tetherRouter.finish).
	eventAnswered
)

// event is one entry of the event queue.
type event struct {
	at   int64  // virtual ns
	seq  uint64 // scheduling order: breaks ties, so runs are deterministic
	call *call
	kind eventKind
}

func (e event) before(f event) bool {
	return e.at < f.at || (e.at == f.at && e.seq < f.seq)
}

// eventQueue is a binary min-heap of events by (at, seq). (container/heap
// would box every event in an interface.)
type eventQueue []event

func (q *eventQueue) push(e event) {
	*q = append(*q, e)
	h := *q
	for i := len(h) - 1; i > 0; {
		p := (i - 1) / 2
		if !h[i].before(h[p]) {
			break
		}
		h[i], h[p] = h[p], h[i]
		i = p
	}
}

// pop removes and returns the earliest event; q must not be empty.
func (q *eventQueue) pop() event {
	h := *q
	top := h[0]
	n := len(h) - 1
	h[0] = h[n]
	h[n] = event{} // let the request go
	h = h[:n]
	for i := 0; ; {
		l, m := 2*i+1, i
		if l < n && h[l].before(h[m]) {
			m = l
		}
		if r := l + 1; r < n && h[r].before(h[m]) {
			m = r
		}
		if m == i {
			break
		}
		h[i], h[m] = h[m], h[i]
		i = m
	}
	*q = h
	return top
}
