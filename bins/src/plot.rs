//! The line chart of `bench remote --sweep --plot FILE.png`, drawn with plotters.
//!
//! plotters draws into an RGB buffer (its bitmap backend, no image-format crates) and the
//! `png` crate writes the file. Text is set in DejaVu Sans, embedded in the binary by the
//! `dejavu` crate and handed to plotters' `ab_glyph` renderer, so a chart comes out the same
//! on a machine without fonts or fontconfig.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Context};
use plotters::prelude::*;

/// One line on the chart: a name for the legend and its (x, y) points, drawn
/// in the order given (sort by x first if you want a left-to-right line).
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const WIDTH: u32 = 960;
const HEIGHT: u32 = 600;

const GRID: RGBColor = RGBColor(225, 225, 225);
const LEGEND_BORDER: RGBColor = RGBColor(150, 150, 150);
/// Series colours (the first five of matplotlib's "tab10"), reused cyclically.
const PALETTE: [RGBColor; 5] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

/// Renders `series` as a 960×600 line chart and writes it to `path` as a PNG.
///
/// The y axis is linear and starts at 0 unless some y is negative. The x axis
/// is log2-scaled (ticks at powers of two) when all x are positive and
/// max/min ≥ 8, linear otherwise. Non-finite points are skipped.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    let rgb = render(title, x_label, y_label, series)?;
    write_png(path, &rgb).with_context(|| format!("writing plot {}", path.display()))
}

/// Registers the embedded font under the family plotters asks for, once per process.
fn font() -> anyhow::Result<()> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular())
            .is_ok()
    });
    ok.then_some(())
        .ok_or_else(|| anyhow!("the embedded DejaVu Sans font did not parse"))
}

/// How points map onto the x axis: plotted as log2(x) with power-of-two labels, or as is.
#[derive(Clone, Copy, Debug, PartialEq)]
struct XScale {
    log2: bool,
}

impl XScale {
    fn for_range(xmin: f64, xmax: f64) -> Self {
        XScale {
            log2: xmin > 0.0 && xmax / xmin >= 8.0,
        }
    }

    fn to_axis(self, x: f64) -> f64 {
        if self.log2 {
            x.log2()
        } else {
            x
        }
    }

    /// The label of axis position `v`: on a log axis, the x it stands for.
    fn label(self, v: f64) -> String {
        number(if self.log2 { v.exp2() } else { v })
    }
}

/// `v` with no more digits than it needs (tick values are short decimals).
fn number(v: f64) -> String {
    let s = format!("{:.6}", v);
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.into()
    }
}

/// The smallest and largest of `vals`, widened where they coincide so the axis has a span.
fn span(vals: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
    }
    if hi - lo < f64::EPSILON * hi.abs().max(1.0) {
        (lo, hi) = (lo - 0.5, hi + 0.5);
    }
    (lo, hi)
}

/// Draws the chart; returns its pixels, RGB, row-major.
fn render(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> anyhow::Result<Vec<u8>> {
    font()?;
    let finite = |s: &Series| -> Vec<(f64, f64)> {
        s.points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect()
    };
    let all: Vec<(f64, f64)> = series.iter().flat_map(finite).collect();
    let (xmin, xmax) = span(all.iter().map(|p| p.0), false);
    let scale = XScale::for_range(xmin, xmax);
    let (x0, x1) = span(all.iter().map(|p| scale.to_axis(p.0)), false);
    let (y0, y1) = span(all.iter().map(|p| p.1), true);
    // Headroom above the highest point so markers and the legend do not touch the frame.
    let y1 = y1 + (y1 - y0) * 0.08;
    // On a log axis one tick per power of two, up to a dozen (plotters then takes every
    // second or fourth); plotters picks 1-2-5 steps, so integer steps stay integers.
    let x_ticks = if scale.log2 {
        ((x1 - x0).floor() as usize + 1).clamp(2, 12)
    } else {
        10
    };

    let mut rgb = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 24))
            .margin(20)
            .x_label_area_size(60)
            .y_label_area_size(80)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        chart
            .configure_mesh()
            .x_labels(x_ticks)
            .y_labels(8)
            .x_label_formatter(&|v| scale.label(*v))
            .y_label_formatter(&|v| number(*v))
            .x_desc(x_label)
            .y_desc(y_label)
            .axis_desc_style(("sans-serif", 18))
            .label_style(("sans-serif", 15))
            .bold_line_style(GRID)
            .light_line_style(TRANSPARENT)
            .axis_style(BLACK)
            .draw()?;
        for (i, s) in series.iter().enumerate() {
            let color = PALETTE[i % PALETTE.len()];
            let pts: Vec<(f64, f64)> = finite(s)
                .into_iter()
                .map(|(x, y)| (scale.to_axis(x), y))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
                .label(s.name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
                });
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
        }
        if !series.is_empty() {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE)
                .border_style(LEGEND_BORDER)
                .label_font(("sans-serif", 15))
                .draw()?;
        }
        root.present()?;
    }
    Ok(rgb)
}

fn write_png(path: &Path, rgb: &[u8]) -> anyhow::Result<()> {
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut png = png::Encoder::new(file, WIDTH, HEIGHT);
    png.set_color(png::ColorType::Rgb);
    png.set_depth(png::BitDepth::Eight);
    let mut w = png.write_header()?;
    w.write_image_data(rgb)?;
    w.finish()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Width, height and RGB pixels of a PNG this module wrote.
    fn decode(png: &[u8]) -> (u32, u32, Vec<u8>) {
        let mut r = png::Decoder::new(std::io::Cursor::new(png))
            .read_info()
            .unwrap();
        let mut px = vec![0u8; r.output_buffer_size().unwrap()];
        let info = r.next_frame(&mut px).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        px.truncate(info.buffer_size());
        (info.width, info.height, px)
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("kvferry-plot-{}-{name}.png", std::process::id()))
    }

    fn sweep() -> Vec<Series> {
        let sizes = [
            1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0,
        ];
        let direct = [0.8, 1.6, 3.1, 6.0, 10.5, 16.0, 19.5, 21.0, 21.8, 22.1, 22.3];
        let staged = [0.5, 1.0, 2.1, 4.2, 7.9, 12.4, 16.8, 19.2, 20.1, 20.6, 20.8];
        vec![
            Series {
                name: "direct".into(),
                points: sizes.iter().copied().zip(direct).collect(),
            },
            Series {
                name: "staged".into(),
                points: sizes.iter().copied().zip(staged).collect(),
            },
        ]
    }

    #[test]
    fn plot_two_series_png() {
        let path = tmp("two");
        line_chart(
            &path,
            "bench remote --sweep: direct vs staged",
            "hit-set size (MiB)",
            "GB/s",
            &sweep(),
        )
        .unwrap();
        let png = std::fs::read(&path).unwrap();
        if std::env::var_os("KVFERRY_KEEP_PLOT").is_none() {
            std::fs::remove_file(&path).unwrap();
        } else {
            eprintln!("kept {}", path.display());
        }
        // Compressed: the uncompressed pixels alone are 1.7 MB.
        assert!(png.len() < 200_000, "{} bytes", png.len());
        let (w, h, px) = decode(&png);
        assert_eq!((w, h), (WIDTH, HEIGHT));
        let at = |x: u32, y: u32| -> RGBColor {
            let i = ((y * w + x) * 3) as usize;
            RGBColor(px[i], px[i + 1], px[i + 2])
        };
        let count = |pred: &dyn Fn(RGBColor) -> bool, rows: std::ops::Range<u32>| {
            rows.flat_map(|y| (0..w).map(move |x| (x, y)))
                .filter(|&(x, y)| pred(at(x, y)))
                .count()
        };
        // Each line crosses the plot at 2 px with 11 markers of radius 4.
        for (k, c) in PALETTE.iter().take(2).enumerate() {
            let n = count(&|p| p == *c, 0..h);
            assert!(n > 1000, "series {k}: {n} pixels");
        }
        let white = count(&|p| p == WHITE, 0..h);
        assert!(white > (w * h) as usize * 3 / 4, "background: {white}");
        assert_eq!(at(0, 0), WHITE);
        assert_eq!(at(w - 1, h - 1), WHITE);
        // Text is drawn without any system font: dark glyph pixels in the title band (top
        // 50 rows) and along the x axis labels (bottom 60).
        let dark = |p: RGBColor| p.0 < 90 && p.1 < 90 && p.2 < 90;
        assert!(count(&dark, 0..50) > 200, "title");
        assert!(count(&dark, h - 60..h) > 200, "x labels");
    }

    #[test]
    fn plot_axes() {
        let s = XScale::for_range(1.0, 1024.0);
        assert!(s.log2);
        assert_eq!(s.to_axis(256.0), 8.0);
        let labels: Vec<String> = (0..=10).step_by(2).map(|v| s.label(f64::from(v))).collect();
        assert_eq!(labels, ["1", "4", "16", "64", "256", "1024"]);
        let s = XScale::for_range(0.25, 16.0);
        let labels: Vec<String> = (-2..=4).map(|v| s.label(f64::from(v))).collect();
        assert_eq!(labels, ["0.25", "0.5", "1", "2", "4", "8", "16"]);
        // Less than a factor of 8, or anything at or below zero: linear.
        assert!(!XScale::for_range(2.0, 15.0).log2);
        assert!(!XScale::for_range(0.0, 1024.0).log2);
        assert_eq!(XScale::for_range(0.0, 1.0).label(0.2), "0.2");
        assert_eq!(number(-0.0), "0");
        assert_eq!(span([3.0].into_iter(), true), (0.0, 3.0));
        assert_eq!(span([3.0].into_iter(), false), (2.5, 3.5));
        assert_eq!(span(std::iter::empty(), true), (0.0, 1.0));
    }

    #[test]
    fn plot_degenerate_inputs() {
        // Empty, a single point, non-finite and non-positive values: no panic.
        let cases = [
            vec![],
            vec![Series {
                name: "one".into(),
                points: vec![(4.0, 3.0)],
            }],
            vec![Series {
                name: "odd".into(),
                points: vec![
                    (0.0, 1.0),
                    (f64::NAN, 2.0),
                    (8.0, f64::INFINITY),
                    (16.0, -1.0),
                ],
            }],
        ];
        for (i, s) in cases.iter().enumerate() {
            let path = tmp(&format!("degenerate-{i}"));
            line_chart(&path, "t", "x", "y", s).unwrap();
            let (w, h, _) = decode(&std::fs::read(&path).unwrap());
            std::fs::remove_file(&path).unwrap();
            assert_eq!((w, h), (WIDTH, HEIGHT));
        }
    }
}
