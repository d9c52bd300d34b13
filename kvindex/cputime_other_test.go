//go:build !unix

package kvindex_test

import "time"

// processCPU is unknown here: 0.
func processCPU() time.Duration { return 0 }

// minorFaults is unknown here: 0.
func minorFaults() int64 { return 0 }
