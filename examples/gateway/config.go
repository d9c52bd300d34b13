package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/enginepick/enginepick/examples/gateway/internal/gw"
	"github.com/enginepick/enginepick/loadmon"
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
	// DPRankStart is the global DP rank of the engine's rank 0 (a node owning global ranks 4..7
	// has 4): its load pages and KV events name global ranks, and a picked rank r is sent to the
	// engine as DPRankStart + r. Default 0.
	DPRankStart int `yaml:"dp_rank_start"`
	// Ranks lists the engine's ranks, in order, when they have their own endpoints (one server per
	// rank, as vLLM's external DP load balancing runs them); empty means the engine's endpoints
	// serve every rank.
	Ranks []rankSpec `yaml:"ranks"`
}

// rankSpec is one DP rank of an engine whose ranks have their own endpoints (the --engine keys
// ranks.R.KEY). Each field is set for every rank of the engine or for none.
type rankSpec struct {
	// URL is the base URL of the server that serves only this rank: a request picked for the rank
	// is sent there, without a rank in the request.
	URL string `yaml:"url"`
	// LoadURL is the rank's own load page (default: URL + the format's path, when URL is set).
	LoadURL string `yaml:"load_url"`
	// KVEvents, KVTopic and KVReplay are the rank's own KV-event publisher, its topic, and its
	// replay socket ("" none), used as they are (no port offset).
	KVEvents string `yaml:"kv_events"`
	KVTopic  string `yaml:"kv_topic"`
	KVReplay string `yaml:"kv_replay"`
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
		case "dp_rank_start":
			s.DPRankStart, err = strconv.Atoi(v)
		default:
			if !s.setRankKey(strings.TrimSpace(k), v) {
				return s, fmt.Errorf("--engine %q: unknown key %q: %w", text, k, state.ErrInvalidConfiguration)
			}
		}
		if err != nil {
			return s, fmt.Errorf("--engine %q: %s: %w: %w", text, k, err, state.ErrInvalidConfiguration)
		}
	}
	return s, nil
}

// setRankKey sets the key ranks.R.KEY of rank R, growing the rank list; false for any other key.
func (s *engineSpec) setRankKey(key, v string) bool {
	idx, field, ok := strings.Cut(strings.TrimPrefix(key, "ranks."), ".")
	r, err := strconv.Atoi(idx)
	if !strings.HasPrefix(key, "ranks.") || !ok || err != nil || r < 0 || r >= loadmon.MaxRanks {
		return false
	}
	if r >= len(s.Ranks) {
		s.Ranks = append(s.Ranks, make([]rankSpec, r+1-len(s.Ranks))...)
	}
	rs := &s.Ranks[r]
	dst := map[string]*string{"url": &rs.URL, "load_url": &rs.LoadURL, "kv_events": &rs.KVEvents, "kv_topic": &rs.KVTopic, "kv_replay": &rs.KVReplay}[field]
	if dst == nil {
		return false
	}
	*dst = v
	return true
}

// checkRanks refuses a contradictory rank description: engine-level endpoints next to per-rank
// ones, a rank count other than the ranks listed, a key set for some ranks only, or a topic or
// replay socket without a publisher.
func (s engineSpec) checkRanks() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("engine %s: "+format+": %w", append([]any{s.URL}, append(args, state.ErrInvalidConfiguration)...)...)
	}
	if s.DPRankStart < 0 {
		return bad("dp_rank_start %d is negative", s.DPRankStart)
	}
	if len(s.Ranks) == 0 {
		return nil
	}
	switch {
	case s.DPRanks != 0 && s.DPRanks != len(s.Ranks):
		return bad("dp_ranks %d, but %d ranks are listed", s.DPRanks, len(s.Ranks))
	case s.LoadURL != "" || s.KVEvents != "" || s.KVTopic != "" || s.KVReplay != "":
		return bad("ranks are listed: give load_url and kv_events, kv_topic, kv_replay per rank, not for the engine")
	}
	first := s.Ranks[0]
	if first == (rankSpec{}) {
		return bad("ranks.0 is empty: a rank needs url, load_url or kv_events (for a rank count alone, use dp_ranks)")
	}
	for r, rs := range s.Ranks {
		for _, f := range []struct {
			key       string
			set, want bool
		}{{"url", rs.URL != "", first.URL != ""}, {"load_url", rs.LoadURL != "", first.LoadURL != ""}, {"kv_events", rs.KVEvents != "", first.KVEvents != ""}} {
			if f.set != f.want {
				return bad("ranks.%d.%s: set it for every rank or none", r, f.key)
			}
		}
		if rs.KVEvents == "" && (rs.KVTopic != "" || rs.KVReplay != "") {
			return bad("ranks.%d: kv_topic and kv_replay need kv_events", r)
		}
	}
	return nil
}

// rankURLs returns the ranks' own base URLs, or nil.
func (s engineSpec) rankURLs() []string {
	if len(s.Ranks) == 0 || s.Ranks[0].URL == "" {
		return nil
	}
	out := make([]string, len(s.Ranks))
	for r, rs := range s.Ranks {
		out[r] = strings.TrimRight(rs.URL, "/")
	}
	return out
}

// ranks returns the engine's DP rank count.
func (s engineSpec) ranks() int {
	if s.DPRanks == 0 && len(s.Ranks) > 0 {
		return len(s.Ranks)
	}
	return max(s.DPRanks, 1)
}

// engineConfig converts a spec to the registry's form.
func (s engineSpec) engineConfig() (gw.EngineConfig, error) {
	if err := s.checkRanks(); err != nil {
		return gw.EngineConfig{}, err
	}
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
		DPRanks: s.ranks(), DPRankStart: s.DPRankStart, RankURLs: s.rankURLs(), BootstrapPort: s.BootstrapPort, PDCompatibility: s.PDCompatibility}, nil
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
	t := loadsource.Target{Engine: state.EngineID(strings.TrimRight(s.URL, "/")), Format: f, Ranks: s.ranks(), RankStart: s.DPRankStart}
	if len(s.Ranks) > 0 && (s.Ranks[0].LoadURL != "" || s.Ranks[0].URL != "") {
		for _, rs := range s.Ranks { // checkRanks: every rank has a load_url, or every rank a url
			u := rs.LoadURL
			if u == "" {
				u = strings.TrimRight(rs.URL, "/") + f.Path()
			}
			t.RankURLs = append(t.RankURLs, u)
		}
		return t, true, nil
	}
	t.URL = s.LoadURL
	if t.URL == "" {
		t.URL = strings.TrimRight(s.URL, "/") + f.Path()
	}
	return t, true, nil
}
