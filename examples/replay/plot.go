package main

import (
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"strconv"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"

	"github.com/enginepick/enginepick/internal/sim"
)

// Plot file names written by -plot.
const (
	plotTTFT      = "ttft_cdf.png"
	plotHitRate   = "hit_rate.png"
	plotImbalance = "imbalance.png"
)

// minPlotSeconds keeps TTFTs positive on the logarithmic axis.
const minPlotSeconds = 1e-3

// ceilingColor draws the infinite-cache ceiling, apart from the bars' plotutil colour.
var ceilingColor = color.RGBA{R: 200, G: 30, B: 30, A: 255}

// writePlots writes the three charts of rep into dir, creating it if needed.
func writePlots(dir string, rep *sim.Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("-plot: %w", err)
	}
	charts := []struct {
		name  string
		build func(*sim.Report) (*plot.Plot, error)
	}{
		{plotTTFT, ttftCDF},
		{plotHitRate, hitRate},
		{plotImbalance, imbalanceBars},
	}
	for _, c := range charts {
		p, err := c.build(rep)
		if err != nil {
			return err
		}
		if err := save(p, filepath.Join(dir, c.name)); err != nil {
			return err
		}
	}
	return nil
}

// subtitle names the replay every chart shows: trace, request count, fleet and speed.
func subtitle(rep *sim.Report) string {
	return fmt.Sprintf("%s, %d requests on %s (speed %g)", rep.Trace, rep.Requests, rep.Fleet, rep.Speed)
}

// ttftCDF plots the empirical distribution of time to first token, one line per policy, on a
// logarithmic time axis.
func ttftCDF(rep *sim.Report) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = "TTFT: " + subtitle(rep)
	p.X.Label.Text = "time to first token (s)"
	p.Y.Label.Text = "fraction of requests"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min, p.Y.Max = 0, 1
	p.Legend.Top = false
	p.Legend.Left = false
	p.Add(plotter.NewGrid())
	plotted := false
	for i, r := range rep.Results {
		n := len(r.TTFTSamples)
		if n == 0 {
			continue
		}
		xys := make(plotter.XYs, n)
		for k, s := range r.TTFTSamples {
			xys[k] = plotter.XY{X: math.Max(s, minPlotSeconds), Y: float64(k+1) / float64(n)}
		}
		line, err := plotter.NewLine(xys)
		if err != nil {
			return nil, fmt.Errorf("TTFT plot of %s: %w", r.Policy, err)
		}
		line.Color = plotutil.Color(i)
		line.Width = vg.Points(1.5)
		p.Add(line)
		p.Legend.Add(r.Policy, line)
		plotted = true
	}
	if !plotted {
		// No request completed (admission rejected them all, say): the log axis still needs a
		// positive range, or gonum panics while drawing.
		p.X.Min, p.X.Max = minPlotSeconds, 1
	}
	return p, nil
}

// hitRate plots each policy's prefix cache hit rate, in percent, with the trace's infinite-cache
// ceiling (Report.InfiniteCacheHitRate) as a dashed line when the trace has hash IDs.
func hitRate(rep *sim.Report) (*plot.Plot, error) {
	names, hits := perPolicy(rep, func(r *sim.PolicyResult) float64 { return 100 * r.HitRate })
	p, err := bars("Prefix cache hit rate: "+subtitle(rep), "prompt tokens served from cache", names, hits,
		func(v float64) string { return fmt.Sprintf("%.1f %%", v) })
	if err != nil {
		return nil, err
	}
	p.Y.Tick.Marker = percentTicks{}
	p.Y.Min = 0
	top := math.Max(1, floatsMax(hits))
	if ceiling := 100 * rep.InfiniteCacheHitRate; ceiling > 0 {
		line, err := plotter.NewLine(plotter.XYs{{X: -0.5, Y: ceiling}, {X: float64(len(names)) - 0.5, Y: ceiling}})
		if err != nil {
			return nil, fmt.Errorf("hit rate plot: %w", err)
		}
		line.Color = ceilingColor
		line.Width = vg.Points(1.5)
		line.Dashes = []vg.Length{vg.Points(6), vg.Points(3)}
		p.Add(line)
		p.Legend.Add(fmt.Sprintf("infinite-cache ceiling of the trace: %.1f %%", ceiling), line)
		p.Legend.Top = true
		top = math.Max(top, ceiling)
	}
	p.Y.Max = math.Min(100, 1.25*top) // headroom for the bar labels and the legend
	return p, nil
}

// imbalanceBars plots each policy's load imbalance on a value axis that starts at 0, so that bar
// heights compare as the values do (imbalance is max ÷ mean, 1 once the load is even), with
// linearTicks labels.
func imbalanceBars(rep *sim.Report) (*plot.Plot, error) {
	names, imbalance := perPolicy(rep, func(r *sim.PolicyResult) float64 { return r.Imbalance })
	p, err := bars("Load imbalance: "+subtitle(rep), "max ÷ mean requests per engine (1 = even)", names, imbalance,
		func(v float64) string { return fmt.Sprintf("%.2f", v) })
	if err != nil {
		return nil, err
	}
	p.Y.Min = 0
	p.Y.Max = 1.15 * math.Max(1, floatsMax(imbalance)) // headroom for the bar labels
	p.Y.Tick.Marker = linearTicks{}
	return p, nil
}

// linearTicks marks a linear axis with 4 to 10 major ticks at multiples of 1, 2 or 5 × 10^k, each
// labelled with as many decimals as the step needs and no more, so that labels are distinct and
// each reads as its exact value. plot.DefaultTicks is not used because on a narrow range such as
// [1, 1.1] it labels 1.05 and 1.1 both "1.1".
type linearTicks struct{}

// Ticks implements plot.Ticker. An empty or inverted range gets one tick at lo.
func (linearTicks) Ticks(lo, hi float64) []plot.Tick {
	if !(hi > lo) {
		return []plot.Tick{{Value: lo, Label: strconv.FormatFloat(lo, 'g', -1, 64)}}
	}
	// (hi-lo)/unit is in [4, 40): a step of 1, 2 or 5 units gives 4 to 10 intervals.
	exp := math.Floor(math.Log10((hi - lo) / 4))
	unit := math.Pow(10, exp)
	step := unit
	for _, m := range []float64{1, 2, 5} {
		if step = m * unit; (hi-lo)/step <= 10 {
			break
		}
	}
	decimals := max(0, int(-exp))
	var ticks []plot.Tick
	for k := math.Ceil(lo/step - 1e-9); k*step <= hi+1e-9*step; k++ {
		v := k * step
		label := strconv.FormatFloat(v, 'f', decimals, 64)
		if v == 0 {
			label = "0"
		}
		ticks = append(ticks, plot.Tick{Value: v, Label: label})
	}
	return ticks
}

// perPolicy returns the policy names of rep and value of each result.
func perPolicy(rep *sim.Report, value func(*sim.PolicyResult) float64) ([]string, plotter.Values) {
	names := make([]string, len(rep.Results))
	values := make(plotter.Values, len(rep.Results))
	for i := range rep.Results {
		names[i], values[i] = rep.Results[i].Policy, value(&rep.Results[i])
	}
	return names, values
}

// bars returns a chart with one bar per policy, each labelled with its value formatted by label.
// The caller sets the y range.
func bars(title, unit string, names []string, values plotter.Values, label func(float64) string) (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = unit
	chart, err := plotter.NewBarChart(values, vg.Points(30))
	if err != nil {
		return nil, fmt.Errorf("%s plot: %w", title, err)
	}
	chart.Color = plotutil.Color(0)
	chart.LineStyle.Width = 0
	xys := make(plotter.XYs, len(values))
	texts := make([]string, len(values))
	for i, v := range values {
		xys[i] = plotter.XY{X: float64(i), Y: v}
		texts[i] = label(v)
	}
	labels, err := plotter.NewLabels(plotter.XYLabels{XYs: xys, Labels: texts})
	if err != nil {
		return nil, fmt.Errorf("%s plot: %w", title, err)
	}
	for i := range labels.TextStyle {
		labels.TextStyle[i].XAlign = text.XCenter
		labels.TextStyle[i].YAlign = draw.YBottom
	}
	labels.Offset = vg.Point{Y: vg.Points(3)}
	p.Add(plotter.NewGrid(), chart, labels)
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
	return p, nil
}

// percentTicks labels a percentage axis: the default ticks, each major label followed by " %".
type percentTicks struct{}

// Ticks implements plot.Ticker.
func (percentTicks) Ticks(lo, hi float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ticks {
		if ticks[i].Label != "" {
			ticks[i].Label += " %"
		}
	}
	return ticks
}

func floatsMax(vs plotter.Values) float64 {
	top := math.Inf(-1)
	for _, v := range vs {
		top = math.Max(top, v)
	}
	return top
}

func save(p *plot.Plot, path string) error {
	if err := p.Save(8*vg.Inch, 4.5*vg.Inch, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
