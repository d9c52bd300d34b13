package sim

import (
	"strconv"

	"github.com/enginepick/enginepick/internal/label"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// Policy names of the affinity policies in the replay (docs/design.md §12).
const (
	// NameSessionAware is policy.NewSessionAware over the run's affinity store.
	NameSessionAware = label.SessionAware
	// NameSticky is policy.NewSticky over the run's affinity store, with its default round-robin
	// fallback.
	NameSticky = label.Sticky
	// NameStickyRendezvous is the stateless policy.NewSticky: rendezvous hashing with a 1.25 load
	// factor.
	NameStickyRendezvous = "sticky_rendezvous"
)

// SessionKey returns the request's conversation key, which the replay sends as both the session
// key and the routing key, or "" when the trace does not say (docs/traces.md):
//
//   - Session, when set: a generated chat names its conversation, "conv-<n>".
//   - Mooncake: every request of the conversation trace starts with block 0, the shared system
//     prompt, and the turns of one conversation repeat the earlier turns' prefix, so the second
//     hash ID names the conversation chain: "conv-<HashIDs[1]>". A request of one block, or none,
//     has no chain: "".
//   - Azure: the trace has no conversation information: "" for every request, so the affinity
//     policies route every request as keyless (no_session, no_routing_key).
//
// The key is a derivation, not a field of the trace: two conversations that share their second
// block (for example a common long instruction) get one key.
func (r *Request) SessionKey() string {
	if r.Session != "" {
		return r.Session
	}
	if len(r.HashIDs) < 2 {
		return ""
	}
	return "conv-" + strconv.FormatUint(r.HashIDs[1], 10)
}

func sessionAware(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
	return policy.NewSessionAware(env.PolicyConfig(), policy.SessionAwareOptions{Store: env.Affinity})
}

func sticky(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
	return policy.NewSticky(env.PolicyConfig(), policy.StickyOptions{Store: env.Affinity})
}

func stickyRendezvous(env PolicyEnv, _ state.Stage) (policy.Policy, error) {
	return policy.NewSticky(env.PolicyConfig(), policy.StickyOptions{Rendezvous: true, LoadFactor: 1.25})
}
