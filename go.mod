module github.com/enginepick/enginepick

go 1.26

require github.com/stretchr/testify v1.12.1

require (
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	go.uber.org/multierr v1.10.0 // indirect
	go.uber.org/zap v1.28.0 // indirect
	go.yaml.in/yaml/v3 v3.0.6 // indirect
)
