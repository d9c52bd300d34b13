//go:build !unix

package main

import "time"

// processCPU is unavailable here: the CPU figures read 0.
func processCPU() time.Duration { return 0 }
