//go:build !linux

package kvindex

import "unsafe"

// adviseHuge does nothing outside Linux (hugepage_linux.go).
func adviseHuge(unsafe.Pointer, uintptr) {}
