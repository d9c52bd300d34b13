package enginepick_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRuntimeLinksNoDeploymentDependencies holds the split between the runtime and the deployment:
// a program that builds a Router by hand (NewRouter with the routing packages) links none of the
// ZMQ, msgpack, Redis or Prometheus text-parser modules, which only package config (load pollers,
// KV-event subscribers) and affinity/redisstore bring in.
func TestRuntimeLinksNoDeploymentDependencies(t *testing.T) {
	t.Parallel()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command on PATH")
	}
	runtime := []string{".", "./state", "./loadmon", "./kvindex", "./affinity", "./admission", "./policy", "./bucket", "./flowcontrol"}
	out, err := exec.Command(gobin, append([]string{"list", "-deps"}, runtime...)...).Output()
	require.NoError(t, err, "go list -deps")
	deps := strings.Fields(string(out))
	require.Contains(t, deps, "github.com/enginepick/enginepick/bucket", "the listing covers the runtime packages")
	for _, banned := range []string{"github.com/go-zeromq/zmq4", "github.com/vmihailenco/msgpack", "github.com/redis/go-redis",
		"github.com/prometheus/common", "github.com/enginepick/enginepick/config", "github.com/enginepick/enginepick/kvindex/kvevents",
		"github.com/enginepick/enginepick/loadmon/loadsource"} {
		for _, d := range deps {
			assert.False(t, d == banned || strings.HasPrefix(d, banned+"/"), "the runtime links %s", d)
		}
	}
}
