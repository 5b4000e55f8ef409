package xds

import (
	"errors"
	"fmt"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/tetherproxy/tether/config"
)

// BootstrapOption changes what ADSBootstrap makes.
type BootstrapOption func(*bootstrapOptions)

type bootstrapOptions struct {
	tls config.TLS
}

// WithTLS makes the bootstrap's ADS cluster connect to tether over TLS as
// t ([tls] and [tls.envoy]) says; a t without cert_file, or with an empty
// [tls.envoy], changes nothing.
func WithTLS(t config.TLS) BootstrapOption {
	return func(o *bootstrapOptions) { o.tls = t }
}

// upstreamTLS is the transport socket of a cluster that reaches tether's
// gRPC servers when they speak TLS ([tls]), nil when they do not, and nil
// when [tls.envoy] is empty: config.Validate allows that only with the
// ADS server off, where Envoy is configured elsewhere (Istio) and the
// resources tether builds are not served, so Envoy's TLS to tether is
// that configuration's to set (docs/security.md). Otherwise Envoy
// presents [tls.envoy]'s certificate (mutual TLS), verifies tether's
// against its CA and, with an SNI, requires that name in it. The files are
// Envoy's: tether does not read them. ALPN offers h2, which gRPC servers
// require. The maximum version is always TLS 1.3: Envoy's upstream default
// maximum is TLS 1.2, so min_version = "1.3" alone would leave Envoy no
// version to offer.
func upstreamTLS(t config.TLS) (*corev3.TransportSocket, error) {
	e := t.Envoy
	if !t.Enabled() || e == (config.EnvoyTLS{}) {
		return nil, nil
	}
	var errs []error
	for _, m := range t.EnvoyMissing() {
		errs = append(errs, fmt.Errorf("%s: %s", m.Key, m.Why))
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	file := func(p string) *corev3.DataSource {
		return &corev3.DataSource{Specifier: &corev3.DataSource_Filename{Filename: p}}
	}
	version := tlsv3.TlsParameters_TLSv1_2
	if t.MinVersion == "1.3" {
		version = tlsv3.TlsParameters_TLSv1_3
	}
	vc := &tlsv3.CertificateValidationContext{TrustedCa: file(e.CAFile)}
	if e.SNI != "" {
		vc.MatchTypedSubjectAltNames = []*tlsv3.SubjectAltNameMatcher{{
			SanType: tlsv3.SubjectAltNameMatcher_DNS,
			Matcher: &matcherv3.StringMatcher{MatchPattern: &matcherv3.StringMatcher_Exact{Exact: e.SNI}},
		}}
	}
	ctx := &tlsv3.UpstreamTlsContext{
		Sni: e.SNI,
		CommonTlsContext: &tlsv3.CommonTlsContext{
			TlsParams: &tlsv3.TlsParameters{
				TlsMinimumProtocolVersion: version,
				TlsMaximumProtocolVersion: tlsv3.TlsParameters_TLSv1_3,
			},
			AlpnProtocols:         []string{"h2"},
			ValidationContextType: &tlsv3.CommonTlsContext_ValidationContext{ValidationContext: vc},
		},
	}
	if e.CertFile != "" {
		ctx.CommonTlsContext.TlsCertificates = []*tlsv3.TlsCertificate{{
			CertificateChain: file(e.CertFile),
			PrivateKey:       file(e.KeyFile),
		}}
	}
	a, err := anypb.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("pack upstream TLS context: %w", err)
	}
	return &corev3.TransportSocket{
		Name:       "envoy.transport_sockets.tls",
		ConfigType: &corev3.TransportSocket_TypedConfig{TypedConfig: a},
	}, nil
}
