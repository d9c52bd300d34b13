package policy

// SetCostScan sets, for tests, whether p's cost comparison always scans the group's other
// engines (always: the shortcut in cheaper is off) and a hook run before each scan (nil: none).
func SetCostScan(p Policy, always bool, hook func()) {
	c := p.(*cacheAware)
	c.alwaysScan, c.costScanHook = always, hook
}

// CacheAwareFallbackDecision exposes cacheAwareFallbackDecision to tests.
var CacheAwareFallbackDecision = cacheAwareFallbackDecision

// Choices returns the sample size of a policy NewPowerOfN returned.
func Choices(p Policy) int { return p.(*powerOfN).n }
