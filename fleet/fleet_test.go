package fleet

import "testing"

func TestAtAddress(t *testing.T) {
	f := New([]Instance{
		{Name: "v4", Address: "10.0.0.1:8000"},
		{Name: "v6", Address: "[2001:db8::1]:8000"},
		{Name: "host", Address: "gpu-0.pool.svc:8000"},
		{Name: "twin", Address: "10.0.0.1:8000"},
	})
	for _, tc := range []struct{ addr, want string }{
		{"10.0.0.1:8000", "v4"},
		{"[2001:db8:0::1]:8000", "v6"},
		{"[2001:DB8::1]:8000", "v6"},
		{"[::ffff:10.0.0.1]:8000", "v4"},
		{"gpu-0.pool.svc:8000", "host"},
		{"10.0.0.1:8001", ""},
		{"10.0.0.1", ""},
		{"[2001:db8::1]", ""},
		{"", ""},
		{"not an address", ""},
	} {
		in, ok := f.AtAddress(tc.addr)
		if in.Name != tc.want || ok != (tc.want != "") {
			t.Errorf("AtAddress(%q) = %q, %v; want %q", tc.addr, in.Name, ok, tc.want)
		}
	}
}
