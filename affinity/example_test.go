package affinity_test

import (
	"context"
	"fmt"
	"time"

	"github.com/enginepick/enginepick/affinity"
	"github.com/enginepick/enginepick/state"
)

func ExampleMemoryStore() {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	st, _ := affinity.NewMemoryStore(affinity.Options{IdleTimeout: 10 * time.Second, Now: func() time.Time { return now }})
	ctx := context.Background()
	s := affinity.Scope{Namespace: "session", Model: "llama", BucketID: "short", Stage: state.StagePlain, Key: "conv-42"}

	fmt.Println(st.Bind(ctx, s, "http://a:8000"))                     // first bind
	fmt.Println(st.Bind(ctx, s, "http://b:8000"))                     // a live binding wins
	fmt.Println(st.Replace(ctx, s, "http://a:8000", "http://b:8000")) // replace the expected binding
	now = now.Add(9 * time.Second)
	fmt.Println(st.Lookup(ctx, s)) // a hit refreshes the idle time
	now = now.Add(10 * time.Second)
	fmt.Println(st.Sweep(), st.Len()) // idle for 10 s: swept
	fmt.Println(st.Lookup(ctx, s))
	// Output:
	// http://a:8000 <nil>
	// http://a:8000 <nil>
	// http://b:8000 <nil>
	// http://b:8000 true <nil>
	// 1 0
	//  false <nil>
}
