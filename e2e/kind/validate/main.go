// Command validate loads a kind cluster config with kind's own loader and validation — the code
// `kind create cluster --config` runs before it touches Docker — and prints the result as JSON.
//
// kind keeps that code in internal packages (pkg/internal/apis/config/...). Go lets a package import
// an internal package only from under the internal directory's parent, so this throwaway module is
// named under sigs.k8s.io/kind/pkg/. It is never published; it only exists to run kind's checks here,
// on machines without Docker (see tests/test_images_and_kind.py).
//
// Usage: go run . PATH/TO/kind-config.yaml
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"sigs.k8s.io/kind/pkg/internal/apis/config/encoding"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: validate KIND_CONFIG")
		os.Exit(2)
	}
	cfg, err := encoding.Load(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "kind could not load the config:", err)
		os.Exit(1)
	}
	// As `kind create cluster` does: the --name flag or the config's name, else "kind".
	if cfg.Name == "" {
		cfg.Name = "kind"
	}
	if err := cfg.Validate(); err != nil {
		fmt.Fprintln(os.Stderr, "kind rejected the config:", err)
		os.Exit(1)
	}
	out, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Println(string(out))
}
