package main

import (
	"context"
	"fmt"
	"time"

	goredis "github.com/redis/go-redis/v9"
	"github.com/rs/zerolog"
)

// redisLogger sends go-redis's own log lines to tether's JSON log,
// sampled, instead of plain text on stderr. Those lines are mostly dial
// failures while Redis is down, one per attempt. go-redis keeps its logger
// in a package variable. So tether serve sets it once, for the whole
// process.
type redisLogger struct{ log zerolog.Logger }

func (l redisLogger) Printf(_ context.Context, format string, v ...any) {
	l.log.Warn().Str("component", "go-redis").Msg(fmt.Sprintf(format, v...))
}

func setRedisLogger(log zerolog.Logger) {
	goredis.SetLogger(redisLogger{log.Sample(&zerolog.BurstSampler{Burst: 5, Period: 10 * time.Second})})
}
