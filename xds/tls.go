package xds

import (
	"errors"
	"fmt"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	matcherv3 "github.com/envoyproxy/go-control-plane/envoy/type/matcher/v3"
	"google.golang.org/protobuf/types/known/anypb"
)

// BootstrapOption changes what ADSBootstrap makes.
type BootstrapOption func(*bootstrapOptions)

type bootstrapOptions struct {
	tls *UpstreamTLS
}

// WithTLS makes the bootstrap's ADS cluster connect to tether over TLS as
// t says. A nil t changes nothing.
func WithTLS(t *UpstreamTLS) BootstrapOption {
	return func(o *bootstrapOptions) { o.tls = t }
}

// upstreamTLS is the transport socket of a cluster that reaches tether's
// gRPC servers when they speak TLS. It is nil for a nil e. That means
// plaintext, or Envoy's TLS to tether set elsewhere, as by Istio (see
// docs/security.md).
//
// Envoy presents its client certificate for mutual TLS when e names one.
// It verifies tether's certificate against e's CA. With an SNI, it
// requires that name in the certificate. The files are Envoy's: tether
// does not read them. ALPN offers h2, which gRPC servers require.
//
// The maximum version is always TLS 1.3. Envoy's upstream default maximum
// is TLS 1.2, so a minimum of 1.3 alone would leave Envoy no version to
// offer.
func upstreamTLS(e *UpstreamTLS) (*corev3.TransportSocket, error) {
	if e == nil {
		return nil, nil
	}
	if e.CAFile == "" {
		return nil, errors.New("upstream TLS: no CA file to verify tether's certificate with")
	}
	if (e.CertFile == "") != (e.KeyFile == "") {
		return nil, fmt.Errorf("upstream TLS: certificate %q and key %q: want both or neither", e.CertFile, e.KeyFile)
	}
	file := func(p string) *corev3.DataSource {
		return &corev3.DataSource{Specifier: &corev3.DataSource_Filename{Filename: p}}
	}
	version := tlsv3.TlsParameters_TLSv1_2
	if e.MinVersion == "1.3" {
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
