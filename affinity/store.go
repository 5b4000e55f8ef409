package affinity

import (
	"context"
	"time"

	"github.com/tetherproxy/tether/bindings"
)

// Store is what the decision needs of the binding store: a session's
// binding, made when there is none, and its replacement when the session
// moves. Keys are already hashed by the identity package; a store may
// prefix them but never sees a raw identifier. store/memory and
// store/redis implement it (and the contracts other packages declare of
// the same store); store/storetest holds both to it.
//
// Both methods are atomic per session: two callers racing on the same key
// observe one winner and both return the winner's binding. A missing key
// is not an error: GetOrBind binds the candidate (Created), Replace stores
// next.
//
// A store also keeps, per instance, an index of the sessions bound to it
// (members expire with the sessions), so that active sessions can be
// counted and an instance's sessions found.
type Store interface {
	// GetOrBind resolves l.Key (following an alias link when l.Key has
	// one), links l.Aliases to the resolved key, and returns its binding,
	// refreshing its idle timeout. When there is none, or it is older than
	// l.Lifetime.Max measured at l.Candidate.Since, the candidate is stored
	// and returned. Either way the request is counted (Result.Requests).
	GetOrBind(ctx context.Context, l bindings.Lookup) (bindings.Result, error)
	// Replace moves key to next if it is still bound to instance old (or not
	// bound at all), clears any pending Move, and returns the binding now
	// stored: next on success, the binding another caller stored first
	// otherwise. The session's request count is kept (it starts again from
	// 0 when there was no binding). key is a Result.Key, never an alias.
	Replace(ctx context.Context, key, old string, next bindings.Binding, lt bindings.Lifetime) (bindings.Binding, error)
}

// Peeker is a Store that can say, from what it holds in memory, where a
// session is bound: the binding GetOrBind would find for key at now under
// lt, with the same rules, or ok false when it cannot say without a round
// trip. Peek counts no request and changes nothing. The decider does not
// rank the fleet for a session Peek finds on an available instance, so a
// hit skips the placement pipeline. GetOrBind still decides. When the
// binding went between the two (its idle timeout ran out in the
// microseconds between them, or another replica removed it), the session
// is bound again on the peeked instance as it is: the pipeline's version
// draw and bounded load are not applied to it.
type Peeker interface {
	Peek(key string, now time.Time, lt bindings.Lifetime) (b bindings.Binding, ok bool)
}
