package redisstore_test

import (
	"github.com/redis/go-redis/v9"

	"github.com/enginepick/enginepick/affinity/redisstore"
	"github.com/enginepick/enginepick/loadmon"
	"github.com/enginepick/enginepick/policy"
)

// Router replicas share session bindings through a Redis Cluster: every replica builds its
// SessionAware policies over a Store with the same Prefix, Shards and IdleTimeout. (Not run: it
// needs a cluster.)
func Example() {
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"10.0.0.1:6379", "10.0.0.2:6379", "10.0.0.3:6379"}})
	defer client.Close()
	store, err := redisstore.New(redisstore.Options{Client: client, Prefix: "myrouter:affinity"})
	if err != nil {
		panic(err)
	}
	p, err := policy.NewSessionAware(policy.Config{Load: loadmon.NewTable(), InFlight: loadmon.NewInFlight(nil)},
		policy.SessionAwareOptions{Store: store})
	if err != nil {
		panic(err)
	}
	_ = p // attach p to an engine group: bucket.NewEngineGroup(p, nil)
}
