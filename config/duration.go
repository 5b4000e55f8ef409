package config

import (
	"fmt"
	"time"
)

// Duration accepts either an integer number of seconds or a Go duration
// string. Seconds suit keys such as max_sticky_duration = 1800. Duration
// strings look like "30m" or "250ms".
type Duration struct {
	D time.Duration
}

// Dur is d as a Duration, for building configs in code.
func Dur(d time.Duration) Duration { return Duration{D: d} }

// UnmarshalTOML implements toml.Unmarshaler.
func (d *Duration) UnmarshalTOML(v any) error {
	switch x := v.(type) {
	case int64:
		if x > int64(1<<62/time.Second) || x < -int64(1<<62/time.Second) {
			return fmt.Errorf("%d seconds is out of range", x)
		}
		*d = Duration{D: time.Duration(x) * time.Second}
	case float64:
		if x > float64(1<<62/time.Second) || x < -float64(1<<62/time.Second) || x != x {
			return fmt.Errorf("%v seconds is out of range", x)
		}
		*d = Duration{D: time.Duration(x * float64(time.Second))}
	case string:
		p, err := time.ParseDuration(x)
		if err != nil {
			return fmt.Errorf("%q is not a duration (want seconds as a number, or like \"30m\", \"250ms\")", x)
		}
		*d = Duration{D: p}
	default:
		return fmt.Errorf("%v is not a duration", v)
	}
	return nil
}

// MarshalText shows the duration the way Go writes it.
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.D.String()), nil }

func (d Duration) String() string { return d.D.String() }
