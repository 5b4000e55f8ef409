package affinity_test

import (
	"os"
	"strings"
	"testing"
)

// boundStatement is how the documents state bounded load, word for word:
// what bound computes (TestKVSessionsRaisesTheBound holds the code to it).
const boundStatement = "max(⌈(1+ε) × its weighted share⌉, kv_sessions)"

// kvStatement is what kv_sessions means, in the same words everywhere.
const kvStatement = "below `kv_sessions` an instance always takes its own sessions"

// TestDocumentsStateOneBound: the README, this package's README and
// docs/config.md say what bounded load is and what kv_sessions means in
// the same words, and none states another form of the bound.
func TestDocumentsStateOneBound(t *testing.T) {
	for _, path := range []string{"../README.md", "README.md", "../docs/config.md"} {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		// Line breaks in the Markdown source are spaces.
		doc := strings.Join(strings.Fields(string(b)), " ")
		for _, want := range []string{boundStatement, kvStatement} {
			if !strings.Contains(doc, want) {
				t.Errorf("%s does not say %q", path, want)
			}
		}
		for _, other := range []string{"soft cap", "⌈(1+ε)·(A+1)·w/W⌉, kv_sessions"} {
			if strings.Contains(doc, other) {
				t.Errorf("%s states another bound: %q", path, other)
			}
		}
	}
}
