module sigs.k8s.io/kind/pkg/kvfabricvalidate

go 1.26

require sigs.k8s.io/kind v0.33.0

require (
	github.com/pkg/errors v0.9.1 // indirect
	go.yaml.in/yaml/v3 v3.0.4 // indirect
)
