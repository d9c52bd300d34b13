package main

import (
	"fmt"
	"math"
	"os"
	"path/filepath"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/enginepick/enginepick/sim"
)

// Plot file names written by -plot.
const (
	plotTTFT      = "ttft_cdf.png"
	plotHitRate   = "hit_rate.png"
	plotImbalance = "imbalance.png"
)

// minPlotSeconds keeps TTFTs positive on the logarithmic axis.
const minPlotSeconds = 1e-3

// writePlots writes the three charts of rep into dir, creating it if needed.
func writePlots(dir string, rep *sim.Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("replay: -plot: %w", err)
	}
	if err := ttftCDF(filepath.Join(dir, plotTTFT), rep); err != nil {
		return err
	}
	names := make([]string, len(rep.Results))
	hits := make(plotter.Values, len(rep.Results))
	imbalance := make(plotter.Values, len(rep.Results))
	for i, r := range rep.Results {
		names[i], hits[i], imbalance[i] = r.Policy, 100*r.HitRate, r.Imbalance
	}
	if err := bars(filepath.Join(dir, plotHitRate), "Prefix cache hit rate", "% of prompt tokens", names, hits); err != nil {
		return err
	}
	return bars(filepath.Join(dir, plotImbalance), "Load imbalance", "max ÷ mean requests per engine", names, imbalance)
}

// ttftCDF plots the empirical distribution of time to first token, one line per policy, on a
// logarithmic time axis.
func ttftCDF(path string, rep *sim.Report) error {
	p := plot.New()
	p.Title.Text = fmt.Sprintf("TTFT, %s on %s (speed %g)", rep.Trace, rep.Fleet, rep.Speed)
	p.X.Label.Text = "time to first token (s)"
	p.Y.Label.Text = "fraction of requests"
	p.X.Scale = plot.LogScale{}
	p.X.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Y.Min, p.Y.Max = 0, 1
	p.Legend.Top = false
	p.Legend.Left = false
	p.Add(plotter.NewGrid())
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
			return fmt.Errorf("replay: TTFT plot of %s: %w", r.Policy, err)
		}
		line.Color = plotutil.Color(i)
		line.Width = vg.Points(1.5)
		p.Add(line)
		p.Legend.Add(r.Policy, line)
	}
	return save(p, path)
}

// bars plots one value per policy.
func bars(path, title, unit string, names []string, values plotter.Values) error {
	p := plot.New()
	p.Title.Text = title
	p.Y.Label.Text = unit
	p.Y.Min = 0
	chart, err := plotter.NewBarChart(values, vg.Points(30))
	if err != nil {
		return fmt.Errorf("replay: %s plot: %w", title, err)
	}
	chart.Color = plotutil.Color(0)
	chart.LineStyle.Width = 0
	p.Add(plotter.NewGrid(), chart)
	p.NominalX(names...)
	p.X.Min, p.X.Max = -0.5, float64(len(names))-0.5
	top := 0.0
	for _, v := range values {
		top = math.Max(top, v)
	}
	p.Y.Max = 1.1 * top
	return save(p, path)
}

func save(p *plot.Plot, path string) error {
	if err := p.Save(7*vg.Inch, 4.5*vg.Inch, path); err != nil {
		return fmt.Errorf("replay: write %s: %w", path, err)
	}
	return nil
}
