//go:build tools

// The endpoint picker this module builds: GIE's reference picker, pinned by go.mod.
package tools

import _ "sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp"
