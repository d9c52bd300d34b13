package kvindex

import (
	"fmt"
	"strings"
)

// Tier is a set of storage tiers, as a bitset. An engine holds a block while any of its bits is
// set: a block moved from the device to host memory is still held (docs/design.md
// §11). Matching is tier-blind; tiers are kept
// for statistics and for removals that name one tier.
type Tier uint8

// The four tiers (docs/design.md §11: DEVICE for "GPU" or untagged events, HOST for
// "CPU_PINNED", DISK, EXTERNAL). Mapping an engine's medium string to a Tier is the event
// decoder's job (docs/design.md §13).
const (
	TierDevice Tier = 1 << iota
	TierHost
	TierDisk
	TierExternal

	// allTiers is every tier, what Remove takes tiers 0 to mean.
	allTiers = TierDevice | TierHost | TierDisk | TierExternal
)

var tierNames = [...]string{"device", "host", "disk", "external"}

// String returns the tier names joined by "|" ("device|host"), "none" for 0, and appends
// "|0xNN" for bits outside the four tiers.
func (t Tier) String() string {
	if t == 0 {
		return "none"
	}
	var parts []string
	for i, name := range tierNames {
		if t&(1<<i) != 0 {
			parts = append(parts, name)
		}
	}
	if rest := t &^ allTiers; rest != 0 {
		parts = append(parts, fmt.Sprintf("%#x", uint8(rest)))
	}
	return strings.Join(parts, "|")
}
