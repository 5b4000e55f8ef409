package redis

import (
	"fmt"

	goredis "github.com/redis/go-redis/v9"
)

// Client is the go-redis client the store calls, for other users of the
// same Redis, such as the routing audit's stream. It stays the store's: do
// not close it. Its calls go through the store's guard. So while Redis is
// unreachable they fail at once. Their failures count towards opening the
// guard, as a failed call is a sign of the same outage. They are bounded by
// the caller's context, not by Options.Timeout.
func (s *Store) Client() goredis.UniversalClient { return s.client }

// Prefix is the prefix of every key the store writes (Options.Prefix or
// DefaultPrefix).
func (s *Store) Prefix() string { return s.prefix }

// NewClient builds a client for rawURL, in any of Open's forms, without a
// store and without connecting: for data that lives in another Redis than
// the bindings (audit.redis_url). The caller closes it. Like Open's, its errors hide the URL's password.
func NewClient(rawURL string) (goredis.UniversalClient, error) {
	co, err := parseURL(rawURL)
	if err != nil {
		return nil, err
	}
	c, err := newClient(co)
	if err != nil {
		return nil, fmt.Errorf("redis client %q: %w", redact(rawURL), safeErr(err, rawURL))
	}
	return c, nil
}
