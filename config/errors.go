package config

import (
	"fmt"

	"github.com/enginepick/enginepick/state"
)

// Error reports one invalid part of a configuration. It matches its cause (one of state's
// state.ErrUnknownField … state.ErrWrongStage) and state.ErrInvalidConfiguration with errors.Is.
//
// Path names the field as written, from the root: `models[0].buckets[1].groups.pd.decode.policy.type`
// (list elements by 0-based index). Line is the 1-based line of the field in the input when the
// loader knows it, 0 otherwise (a Config built in code).
type Error struct {
	// Path is the field's path from the root; empty when the input is not a document at all.
	Path string
	// Line is the field's 1-based line in the input; 0 when unknown.
	Line int
	// Err is the cause; it wraps one of state's cause sentinels.
	Err error
}

// Error implements error: `config: line 12: models[0].buckets[1].id: duplicate bucket ID "short"`,
// without the line part when Line is 0 and without the path when Path is empty.
func (e *Error) Error() string {
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
func (e *Error) Unwrap() []error { return []error{e.Err, state.ErrInvalidConfiguration} }

// cfgErr builds a *Error whose cause wraps sentinel with a formatted detail.
func cfgErr(path string, line int, sentinel error, format string, args ...any) *Error {
	return &Error{Path: path, Line: line, Err: &causeError{sentinel: sentinel, msg: fmt.Sprintf(format, args...)}}
}

// causeError is a message that matches its sentinel without repeating the sentinel's text.
type causeError struct {
	sentinel error
	msg      string
}

func (e *causeError) Error() string { return e.msg }
func (e *causeError) Unwrap() error { return e.sentinel }
