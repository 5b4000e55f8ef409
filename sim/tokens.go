package sim

import "unicode"

// CountTokens is the emulator's tokenizer: one token per run of
// non-whitespace characters, with whitespace as unicode.IsSpace defines it
// (the rule of strings.Fields). "Hello, world!" is 2 tokens, "" is 0. Real
// tokenizers give about 1.3 tokens per English word; this rule only has to be
// simple, deterministic and the same on every instance.
func CountTokens(s string) int {
	n := 0
	inWord := false
	for _, r := range s {
		switch {
		case unicode.IsSpace(r):
			inWord = false
		case !inWord:
			n++
			inWord = true
		}
	}
	return n
}
