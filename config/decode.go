package config

import (
	"bytes"
	"encoding"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"go.yaml.in/yaml/v3"

	"github.com/enginepick/enginepick/policy"
	"github.com/enginepick/enginepick/state"
)

// format is the syntax of a configuration document.
type format uint8

const (
	// formatAuto reads JSON when the first non-blank byte is '{', YAML otherwise.
	formatAuto format = iota
	// formatYAML is YAML 1.2 (one document).
	formatYAML
	// formatJSON is JSON (one value).
	formatJSON
)

// maxBytes is the largest configuration document Parse accepts, in bytes; maxConfigNodes bounds
// the values in it (after YAML aliases are expanded), so that a hostile input cannot exhaust
// memory.
const (
	maxBytes       = 4 << 20
	maxConfigNodes = 200_000
)

// Load reads and parses a configuration file: JSON when its name ends in .json, YAML when it
// ends in .yaml or .yml, otherwise as Parse detects. The result is validated (Config.Validate).
//
// Errors: the file's read error, or a *Error (docs/design.md §14.4).
func Load(path string) (*Config, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	f := formatAuto
	switch strings.ToLower(filepath.Ext(path)) {
	case ".json":
		f = formatJSON
	case ".yaml", ".yml":
		f = formatYAML
	}
	return parse(data, f)
}

// Parse decodes a configuration document strictly and validates it: JSON when its first non-blank
// byte is '{', YAML 1.2 (one document) otherwise. An unknown field, a removed option, a value of
// the wrong kind, a duplicate key, or any rule of Config.Validate broken is a *Error naming the
// field's path (and, when known, its line); so is an empty document (state.ErrMissingField) and
// a document above 4 MiB (state.ErrBadValue). On error the returned Config is nil.
func Parse(data []byte) (*Config, error) { return parse(data, formatAuto) }

// parse is Parse in the given syntax.
func parse(data []byte, format format) (*Config, error) {
	root, err := parseTree(data, format)
	if err != nil {
		return nil, err
	}
	cfg := Config{lines: map[string]int{}}
	d := decoder{lines: cfg.lines}
	if err := d.decodeValue(root, reflect.ValueOf(&cfg).Elem(), ""); err != nil {
		return nil, err
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &cfg, nil
}

// nodeKind is the kind of a parsed value.
type nodeKind uint8

const (
	kindNull nodeKind = iota
	kindMap
	kindSeq
	kindString
	kindInt   // text is a decimal integer, possibly negative, of any size
	kindFloat // text is a float in strconv.FormatFloat('g') form, possibly ±Inf or NaN
	kindBool  // text is "true" or "false"
)

func (k nodeKind) String() string {
	return [...]string{"null", "a mapping", "a list", "a string", "an integer", "a number", "a boolean"}[k]
}

// cnode is one value of a parsed document, independent of its syntax.
type cnode struct {
	kind   nodeKind
	line   int
	keys   []string // kindMap, in input order
	klines []int
	vals   []*cnode
	items  []*cnode // kindSeq
	text   string   // scalars
}

// parseTree parses data into a cnode tree, rejecting duplicate keys.
func parseTree(data []byte, format format) (*cnode, error) {
	if len(data) > maxBytes {
		return nil, cfgErr("", 0, state.ErrBadValue, "document is %d bytes, more than %d", len(data), maxBytes)
	}
	if format == formatAuto {
		format = formatYAML
		if t := bytes.TrimLeft(data, " \t\r\n"); len(t) > 0 && t[0] == '{' {
			format = formatJSON
		}
	}
	var (
		root *cnode
		err  error
	)
	switch format {
	case formatJSON:
		root, err = parseJSON(data)
	case formatYAML:
		root, err = parseYAML(data)
	default:
		return nil, cfgErr("", 0, state.ErrBadValue, "unknown format %d", format)
	}
	if err != nil {
		return nil, err
	}
	if root == nil || root.kind == kindNull {
		return nil, cfgErr("", 0, state.ErrMissingField, "empty document: want a mapping with models")
	}
	return root, nil
}

func parseYAML(data []byte) (*cnode, error) {
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, nil
		}
		return nil, cfgErr("", 0, state.ErrBadValue, "not valid YAML: %v", strings.TrimPrefix(err.Error(), "yaml: "))
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); !errors.Is(err, io.EOF) {
		return nil, cfgErr("", extra.Line, state.ErrBadValue, "more than one YAML document")
	}
	budget := maxConfigNodes
	return fromYAML(&doc, &budget, 0)
}

func fromYAML(n *yaml.Node, budget *int, depth int) (*cnode, error) {
	if *budget--; *budget < 0 {
		return nil, cfgErr("", n.Line, state.ErrBadValue, "document has more than %d values", maxConfigNodes)
	}
	if depth > 64 {
		return nil, cfgErr("", n.Line, state.ErrBadValue, "document nests deeper than 64 levels")
	}
	switch n.Kind {
	case yaml.DocumentNode:
		if len(n.Content) == 0 {
			return nil, nil
		}
		return fromYAML(n.Content[0], budget, depth)
	case yaml.AliasNode:
		return fromYAML(n.Alias, budget, depth+1)
	case yaml.MappingNode:
		if n.Tag != "!!map" && n.Tag != "" {
			return nil, cfgErr("", n.Line, state.ErrBadValue, "mapping has tag %s: want a plain mapping", n.Tag)
		}
		out := &cnode{kind: kindMap, line: n.Line}
		for i := 0; i+1 < len(n.Content); i += 2 {
			k, v := n.Content[i], n.Content[i+1]
			if k.Tag == "!!merge" {
				return nil, cfgErr("", k.Line, state.ErrBadValue, "YAML merge keys (<<) are not supported: write the fields out, or use default_policy and stage_policies")
			}
			if k.Kind != yaml.ScalarNode || (k.Tag != "!!str" && k.Tag != "!!int" && k.Tag != "!!bool" && k.Tag != "!!float") {
				return nil, cfgErr("", k.Line, state.ErrBadValue, "mapping key at column %d is not a plain name", k.Column)
			}
			c, err := fromYAML(v, budget, depth+1)
			if err != nil {
				return nil, err
			}
			out.keys = append(out.keys, k.Value)
			out.klines = append(out.klines, k.Line)
			out.vals = append(out.vals, c)
		}
		return out, nil
	case yaml.SequenceNode:
		if n.Tag != "!!seq" && n.Tag != "" {
			return nil, cfgErr("", n.Line, state.ErrBadValue, "list has tag %s: want a plain list", n.Tag)
		}
		out := &cnode{kind: kindSeq, line: n.Line}
		for _, item := range n.Content {
			c, err := fromYAML(item, budget, depth+1)
			if err != nil {
				return nil, err
			}
			out.items = append(out.items, c)
		}
		return out, nil
	case yaml.ScalarNode:
		out := &cnode{line: n.Line, text: n.Value}
		switch n.Tag {
		case "!!null":
			out.kind, out.text = kindNull, ""
		case "!!str":
			out.kind = kindString
		case "!!bool":
			var b bool
			if err := n.Decode(&b); err != nil {
				return nil, cfgErr("", n.Line, state.ErrBadValue, "%s is not a boolean", strconv.Quote(n.Value))
			}
			out.kind, out.text = kindBool, strconv.FormatBool(b)
		case "!!int":
			var i int64
			var u uint64
			switch {
			case n.Decode(&i) == nil:
				out.kind, out.text = kindInt, strconv.FormatInt(i, 10)
			case n.Decode(&u) == nil:
				out.kind, out.text = kindInt, strconv.FormatUint(u, 10)
			default:
				// Too large for 64 bits: keep it an integer so that the range error names it.
				out.kind, out.text = kindInt, strings.ReplaceAll(n.Value, "_", "")
			}
		case "!!float":
			if integerText(n.Value) {
				// An integer too large for 64 bits, which YAML resolves as a float: keep it an
				// integer so that the range error names it.
				out.kind, out.text = kindInt, strings.ReplaceAll(n.Value, "_", "")
				break
			}
			var f float64
			if err := n.Decode(&f); err != nil {
				return nil, cfgErr("", n.Line, state.ErrBadValue, "%s is not a number", strconv.Quote(n.Value))
			}
			out.kind, out.text = kindFloat, strconv.FormatFloat(f, 'g', -1, 64)
		default:
			return nil, cfgErr("", n.Line, state.ErrBadValue, "value %s has tag %s: want a plain string, number, boolean or null", strconv.Quote(n.Value), n.Tag)
		}
		return out, nil
	}
	return nil, cfgErr("", n.Line, state.ErrBadValue, "unsupported YAML node")
}

// integerText reports whether s is an optionally signed run of decimal digits (and underscores).
func integerText(s string) bool {
	s = strings.TrimLeft(s, "+-")
	return s != "" && strings.Trim(s, "0123456789_") == ""
}

// parseJSON reads one JSON value with its line numbers.
func parseJSON(data []byte) (*cnode, error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	p := jsonParser{dec: dec, data: data, budget: maxConfigNodes}
	root, err := p.value(0)
	if err != nil {
		return nil, err
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return nil, cfgErr("", p.line(), state.ErrBadValue, "more than one JSON value")
	}
	return root, nil
}

type jsonParser struct {
	dec    *json.Decoder
	data   []byte
	budget int
}

// line returns the 1-based line of the decoder's input offset.
func (p *jsonParser) line() int {
	off := min(int(p.dec.InputOffset()), len(p.data))
	return 1 + bytes.Count(p.data[:off], []byte{'\n'})
}

func (p *jsonParser) value(depth int) (*cnode, error) {
	if p.budget--; p.budget < 0 {
		return nil, cfgErr("", p.line(), state.ErrBadValue, "document has more than %d values", maxConfigNodes)
	}
	if depth > 64 {
		return nil, cfgErr("", p.line(), state.ErrBadValue, "document nests deeper than 64 levels")
	}
	tok, err := p.dec.Token()
	if err != nil {
		if errors.Is(err, io.EOF) {
			if depth == 0 {
				return nil, nil
			}
			err = io.ErrUnexpectedEOF
		}
		return nil, cfgErr("", p.line(), state.ErrBadValue, "not valid JSON: %v", err)
	}
	// A token never spans lines (JSON strings hold no raw newline), so the line of the offset
	// just after it is its own line.
	line := p.line()
	switch t := tok.(type) {
	case json.Delim:
		if t == '{' {
			out := &cnode{kind: kindMap, line: line}
			for p.dec.More() {
				kt, err := p.dec.Token()
				if err != nil {
					return nil, cfgErr("", p.line(), state.ErrBadValue, "not valid JSON: %v", err)
				}
				key, _ := kt.(string)
				kl := p.line()
				v, err := p.value(depth + 1)
				if err != nil {
					return nil, err
				}
				out.keys = append(out.keys, key)
				out.klines = append(out.klines, kl)
				out.vals = append(out.vals, v)
			}
			if _, err := p.dec.Token(); err != nil {
				return nil, cfgErr("", p.line(), state.ErrBadValue, "not valid JSON: %v", err)
			}
			return out, nil
		}
		out := &cnode{kind: kindSeq, line: line}
		for p.dec.More() {
			v, err := p.value(depth + 1)
			if err != nil {
				return nil, err
			}
			out.items = append(out.items, v)
		}
		if _, err := p.dec.Token(); err != nil {
			return nil, cfgErr("", p.line(), state.ErrBadValue, "not valid JSON: %v", err)
		}
		return out, nil
	case string:
		return &cnode{kind: kindString, line: line, text: t}, nil
	case json.Number:
		s := t.String()
		if !strings.ContainsAny(s, ".eE") {
			return &cnode{kind: kindInt, line: line, text: s}, nil
		}
		f, err := strconv.ParseFloat(s, 64)
		if err != nil && !errors.Is(err, strconv.ErrRange) {
			return nil, cfgErr("", line, state.ErrBadValue, "%s is not a number", s)
		}
		return &cnode{kind: kindFloat, line: line, text: strconv.FormatFloat(f, 'g', -1, 64)}, nil
	case bool:
		return &cnode{kind: kindBool, line: line, text: strconv.FormatBool(t)}, nil
	case nil:
		return &cnode{kind: kindNull, line: line}, nil
	}
	return nil, cfgErr("", line, state.ErrBadValue, "unexpected JSON token %v", tok)
}

// removedFields are options that were dropped; each maps to the message that says what to use
// instead (docs/design.md §14.3). They are recognized in every mapping.
var removedFields = map[string]string{
	"fuse":                   `"fuse" was removed with the fused_score policy: use policy type cache_aware instead`,
	"fuse_terms":             `"fuse_terms" was removed with the fused_score policy: use policy type cache_aware instead`,
	"fuse_weights":           `"fuse_weights" was removed with the fused_score policy: use policy type cache_aware instead`,
	"stable_pair":            `"stable_pair" was removed: both engines of a PD pair always come from one bucket; use policy type session_aware on the prefill and decode groups instead`,
	"prefix_cache_min_share": `"prefix_cache_min_share" was removed with filter prefix_cache, and cache_aware's gate is not equivalent to it: use policy type cache_aware with min_match_ratio instead`,
	"worker_ids":             `"worker_ids" was renamed engine_ids: use engine_ids instead`,
	"worker_queue_limit":     `"worker_queue_limit" was renamed engine_queue_limit: use engine_queue_limit instead`,
	"candidate_min_workers":  `"candidate_min_workers" was renamed candidate_min_engines: use candidate_min_engines instead`,
	"candidate_max_workers":  `"candidate_max_workers" was renamed candidate_max_engines: use candidate_max_engines instead`,
}

var (
	textUnmarshaler  = reflect.TypeFor[encoding.TextUnmarshaler]()
	stringListType   = reflect.TypeFor[StringList]()
	durationType     = reflect.TypeFor[Duration]()
	policyConfigType = reflect.TypeFor[Policy]()
)

// decodeValue decodes n into v strictly; path is v's path.
func (d *decoder) decodeValue(n *cnode, v reflect.Value, path string) error {
	if path != "" {
		if _, ok := d.lines[path]; !ok {
			d.lines[path] = n.line
		}
	}
	if n.kind == kindNull {
		v.SetZero() // an explicit null is the same as an absent field
		return nil
	}
	if v.Type() == stringListType {
		switch n.kind {
		case kindString:
			v.Set(reflect.ValueOf(StringList{n.text}))
			return nil
		case kindSeq:
			out := make(StringList, len(n.items))
			for i, it := range n.items {
				if it.kind != kindString {
					return cfgErr(fmt.Sprintf("%s[%d]", path, i), it.line, state.ErrBadValue, "%s: want a string", describe(it))
				}
				out[i] = it.text
			}
			v.Set(reflect.ValueOf(out))
			return nil
		}
		return cfgErr(path, n.line, state.ErrBadValue, "%s: want a string or a list of strings", describe(n))
	}
	if v.Kind() == reflect.Pointer {
		p := reflect.New(v.Type().Elem())
		if err := d.decodeValue(n, p.Elem(), path); err != nil {
			return err
		}
		v.Set(p)
		return nil
	}
	if reflect.PointerTo(v.Type()).Implements(textUnmarshaler) {
		if n.kind != kindString {
			if v.Type() == durationType {
				return cfgErr(path, n.line, state.ErrBadValue, "%s: want a duration such as 5s or 250ms", describe(n))
			}
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want a string", describe(n))
		}
		if err := v.Addr().Interface().(encoding.TextUnmarshaler).UnmarshalText([]byte(n.text)); err != nil {
			return &Error{Path: path, Line: n.line, Err: err}
		}
		return nil
	}
	switch v.Kind() {
	case reflect.Struct:
		if v.Type() == policyConfigType {
			return d.decodePolicy(n, v.Addr().Interface().(*Policy), path)
		}
		return d.decodeStruct(n, v, path)
	case reflect.Slice:
		if n.kind != kindSeq {
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want a list", describe(n))
		}
		out := reflect.MakeSlice(v.Type(), len(n.items), len(n.items))
		for i, it := range n.items {
			if err := d.decodeValue(it, out.Index(i), fmt.Sprintf("%s[%d]", path, i)); err != nil {
				return err
			}
		}
		v.Set(out)
		return nil
	case reflect.Map:
		// A mapping of names the user chooses (flow_control.flow_weights): string keys, each
		// value decoded strictly, a repeated name refused.
		if n.kind != kindMap {
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want a mapping", describe(n))
		}
		out := reflect.MakeMapWithSize(v.Type(), len(n.keys))
		for i, key := range n.keys {
			kpath := join(path, key)
			kv := reflect.ValueOf(key).Convert(v.Type().Key())
			if out.MapIndex(kv).IsValid() {
				return cfgErr(kpath, n.klines[i], state.ErrDuplicate, "key set twice")
			}
			d.lines[kpath] = n.klines[i]
			ev := reflect.New(v.Type().Elem()).Elem()
			if err := d.decodeValue(n.vals[i], ev, kpath); err != nil {
				return err
			}
			out.SetMapIndex(kv, ev)
		}
		v.Set(out)
		return nil
	case reflect.String:
		if n.kind != kindString {
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want a string (quote it)", describe(n))
		}
		v.SetString(n.text)
		return nil
	case reflect.Bool:
		if n.kind != kindBool {
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want true or false", describe(n))
		}
		v.SetBool(n.text == "true")
		return nil
	case reflect.Int, reflect.Int64:
		if n.kind != kindInt {
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want an integer", describe(n))
		}
		i, err := strconv.ParseInt(n.text, 10, v.Type().Bits())
		if err != nil {
			return cfgErr(path, n.line, state.ErrOutOfRange, "%s does not fit in %d bits", n.text, v.Type().Bits())
		}
		v.SetInt(i)
		return nil
	case reflect.Uint64:
		if n.kind != kindInt || strings.HasPrefix(n.text, "-") {
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want a non-negative integer", describe(n))
		}
		u, err := strconv.ParseUint(n.text, 10, 64)
		if err != nil {
			return cfgErr(path, n.line, state.ErrOutOfRange, "%s does not fit in 64 bits", n.text)
		}
		v.SetUint(u)
		return nil
	case reflect.Float64:
		if n.kind != kindInt && n.kind != kindFloat {
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want a number", describe(n))
		}
		f, err := strconv.ParseFloat(n.text, 64)
		if (err != nil && !errors.Is(err, strconv.ErrRange)) || math.IsNaN(f) || math.IsInf(f, 0) {
			return cfgErr(path, n.line, state.ErrBadValue, "%s: want a finite number", describe(n))
		}
		v.SetFloat(f)
		return nil
	}
	return cfgErr(path, n.line, state.ErrBadValue, "unsupported field type %s", v.Type())
}

// decoder decodes a cnode tree into configuration structs, recording each field's line.
type decoder struct {
	lines map[string]int // path → line of the key (or list item)
}

// describe names a value's kind and, for scalars, the value itself.
func describe(n *cnode) string {
	switch n.kind {
	case kindString:
		return fmt.Sprintf("string %s", strconv.Quote(truncate(n.text)))
	case kindInt, kindFloat, kindBool:
		return fmt.Sprintf("%s %s", n.kind, truncate(n.text))
	}
	return n.kind.String()
}

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// fieldName returns a struct field's configuration name: its json tag's name, "" for none.
func fieldName(f reflect.StructField) string {
	name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
	if name == "-" {
		return ""
	}
	return name
}

// fieldIndex returns the index of the field of struct type t whose configuration name is key; -1
// for none.
func fieldIndex(t reflect.Type, key string) int {
	for i := range t.NumField() {
		if fieldName(t.Field(i)) == key {
			return i
		}
	}
	return -1
}

// fieldNames returns the configuration names of a struct's fields, in declaration order.
func fieldNames(t reflect.Type) []string {
	names := make([]string, 0, t.NumField())
	for i := range t.NumField() {
		if name := fieldName(t.Field(i)); name != "" {
			names = append(names, name)
		}
	}
	return names
}

// decodePolicy decodes a policy attachment: its own fields, and the block named after its type
// into the options value of the type's builder (policy.Builder.NewOptions). A block named after
// another registered type is a conflict; an unregistered type is left to Validate.
func (d *decoder) decodePolicy(n *cnode, pc *Policy, path string) error {
	if n.kind != kindMap {
		return cfgErr(path, n.line, state.ErrBadValue, "%s: want a mapping", describe(n))
	}
	typ := ""
	for i, k := range n.keys {
		if k == "type" && n.vals[i].kind == kindString {
			typ = n.vals[i].text
		}
	}
	own := &cnode{kind: kindMap, line: n.line}
	var block *cnode
	blockKey, blockLine := "", 0
	for i, k := range n.keys {
		if _, registered := policy.Lookup(k); !registered {
			own.keys, own.klines, own.vals = append(own.keys, k), append(own.klines, n.klines[i]), append(own.vals, n.vals[i])
			continue
		}
		fpath := join(path, k)
		if k != typ {
			return cfgErr(fpath, n.klines[i], state.ErrConflict, "options for policy type %s, but the type is %q: name the block after the type", k, typ)
		}
		if block != nil {
			return cfgErr(fpath, n.klines[i], state.ErrDuplicate, "field set twice")
		}
		block, blockKey, blockLine = n.vals[i], k, n.klines[i]
	}
	if err := d.decodeStruct(own, reflect.ValueOf(pc).Elem(), path); err != nil {
		return err
	}
	if block == nil || block.kind == kindNull {
		return nil
	}
	b, _ := policy.Lookup(blockKey)
	opts := b.NewOptions()
	ov := reflect.ValueOf(opts)
	if ov.Kind() != reflect.Pointer || ov.IsNil() {
		return cfgErr(join(path, blockKey), blockLine, state.ErrBadValue, "policy type %s takes no options", blockKey)
	}
	bpath := join(path, blockKey)
	if ov.Elem().Kind() == reflect.Struct && ov.Elem().NumField() == 0 && block.kind == kindMap && len(block.keys) > 0 {
		p := join(bpath, block.keys[0])
		return cfgErr(p, block.klines[0], state.ErrUnknownField, "unknown field: policy type %s takes no options", blockKey)
	}
	d.lines[bpath] = blockLine
	if err := d.decodeValue(block, ov.Elem(), bpath); err != nil {
		return err
	}
	pc.Options = opts
	return nil
}

func (d *decoder) decodeStruct(n *cnode, v reflect.Value, path string) error {
	if n.kind != kindMap {
		if path == "" {
			return cfgErr(path, n.line, state.ErrBadValue, "the document is %s: want a mapping with models", describe(n))
		}
		return cfgErr(path, n.line, state.ErrBadValue, "%s: want a mapping", describe(n))
	}
	t := v.Type()
	seen := make(map[string]bool, len(n.keys))
	for i, key := range n.keys {
		fpath := key
		if path != "" {
			fpath = path + "." + key
		}
		line := n.klines[i]
		if seen[key] {
			return cfgErr(fpath, line, state.ErrDuplicate, "field set twice")
		}
		seen[key] = true
		idx := fieldIndex(t, key)
		if idx < 0 {
			if msg, ok := removedFields[key]; ok {
				return &Error{Path: fpath, Line: line, Err: &causeError{sentinel: state.ErrRemovedOption, msg: msg}}
			}
			names := fieldNames(t)
			if t == policyConfigType {
				names = append(names, "<the type's options block>")
			}
			return cfgErr(fpath, line, state.ErrUnknownField, "unknown field: want one of %s", strings.Join(slices.Sorted(slices.Values(names)), ", "))
		}
		d.lines[fpath] = line
		if err := d.decodeValue(n.vals[i], v.Field(idx), fpath); err != nil {
			return err
		}
	}
	return nil
}
