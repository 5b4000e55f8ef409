package config

import (
	"net/url"
	"slices"
	"strings"
)

// embeddedURL is the redis.url of the in-process memory store (store
// Embedded). It has no server, so it takes no settings.
const embeddedURL = "embedded"

// checkEmbedded says why u, which is not exactly "embedded", is wrong. u
// may ask for the embedded store with settings only a real Redis has: an
// address, TLS, credentials, a database, a Cluster seed list or Sentinel
// options. Or u may spell "embedded" otherwise, as "Embedded" or
// " embedded". checkEmbedded returns "" for a value that does not ask for
// the embedded store. A Redis URL whose host is named embedded, such as
// redis://embedded:6379, is a Redis URL.
func checkEmbedded(u string) string {
	if u == embeddedURL {
		return ""
	}
	scheme, rest, hasScheme := strings.Cut(u, "://")
	if hasScheme {
		if !slices.Contains(strings.Split(strings.ToLower(scheme), "+"), embeddedURL) {
			return ""
		}
	} else {
		t := strings.TrimSpace(u)
		if !hasEmbeddedPrefix(t) {
			return ""
		}
		scheme, rest = "", t[len(embeddedURL):]
		if rest != "" && !strings.ContainsAny(rest[:1], ":/?@") {
			rest = "" // a misspelling ("embeddedd"), not settings
		}
	}
	settings := embeddedSettings(strings.ToLower(scheme), rest)
	if len(settings) == 0 {
		return `want exactly "embedded" (the in-process memory store), or a Redis URL`
	}
	list := settings[0]
	if n := len(settings); n > 1 {
		list = strings.Join(settings[:n-1], ", ") + " and " + settings[n-1]
	}
	return `"embedded" is the in-process memory store, which has no server: it takes none of this value's ` + list +
		` (only a real Redis does); write exactly "embedded", or a Redis URL (redis://, rediss://, redis+cluster://, redis+sentinel://)`
}

// embeddedSettings names what rest and the scheme ask of a server. rest is
// the value after "scheme://" or after "embedded". It never quotes them,
// since they may hold a password.
func embeddedSettings(scheme, rest string) []string {
	authority, query, _ := strings.Cut(rest, "?")
	authority, path, _ := strings.Cut(authority, "/")
	q, err := url.ParseQuery(query)
	if err != nil {
		q = url.Values{}
	}
	keys := make([]string, 0, len(q))
	for k := range q {
		keys = append(keys, strings.ToLower(k))
	}
	param := func(subs ...string) bool {
		return slices.ContainsFunc(keys, func(k string) bool {
			return slices.ContainsFunc(subs, func(s string) bool { return strings.Contains(k, s) })
		})
	}
	var out []string
	add := func(ok bool, what string) {
		if ok {
			out = append(out, what)
		}
	}
	parts := strings.Split(scheme, "+")
	add(slices.Contains(parts, "cluster"), "Cluster scheme")
	add(slices.Contains(parts, "sentinel") || param("master", "sentinel"), "Sentinel options")
	add(param("addr"), "seed list (addr=)")
	add(slices.Contains(parts, "rediss") || param("tls", "ssl"), "TLS")
	_, host, hasUser := strings.Cut(authority, "@")
	if !hasUser {
		host = authority
	}
	add(hasUser || param("pass", "user"), "credentials")
	add(strings.Trim(host, ":") != "", "address")
	add(path != "" || param("db"), "database")
	add(len(out) == 0 && query != "", "options")
	return out
}

// shownRedisURL is what an error may print of a redis.url:
//   - the value itself when it is "embedded" but for case and spaces;
//   - "embedded…" for one that adds settings to it without a scheme;
//   - otherwise its scheme only (shownURL), since the rest may hold a
//     password.
func shownRedisURL(u string) string {
	t := strings.TrimSpace(u)
	switch {
	case strings.EqualFold(t, embeddedURL):
		return u
	case !strings.Contains(u, "://") && hasEmbeddedPrefix(t):
		return t[:len(embeddedURL)] + "…"
	}
	return shownURL(u)
}

// hasEmbeddedPrefix reports whether s starts with "embedded", in any case.
func hasEmbeddedPrefix(s string) bool {
	return len(s) >= len(embeddedURL) && strings.EqualFold(s[:len(embeddedURL)], embeddedURL)
}
