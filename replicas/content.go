package replicas

// The content share: what one replica's cache-aware placement sent where,
// known to every replica.
//
// Each replica keeps its own prefix index (package prefix) of the blocks
// it sent to each instance. With two or more replicas behind one Envoy, an
// anonymous caller's follow-up that lands on another replica than its
// first turn would be placed without knowing where that turn went. So
// every Record on the index also goes, off the request path, to the other
// replicas, which apply it to their own index with the same Record:
//
//  1. Record, on the request path, records on the local index. It then
//     appends a copy of the chain's hashes to a bounded buffer under a
//     mutex, and never waits. A record that does not fit
//     (ContentBufferBytes) is dropped and counted.
//  2. Run publishes the buffer as one message through the bus
//     (ContentBus: the Redis store's <prefix>content channel). It does so
//     ContentFlushEvery after the buffer's first record, or at once when
//     the buffer holds ContentFlushBytes.
//  3. Run also subscribes. A message that does not decode is counted and
//     dropped whole. Each record of an instance in the fleet is recorded on
//     the local index at its own time, never later than now.
//
// A record reaches the other replicas one flush interval plus one publish
// later. A lost message leaves their indexes short of it. That costs a
// placement by identity, never a wrong answer: the index is a hint.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

const (
	// ContentFlushEvery is how long a record waits for others to share
	// its message: at most this late (plus one publish) another replica
	// indexes it.
	ContentFlushEvery = 20 * time.Millisecond
	// ContentFlushBytes publishes the buffer before ContentFlushEvery when
	// it holds this much (20 records of 400 KB prompts).
	ContentFlushBytes = 256 << 10
	// ContentBufferBytes bounds the records waiting to be published (about
	// 330 records of 400 KB prompts, 16 000 of 1 KB ones): past it a
	// record is dropped, and the request never waits.
	ContentBufferBytes = 4 << 20
	// ContentPublishTimeout bounds one publish.
	ContentPublishTimeout = time.Second
)

// ContentBus carries the content share's messages between replicas. The
// Redis store uses PUBLISH and SUBSCRIBE on <prefix>content. The memory
// store, alone in its process, carries nothing. The names say content
// because the store that implements them carries other things.
type ContentBus interface {
	// PublishContent sends one message to every replica subscribed,
	// this one included.
	PublishContent(ctx context.Context, msg []byte) error
	// SubscribeContent calls on with each message published, in order,
	// until ctx ends; it subscribes again after a drop (messages published
	// meanwhile are lost). on must not keep msg.
	SubscribeContent(ctx context.Context, on func(msg []byte))
}

// PrefixIndex is the prefix index the share wraps (prefix.Index). The
// share is what the decider reads and records in its place
// (affinity.PrefixIndex).
type PrefixIndex interface {
	Match(chain []uint64, names []string, depth []int) int
	Record(instance string, chain []uint64, now time.Time)
	Horizon(instance string) (time.Duration, bool)
}

// ContentStats counts what the share did, in records (one decision's
// chain on one instance) except Bad.
type ContentStats struct {
	Published uint64 // sent to the other replicas
	// Dropped were not sent: the buffer was full.
	Dropped uint64
	// Unpublished were not sent: the bus failed their message.
	Unpublished uint64
	Received    uint64 // in other replicas' messages
	Applied     uint64 // recorded on this replica's index (Received less unknown instances)
	Bad         uint64 // messages that did not decode, dropped whole
}

// ContentShare wraps a replica's prefix index so that what it records is
// recorded on every replica's (see the file's comment). Build it with
// NewContentShare; hand it to the decider as its index (affinity.PrefixIndex),
// and Run it.
type ContentShare struct {
	replica string
	index   PrefixIndex
	bus     ContentBus
	known   func(instance string) bool
	log     zerolog.Logger

	mu      sync.Mutex
	pending []byte // the message being filled: header, then records
	spare   []byte // the last message published, for reuse
	records uint64 // records in pending
	kick    chan struct{}
	full    chan struct{}

	published, dropped, unpublished, received, applied, bad atomic.Uint64
}

// NewContentShare returns the share of replica's index over bus. known
// reports whether an instance is in the fleet (fleet.Fleet's Lookup):
// another replica's record of one that is not is not applied.
func NewContentShare(replica string, index PrefixIndex, bus ContentBus, known func(instance string) bool, log zerolog.Logger) *ContentShare {
	c := &ContentShare{replica: replica, index: index, bus: bus, known: known, log: log,
		kick: make(chan struct{}, 1), full: make(chan struct{}, 1)}
	c.pending = appendContentHeader(nil, replica)
	return c
}

// Match asks the index.
func (c *ContentShare) Match(chain []uint64, names []string, depth []int) int {
	return c.index.Match(chain, names, depth)
}

// Horizon is the index's own (PrefixIndex): what it measured of its
// evictions, every replica's records included.
func (c *ContentShare) Horizon(instance string) (time.Duration, bool) {
	return c.index.Horizon(instance)
}

// Record records chain on the index and queues it for the other replicas.
// It never waits for them: a record the buffer has no room for is dropped
// and counted.
func (c *ContentShare) Record(instance string, chain []uint64, now time.Time) {
	c.index.Record(instance, chain, now)
	if len(chain) == 0 || len(instance) > maxContentName {
		return
	}
	size := contentRecordSize(instance, len(chain))
	c.mu.Lock()
	header := contentHeaderSize(c.replica)
	if len(c.pending)+size > header+ContentBufferBytes {
		c.mu.Unlock()
		c.dropped.Add(1)
		return
	}
	first := c.records == 0
	c.pending = appendContentRecord(c.pending, instance, now, chain)
	c.records++
	flush := len(c.pending)-header >= ContentFlushBytes
	c.mu.Unlock()
	if first {
		signal(c.kick)
	}
	if flush {
		signal(c.full)
	}
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// Stats returns what the share did so far.
func (c *ContentShare) Stats() ContentStats {
	return ContentStats{
		Published: c.published.Load(), Dropped: c.dropped.Load(), Unpublished: c.unpublished.Load(),
		Received: c.received.Load(), Applied: c.applied.Load(), Bad: c.bad.Load(),
	}
}

// Run publishes what Record queues and applies what the other replicas
// publish, until ctx ends. Records still queued then are not sent.
func (c *ContentShare) Run(ctx context.Context) {
	var sub sync.WaitGroup
	defer sub.Wait()
	sub.Go(func() { c.bus.SubscribeContent(ctx, c.apply) })
	warn := c.log.Sample(&zerolog.BurstSampler{Burst: 1, Period: 30 * time.Second})
	timer := time.NewTimer(ContentFlushEvery)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.kick:
		}
		timer.Reset(ContentFlushEvery)
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		case <-c.full:
		}
		if err := c.Flush(ctx); err != nil && ctx.Err() == nil {
			warn.Warn().Err(err).Msg("prefix index records not shared; the other replicas place without them")
		}
	}
}

// Flush publishes the records queued now, as one message (none: nothing
// is sent). Run calls it; a test may too.
func (c *ContentShare) Flush(ctx context.Context) error {
	c.mu.Lock()
	msg, n := c.pending, c.records
	if n == 0 {
		c.mu.Unlock()
		return nil
	}
	c.pending = appendContentHeader(c.spare[:0], c.replica)
	c.spare, c.records = nil, 0
	c.mu.Unlock()
	// A record queued after the swap waits for the next round.
	drain(c.full)
	pctx, cancel := context.WithTimeout(ctx, ContentPublishTimeout)
	err := c.bus.PublishContent(pctx, msg)
	cancel()
	if err != nil {
		c.unpublished.Add(n)
	} else {
		c.published.Add(n)
	}
	c.mu.Lock()
	c.spare = msg
	c.mu.Unlock()
	if err != nil {
		return fmt.Errorf("content share: publish %d records: %w", n, err)
	}
	return nil
}

func drain(ch chan struct{}) {
	select {
	case <-ch:
	default:
	}
}

// apply records another replica's message on the index.
func (c *ContentShare) apply(msg []byte) {
	replica, rest, err := decodeContentHeader(msg)
	if err == nil && replica == c.replica {
		return // recorded here already
	}
	var recs []ContentRecord
	if err == nil {
		recs, err = decodeContentRecords(rest)
	}
	if err != nil {
		c.bad.Add(1)
		c.log.Debug().Err(err).Int("bytes", len(msg)).Msg("content share message dropped")
		return
	}
	c.received.Add(uint64(len(recs)))
	now := time.Now()
	for _, r := range recs {
		if c.known != nil && !c.known(r.Instance) {
			continue
		}
		at := r.At
		if at.After(now) {
			at = now // another replica's clock ahead of this one's
		}
		c.index.Record(r.Instance, r.Chain, at)
		c.applied.Add(1)
	}
}

// The message format, little-endian:
//
//	message = version (1 byte, contentVersion)
//	          uvarint len(replica) · replica
//	          record*
//	record  = uvarint len(instance) · instance
//	          varint at (unix ms)
//	          uvarint n (≥ 1) · n × uint64 (the chain's hashes)
//
// The hashes are random, so they are sent as they are. A 400 KB prompt's
// 1600 blocks make a record of about 12.8 KB.
const (
	contentVersion = 1
	// maxContentName bounds a replica's or an instance's name in a message.
	maxContentName = 1024
)

// ContentRecord is one record of a message: chain was sent to Instance
// at At.
type ContentRecord struct {
	Instance string
	At       time.Time
	Chain    []uint64
}

func contentHeaderSize(replica string) int {
	return 1 + uvarintLen(uint64(len(replica))) + len(replica)
}

func contentRecordSize(instance string, n int) int {
	return uvarintLen(uint64(len(instance))) + len(instance) + binary.MaxVarintLen64 + uvarintLen(uint64(n)) + 8*n
}

func uvarintLen(v uint64) int {
	n := 1
	for v >= 0x80 {
		v >>= 7
		n++
	}
	return n
}

func appendContentHeader(dst []byte, replica string) []byte {
	dst = append(dst, contentVersion)
	dst = binary.AppendUvarint(dst, uint64(len(replica)))
	return append(dst, replica...)
}

func appendContentRecord(dst []byte, instance string, at time.Time, chain []uint64) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(instance)))
	dst = append(dst, instance...)
	dst = binary.AppendVarint(dst, at.UnixMilli())
	dst = binary.AppendUvarint(dst, uint64(len(chain)))
	for _, h := range chain {
		dst = binary.LittleEndian.AppendUint64(dst, h)
	}
	return dst
}

var errContentShort = errors.New("content message: truncated")

func decodeContentHeader(msg []byte) (replica string, rest []byte, err error) {
	if len(msg) == 0 {
		return "", nil, errContentShort
	}
	if msg[0] != contentVersion {
		return "", nil, fmt.Errorf("content message: version %d, want %d", msg[0], contentVersion)
	}
	name, rest, err := contentName(msg[1:], "replica")
	return string(name), rest, err
}

// decodeContentRecords reads the records after the header; the chains
// share one array.
func decodeContentRecords(b []byte) ([]ContentRecord, error) {
	// First pass: check the whole message and count its hashes.
	recs, hashes := 0, 0
	for rest := b; len(rest) > 0; recs++ {
		var n int
		var err error
		if _, _, n, rest, err = contentRecordAt(rest); err != nil {
			return nil, fmt.Errorf("record %d: %w", recs, err)
		}
		hashes += n
		rest = rest[8*n:]
	}
	out := make([]ContentRecord, 0, recs)
	all := make([]uint64, hashes)
	for rest := b; len(rest) > 0; {
		name, at, n, r, _ := contentRecordAt(rest)
		chain := all[:n:n]
		all = all[n:]
		for i := range chain {
			chain[i] = binary.LittleEndian.Uint64(r[8*i:])
		}
		rest = r[8*n:]
		out = append(out, ContentRecord{Instance: string(name), At: time.UnixMilli(at), Chain: chain})
	}
	return out, nil
}

// contentRecordAt reads one record's head: its instance, time and count,
// checking that its n hashes follow in rest.
func contentRecordAt(b []byte) (name []byte, at int64, n int, rest []byte, err error) {
	name, rest, err = contentName(b, "instance")
	if err != nil {
		return nil, 0, 0, nil, err
	}
	if len(name) == 0 {
		return nil, 0, 0, nil, errors.New("content message: empty instance")
	}
	at, k := binary.Varint(rest)
	if k <= 0 {
		return nil, 0, 0, nil, errContentShort
	}
	rest = rest[k:]
	count, k := binary.Uvarint(rest)
	if k <= 0 {
		return nil, 0, 0, nil, errContentShort
	}
	rest = rest[k:]
	if count == 0 || count > uint64(len(rest)/8) {
		return nil, 0, 0, nil, fmt.Errorf("content message: %d hashes in %d bytes", count, len(rest))
	}
	return name, at, int(count), rest, nil
}

func contentName(b []byte, what string) (name, rest []byte, err error) {
	n, k := binary.Uvarint(b)
	if k <= 0 {
		return nil, nil, errContentShort
	}
	if n > maxContentName || n > uint64(len(b)-k) {
		return nil, nil, fmt.Errorf("content message: %s name of %d bytes", what, n)
	}
	return b[k : k+int(n)], b[k+int(n):], nil
}
