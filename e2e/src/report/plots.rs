//! PNG plots of a replay with `plotters` (bitmap backend): latency, prefix hit ratio and
//! throughput over time, with the scale/restart events as vertical markers.
//!
//! Text needs a TrueType font (plotters' `ab_glyph` backend, no system font library): the first
//! of `$TANDEM_PLOT_FONT` and the usual DejaVu/Liberation paths that loads is registered; with none
//! (or `TANDEM_PLOT_FONT=none`) the plots are drawn without captions or tick labels, and the file
//! names and `results.json` say what each shows.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

use super::events::{Event, RESTART, SCALE};
use super::summary::Summary;
use crate::replay::{Outcome, RequestResult};

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
#[error("plot {path}: {message}")]
pub struct PlotError {
    /// The PNG being written.
    pub path: PathBuf,
    /// What failed in plotters.
    pub message: String,
}

const FONT_FAMILY: &str = "sans-serif";
const FONT_CANDIDATES: [&str; 4] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
];

/// Registers a font once per process; true when text can be drawn.
pub fn font_available() -> bool {
    static FONT: OnceLock<bool> = OnceLock::new();
    *FONT.get_or_init(|| {
        let env = std::env::var("TANDEM_PLOT_FONT").ok();
        if env.as_deref() == Some("none") {
            return false;
        }
        let candidates = env
            .into_iter()
            .chain(FONT_CANDIDATES.iter().map(|s| s.to_string()));
        for path in candidates {
            let Ok(bytes) = std::fs::read(&path) else {
                continue;
            };
            // plotters keeps registered fonts for the life of the process: leak once.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
        tracing::info!("no TrueType font found; plots are drawn without text");
        false
    })
}

/// One line or point series of a panel.
struct Series {
    label: &'static str,
    color: RGBColor,
    points: Vec<(f64, f64)>,
    dots: bool,
}

fn err(path: &Path) -> impl Fn(String) -> PlotError + '_ {
    move |message| PlotError {
        path: path.to_owned(),
        message,
    }
}

/// What every panel of one figure shares.
struct Frame<'a> {
    /// Right end of the time axis (s).
    x_max: f64,
    /// Events to mark.
    events: &'a [Event],
    /// Draw text.
    text: bool,
}

/// Draws one panel: series over seconds, event markers, an optional horizontal reference line.
fn panel(
    area: &DrawingArea<BitMapBackend<'_>, Shift>,
    frame: &Frame<'_>,
    (title, y_desc): (&str, &str),
    series: &[Series],
    reference: Option<f64>,
) -> Result<(), String> {
    let (x_max, events, text) = (frame.x_max, frame.events, frame.text);
    let y_max = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .chain(reference)
        .filter(|v| v.is_finite())
        .fold(0.0, f64::max)
        .max(1e-9)
        * 1.1;
    let x_max = x_max.max(1e-3);
    let mut b = ChartBuilder::on(area);
    b.margin(12)
        .x_label_area_size(if text { 36 } else { 4 })
        .y_label_area_size(if text { 64 } else { 4 });
    if text {
        b.caption(title, (FONT_FAMILY, 20));
    }
    let mut chart = b
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| e.to_string())?;
    let mut mesh = chart.configure_mesh();
    if text {
        mesh.x_desc("time (s)")
            .y_desc(y_desc)
            .label_style((FONT_FAMILY, 14));
    } else {
        mesh.x_labels(0).y_labels(0);
    }
    mesh.draw().map_err(|e| e.to_string())?;
    for e in events {
        let color = match e.kind.as_str() {
            RESTART => RED,
            SCALE => BLUE,
            _ => continue,
        };
        let x = e.t_ms / 1000.0;
        chart
            .draw_series(LineSeries::new(
                [(x, 0.0), (x, y_max)],
                color.stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
    }
    if let Some(r) = reference {
        chart
            .draw_series(LineSeries::new(
                [(0.0, r), (x_max, r)],
                RGBColor(255, 165, 0).stroke_width(3),
            ))
            .map_err(|e| e.to_string())?
            .label("unbounded-cache ceiling")
            .legend(|(x, y)| {
                PathElement::new([(x, y), (x + 16, y)], RGBColor(255, 165, 0).stroke_width(3))
            });
    }
    for s in series {
        let color = s.color;
        let drawn = if s.dots {
            chart
                .draw_series(
                    s.points
                        .iter()
                        .map(|&p| Circle::new(p, 2, color.mix(0.6).filled())),
                )
                .map_err(|e| e.to_string())?
        } else {
            chart
                .draw_series(LineSeries::new(
                    s.points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(|e| e.to_string())?
        };
        drawn
            .label(s.label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 16, y)], color.stroke_width(2)));
    }
    if text {
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font((FONT_FAMILY, 13))
            .position(SeriesLabelPosition::UpperRight)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Writes `latency.png`, `hit_ratio.png` and `throughput.png` into `dir`; returns their names.
/// `text`: draw captions and labels (pass [`font_available`]).
pub fn write_plots(
    dir: &Path,
    results: &[RequestResult],
    summary: &Summary,
    text: bool,
) -> Result<Vec<String>, PlotError> {
    let origin = results
        .iter()
        .map(|r| r.sent_ms)
        .fold(f64::INFINITY, f64::min);
    let origin = if origin.is_finite() {
        origin.min(0.0)
    } else {
        0.0
    };
    let secs = |ms: f64| (ms - origin) / 1000.0;
    let x_max = results
        .iter()
        .map(|r| secs(r.finished_ms))
        .fold(1.0, f64::max);
    let frame = Frame {
        x_max,
        events: &summary.events,
        text,
    };
    let done = || results.iter().filter(|r| r.outcome != Outcome::Failed);
    let mut written = Vec::new();

    let path = dir.join("latency.png");
    {
        let root = BitMapBackend::new(&path, (1200, 800)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&path)(e.to_string()))?;
        let (top, bottom) = root.split_vertically(400);
        let ttft = Series {
            label: "TTFT",
            color: RGBColor(31, 119, 180),
            points: done()
                .filter_map(|r| Some((secs(r.sent_ms), r.ttft_ms?)))
                .collect(),
            dots: true,
        };
        let tpot = Series {
            label: "TPOT",
            color: RGBColor(255, 127, 14),
            points: done()
                .filter_map(|r| Some((secs(r.sent_ms), r.tpot_ms?)))
                .collect(),
            dots: true,
        };
        panel(
            &top,
            &frame,
            ("Time to first token", "TTFT (ms)"),
            &[ttft],
            None,
        )
        .map_err(err(&path))?;
        panel(
            &bottom,
            &frame,
            ("Time per output token", "TPOT (ms)"),
            &[tpot],
            None,
        )
        .map_err(err(&path))?;
        root.present().map_err(|e| err(&path)(e.to_string()))?;
    }
    written.push("latency.png".to_owned());

    let path = dir.join("hit_ratio.png");
    {
        let root = BitMapBackend::new(&path, (1200, 500)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&path)(e.to_string()))?;
        let w = &summary.over_time;
        let line = |label, color, f: fn(&super::summary::HitRatio) -> f64| Series {
            label,
            color,
            points: w
                .iter()
                .filter(|w| w.requests > 0)
                .map(|w| (secs(w.t_ms), f(&w.hit)))
                .collect(),
            dots: false,
        };
        let series = [
            line("total", RGBColor(0, 0, 0), |h| h.total),
            line("L1", RGBColor(44, 160, 44), |h| h.l1),
            line("L2", RGBColor(31, 119, 180), |h| h.l2),
            line("L3", RGBColor(148, 103, 189), |h| h.l3),
        ];
        panel(
            &root,
            &frame,
            (
                "Prefix hit ratio (red: restart, blue: scale)",
                "hit tokens / prompt tokens",
            ),
            &series,
            Some(summary.unbounded_hit_ratio),
        )
        .map_err(err(&path))?;
        root.present().map_err(|e| err(&path)(e.to_string()))?;
    }
    written.push("hit_ratio.png".to_owned());

    let path = dir.join("throughput.png");
    {
        let root = BitMapBackend::new(&path, (1200, 900)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&path)(e.to_string()))?;
        let areas = root.split_evenly((3, 1));
        let w = &summary.over_time;
        let reqs = Series {
            label: "completions/s",
            color: RGBColor(31, 119, 180),
            points: w.iter().map(|w| (secs(w.t_ms), w.requests_per_s)).collect(),
            dots: false,
        };
        let toks = Series {
            label: "output tokens/s",
            color: RGBColor(255, 127, 14),
            points: w
                .iter()
                .map(|w| (secs(w.t_ms), w.output_tokens_per_s))
                .collect(),
            dots: false,
        };
        let kv = Series {
            label: "KV MiB/s received",
            color: RGBColor(148, 103, 189),
            points: summary
                .kv
                .over_time
                .iter()
                .map(|&(t, b)| (secs(t), b / 1048576.0))
                .collect(),
            dots: false,
        };
        panel(&areas[0], &frame, ("Completions", "req/s"), &[reqs], None).map_err(err(&path))?;
        panel(
            &areas[1],
            &frame,
            ("Output tokens", "tokens/s"),
            &[toks],
            None,
        )
        .map_err(err(&path))?;
        panel(&areas[2], &frame, ("KV transfer", "MiB/s"), &[kv], None).map_err(err(&path))?;
        root.present().map_err(|e| err(&path)(e.to_string()))?;
    }
    written.push("throughput.png".to_owned());
    Ok(written)
}
