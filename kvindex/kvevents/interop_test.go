package kvevents

import (
	"bufio"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// requireInteropEnv, when set (as .ci/run sets it), turns the interop test's skip into a failure.
const requireInteropEnv = "KVEVENTS_REQUIRE_INTEROP"

// interopPython returns a Python 3 with the zmq and msgpack modules (Debian's python3-zmq and
// python3-msgpack install them for /usr/bin/python3), or skips the test.
func interopPython(t *testing.T) string {
	t.Helper()
	for _, py := range []string{"/usr/bin/python3", "python3"} {
		if err := exec.Command(py, "-c", "import zmq, msgpack").Run(); err == nil {
			return py
		}
	}
	msg := "needs python3 with the zmq and msgpack modules: apt-get install python3-zmq python3-msgpack (.ci/run installs them)"
	if os.Getenv(requireInteropEnv) != "" {
		t.Fatalf("%s is set: %s", requireInteropEnv, msg)
	}
	t.Skip(msg)
	return ""
}

// TestInteropLibzmqPublisher runs the subscriber against a real libzmq publisher (pyzmq) that
// frames batches exactly as vLLM's ZmqEventPublisher does (the vllm_publisher fixture under
// testdata/interop): an array-like batch, map batches, unsigned, signed and raw-bytes block hashes, a sliding-window
// group event, a batch lost on the PUB socket and fetched from the ROUTER replay socket, and a
// restart numbering from 0 again.
func TestInteropLibzmqPublisher(t *testing.T) {
	py := interopPython(t)
	addr, replay := freeAddr(t), freeAddr(t)
	cmd := exec.Command(py, "testdata/interop/vllm_publisher.py", "--endpoint", addr, "--replay", replay, "--topic", "kv")
	stdin, err := cmd.StdinPipe()
	require.NoError(t, err)
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	lines := make(chan string, 8)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	defer func() {
		_, _ = io.WriteString(stdin, "quit\n")
		_ = stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case err := <-done:
			assert.NoError(t, err, "publisher exit")
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
			t.Error("publisher did not exit")
		}
		for range lines { // drain until the reader goroutine ends
		}
	}()
	expect := func(want string) {
		t.Helper()
		select {
		case got, ok := <-lines:
			require.True(t, ok, "publisher exited before %q", want)
			require.Equal(t, want, strings.TrimSpace(got))
		case <-time.After(20 * time.Second):
			t.Fatalf("publisher did not print %q", want)
		}
	}
	expect("ready")

	x := newIndex(t, "")
	sub := newSubscriber(t, x, nil, Endpoint{Engine: eng, Address: addr, Topic: "kv", ReplayAddress: replay})
	require.Eventually(t, func() bool { return sub.Stats().UnknownTopics > 0 }, 20*time.Second, 10*time.Millisecond,
		"no probe from the publisher")
	_, err = io.WriteString(stdin, "go\n")
	require.NoError(t, err)
	expect("published")

	require.Eventually(t, func() bool {
		st := streamStats(sub, eng)
		return st.Batches == 3 && st.Trusted
	}, 20*time.Second, 10*time.Millisecond, "batches 0, 1, 3 live and 2 replayed")
	assert.Equal(t, 2, held(x, eng, 1, 3), "prompt 1: blocks 0–1; block 2 removed by the replayed batch")
	assert.Equal(t, 2, held(x, eng, 2, 2), "prompt 2: signed hashes, block 0 from the replay")
	assert.Equal(t, 2, held(x, eng, 3, 2), "prompt 3: raw-bytes hashes")
	assert.Zero(t, held(x, eng, 9, 1), "the sliding-window group is ignored")
	assert.Equal(t, 2, engineStats(x, eng).HostBlocks, "medium CPU is host memory")
	st := streamStats(sub, eng)
	assert.EqualValues(t, 1, st.Gaps)
	assert.EqualValues(t, 1, st.Replays)
	assert.EqualValues(t, 1, st.Duplicates, "batch 3 revealed the gap and came back in the replay")
	assert.EqualValues(t, 1, st.Ignored)
	assert.Zero(t, st.Rejected+st.Malformed+st.ReplayFailures+st.Drops)

	_, err = io.WriteString(stdin, "restart\n")
	require.NoError(t, err)
	expect("restarted")
	require.Eventually(t, func() bool { return held(x, eng, 4, 1) == 1 }, 20*time.Second, 10*time.Millisecond)
	assert.Zero(t, held(x, eng, 1, 1)+held(x, eng, 2, 1)+held(x, eng, 3, 1), "the restart cleared the rank")
	assert.EqualValues(t, 1, streamStats(sub, eng).Regressions)
}
