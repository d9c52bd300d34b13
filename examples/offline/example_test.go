package main

import "os"

// The short bucket's decode engine is at its running cap (64 of 64), so the first request is
// rejected there and re-picked, prefill and decode, in the long bucket; the second request's 20k
// peak only fits the long bucket; the third fits no bucket (the long bucket's context is 128k).
func Example() {
	_ = run(os.Stdout)
	// Output:
	// 2k prompt, 1k output   -> bucket long: prefill http://p-long-0 (power_of_two), decode http://d-long-0 (power_of_two)
	// 4k prompt, 16k output  -> bucket long: prefill http://p-long-0 (power_of_two), decode http://d-long-0 (power_of_two)
	// 200k prompt            -> HTTP 400: bucket: input 200000 tokens (peak 200000): no matching bucket
}
