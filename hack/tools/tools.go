//go:build tools

// Package tools pins the Go programs the project's own targets build: actionlint (lints the
// GitHub Actions workflow in `make test`) and kind (`make e2e-kind`).
package tools

import (
	_ "github.com/rhysd/actionlint/cmd/actionlint"
	_ "sigs.k8s.io/kind"
)
