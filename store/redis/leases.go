package redis

import (
	"context"
	"fmt"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"github.com/tetherproxy/tether/replicas"
)

// The lease scripts. Like the circuit scripts they are not loaded by New:
// go-redis sends them with EVALSHA and falls back to EVAL once per server.
var (
	leaseTake    = goredis.NewScript(leaseTakeSrc)
	leaseRelease = goredis.NewScript(leaseReleaseSrc)
)

// leaseTakeSrc: KEYS[1] the lease, ARGV[1] holder, ARGV[2] ttl ms. Takes
// a free lease or renews the holder's own; replies 1, or 0 while another
// holder's runs. Expiry is Redis's own clock, so replicas' clocks need not
// agree.
const leaseTakeSrc = `
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
`

// leaseReleaseSrc: KEYS[1] the lease, ARGV[1] holder. Deletes it only if
// holder has it.
const leaseReleaseSrc = `
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
`

func (s *Store) leaseKey(name string) string { return s.fleet + "lease:" + name }

// Lease implements replicas.Leases in one EVALSHA; the lease runs for ttl
// by Redis's clock (now is not used).
func (s *Store) Lease(ctx context.Context, name, holder string, ttl time.Duration, _ time.Time) (bool, error) {
	if err := replicas.CheckLease(name, holder, ttl); err != nil {
		return false, fmt.Errorf("redis lease: %w", err)
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	if err := ctx.Err(); err != nil {
		return false, fmt.Errorf("redis lease: %w", err)
	}
	c := &scriptCall{sc: leaseTake, keys: []string{s.leaseKey(name)}, args: []any{holder, millis(ttl)}}
	s.exec(ctx, []*scriptCall{c}, nil)
	n, err := c.cmd.Int64()
	if err != nil {
		return false, fmt.Errorf("redis lease %q: %w", name, err)
	}
	return n == 1, nil
}

// Release implements replicas.Leases in one EVALSHA.
func (s *Store) Release(ctx context.Context, name, holder string) error {
	if err := replicas.CheckLease(name, holder, time.Second); err != nil {
		return fmt.Errorf("redis release: %w", err)
	}
	ctx, cancel := s.opContext(ctx)
	defer cancel()
	c := &scriptCall{sc: leaseRelease, keys: []string{s.leaseKey(name)}, args: []any{holder}}
	s.exec(ctx, []*scriptCall{c}, nil)
	if err := c.cmd.Err(); err != nil {
		return fmt.Errorf("redis release %q: %w", name, err)
	}
	return nil
}
