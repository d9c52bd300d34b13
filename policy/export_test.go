package policy

// SetCostScan sets, for tests, whether p's cost comparison always scans the group's other
// engines (always: the shortcut in cheaper is off) and a hook run before each scan (nil: none).
func SetCostScan(p *CacheAware, always bool, hook func()) {
	p.alwaysScan, p.costScanHook = always, hook
}
