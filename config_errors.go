package enginepick

import (
	"errors"
	"fmt"

	"github.com/enginepick/enginepick/state"
)

// Causes of a *ConfigError, usable with errors.Is (docs/design.md §14.4).
var (
	// ErrUnknownField: the input names a field the configuration does not have.
	ErrUnknownField = errors.New("unknown field")
	// ErrRemovedOption: the input uses an option that was removed; the message says what to use
	// instead.
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

// ConfigError reports one invalid part of a configuration. It matches its cause (one of the
// Err… sentinels above) and state.ErrInvalidConfiguration with errors.Is.
//
// Path names the field as written, from the root: `models[0].buckets[1].groups.pd.decode.policy.type`
// (list elements by 0-based index). Line is the 1-based line of the field in the input when the
// loader knows it, 0 otherwise (a Config built in code).
type ConfigError struct {
	// Path is the field's path from the root; empty when the input is not a document at all.
	Path string
	// Line is the field's 1-based line in the input; 0 when unknown.
	Line int
	// Err is the cause; it wraps one of the Err… sentinels.
	Err error
}

// Error implements error: `config: line 12: models[0].buckets[1].id: duplicate bucket ID "short"`,
// without the line part when Line is 0 and without the path when Path is empty.
func (e *ConfigError) Error() string {
	s := "config: "
	if e.Line > 0 {
		s += fmt.Sprintf("line %d: ", e.Line)
	}
	if e.Path != "" {
		s += e.Path + ": "
	}
	return s + e.Err.Error()
}

// Unwrap returns the cause and state.ErrInvalidConfiguration.
func (e *ConfigError) Unwrap() []error { return []error{e.Err, state.ErrInvalidConfiguration} }

// cfgErr builds a *ConfigError whose cause wraps sentinel with a formatted detail.
func cfgErr(path string, line int, sentinel error, format string, args ...any) *ConfigError {
	return &ConfigError{Path: path, Line: line, Err: &causeError{sentinel: sentinel, msg: fmt.Sprintf(format, args...)}}
}

// causeError is a message that matches its sentinel without repeating the sentinel's text.
type causeError struct {
	sentinel error
	msg      string
}

func (e *causeError) Error() string { return e.msg }
func (e *causeError) Unwrap() error { return e.sentinel }
