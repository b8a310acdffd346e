//go:build tools

// Package tools pins the Go programs the project's own targets build: actionlint (lints the
// GitHub Actions workflow in `make test`), kind (`make e2e-kind`) and kube-score (checks the
// chart and the objects the operator builds, tests/unit/test_kube_score.py).
package tools

import (
	_ "github.com/rhysd/actionlint/cmd/actionlint"
	_ "github.com/zegl/kube-score/cmd/kube-score"
	_ "sigs.k8s.io/kind"
)
