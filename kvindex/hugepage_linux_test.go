package kvindex

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"
)

// TestAdviseHugeMarksEveryOverlappedRegion checks the madvise call itself: on a fresh anonymous
// mapping of its own (so that no other allocation's advice can mark the regions first), an array
// that starts and ends inside 2 MiB regions leaves exactly the regions it overlaps marked
// MADV_HUGEPAGE ("hg" in /proc/self/smaps), its first and last included, and the rest of the
// mapping unmarked.
func TestAdviseHugeMarksEveryOverlappedRegion(t *testing.T) {
	if _, err := os.Stat("/sys/kernel/mm/transparent_hugepage"); err != nil {
		t.Skip("kernel without transparent huge pages: madvise(MADV_HUGEPAGE) is refused")
	}
	// The advice on, whatever GODEBUG the test runs with (disablethp=1 turns it off); the test
	// is not parallel, so no other test allocates a table while the switch is set here.
	was := hugeAdvice.Swap(true)
	defer hugeAdvice.Store(was)
	const mib = 1 << 20
	m, err := syscall.Mmap(-1, 0, 16*mib, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	require.NoError(t, err)
	defer func() { require.NoError(t, syscall.Munmap(m)) }()
	base := uintptr(unsafe.Pointer(&m[0]))
	// An array at Go's 8 KiB alignment, 1 MiB into a region, 5 MiB long: it overlaps four regions
	// and holds only two of them whole.
	off := (base+hugePage-1)&^(hugePage-1) - base + mib + 8192
	adviseHuge(unsafe.Pointer(&m[off]), 5*mib)

	start := (base + off) &^ (hugePage - 1)
	end := start + 4*hugePage
	marked, unmarked := vmaFlags(t, base, base+16*mib)
	require.Equal(t, [][2]uintptr{{start, end}}, marked, "regions marked hg")
	var rest [][2]uintptr // the mapping outside [start, end); empty before start when base is aligned
	if base < start {
		rest = append(rest, [2]uintptr{base, start})
	}
	rest = append(rest, [2]uintptr{end, base + 16*mib})
	require.Equal(t, rest, unmarked, "regions left alone")

	// With GODEBUG=disablethp=1 (hugeAdvice false) a second mapping is left alone. (The test
	// is not parallel: no other test allocates a table while the switch is off.)
	m2, err := syscall.Mmap(-1, 0, 16*mib, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANON)
	require.NoError(t, err)
	defer func() { require.NoError(t, syscall.Munmap(m2)) }()
	hugeAdvice.Store(false)
	adviseHuge(unsafe.Pointer(&m2[0]), 16*mib)
	base2 := uintptr(unsafe.Pointer(&m2[0]))
	marked, _ = vmaFlags(t, base2, base2+16*mib)
	require.Empty(t, marked, "nothing advised with disablethp=1")
}

// vmaFlags returns the parts of [lo, hi) that /proc/self/smaps shows with and without the "hg"
// (MADV_HUGEPAGE) flag, adjacent parts merged, in address order.
func vmaFlags(t *testing.T, lo, hi uintptr) (marked, unmarked [][2]uintptr) {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	require.NoError(t, err)
	defer f.Close()
	add := func(to *[][2]uintptr, a, b uintptr) {
		if n := len(*to); n > 0 && (*to)[n-1][1] == a {
			(*to)[n-1][1] = b
			return
		}
		*to = append(*to, [2]uintptr{a, b})
	}
	var a, b uintptr
	sawFlags := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if flags, ok := strings.CutPrefix(line, "VmFlags:"); ok {
			sawFlags = true
			if b <= lo || a >= hi {
				continue
			}
			if strings.Contains(" "+flags+" ", " hg ") {
				add(&marked, max(a, lo), min(b, hi))
			} else {
				add(&unmarked, max(a, lo), min(b, hi))
			}
			continue
		}
		// A mapping's header: "start-end perms offset dev inode [path]", addresses in hex.
		fields := strings.Fields(line)
		if len(fields) == 0 {
			continue
		}
		s, e, ok := strings.Cut(fields[0], "-")
		if !ok {
			continue
		}
		x, err1 := strconv.ParseUint(s, 16, 64)
		y, err2 := strconv.ParseUint(e, 16, 64)
		if err1 == nil && err2 == nil {
			a, b = uintptr(x), uintptr(y)
		}
	}
	require.NoError(t, sc.Err())
	if !sawFlags {
		t.Skip("/proc/self/smaps shows no VmFlags: the advice cannot be read back")
	}
	return marked, unmarked
}

// TestDisableTHPFromGODEBUG checks the parsing of the Go runtime's disablethp setting, which turns
// the index's huge-page advice off.
func TestDisableTHPFromGODEBUG(t *testing.T) {
	for _, c := range []struct {
		godebug string
		off     bool
	}{
		{"", false},
		{"disablethp=1", true},
		{"disablethp=0", false},
		{"gctrace=1,disablethp=1", true},
		{"disablethp=1, madvdontneed=1", true},
		{"disablethp=1,disablethp=0", false},
		{"xdisablethp=1", false},
		{"disablethp", false},
		{"disablethp=2", true},              // the runtime turns it on for any non-zero value
		{"gctrace=1, disablethp=1", false},  // the runtime trims no spaces: " disablethp" is another key
		{"disablethp=1,disablethp=x", true}, // a value that does not parse is ignored
		{"disablethp=", false},
	} {
		require.Equal(t, c.off, disablesTHP(c.godebug), "GODEBUG=%q", c.godebug)
	}
}
