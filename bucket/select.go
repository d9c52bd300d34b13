package bucket

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"github.com/enginepick/enginepick/flowcontrol"
	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

var (
	// ErrNoMatchingBucket: no bucket accepts the request's length (HTTP 400).
	ErrNoMatchingBucket = errors.New("no matching bucket")

	// ErrUnknownModel: the router has no resolver for the requested model (HTTP 404). There is no
	// fallback to another model's buckets (docs/design.md §16).
	ErrUnknownModel = errors.New("unknown model")
)

// ExhaustedError reports that every compatible bucket was tried and none produced a complete
// selection (HTTP 503). Rejections holds every admission rejection met on the way, in order; Last
// is the last bucket's failure (a *StageError). Unwrap returns the rejections and Last, so
// errors.As finds each *policy.AdmissionRejectedError and errors.Is finds policy.ErrNoCandidates.
type ExhaustedError struct {
	// Rejections lists every admission rejection, in bucket order.
	Rejections []*policy.AdmissionRejectedError
	// Last is the last bucket's failure (a *StageError).
	Last error
}

// Error implements error.
func (e *ExhaustedError) Error() string {
	if len(e.Rejections) == 0 {
		return fmt.Sprintf("bucket: every bucket exhausted: %v", e.Last)
	}
	var b strings.Builder
	b.WriteString("bucket: every bucket exhausted; admission rejected ")
	for i, r := range e.Rejections {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%q (%s: %d of cap %d)", r.Engine.ID(), r.Limit, r.Observed, r.Cap)
	}
	return b.String()
}

// Unwrap returns every rejection, then Last.
func (e *ExhaustedError) Unwrap() []error {
	out := make([]error, 0, len(e.Rejections)+1)
	for _, r := range e.Rejections {
		out = append(out, r)
	}
	return append(out, e.Last)
}

// advances reports whether err lets the bucket loop try the next bucket: no candidates or an
// admission rejection. Every other error stops the loop (docs/design.md §1).
func advances(err error) bool {
	return errors.Is(err, policy.ErrNoCandidates) || errors.Is(err, policy.ErrAdmissionRejected)
}

// Select is the bucket loop written once (docs/design.md §1): resolve, then ask each compatible
// bucket in order for a complete selection. No candidates or an admission rejection advances to
// the next bucket, where every stage is picked again; an invalid signal or configuration, a
// foreign pick, a context error or any other error stops at once and is returned.
//
// Errors: a resolve error (policy.ErrInvalidSignal); ErrNoMatchingBucket when no bucket fits;
// *ExhaustedError when every bucket failed.
func Select(ctx context.Context, r *Resolver, registry state.Registry, req *Request) (Selection, error) {
	var buf [8]*Bucket
	buckets, err := r.resolveInto(buf[:0], req.Signals)
	if err != nil {
		return Selection{}, err
	}
	if len(buckets) == 0 {
		return Selection{}, fmt.Errorf("bucket: input %d tokens (peak %d): %w", req.InputTokens, req.ExpectedPeakTokens, ErrNoMatchingBucket)
	}
	return selectFrom(ctx, buckets, registry, req)
}

// selectFrom runs the bucket loop over the resolved buckets in order.
func selectFrom(ctx context.Context, pickers []*Bucket, registry state.Registry, req *Request) (Selection, error) {
	var rejections []*policy.AdmissionRejectedError
	var last error
	for _, p := range pickers {
		if err := ctx.Err(); err != nil {
			return Selection{}, err
		}
		sel, err := p.pickEngines(ctx, registry, req)
		if err == nil {
			return sel, nil
		}
		if !advances(err) {
			return Selection{}, err
		}
		rejections = appendRejections(rejections, err)
		last = err
	}
	return Selection{}, &ExhaustedError{Rejections: rejections, Last: last}
}

// appendRejections collects every *policy.AdmissionRejectedError in err's tree.
func appendRejections(dst []*policy.AdmissionRejectedError, err error) []*policy.AdmissionRejectedError {
	switch e := err.(type) {
	case *policy.AdmissionRejectedError:
		return append(dst, e)
	case interface{ Unwrap() []error }:
		for _, inner := range e.Unwrap() {
			dst = appendRejections(dst, inner)
		}
	case interface{ Unwrap() error }:
		if inner := e.Unwrap(); inner != nil {
			return appendRejections(dst, inner)
		}
	}
	return dst
}

// StatusCode maps a selection error to the HTTP status a gateway returns (docs/design.md §16):
// nil 200; ErrNoMatchingBucket 400; ErrUnknownModel 404; a *flowcontrol.RejectedError 429 (its
// RetryAfter is the Retry-After hint); flowcontrol.ErrTimeout 503; context.Canceled 499 (client
// closed request); context.DeadlineExceeded 504; exhaustion, no candidates or admission rejection
// 503; invalid signal, invalid configuration, a foreign pick, or anything else 500.
func StatusCode(err error) int {
	var rejected *flowcontrol.RejectedError
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrNoMatchingBucket):
		return http.StatusBadRequest
	case errors.Is(err, ErrUnknownModel):
		return http.StatusNotFound
	case errors.As(err, &rejected):
		return http.StatusTooManyRequests
	case errors.Is(err, flowcontrol.ErrTimeout):
		return http.StatusServiceUnavailable
	case errors.Is(err, context.Canceled):
		return 499
	case errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	case errors.Is(err, policy.ErrInvalidSignal), errors.Is(err, policy.ErrInvalidConfiguration),
		errors.Is(err, policy.ErrOutsideCandidates):
		return http.StatusInternalServerError
	case advances(err):
		return http.StatusServiceUnavailable
	}
	var ex *ExhaustedError
	if errors.As(err, &ex) {
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}
