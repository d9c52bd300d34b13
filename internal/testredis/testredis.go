// Package testredis runs a redis-server of a test's own, for the tests that stop and restart
// their Redis: stopping it disturbs no other test. Tests only.
package testredis

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// EnvRequire names the environment variable that, set to "1", makes a test whose server is
// missing fail instead of skip (CI sets it).
const EnvRequire = "ENGINEPICK_REQUIRE_SERVERS"

// Server is a redis-server, a child of the test, on one loopback port, without persistence (a
// restart loses every key).
type Server struct {
	t    testing.TB
	bin  string
	port int
	dir  string
	cmd  *exec.Cmd
	done chan struct{}
}

// Start starts a Server on a free port and waits until it answers PING; t's cleanup kills it.
// Without redis-server on PATH, t skips, or fails when EnvRequire is "1"; why names the test
// that needs it.
func Start(t testing.TB, why string) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		msg := "redis-server not on PATH: " + why + " needs it (Debian: apt-get install -y redis-server)"
		if os.Getenv(EnvRequire) == "1" {
			t.Fatal(msg + "; " + EnvRequire + "=1 requires it")
		}
		t.Skip(msg)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := l.Addr().(*net.TCPAddr).Port
	require.NoError(t, l.Close())
	s := &Server{t: t, bin: bin, port: port, dir: t.TempDir()}
	s.Restart()
	t.Cleanup(s.Stop)
	return s
}

// Addr is the server's host:port.
func (s *Server) Addr() string { return "127.0.0.1:" + strconv.Itoa(s.port) }

// Restart starts the server again on its port after Stop and waits until it answers PING.
func (s *Server) Restart() {
	s.t.Helper()
	s.cmd = exec.Command(s.bin, "--bind", "127.0.0.1", "--port", strconv.Itoa(s.port), "--dir", s.dir,
		"--save", "", "--appendonly", "no", "--logfile", filepath.Join(s.dir, "redis.log"))
	require.NoError(s.t, s.cmd.Start())
	s.done = make(chan struct{})
	go func(cmd *exec.Cmd, done chan struct{}) { _ = cmd.Wait(); close(done) }(s.cmd, s.done)
	// A plain dial until the port is open (a go-redis client's failed dials would start its
	// pool's background redial), then one PING.
	require.Eventually(s.t, func() bool {
		c, err := net.DialTimeout("tcp", s.Addr(), time.Second)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	}, 10*time.Second, 5*time.Millisecond, "redis-server on %s listens", s.Addr())
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1})
	defer c.Close()
	require.NoError(s.t, c.Ping(context.Background()).Err(), "redis-server on %s answers", s.Addr())
}

// Stop kills the server (SIGKILL: an abrupt loss, as of a crashed or partitioned Redis) and waits
// for it to exit; its port is closed when Stop returns. Stopping a stopped server does nothing.
func (s *Server) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.done
	s.cmd = nil
}
