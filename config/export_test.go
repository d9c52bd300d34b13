package config

// Format is a document syntax for ParseAs: FormatAuto is what Parse detects; FormatYAML and
// FormatJSON force one syntax, as Load does by the file's extension.
type Format = format

const (
	FormatAuto = formatAuto
	FormatYAML = formatYAML
	FormatJSON = formatJSON
)

// ParseAs is Parse in the given syntax.
func ParseAs(data []byte, f Format) (*Config, error) { return parse(data, f) }

// CheckHealth runs the degraded-state checks now (New runs them every WithHealthInterval).
func (r *Router) CheckHealth() { r.checkHealth() }
