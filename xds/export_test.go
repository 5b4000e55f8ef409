package xds

// TransportSocket is upstreamTLS, for the tests of package xds_test
// (which translate a configuration through package plan).
var TransportSocket = upstreamTLS
