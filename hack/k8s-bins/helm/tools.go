//go:build tools

// Package tools pins the command built from this module.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
