package lora

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestClass(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name             string
		running, waiting []string
		max              int
		class            int
		ok               bool
	}{
		{"running", []string{"b", "a"}, nil, 2, Running, true},
		{"running and waiting is running", []string{"a"}, []string{"a"}, 1, Running, true},
		{"running with unknown slots", []string{"a"}, nil, 0, Running, true},
		{"free slot", []string{"b"}, nil, 2, FreeSlot, true},
		{"idle engine", nil, nil, 1, FreeSlot, true},
		{"an adapter both running and waiting takes one slot", []string{"b"}, []string{"b"}, 2, FreeSlot, true},
		{"waiting, with a free slot, is a free slot", nil, []string{"a"}, 2, FreeSlot, true},
		{"waiting, slots taken", []string{"b"}, []string{"a"}, 2, Waiting, true},
		{"waiting with unknown slots", nil, []string{"a"}, 0, Waiting, true},
		{"full", []string{"b", "c"}, nil, 2, Full, true},
		{"full through waiting adapters", []string{"b"}, []string{"c"}, 2, Full, true},
		{"over full", []string{"b", "c", "d"}, nil, 2, Full, true},
		{"absent with unknown slots", []string{"b"}, nil, 0, 0, false},
	}
	for _, tc := range cases {
		class, ok := Class("a", tc.running, tc.waiting, tc.max)
		assert.Equal(t, tc.ok, ok, tc.name)
		assert.Equal(t, tc.class, class, tc.name)
	}
}

func TestUnion(t *testing.T) {
	t.Parallel()
	assert.Nil(t, Union(nil, []string{}))
	assert.Equal(t, []string{"a", "b", "c"}, Union([]string{"c", "a"}, []string{"b", "a"}, nil))
}
