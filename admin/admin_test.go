package admin

import (
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/rs/zerolog"

	"github.com/tetherproxy/tether/config"
	"github.com/tetherproxy/tether/internal/syncbuf"
)

const testToken = "tok-3f9a1c2e7b5d4a60-admin"

// TestAdminBeyondLoopbackWarns: an open admin API on a non-loopback
// address starts, with a warning; on loopback, or with a token, it does
// not warn.
func TestAdminBeyondLoopbackWarns(t *testing.T) {
	h := http.NotFoundHandler()
	for _, tc := range []struct {
		ip    net.IP
		token string
		warn  bool
	}{
		{net.IPv4zero, "", true},
		{net.IPv6unspecified, "", true},
		{net.ParseIP("10.0.0.7"), "", true},
		{net.IPv4(127, 0, 0, 1), "", false},
		{net.IPv6loopback, "", false},
		{net.IPv4zero, testToken, false},
	} {
		logs := &syncbuf.Buffer{}
		Guard(tc.token, config.Default().Server, &net.TCPAddr{IP: tc.ip, Port: 8090}, zerolog.New(logs), h)
		if got := strings.Contains(logs.String(), `"level":"warn"`); got != tc.warn {
			t.Errorf("%v token=%v: warned %v, want %v:\n%s", tc.ip, tc.token != "", got, tc.warn, logs)
		}
		if strings.Contains(logs.String(), testToken) {
			t.Errorf("the token is in the logs: %s", logs)
		}
	}
}
