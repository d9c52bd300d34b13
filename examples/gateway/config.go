package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/state"
)

// engineSpec is one engine as the configuration file or an --engine flag gives it.
type engineSpec struct {
	// URL is the engine's base URL; also its ID.
	URL string `yaml:"url"`
	// Model is the served model name clients send.
	Model string `yaml:"model"`
	// Kind is vllm or sglang.
	Kind string `yaml:"kind"`
	// Stage is plain (default), prefill or decode.
	Stage string `yaml:"stage"`
	// DPRanks is the engine's data-parallel rank count (default 1).
	DPRanks int `yaml:"dp_ranks"`
	// BootstrapPort is a prefill engine's PD bootstrap port (0: none).
	BootstrapPort int `yaml:"bootstrap_port"`
	// PDCompatibility is the PD compatibility label (docs/design.md §3).
	PDCompatibility string `yaml:"pd_compatibility"`
	// Load is the load source format: vllm_metrics, sglang_get_load, sglang_loads or none.
	// Default: vllm_metrics for vLLM, sglang_loads for SGLang.
	Load string `yaml:"load"`
	// LoadURL overrides the load endpoint (default: URL + the format's path).
	LoadURL string `yaml:"load_url"`
	// KVEvents is the ZMQ endpoint of the engine's KV-event publisher for rank 0 ("" none);
	// rank r uses the port plus r, as the publishers do.
	KVEvents string `yaml:"kv_events"`
	// KVTopic is the publisher's topic.
	KVTopic string `yaml:"kv_topic"`
	// KVReplay is the publisher's replay endpoint for rank 0 ("" none).
	KVReplay string `yaml:"kv_replay"`
	// KVBind makes the gateway bind KVEvents instead of dialing it (for publishers that connect).
	KVBind bool `yaml:"kv_bind"`
}

// fileConfig is the configuration file: the engine list.
type fileConfig struct {
	Engines []engineSpec `yaml:"engines"`
}

// loadFile reads a YAML (or JSON) engine list; unknown fields are errors.
func loadFile(path string) ([]engineSpec, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	var fc fileConfig
	if err := dec.Decode(&fc); err != nil {
		return nil, fmt.Errorf("config %s: %w: %w", path, err, state.ErrInvalidConfiguration)
	}
	return fc.Engines, nil
}

// parseEngineFlag parses "url=http://h:8000,model=m,kind=vllm,stage=plain,…" (the keys of the
// configuration file).
func parseEngineFlag(text string) (engineSpec, error) {
	var s engineSpec
	for _, kv := range strings.Split(text, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return s, fmt.Errorf("--engine %q: %q is not key=value: %w", text, kv, state.ErrInvalidConfiguration)
		}
		var err error
		switch strings.TrimSpace(k) {
		case "url":
			s.URL = v
		case "model":
			s.Model = v
		case "kind":
			s.Kind = v
		case "stage":
			s.Stage = v
		case "dp_ranks":
			s.DPRanks, err = strconv.Atoi(v)
		case "bootstrap_port":
			s.BootstrapPort, err = strconv.Atoi(v)
		case "pd_compatibility":
			s.PDCompatibility = v
		case "load":
			s.Load = v
		case "load_url":
			s.LoadURL = v
		case "kv_events":
			s.KVEvents = v
		case "kv_topic":
			s.KVTopic = v
		case "kv_replay":
			s.KVReplay = v
		case "kv_bind":
			s.KVBind, err = strconv.ParseBool(v)
		default:
			return s, fmt.Errorf("--engine %q: unknown key %q: %w", text, k, state.ErrInvalidConfiguration)
		}
		if err != nil {
			return s, fmt.Errorf("--engine %q: %s: %w: %w", text, k, err, state.ErrInvalidConfiguration)
		}
	}
	return s, nil
}

// engineConfig converts a spec to the registry's form.
func (s engineSpec) engineConfig() (gw.EngineConfig, error) {
	kind, err := gw.ParseKind(s.Kind)
	if err != nil {
		return gw.EngineConfig{}, fmt.Errorf("engine %s: %w", s.URL, err)
	}
	stage := state.StagePlain
	if s.Stage != "" {
		if stage, err = state.ParseStage(s.Stage); err != nil {
			return gw.EngineConfig{}, fmt.Errorf("engine %s: %w", s.URL, err)
		}
	}
	return gw.EngineConfig{URL: strings.TrimRight(s.URL, "/"), Model: state.ModelID(s.Model), Kind: kind, Stage: stage,
		DPRanks: s.DPRanks, BootstrapPort: s.BootstrapPort, PDCompatibility: s.PDCompatibility}, nil
}

// loadTarget returns the engine's load source, or false for "none".
func (s engineSpec) loadTarget(kind gw.Kind) (loadsource.Target, bool, error) {
	name := s.Load
	if name == "" {
		name = map[gw.Kind]string{gw.KindVLLM: "vllm_metrics", gw.KindSGLang: "sglang_loads"}[kind]
	}
	if name == "none" {
		return loadsource.Target{}, false, nil
	}
	f, err := loadsource.ParseFormat(name)
	if err != nil {
		return loadsource.Target{}, false, fmt.Errorf("engine %s: %w", s.URL, err)
	}
	u := s.LoadURL
	if u == "" {
		u = strings.TrimRight(s.URL, "/") + f.Path()
	}
	return loadsource.Target{Engine: state.EngineID(strings.TrimRight(s.URL, "/")), URL: u, Format: f, Ranks: max(s.DPRanks, 1)}, true, nil
}
