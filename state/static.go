package state

import (
	"fmt"
	"sync"
	"sync/atomic"
)

// StaticEngine is a ready-made Engine for tests and simple hosts: a fixed ID, model and stage, and a
// health flag that may be flipped at any time. Use NewStaticEngine; the zero value has an empty ID
// and reports unhealthy. All methods are safe for concurrent use.
type StaticEngine struct {
	id      EngineID
	model   ModelID
	stage   Stage
	healthy atomic.Bool
}

var _ Engine = (*StaticEngine)(nil)

// NewStaticEngine returns a healthy engine with the given identity, model and stage.
func NewStaticEngine(id EngineID, model ModelID, stage Stage) *StaticEngine {
	e := &StaticEngine{id: id, model: model, stage: stage}
	e.healthy.Store(true)
	return e
}

// ID implements Engine.
func (e *StaticEngine) ID() EngineID { return e.id }

// Model implements Engine.
func (e *StaticEngine) Model() ModelID { return e.model }

// Stage implements Engine.
func (e *StaticEngine) Stage() Stage { return e.stage }

// Healthy implements Engine.
func (e *StaticEngine) Healthy() bool { return e.healthy.Load() }

// SetHealthy sets the value Healthy reports from now on.
func (e *StaticEngine) SetHealthy(healthy bool) { e.healthy.Store(healthy) }

// String returns the engine's ID, for test failure messages.
func (e *StaticEngine) String() string { return string(e.id) }

// StaticRegistry is a concurrency-safe Registry whose engines the host adds and removes by hand.
// Reads (Engines, Engine) are lock-free and allocation-free: they load an immutable,
// copy-on-write view that every write replaces as a whole. Writes are serialized by a mutex.
// The zero value is an empty registry ready to use.
type StaticRegistry struct {
	mu   sync.Mutex
	view atomic.Pointer[registryView]
}

type registryView struct {
	version uint64
	byModel map[ModelID][]Engine
	byID    map[EngineID]Engine
}

var _ VersionedRegistry = (*StaticRegistry)(nil)

// NewStaticRegistry returns a registry holding engines. It returns the first error Add would.
func NewStaticRegistry(engines ...Engine) (*StaticRegistry, error) {
	r := &StaticRegistry{}
	for _, e := range engines {
		if err := r.Add(e); err != nil {
			return nil, err
		}
	}
	return r, nil
}

func (r *StaticRegistry) load() *registryView {
	if v := r.view.Load(); v != nil {
		return v
	}
	return &registryView{}
}

// Engines implements Registry. The returned slice is shared and must not be modified; it lists the
// model's engines in the order they were added.
func (r *StaticRegistry) Engines(model ModelID) []Engine { return r.load().byModel[model] }

// EnginesVersion implements VersionedRegistry: it changes on every Add and Remove.
func (r *StaticRegistry) EnginesVersion(ModelID) uint64 { return r.load().version }

// Engine returns the engine with the given ID, if registered.
func (r *StaticRegistry) Engine(id EngineID) (Engine, bool) {
	e, ok := r.load().byID[id]
	return e, ok
}

// Add registers e. A nil engine or an empty ID is an error wrapping ErrInvalidConfiguration; an ID
// already registered is an error wrapping ErrDuplicate (remove the old engine first to replace
// it). On error the registry is unchanged.
func (r *StaticRegistry) Add(e Engine) error {
	if e == nil {
		return fmt.Errorf("state: add engine: nil engine: %w", ErrInvalidConfiguration)
	}
	id := e.ID()
	if id == "" {
		return fmt.Errorf("state: add engine: empty engine ID: %w", ErrInvalidConfiguration)
	}
	if !e.Stage().Valid() {
		return fmt.Errorf("state: add engine %q: stage %d: %w", id, uint8(e.Stage()), ErrInvalidConfiguration)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	old := r.load()
	if _, dup := old.byID[id]; dup {
		return fmt.Errorf("state: add engine %q: %w engine", id, ErrDuplicate)
	}
	next := old.clone()
	next.byID[id] = e
	m := e.Model()
	next.byModel[m] = append(append([]Engine(nil), old.byModel[m]...), e)
	r.view.Store(next)
	return nil
}

// Remove unregisters the engine with the given ID and reports whether it was registered.
func (r *StaticRegistry) Remove(id EngineID) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	old := r.load()
	e, ok := old.byID[id]
	if !ok {
		return false
	}
	next := old.clone()
	delete(next.byID, id)
	m := e.Model()
	kept := make([]Engine, 0, len(old.byModel[m]))
	for _, x := range old.byModel[m] {
		if x.ID() != id {
			kept = append(kept, x)
		}
	}
	if len(kept) == 0 {
		delete(next.byModel, m)
	} else {
		next.byModel[m] = kept
	}
	r.view.Store(next)
	return true
}

// clone copies the maps (not the per-model slices, which are never modified once published).
func (v *registryView) clone() *registryView {
	n := &registryView{
		byModel: make(map[ModelID][]Engine, len(v.byModel)+1),
		byID:    make(map[EngineID]Engine, len(v.byID)+1),
		version: v.version + 1,
	}
	for k, s := range v.byModel {
		n.byModel[k] = s
	}
	for k, e := range v.byID {
		n.byID[k] = e
	}
	return n
}
