package config

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"math"
	"net"
	"net/url"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/enginepick/enginepick/bucket"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/loadmon/loadsource"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// removedTypes maps each dropped policy type to what to use instead (docs/design.md §14.3).
var removedTypes = map[string]string{
	"fused_score":          `policy type "fused_score" was removed: use cache_aware, which weighs prefix hits against load, instead`,
	"score_policy":         `policy type "score_policy" was removed: use cache_aware, which weighs prefix hits against load, instead`,
	"legacy_host_affinity": `policy type "legacy_host_affinity" was removed: use power_of_two on the decode group instead`,
	"load_based":           `policy type "load_based" was renamed least_load: use least_load instead`,
}

// stageSupports reports whether a registered policy type can serve stage s (docs/design.md §4):
// whether its builder, when it has the optional SupportsStage method (policy.Policy), supports s.
func stageSupports(typ string, s state.Stage) bool {
	b, ok := policy.Lookup(typ)
	if !ok {
		return true // Validate reports the unknown type
	}
	ss, ok := b.(stageSupporter)
	return !ok || ss.SupportsStage(s)
}

// stageTypes lists the registered policy types that can serve stage s, for messages.
func stageTypes(s state.Stage) string {
	var names []string
	for _, n := range policy.Names() {
		if stageSupports(n, s) {
			names = append(names, n)
		}
	}
	return strings.Join(names, ", ")
}

// Validate checks every rule of docs/design.md §14.4 that needs no engine registry and returns
// the first violation, in document order, as a *Error naming the field. Parse and New
// call it; call it yourself on a Config built in code.
func (c *Config) Validate() error {
	v := validator{lines: c.lines}
	v.config(c)
	return v.err
}

// validator accumulates the first error.
type validator struct {
	lines map[string]int
	err   error
}

// fail records the first error; later calls are ignored.
func (v *validator) fail(path string, sentinel error, format string, args ...any) {
	if v.err == nil {
		v.err = cfgErr(path, v.lineOf(path), sentinel, format, args...)
	}
}

// lineOf returns the line of path, or of its nearest recorded ancestor (a missing field is
// reported at the line of the mapping that lacks it); 0 when none is known.
func (v *validator) lineOf(path string) int {
	for path != "" {
		if l, ok := v.lines[path]; ok {
			return l
		}
		i := strings.LastIndexAny(path, ".[")
		if i < 0 {
			break
		}
		path = path[:i]
	}
	return 0
}

func join(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}

func (v *validator) config(c *Config) {
	if len(c.Models) == 0 {
		v.fail("models", state.ErrMissingField, "at least one model is required")
		return
	}
	models := map[string]int{}
	for i := range c.Models {
		v.model(&c.Models[i], fmt.Sprintf("models[%d]", i), models, i)
		if v.err != nil {
			return
		}
	}
	v.adapters(c)
	v.engines(c)
	v.load(&c.Load)
	v.kv(&c.KV)
	v.adapterIDs(c)
	v.affinity(&c.Affinity)
	v.flowControl(c.FlowControl)
	v.replicas(c.Replicas)
	if v.err != nil {
		return
	}
	v.membership(c)
}

func (v *validator) model(m *Model, path string, seen map[string]int, i int) {
	if m.ID == "" {
		v.fail(join(path, "id"), state.ErrMissingField, "a model needs an id")
		return
	}
	if j, dup := seen[m.ID]; dup {
		v.fail(join(path, "id"), state.ErrDuplicate, "duplicate model ID %q (also models[%d])", m.ID, j)
		return
	}
	seen[m.ID] = i
	v.sloPreference(join(path, "slo.ttft_preference"), m.SLO.TTFTPreference)
	v.sloPreference(join(path, "slo.tps_preference"), m.SLO.TPSPreference)
	if m.DefaultPolicy != nil {
		v.policy(m.DefaultPolicy, join(path, "default_policy"))
	}
	for _, sp := range []struct {
		p     *Policy
		stage state.Stage
	}{{m.StagePolicies.Plain, state.StagePlain}, {m.StagePolicies.Prefill, state.StagePrefill}, {m.StagePolicies.Decode, state.StageDecode}} {
		if sp.p == nil {
			continue
		}
		p := join(path, "stage_policies."+sp.stage.String())
		v.policy(sp.p, p)
		if v.err == nil && !stageSupports(sp.p.Type, sp.stage) {
			v.fail(join(p, "type"), state.ErrWrongStage, "%q cannot serve the %s stage: use one of %s", sp.p.Type, sp.stage, stageTypes(sp.stage))
		}
	}
	if v.err != nil {
		return
	}
	if len(m.Buckets) == 0 {
		v.fail(join(path, "buckets"), state.ErrMissingField, "model %q needs at least one bucket", m.ID)
		return
	}
	buckets := map[string]int{}
	for j := range m.Buckets {
		v.bucket(m, &m.Buckets[j], fmt.Sprintf("%s.buckets[%d]", path, j), buckets, j, path)
		if v.err != nil {
			return
		}
	}
}

// adapters checks every model's LoRA adapter names: non-empty, and unique among the model IDs
// and every model's adapters.
func (v *validator) adapters(c *Config) {
	if v.err != nil {
		return
	}
	names := map[string]string{}
	for i := range c.Models {
		names[c.Models[i].ID] = fmt.Sprintf("models[%d].id", i)
	}
	for i := range c.Models {
		for j, a := range c.Models[i].Adapters {
			path := fmt.Sprintf("models[%d].adapters[%d]", i, j)
			if a == "" {
				v.fail(path, state.ErrMissingField, "an adapter needs a name")
				return
			}
			if prev, dup := names[a]; dup {
				v.fail(path, state.ErrDuplicate, "adapter %q is also %s: a request's model names one model or adapter", a, prev)
				return
			}
			names[a] = path
		}
	}
}

// adapterIDs checks kv.adapter_ids: each key an adapter of some model, each ID not negative and
// used once.
func (v *validator) adapterIDs(c *Config) {
	if v.err != nil || len(c.KV.AdapterIDs) == 0 {
		return
	}
	adapters := map[string]bool{}
	for i := range c.Models {
		for _, a := range c.Models[i].Adapters {
			adapters[a] = true
		}
	}
	ids := map[int64]string{}
	for _, a := range slices.Sorted(maps.Keys(c.KV.AdapterIDs)) {
		path, id := "kv.adapter_ids."+a, c.KV.AdapterIDs[a]
		switch prev, dup := ids[id]; {
		case !adapters[a]:
			v.fail(path, state.ErrBadValue, "%q is not an adapter of any model (models[].adapters)", a)
		case id < 0:
			v.fail(path, state.ErrOutOfRange, "%d is negative", id)
		case dup:
			v.fail(path, state.ErrDuplicate, "lora_id %d is also kv.adapter_ids.%s", id, prev)
		}
		if v.err != nil {
			return
		}
		ids[id] = a
	}
}

func (v *validator) sloPreference(path, s string) {
	if _, err := parseSLOPreference(s); err != nil {
		v.fail(path, state.ErrBadValue, "%q: want disabled, best_effort or slo_first", s)
	}
}

func parseSLOPreference(s string) (bucket.SLOPreference, error) {
	for _, p := range []bucket.SLOPreference{bucket.SLODisabled, bucket.SLOBestEffort, bucket.SLOFirst} {
		if s == p.String() {
			return p, nil
		}
	}
	if s == "" {
		return bucket.SLODisabled, nil
	}
	return 0, state.ErrBadValue
}

func (v *validator) bucket(m *Model, b *Bucket, path string, seen map[string]int, j int, mpath string) {
	if b.ID == "" {
		v.fail(join(path, "id"), state.ErrMissingField, "a bucket needs an id")
		return
	}
	if k, dup := seen[b.ID]; dup {
		v.fail(join(path, "id"), state.ErrDuplicate, "duplicate bucket ID %q in model %q (also %s.buckets[%d])", b.ID, m.ID, mpath, k)
		return
	}
	seen[b.ID] = j
	if b.Limits.Max != 0 && b.Limits.Min > b.Limits.Max {
		v.fail(join(path, "limits"), state.ErrOutOfRange, "inverted range: min %d is above max %d", b.Limits.Min, b.Limits.Max)
		return
	}
	if b.MaxContextTokens != 0 && b.Limits.Min > b.MaxContextTokens {
		v.fail(join(path, "limits.min"), state.ErrOutOfRange, "min %d is above max_context_tokens %d: no request fits", b.Limits.Min, b.MaxContextTokens)
		return
	}
	if b.TTFTEstimate < 0 {
		v.fail(join(path, "ttft_estimate"), state.ErrOutOfRange, "%v is negative", b.TTFTEstimate.D())
		return
	}
	if b.TPSEstimate < 0 {
		v.fail(join(path, "tps_estimate"), state.ErrOutOfRange, "%v is negative", b.TPSEstimate)
		return
	}
	gpath := join(path, "groups")
	g := &b.Groups
	switch {
	case g.Plain != nil && g.PD != nil:
		v.fail(gpath, state.ErrConflict, "a bucket is plain or PD: set plain or pd, not both")
	case g.Plain == nil && g.PD == nil:
		v.fail(gpath, state.ErrMissingField, "set plain or pd")
	case g.Plain != nil:
		v.group(m, g.Plain, join(gpath, "plain"), state.StagePlain, mpath)
	default:
		switch {
		case g.PD.Prefill == nil:
			v.fail(join(gpath, "pd.prefill"), state.ErrMissingField, "a PD bucket needs both a prefill and a decode group")
		case g.PD.Decode == nil:
			v.fail(join(gpath, "pd.decode"), state.ErrMissingField, "a PD bucket needs both a prefill and a decode group")
		default:
			v.group(m, g.PD.Prefill, join(gpath, "pd.prefill"), state.StagePrefill, mpath)
			v.group(m, g.PD.Decode, join(gpath, "pd.decode"), state.StageDecode, mpath)
			if v.err == nil && g.PD.Prefill.EngineIDs != nil && g.PD.Decode.EngineIDs != nil {
				for k, id := range *g.PD.Decode.EngineIDs {
					if slices.Contains(*g.PD.Prefill.EngineIDs, id) {
						v.fail(fmt.Sprintf("%s.pd.decode.engine_ids[%d]", gpath, k), state.ErrWrongStage,
							"engine %q is also a member of the prefill group: an engine has one stage", id)
						return
					}
				}
			}
		}
	}
}

// group checks one group's membership and its effective policy for stage s.
func (v *validator) group(m *Model, g *Group, path string, s state.Stage, mpath string) {
	if g.EngineIDs != nil {
		seen := map[string]bool{}
		for k, id := range *g.EngineIDs {
			p := fmt.Sprintf("%s.engine_ids[%d]", path, k)
			if id == "" {
				v.fail(p, state.ErrMissingField, "empty engine ID")
				return
			}
			if seen[id] {
				v.fail(p, state.ErrDuplicate, "engine %q listed twice", id)
				return
			}
			seen[id] = true
		}
	}
	if g.Policy != nil {
		pp := join(path, "policy")
		v.policy(g.Policy, pp)
		if v.err == nil && !stageSupports(g.Policy.Type, s) {
			v.fail(join(pp, "type"), state.ErrWrongStage, "%q cannot serve the %s stage: use one of %s", g.Policy.Type, s, stageTypes(s))
		}
		return
	}
	if p, from := effectivePolicy(m, g, s, mpath); from != "" && !stageSupports(p.Type, s) {
		v.fail(path, state.ErrWrongStage, "the %s group inherits %q from %s, which cannot serve the %s stage: set a policy on the group or in stage_policies.%s",
			s, p.Type, from, s, s)
	}
}

// effectivePolicy returns the policy a group runs and where it comes from: the group's own, the
// model's stage default, the model's default, or the built-in power_of_two (from is "" for the
// group's own and for the built-in).
func effectivePolicy(m *Model, g *Group, s state.Stage, mpath string) (*Policy, string) {
	if g.Policy != nil {
		return g.Policy, ""
	}
	var stageDefault *Policy
	switch s {
	case state.StagePlain:
		stageDefault = m.StagePolicies.Plain
	case state.StagePrefill:
		stageDefault = m.StagePolicies.Prefill
	case state.StageDecode:
		stageDefault = m.StagePolicies.Decode
	}
	if stageDefault != nil {
		return stageDefault, join(mpath, "stage_policies."+s.String())
	}
	if m.DefaultPolicy != nil {
		return m.DefaultPolicy, join(mpath, "default_policy")
	}
	return &Policy{Type: defaultPolicy}, ""
}

// policy checks one policy attachment at path: its type, the legacy in-flight filter, and its
// options block with the block's own Validate (policy.Builder).
func (v *validator) policy(p *Policy, path string) {
	tpath := join(path, "type")
	if p.Type == "" {
		v.fail(tpath, state.ErrMissingField, "want one of %s", strings.Join(policy.Names(), ", "))
		return
	}
	if msg, ok := removedTypes[p.Type]; ok {
		v.err = &Error{Path: tpath, Line: v.lineOf(tpath), Err: &causeError{sentinel: state.ErrRemovedOption, msg: msg}}
		return
	}
	b, ok := policy.Lookup(p.Type)
	if !ok {
		v.fail(tpath, state.ErrBadValue, "unknown policy type %q: want one of %s", p.Type, strings.Join(policy.Names(), ", "))
		return
	}
	v.legacyFilter(p, path)
	if v.err != nil || p.Options == nil {
		return
	}
	bpath := join(path, p.Type)
	if want := reflect.TypeOf(b.NewOptions()); reflect.TypeOf(p.Options) != want {
		v.fail(bpath, state.ErrBadValue, "options of type %T: policy type %s wants %v", p.Options, p.Type, want)
		return
	}
	if c, ok := p.Options.(interface{ Validate() error }); ok {
		v.optionErr(bpath, c.Validate())
	}
}

// optionErr records err, a policy's validation error, at its field's path under the block at
// bpath (*policy.OptionError), or at the block.
func (v *validator) optionErr(bpath string, err error) {
	if err == nil || v.err != nil {
		return
	}
	v.err = optionConfigErr(bpath, bpath, v.lineOf, err)
}

// optionConfigErr converts a policy's error into a *Error: an *policy.OptionError at its
// field's path under the block at bpath with its cause, a *Error as it is, anything else at
// path (the attachment's) with the cause it wraps, else as a bad value.
func optionConfigErr(path, bpath string, lineOf func(string) int, err error) error {
	var ce *Error
	if errors.As(err, &ce) {
		return err
	}
	var oe *policy.OptionError
	if errors.As(err, &oe) {
		p := join(bpath, oe.Field)
		return &Error{Path: p, Line: lineOf(p), Err: &causeError{sentinel: oe.Cause, msg: oe.Msg}}
	}
	for _, c := range []error{state.ErrMissingField, state.ErrConflict, state.ErrOutOfRange} {
		if errors.Is(err, c) {
			return &Error{Path: path, Line: lineOf(path), Err: err}
		}
	}
	return &Error{Path: path, Line: lineOf(path), Err: fmt.Errorf("%w: %w", state.ErrBadValue, err)}
}

// legacyFilter checks the legacy filter/max_in_flight pair (docs/design.md §14.3).
func (v *validator) legacyFilter(p *Policy, path string) {
	overloaded := false
	for k, f := range p.Filter {
		fp := fmt.Sprintf("%s.filter[%d]", path, k)
		if len(p.Filter) == 1 {
			fp = join(path, "filter")
		}
		switch f {
		case "overloaded":
			overloaded = true
		case "prefix_cache":
			v.err = &Error{Path: fp, Line: v.lineOf(fp), Err: &causeError{sentinel: state.ErrRemovedOption,
				msg: `filter "prefix_cache" was removed: it is not equivalent to cache_aware's hit gate; use policy type cache_aware (with min_matched_tokens or min_match_ratio) instead`}}
			return
		default:
			v.fail(fp, state.ErrBadValue, "unknown filter %q: want overloaded (with max_in_flight)", f)
			return
		}
	}
	switch {
	case overloaded && p.MaxInFlight == nil:
		v.fail(join(path, "max_in_flight"), state.ErrMissingField, "filter overloaded needs max_in_flight")
	case !overloaded && p.MaxInFlight != nil:
		v.fail(join(path, "max_in_flight"), state.ErrConflict, "max_in_flight needs filter overloaded; or use admission.max_inflight_requests")
	case overloaded && p.Admission.MaxInFlightRequests != nil:
		v.fail(join(path, "max_in_flight"), state.ErrConflict, "filter overloaded with max_in_flight is the legacy spelling of admission.max_inflight_requests: set one of them")
	}
}

func (v *validator) engines(c *Config) {
	if v.err != nil {
		return
	}
	seen := map[string]int{}
	for i := range c.Engines {
		e := &c.Engines[i]
		path := fmt.Sprintf("engines[%d]", i)
		if e.ID == "" {
			v.fail(join(path, "id"), state.ErrMissingField, "an engine needs an id")
			return
		}
		if j, dup := seen[e.ID]; dup {
			v.fail(join(path, "id"), state.ErrDuplicate, "duplicate engine ID %q (also engines[%d])", e.ID, j)
			return
		}
		seen[e.ID] = i
		if e.Model == "" {
			v.fail(join(path, "model"), state.ErrMissingField, "engine %q needs a model", e.ID)
			return
		}
		if !slices.ContainsFunc(c.Models, func(m Model) bool { return m.ID == e.Model }) {
			v.fail(join(path, "model"), state.ErrBadValue, "model %q is not one of models", e.Model)
			return
		}
		if _, err := parseStage(e.Stage); err != nil {
			v.fail(join(path, "stage"), state.ErrBadValue, "%q: want plain, prefill or decode", e.Stage)
			return
		}
		if e.DPRanks < 0 || e.DPRanks > loadmon.MaxRanks {
			v.fail(join(path, "dp_ranks"), state.ErrOutOfRange, "%d: must be in [0, %d]", e.DPRanks, loadmon.MaxRanks)
			return
		}
		if !v.ranks(e, path) {
			return
		}
		if e.Load != nil && !v.loadEndpoint(e.Load, join(path, "load")) {
			return
		}
		if e.KVEvents != nil && !v.kvEndpoint(e.KVEvents, join(path, "kv_events"), e.RankCount()-1) {
			return
		}
	}
}

// ranks checks an engine's dp_rank_start and per-rank endpoints (docs/design.md §14.6).
func (v *validator) ranks(e *Engine, path string) bool {
	n := e.RankCount()
	switch {
	case len(e.Ranks) > loadmon.MaxRanks:
		v.fail(join(path, "ranks"), state.ErrOutOfRange, "%d ranks: at most %d", len(e.Ranks), loadmon.MaxRanks)
		return false
	case len(e.Ranks) > 0 && e.DPRanks != 0 && e.DPRanks != len(e.Ranks):
		v.fail(join(path, "dp_ranks"), state.ErrConflict, "%d, but ranks lists %d ranks", e.DPRanks, len(e.Ranks))
		return false
	case e.DPRankStart < 0:
		v.fail(join(path, "dp_rank_start"), state.ErrOutOfRange, "%d: must be >= 0", e.DPRankStart)
		return false
	case e.DPRankStart+n > loadmon.MaxRanks:
		v.fail(join(path, "dp_rank_start"), state.ErrOutOfRange, "%d: the engine's global ranks %d..%d must be below %d", e.DPRankStart, e.DPRankStart, e.DPRankStart+n-1, loadmon.MaxRanks)
		return false
	case len(e.Ranks) == 0:
		return true
	case e.Load != nil:
		v.fail(join(path, "load"), state.ErrConflict, "the engine lists ranks: give each rank its load in ranks, not the engine")
		return false
	case e.KVEvents != nil:
		v.fail(join(path, "kv_events"), state.ErrConflict, "the engine lists ranks: give each rank its kv_events in ranks, not the engine")
		return false
	}
	first := &e.Ranks[0]
	if first.URL == "" && first.Load == nil && first.KVEvents == nil {
		v.fail(join(path, "ranks[0]"), state.ErrMissingField, "a rank needs url, load or kv_events (for a rank count alone, use dp_ranks)")
		return false
	}
	for j := range e.Ranks {
		r := &e.Ranks[j]
		rp := fmt.Sprintf("%s.ranks[%d]", path, j)
		for _, f := range []struct {
			name      string
			set, want bool
		}{{"url", r.URL != "", first.URL != ""}, {"load", r.Load != nil, first.Load != nil}, {"kv_events", r.KVEvents != nil, first.KVEvents != nil}} {
			if f.set == f.want {
				continue
			}
			if f.want {
				v.fail(join(rp, f.name), state.ErrMissingField, "ranks[0] has %s: every rank needs its own", f.name)
			} else {
				v.fail(join(rp, f.name), state.ErrConflict, "ranks[0] has no %s: set it for every rank or none", f.name)
			}
			return false
		}
		if r.URL != "" {
			if !httpURL(r.URL) {
				v.fail(join(rp, "url"), state.ErrBadValue, "%q: want an absolute http or https URL", r.URL)
				return false
			}
		}
		if r.Load != nil {
			if !v.loadEndpoint(r.Load, join(rp, "load")) {
				return false
			}
			if r.Load.Format != first.Load.Format {
				v.fail(join(rp, "load.format"), state.ErrConflict, "%q, but ranks[0]'s is %q: one format per engine", r.Load.Format, first.Load.Format)
				return false
			}
		}
		if r.KVEvents != nil && !v.kvEndpoint(r.KVEvents, join(rp, "kv_events"), 0) {
			return false
		}
	}
	return true
}

// loadEndpoint checks a load endpoint at path.
func (v *validator) loadEndpoint(l *LoadEndpoint, path string) bool {
	if l.URL == "" {
		v.fail(join(path, "url"), state.ErrMissingField, "a load endpoint needs a url")
		return false
	}
	if !httpURL(l.URL) {
		v.fail(join(path, "url"), state.ErrBadValue, "%q: want an absolute http or https URL", l.URL)
		return false
	}
	if _, err := loadsource.ParseFormat(l.Format); err != nil {
		v.fail(join(path, "format"), state.ErrBadValue, "%q: want vllm_metrics, sglang_get_load or sglang_loads", l.Format)
		return false
	}
	return true
}

// httpURL reports whether s is an absolute http or https URL with a host.
func httpURL(s string) bool {
	u, err := url.Parse(s)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host != ""
}

// kvEndpoint checks a KV-event publisher at path whose addresses serve ranks 0..lastRank by port
// offset.
func (v *validator) kvEndpoint(k *KVEventsEndpoint, path string, lastRank int) bool {
	for _, a := range []struct{ name, addr string }{{"endpoint", k.Endpoint}, {"replay", k.Replay}} {
		if a.addr == "" {
			if a.name == "endpoint" {
				v.fail(join(path, a.name), state.ErrMissingField, "kv_events needs the publisher's endpoint")
				return false
			}
			continue
		}
		if _, err := rankAddress(a.addr, lastRank); err != nil {
			v.fail(join(path, a.name), state.ErrBadValue, "%s", err)
			return false
		}
	}
	return true
}

// rankAddress returns the ZMQ endpoint of DP rank r: addr itself for rank 0, else a tcp:// address
// with the port moved up by r, as vLLM and SGLang publish (docs/design.md §13.1).
func rankAddress(addr string, r int) (string, error) {
	if !strings.HasPrefix(addr, "tcp://") && !strings.HasPrefix(addr, "ipc://") && !strings.HasPrefix(addr, "inproc://") || strings.HasSuffix(addr, "//") {
		return "", fmt.Errorf("%q: want tcp://host:port, ipc:// or inproc://", addr)
	}
	if r == 0 {
		return addr, nil
	}
	host, port, err := net.SplitHostPort(strings.TrimPrefix(addr, "tcp://"))
	p, perr := strconv.Atoi(port)
	if !strings.HasPrefix(addr, "tcp://") || err != nil || perr != nil {
		return "", fmt.Errorf("%q: an engine with several DP ranks needs a tcp://host:port endpoint (rank r publishes on port + r)", addr)
	}
	if p+r > 65535 {
		return "", fmt.Errorf("%q: port %d + rank %d is above 65535", addr, p, r)
	}
	return "tcp://" + net.JoinHostPort(host, strconv.Itoa(p+r)), nil
}

// parseStage reads an engine's stage; empty is plain.
func parseStage(s string) (state.Stage, error) {
	if s == "" {
		return state.StagePlain, nil
	}
	return state.ParseStage(s)
}

func (v *validator) load(l *LoadSettings) {
	if v.err != nil {
		return
	}
	for _, d := range []struct {
		name string
		d    Duration
	}{{"freshness", l.Freshness}, {"poll_interval", l.PollInterval}, {"poll_timeout", l.PollTimeout}} {
		if d.d < 0 {
			v.fail("load."+d.name, state.ErrOutOfRange, "%v is negative", d.d.D())
			return
		}
	}
	interval, timeout := l.PollInterval.D(), l.PollTimeout.D()
	if interval == 0 {
		interval = loadsource.DefaultInterval
	}
	if timeout == 0 {
		timeout = loadsource.DefaultTimeout
	}
	if timeout > interval {
		v.fail("load.poll_timeout", state.ErrOutOfRange, "%v is longer than poll_interval %v", timeout, interval)
		return
	}
	if !(l.PollJitter >= 0 && l.PollJitter <= 1) {
		v.fail("load.poll_jitter", state.ErrOutOfRange, "%v: must be in [0, 1]", l.PollJitter)
	}
}

func (v *validator) kv(k *KVSettings) {
	if v.err != nil {
		return
	}
	switch {
	case k.BlockTokens < 0 || k.BlockTokens > maxBlockTokens:
		v.fail("kv.block_tokens", state.ErrOutOfRange, "%d: must be in [1, %d] (unset means %d)", k.BlockTokens, maxBlockTokens, defaultBlockTokens)
	case k.MaxBlocks < 0 || int64(k.MaxBlocks) > 1<<32-2:
		v.fail("kv.max_blocks", state.ErrOutOfRange, "%d: must be in [1, %d] (unset means %d)", k.MaxBlocks, int64(1<<32-2), defaultMaxBlocks)
	case k.ExpectedBlocks < 0 || k.ExpectedBlocks > cmp.Or(k.MaxBlocks, defaultMaxBlocks):
		v.fail("kv.expected_blocks", state.ErrOutOfRange, "%d: must be in [0, max_blocks = %d]", k.ExpectedBlocks, cmp.Or(k.MaxBlocks, defaultMaxBlocks))
	case k.ExpectedHolderBlocks < 0 || k.ExpectedHolderBlocks > cmp.Or(k.MaxBlocks, defaultMaxBlocks):
		v.fail("kv.expected_holder_blocks", state.ErrOutOfRange, "%d: must be in [0, max_blocks = %d]", k.ExpectedHolderBlocks, cmp.Or(k.MaxBlocks, defaultMaxBlocks))
	case k.MaxApproxBlocks < 0:
		v.fail("kv.max_approx_blocks", state.ErrOutOfRange, "%d is negative", k.MaxApproxBlocks)
	case k.ApproxTTL < 0:
		v.fail("kv.approx_ttl", state.ErrOutOfRange, "%v is negative", k.ApproxTTL.D())
	case k.RemoteTimeout < 0:
		v.fail("kv.remote_timeout", state.ErrOutOfRange, "%v is negative", k.RemoteTimeout.D())
	case k.RemoteMaxConcurrent < 0:
		v.fail("kv.remote_max_concurrent", state.ErrOutOfRange, "%d is negative", k.RemoteMaxConcurrent)
	}
}

func (v *validator) affinity(a *AffinitySettings) {
	if v.err != nil {
		return
	}
	switch a.Mode {
	case "", "strict":
	case "soft":
		p := "affinity.affinity_mode"
		v.err = &Error{Path: p, Line: v.lineOf(p), Err: &causeError{sentinel: state.ErrRemovedOption,
			msg: `affinity mode "soft" was removed: an admitted binding is always reused; use strict (or omit affinity_mode) instead`}}
		return
	default:
		v.fail("affinity.affinity_mode", state.ErrBadValue, "%q: want strict", a.Mode)
		return
	}
	switch a.Store {
	case "", "memory":
		if a.Redis != nil {
			v.fail("affinity.redis", state.ErrConflict, "redis settings need store redis")
			return
		}
	case "redis":
		if a.Redis == nil || len(a.Redis.Addrs) == 0 {
			v.fail("affinity.redis.addrs", state.ErrMissingField, "store redis needs at least one Redis address")
			return
		}
		for k, addr := range a.Redis.Addrs {
			if _, port, err := net.SplitHostPort(addr); err != nil || port == "" {
				v.fail(fmt.Sprintf("affinity.redis.addrs[%d]", k), state.ErrBadValue, "%q: want host:port", addr)
				return
			}
		}
		if strings.ContainsAny(a.Redis.Prefix, "{}") {
			v.fail("affinity.redis.prefix", state.ErrBadValue, "%q: must not contain { or }, which move the cluster hash tag", a.Redis.Prefix)
			return
		}
		if a.Redis.Shards < 0 || a.Redis.Shards > 16384 {
			v.fail("affinity.redis.shards", state.ErrOutOfRange, "%d: must be in [1, 16384] (unset means 256)", a.Redis.Shards)
			return
		}
	default:
		v.fail("affinity.store", state.ErrBadValue, "%q: want memory or redis", a.Store)
		return
	}
	for _, h := range []struct{ name, v string }{{"session_header", a.SessionHeader}, {"routing_key_header", a.RoutingKeyHeader}} {
		if h.v != "" && !validHeaderName(h.v) {
			v.fail("affinity."+h.name, state.ErrBadValue, "%s is not an HTTP header name", strconv.Quote(h.v))
			return
		}
	}
	if a.IdleTimeout < 0 {
		v.fail("affinity.idle_timeout", state.ErrOutOfRange, "%v is negative", a.IdleTimeout.D())
	} else if a.SweepInterval < 0 {
		v.fail("affinity.sweep_interval", state.ErrOutOfRange, "%v is negative", a.SweepInterval.D())
	} else if a.MaxBindings < 0 {
		v.fail("affinity.max_bindings", state.ErrOutOfRange, "%d is negative", a.MaxBindings)
	}
}

func (v *validator) flowControl(f *FlowControl) {
	if v.err != nil || f == nil {
		return
	}
	seen := map[int]int{}
	for i, b := range f.Bands {
		path := fmt.Sprintf("flow_control.bands[%d]", i)
		if j, dup := seen[b.Priority]; dup {
			v.fail(join(path, "priority"), state.ErrDuplicate, "duplicate band priority %d (also flow_control.bands[%d])", b.Priority, j)
			return
		}
		seen[b.Priority] = i
		if b.TTL < 0 {
			v.fail(join(path, "ttl"), state.ErrOutOfRange, "%v is negative", b.TTL.D())
			return
		}
		if b.MaxQueued < 0 {
			v.fail(join(path, "max_queued"), state.ErrOutOfRange, "%d is negative", b.MaxQueued)
			return
		}
	}
	switch {
	case f.MaxQueued < 0:
		v.fail("flow_control.max_queued", state.ErrOutOfRange, "%d is negative", f.MaxQueued)
	case f.HalfLife < 0:
		v.fail("flow_control.half_life", state.ErrOutOfRange, "%v is negative", f.HalfLife.D())
	case f.KVThreshold < 0:
		v.fail("flow_control.kv_threshold", state.ErrOutOfRange, "%v is negative", f.KVThreshold)
	}
	for _, flow := range slices.Sorted(maps.Keys(f.FlowWeights)) {
		if w := f.FlowWeights[flow]; !(w > 0) || math.IsInf(w, 0) {
			v.fail(join("flow_control.flow_weights", flow), state.ErrOutOfRange, "%v: want a finite weight > 0", w)
			return
		}
	}
}

func (v *validator) replicas(r *Replicas) {
	if v.err != nil || r == nil {
		return
	}
	if r.Redis.Addr == "" {
		v.fail("replicas.redis.addr", state.ErrMissingField, "replicas need the broker's address (host:port)")
		return
	}
	if _, port, err := net.SplitHostPort(r.Redis.Addr); err != nil || port == "" {
		v.fail("replicas.redis.addr", state.ErrBadValue, "%q: want host:port", r.Redis.Addr)
		return
	}
	switch {
	case r.Redis.DB < 0:
		v.fail("replicas.redis.db", state.ErrOutOfRange, "%d is negative", r.Redis.DB)
	case r.Lease < 0:
		v.fail("replicas.lease", state.ErrOutOfRange, "%v is negative", r.Lease.D())
	case r.FlushInterval < 0:
		v.fail("replicas.flush_interval", state.ErrOutOfRange, "%v is negative", r.FlushInterval.D())
	case replicasLease(r)/4 < replicasFlush(r) && r.FlushInterval == 0:
		// Name the key the file sets, and the default it meets.
		v.fail("replicas.lease", state.ErrConflict, "%v: at least 4 × flush_interval (%v, the default)", r.Lease.D(), defaultReplicasFlush)
	case replicasLease(r)/4 < replicasFlush(r):
		lease := r.Lease.D().String()
		if r.Lease == 0 {
			lease = defaultReplicasLease.String() + ", the default"
		}
		v.fail("replicas.flush_interval", state.ErrConflict, "%v: at most a quarter of the lease (%s), the heartbeat period",
			r.FlushInterval.D(), lease)
	}
}

// replicasLease returns the block's lease after its default.
func replicasLease(r *Replicas) time.Duration { return cmp.Or(r.Lease.D(), defaultReplicasLease) }

// replicasFlush returns the block's flush interval after its default.
func replicasFlush(r *Replicas) time.Duration {
	return cmp.Or(r.FlushInterval.D(), defaultReplicasFlush)
}

// validHeaderName reports whether s is an HTTP field name (RFC 9110 token).
func validHeaderName(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0) {
			return false
		}
	}
	return s != ""
}

// membership checks group members against the engines the configuration lists: an engine of
// another model or stage cannot be a member (docs/design.md §14.4).
func (v *validator) membership(c *Config) {
	byID := make(map[string]*Engine, len(c.Engines))
	for i := range c.Engines {
		byID[c.Engines[i].ID] = &c.Engines[i]
	}
	v.checkMembers(c, func(id string) (string, state.Stage, bool) {
		e, ok := byID[id]
		if !ok {
			return "", 0, false
		}
		s, _ := parseStage(e.Stage)
		return e.Model, s, true
	})
}

// checkMembers reports the first member whose engine, as lookup finds it (its model and stage;
// false for an unknown engine, which is allowed), is of another model or stage.
func (v *validator) checkMembers(c *Config, lookup func(id string) (model string, stage state.Stage, ok bool)) {
	for i := range c.Models {
		m := &c.Models[i]
		for j := range m.Buckets {
			for _, g := range groupsOf(&m.Buckets[j], fmt.Sprintf("models[%d].buckets[%d].groups", i, j)) {
				if g.g.EngineIDs == nil {
					continue
				}
				for k, id := range *g.g.EngineIDs {
					model, stage, ok := lookup(id)
					if !ok {
						continue
					}
					p := fmt.Sprintf("%s.engine_ids[%d]", g.path, k)
					if model != m.ID {
						v.fail(p, state.ErrWrongStage, "engine %q serves model %q, not %q", id, model, m.ID)
						return
					}
					if stage != g.stage {
						v.fail(p, state.ErrWrongStage, "engine %q is a %s engine, not %s", id, stage, g.stage)
						return
					}
				}
			}
		}
	}
}

type groupRef struct {
	g     *Group
	stage state.Stage
	path  string
}

// groupsOf returns a valid bucket's groups with their stages and paths.
func groupsOf(b *Bucket, path string) []groupRef {
	if b.Groups.Plain != nil {
		return []groupRef{{b.Groups.Plain, state.StagePlain, path + ".plain"}}
	}
	if b.Groups.PD != nil {
		return []groupRef{{b.Groups.PD.Prefill, state.StagePrefill, path + ".pd.prefill"}, {b.Groups.PD.Decode, state.StageDecode, path + ".pd.decode"}}
	}
	return nil
}
