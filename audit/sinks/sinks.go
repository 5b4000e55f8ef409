// Package sinks opens the routing audit's sink that [audit] names. That is
// JSON-lines files (audit/file), a PostgreSQL table (audit/postgres) or a
// Redis Stream (audit/redis). `tether serve` and `tether audit` both open
// it here, so both read and write the same records.
package sinks

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	goredis "github.com/redis/go-redis/v9"

	"github.com/tetherproxy/tether/audit"
	"github.com/tetherproxy/tether/audit/file"
	"github.com/tetherproxy/tether/audit/postgres"
	auditredis "github.com/tetherproxy/tether/audit/redis"
	"github.com/tetherproxy/tether/config"
	redisstore "github.com/tetherproxy/tether/store/redis"
)

// Keys says where the routing audit's keys come from.
func Keys(a config.Audit) audit.KeyConfig {
	return audit.KeyConfig{
		KeysEnv: a.KeyringEnv, KeysFile: a.KeyringFile,
		PseudonymEnv: a.PseudonymKeyEnv, PseudonymFile: a.PseudonymKeyFile,
	}
}

// Open opens the sink a names, whether or not the audit is enabled.
// `tether audit` reads records written while it was.
//
// store is the binding store. The Redis sink writes to its Redis, under
// its key prefix, unless audit.redis_url names another Redis. closeSink
// releases the sink and what was opened for it, not the store.
//
// A PostgreSQL server that cannot be reached fails the opening: the CLI's
// export and forget need it now. tether serve opens it with OpenLazy
// instead.
func Open(ctx context.Context, a config.Audit, store *redisstore.Store) (sink audit.Sink, closeSink func() error, err error) {
	return open(ctx, a, store, false)
}

// OpenLazy is Open, but a PostgreSQL sink opens even when the server
// cannot be reached (postgres.Config.Lazy). Routing must not wait for the
// audit.
func OpenLazy(ctx context.Context, a config.Audit, store *redisstore.Store) (sink audit.Sink, closeSink func() error, err error) {
	return open(ctx, a, store, true)
}

func open(ctx context.Context, a config.Audit, store *redisstore.Store, lazy bool) (audit.Sink, func() error, error) {
	switch a.Sink {
	case config.AuditSinkFile:
		s, err := file.New(file.Config{Dir: a.FileDir, Retention: a.Retention.D})
		if err != nil {
			return nil, nil, err
		}
		return s, s.Close, nil
	case config.AuditSinkPostgres:
		dsn := os.Getenv(a.PostgresDSNEnv)
		if dsn == "" {
			return nil, nil, fmt.Errorf("audit sink postgres: environment variable %s is not set (audit.postgres_dsn_env names it; it holds the DSN)", a.PostgresDSNEnv)
		}
		return openPostgres(ctx, dsn, a.Retention.D, lazy)
	case config.AuditSinkRedis:
		var client goredis.UniversalClient
		prefix, closeClient := redisstore.DefaultPrefix, func() error { return nil }
		switch {
		case a.RedisURL != "":
			c, err := redisstore.NewClient(a.RedisURL)
			if err != nil {
				return nil, nil, fmt.Errorf("audit.redis_url: %w", err)
			}
			client, closeClient = c, c.Close
		case store != nil:
			client, prefix = store.Client(), store.Prefix()
		default:
			return nil, nil, errors.New("audit sink redis: no binding store to write to, and no audit.redis_url")
		}
		s, err := auditredis.New(client, auditredis.Config{Prefix: prefix, Retention: a.Retention.D})
		if err != nil {
			_ = closeClient()
			return nil, nil, err
		}
		return s, func() error { return errors.Join(s.Close(), closeClient()) }, nil
	}
	return nil, nil, fmt.Errorf("audit.sink %q: unknown", a.Sink)
}

// postgresOpenTimeout bounds connecting to PostgreSQL and creating the
// table when the sink opens.
const postgresOpenTimeout = 10 * time.Second

// openPostgres opens the PostgreSQL sink. Its errors never show the DSN.
// lazy opens it even when the server cannot be reached.
func openPostgres(ctx context.Context, dsn string, retention time.Duration, lazy bool) (audit.Sink, func() error, error) {
	ctx, cancel := context.WithTimeout(ctx, postgresOpenTimeout)
	defer cancel()
	s, err := postgres.New(ctx, dsn, postgres.Config{Retention: retention, Lazy: lazy})
	if err != nil {
		return nil, nil, err
	}
	return s, s.Close, nil
}
