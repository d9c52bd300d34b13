package state

import "errors"

// Causes of an invalid configuration, usable with errors.Is. A configuration error (a
// *config.Error, or a policy.OptionError of one policy's options) wraps exactly one of them
// and ErrInvalidConfiguration (docs/design.md §14.4).
var (
	// ErrUnknownField: the input names a field the configuration does not have.
	ErrUnknownField = errors.New("unknown field")
	// ErrRemovedOption: the input uses an option that was removed or renamed; the message says
	// what to use instead.
	ErrRemovedOption = errors.New("removed option")
	// ErrBadValue: a value of the wrong kind (a string where a number is wanted, say), an
	// unknown name, or input that is not YAML or JSON at all.
	ErrBadValue = errors.New("bad value")
	// ErrMissingField: a required field is absent or empty.
	ErrMissingField = errors.New("missing field")
	// ErrDuplicate: an ID or a key that must be unique appears twice.
	ErrDuplicate = errors.New("duplicate")
	// ErrOutOfRange: a number outside its allowed range, or an inverted range.
	ErrOutOfRange = errors.New("out of range")
	// ErrConflict: fields that cannot be combined, or a field that needs another one.
	ErrConflict = errors.New("conflicting fields")
	// ErrWrongStage: a policy attached to a stage it cannot serve, or membership naming an engine
	// of another role or model.
	ErrWrongStage = errors.New("wrong stage")
)
