package state_test

import (
	"errors"
	"fmt"

	"github.com/enginepick/enginepick/state"
)

// A static registry as a small host or a test keeps it: engines are added and removed by hand,
// health is flipped on the engine value, and Engines lists a model's engines, healthy or not, in
// the order they were added. Filtering by health, stage and membership is the engine groups' job.
func ExampleStaticRegistry() {
	reg := &state.StaticRegistry{} // the zero value is an empty registry, ready to use
	a := state.NewStaticEngine("http://10.0.0.1:30000", "llama-8b", state.StagePrefill)
	b := state.NewStaticEngine("http://10.0.0.2:30000", "llama-8b", state.StageDecode)
	for _, e := range []state.Engine{a, b} {
		if err := reg.Add(e); err != nil {
			fmt.Println("add:", err)
		}
	}

	// A second engine with an ID already registered is refused; the registry is unchanged.
	err := reg.Add(state.NewStaticEngine("http://10.0.0.1:30000", "llama-8b", state.StagePlain))
	fmt.Println("duplicate:", errors.Is(err, state.ErrDuplicate))

	a.SetHealthy(false) // the host's health check failed: the engine stays registered
	for _, e := range reg.Engines("llama-8b") {
		fmt.Println(e.ID(), e.Stage(), e.Healthy())
	}
	fmt.Println("unknown model:", len(reg.Engines("mistral-7b")))

	fmt.Println("removed:", reg.Remove("http://10.0.0.1:30000"), reg.Remove("http://10.0.0.1:30000"))
	fmt.Println("left:", len(reg.Engines("llama-8b")))
	// Output:
	// duplicate: true
	// http://10.0.0.1:30000 prefill false
	// http://10.0.0.2:30000 decode true
	// unknown model: 0
	// removed: true false
	// left: 1
}

// Stages are configured by name; anything but the three exact lower-case names is an invalid
// configuration.
func ExampleParseStage() {
	for _, text := range []string{"prefill", "Decode"} {
		s, err := state.ParseStage(text)
		fmt.Printf("%q: %v %v\n", text, s, errors.Is(err, state.ErrInvalidConfiguration))
	}
	// Output:
	// "prefill": prefill false
	// "Decode": plain true
}
