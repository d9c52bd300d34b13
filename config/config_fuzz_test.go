package config_test

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/enginepick/enginepick/config"
	"github.com/enginepick/enginepick/state"
)

// FuzzParseConfig checks the loader on any input (docs/design.md §14.4): it never panics; it
// returns either a *config.Error matching state.ErrInvalidConfiguration and no Config, or a Config
// that validates; and an accepted Config survives a JSON round trip unchanged (marshal, parse,
// marshal gives the same bytes), so nothing it accepted was silently dropped or altered. Seeds:
// every example configuration, every malformed case of TestConfigMalformed, and the corpus under
// testdata/fuzz/FuzzParseConfig.
func FuzzParseConfig(f *testing.F) {
	files, _ := filepath.Glob("../examples/configs/*")
	for _, p := range files {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b, uint8(config.FormatAuto))
		}
	}
	for _, tc := range malformedCases {
		f.Add([]byte(tc.input), uint8(tc.format))
	}
	f.Add([]byte(seedPD), uint8(config.FormatYAML))
	f.Add([]byte("flow_control: {bands: [{priority: 1, ttl: 5s}, {priority: 0, sheddable: true}], flow_weights: {a: 2}}\n"+flowFleet), uint8(config.FormatYAML))
	f.Add([]byte("replicas: {redis: {addr: 'r:6379', password: p, db: 2}, channel: c, lease: 4s, flush_interval: 10ms}\n"+flowFleet), uint8(config.FormatYAML))
	f.Fuzz(func(t *testing.T, data []byte, format uint8) {
		cfg, err := config.ParseAs(data, config.Format(format%3))
		if err != nil {
			var ce *config.Error
			if !errors.As(err, &ce) || !errors.Is(err, state.ErrInvalidConfiguration) {
				t.Fatalf("Parse error %T %v: want a *config.Error matching ErrInvalidConfiguration", err, err)
			}
			if cfg != nil {
				t.Fatalf("Parse returned a Config with error %v", err)
			}
			return
		}
		if err := cfg.Validate(); err != nil {
			t.Fatalf("accepted Config does not validate: %v", err)
		}
		first, err := json.Marshal(cfg)
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		again, err := config.Parse(first)
		if err != nil {
			t.Fatalf("the JSON of an accepted Config is rejected: %v\n%s", err, first)
		}
		second, err := json.Marshal(again)
		if err != nil {
			t.Fatalf("marshal: %v", err)
		}
		if string(first) != string(second) {
			t.Fatalf("round trip changed the Config:\n%s\n%s", first, second)
		}
	})
}
