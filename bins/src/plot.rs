//! A small line-chart renderer for `bench remote --sweep --plot FILE.png`.
//!
//! Pure Rust and dependency-free: pixels go into an RGB buffer, text is drawn
//! with an embedded 5×7 bitmap font (ASCII 32–126, scaled up), and the PNG is
//! written with zlib *stored* (uncompressed) deflate blocks, so the encoder is a
//! CRC-32, an Adler-32 and some framing. Files are ~1.7 MB for 960×600, which
//! is fine for a benchmark artefact.

use std::path::Path;

use anyhow::Context;

/// One line on the chart: a name for the legend and its (x, y) points, drawn
/// in the order given (sort by x first if you want a left-to-right line).
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

const WIDTH: usize = 960;
const HEIGHT: usize = 600;

type Rgb = [u8; 3];

const WHITE: Rgb = [255, 255, 255];
const BLACK: Rgb = [0, 0, 0];
const GRID: Rgb = [225, 225, 225];
const LEGEND_BORDER: Rgb = [150, 150, 150];
/// Series colours (the first five of matplotlib's "tab10"), reused cyclically.
const PALETTE: [Rgb; 5] = [
    [31, 119, 180],
    [255, 127, 14],
    [44, 160, 44],
    [214, 39, 40],
    [148, 103, 189],
];

// Plot-area margins, in pixels.
const LEFT: usize = 110;
const RIGHT: usize = 40;
const TOP: usize = 60;
const BOTTOM: usize = 80;

/// Renders `series` as a 960×600 line chart and writes it to `path` as a PNG.
///
/// The y axis is linear and starts at 0 unless some y is negative. The x axis
/// is log2-scaled (ticks at powers of two) when all x are positive and
/// max/min ≥ 8, linear otherwise. Non-finite points (and, on a log axis,
/// non-positive x) are skipped.
pub fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[Series],
) -> anyhow::Result<()> {
    let png = render(title, x_label, y_label, series).encode_png();
    std::fs::write(path, png).with_context(|| format!("writing plot {}", path.display()))
}

fn render(title: &str, x_label: &str, y_label: &str, series: &[Series]) -> Canvas {
    let mut c = Canvas::new(WIDTH, HEIGHT);
    let (px0, px1) = (LEFT as f64, (WIDTH - RIGHT) as f64);
    let (py0, py1) = (TOP as f64, (HEIGHT - BOTTOM) as f64); // py1 is the bottom

    let finite: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let (xmin, xmax) = min_max(finite.iter().map(|p| p.0));
    let log_x = xmin > 0.0 && xmax / xmin >= 8.0;
    let xs = if log_x {
        Axis::log2(xmin, xmax)
    } else {
        Axis::linear(xmin, xmax, false)
    };
    let (ymin, ymax) = min_max(finite.iter().map(|p| p.1));
    let ys = Axis::linear(ymin, ymax, true);

    let to_px = |x: f64, y: f64| -> Option<(i64, i64)> {
        let fx = xs.frac(x)?;
        let fy = ys.frac(y)?;
        Some((
            (px0 + fx * (px1 - px0)).round() as i64,
            (py1 - fy * (py1 - py0)).round() as i64,
        ))
    };

    // Grid, ticks and tick labels.
    for &(v, ref label) in &xs.ticks {
        let x = (px0 + xs.frac(v).unwrap_or(0.0) * (px1 - px0)).round() as i64;
        c.rect(x, py0 as i64, 1, (py1 - py0) as i64, GRID);
        c.rect(x, py1 as i64, 1, 6, BLACK);
        let w = text_width(label, 2);
        c.text(x - w / 2, py1 as i64 + 12, label, 2, BLACK);
    }
    for &(v, ref label) in &ys.ticks {
        let y = (py1 - ys.frac(v).unwrap_or(0.0) * (py1 - py0)).round() as i64;
        c.rect(px0 as i64, y, (px1 - px0) as i64, 1, GRID);
        c.rect(px0 as i64 - 6, y, 6, 1, BLACK);
        let w = text_width(label, 2);
        c.text(px0 as i64 - 12 - w, y - 7, label, 2, BLACK);
    }
    // Axis lines on top of the grid.
    c.rect(px0 as i64, py0 as i64, 2, (py1 - py0) as i64 + 2, BLACK);
    c.rect(px0 as i64, py1 as i64, (px1 - px0) as i64 + 1, 2, BLACK);

    // Title, axis labels.
    let w = text_width(title, 3);
    c.text((WIDTH as i64 - w) / 2, 18, title, 3, BLACK);
    let x_label = if log_x {
        format!("{x_label}, log2 scale")
    } else {
        x_label.to_string()
    };
    let w = text_width(&x_label, 2);
    c.text(
        (px0 + px1) as i64 / 2 - w / 2,
        HEIGHT as i64 - 34,
        &x_label,
        2,
        BLACK,
    );
    let w = text_width(y_label, 2);
    c.text_up(18, (py0 + py1) as i64 / 2 + w / 2, y_label, 2, BLACK);

    // Series: 2 px lines, then 7×7 square markers.
    let mut drawn: Vec<Vec<(i64, i64)>> = Vec::new();
    for (i, s) in series.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let pts: Vec<(i64, i64)> = s.points.iter().filter_map(|&(x, y)| to_px(x, y)).collect();
        for w in pts.windows(2) {
            c.line(w[0], w[1], colour);
        }
        for &(x, y) in &pts {
            c.rect(x - 3, y - 3, 7, 7, colour);
        }
        drawn.push(pts);
    }

    // Legend: in whichever top/bottom corner of the plot area covers the
    // fewest line pixels.
    if !series.is_empty() {
        let row_h = 24i64;
        let name_w = series
            .iter()
            .map(|s| text_width(&s.name, 2))
            .max()
            .unwrap_or(0);
        let (bw, bh) = (name_w + 56, row_h * series.len() as i64 + 12);
        let (l, r) = (px0 as i64 + 16, px1 as i64 - 16 - bw);
        let (t, b) = (py0 as i64 + 12, py1 as i64 - 12 - bh);
        let candidates = [(l, t), (r, t), (r, b), (l, b)];
        let cover = |&(x, y): &(i64, i64)| {
            drawn
                .iter()
                .flat_map(|pts| sample_polyline(pts))
                .filter(|&(px, py)| {
                    px >= x - 4 && px < x + bw + 4 && py >= y - 4 && py < y + bh + 4
                })
                .count()
        };
        let &(lx, ly) = candidates
            .iter()
            .min_by_key(|p| cover(p))
            .unwrap_or(&(l, t));
        c.rect(lx - 1, ly - 1, bw + 2, bh + 2, LEGEND_BORDER);
        c.rect(lx, ly, bw, bh, WHITE);
        for (i, s) in series.iter().enumerate() {
            let colour = PALETTE[i % PALETTE.len()];
            let y = ly + 6 + row_h * i as i64 + row_h / 2;
            c.rect(lx + 10, y - 1, 28, 3, colour);
            c.rect(lx + 21, y - 3, 7, 7, colour);
            c.text(lx + 46, y - 7, &s.name, 2, BLACK);
        }
    }
    c
}

/// Points every few pixels along a polyline (for legend placement).
fn sample_polyline(pts: &[(i64, i64)]) -> Vec<(i64, i64)> {
    let mut out: Vec<(i64, i64)> = pts.to_vec();
    for w in pts.windows(2) {
        let (dx, dy) = (w[1].0 - w[0].0, w[1].1 - w[0].1);
        let n = (dx.abs().max(dy.abs()) / 4).max(1);
        out.extend((1..n).map(|k| (w[0].0 + dx * k / n, w[0].1 + dy * k / n)));
    }
    out
}

fn min_max(vals: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo > hi {
        (0.0, 1.0) // no points
    } else {
        (lo, hi)
    }
}

/// An axis: its value range, how to map a value into [0, 1], and labelled ticks.
struct Axis {
    lo: f64,
    hi: f64,
    log2: bool,
    ticks: Vec<(f64, String)>,
}

impl Axis {
    /// Linear axis on "nice" (1/2/5 × 10^k) ticks covering [min, max];
    /// `from_zero` extends it down to 0 when all values are non-negative.
    fn linear(min: f64, max: f64, from_zero: bool) -> Axis {
        let min = if from_zero && min >= 0.0 { 0.0 } else { min };
        let (min, max) = if max - min > 0.0 {
            (min, max)
        } else if min == 0.0 {
            (0.0, 1.0)
        } else {
            // A single value: centre it (or sit it on zero) with some room.
            let pad = min.abs() * 0.5;
            (
                if from_zero && min > 0.0 {
                    0.0
                } else {
                    min - pad
                },
                max + pad,
            )
        };
        let step = nice_step((max - min) / 5.0);
        let lo = (min / step).floor() * step;
        let hi = (max / step).ceil() * step;
        let decimals = (-step.log10().floor()).max(0.0) as usize;
        let n = ((hi - lo) / step).round() as i64;
        let ticks = (0..=n)
            .map(|k| {
                let v = lo + k as f64 * step;
                let v = if v.abs() < step * 1e-9 { 0.0 } else { v };
                (v, format!("{v:.decimals$}"))
            })
            .collect();
        Axis {
            lo,
            hi,
            log2: false,
            ticks,
        }
    }

    /// Log2 axis from the power of two at or below `min` to the one at or
    /// above `max`, with ticks at powers of two (every k-th, for ≤ ~7 ticks).
    fn log2(min: f64, max: f64) -> Axis {
        let e_lo = min.log2().floor() as i32;
        let e_hi = (max.log2().ceil() as i32).max(e_lo + 1);
        let every = ((e_hi - e_lo) as usize).div_ceil(6).max(1);
        let ticks = (e_lo..=e_hi)
            .step_by(every)
            .map(|e| {
                let v = 2f64.powi(e);
                (v, format!("{v}")) // exact in f64: "16", "1024", "0.25"
            })
            .collect();
        Axis {
            lo: 2f64.powi(e_lo),
            hi: 2f64.powi(e_hi),
            log2: true,
            ticks,
        }
    }

    /// Where `v` falls on the axis, 0 at `lo` and 1 at `hi`; None if it can't
    /// be placed (non-finite, or ≤ 0 on a log axis).
    fn frac(&self, v: f64) -> Option<f64> {
        if !v.is_finite() {
            return None;
        }
        if self.log2 {
            (v > 0.0).then(|| (v.log2() - self.lo.log2()) / (self.hi.log2() - self.lo.log2()))
        } else {
            Some((v - self.lo) / (self.hi - self.lo))
        }
    }
}

/// 1, 2 or 5 × 10^k, the smallest at or above `raw`.
fn nice_step(raw: f64) -> f64 {
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * mag
}

/// An RGB8 pixel buffer, with clipping drawing primitives.
struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Canvas {
        Canvas {
            w,
            h,
            px: vec![255; w * h * 3],
        }
    }

    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if x >= 0 && y >= 0 && (x as usize) < self.w && (y as usize) < self.h {
            let i = (y as usize * self.w + x as usize) * 3;
            self.px[i..i + 3].copy_from_slice(&c);
        }
    }

    fn rect(&mut self, x: i64, y: i64, w: i64, h: i64, c: Rgb) {
        for yy in y..y + h {
            for xx in x..x + w {
                self.set(xx, yy, c);
            }
        }
    }

    /// A 2 px wide line (Bresenham, stamping 2×2 squares).
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: Rgb) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            self.rect(x, y, 2, 2, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Left-to-right text with its top-left corner at (x, y).
    fn text(&mut self, x: i64, y: i64, s: &str, scale: i64, c: Rgb) {
        self.glyphs(s, scale, c, |col, row| (x + col, y + row));
    }

    /// Text rotated 90° anticlockwise, reading bottom to top, starting at
    /// (x, y) — the bottom-left corner of the rotated run.
    fn text_up(&mut self, x: i64, y: i64, s: &str, scale: i64, c: Rgb) {
        self.glyphs(s, scale, c, |col, row| (x + row, y - col));
    }

    /// Draws `s` with the 5×7 font (a 6 px advance per char, before scaling);
    /// `at` maps an unrotated pixel offset (column, row) from the start of the
    /// string to canvas coordinates.
    fn glyphs(&mut self, s: &str, scale: i64, c: Rgb, at: impl Fn(i64, i64) -> (i64, i64)) {
        for (i, ch) in s.chars().enumerate() {
            let g = glyph(ch);
            for (gx, &bits) in g.iter().enumerate() {
                for gy in 0..8 {
                    if bits >> gy & 1 == 0 {
                        continue;
                    }
                    let col = (i as i64 * 6 + gx as i64) * scale;
                    for dy in 0..scale {
                        for dx in 0..scale {
                            let (x, y) = at(col + dx, gy * scale + dy);
                            self.set(x, y, c);
                        }
                    }
                }
            }
        }
    }

    /// The canvas as an RGB8 PNG, stored (uncompressed) deflate.
    fn encode_png(&self) -> Vec<u8> {
        let mut raw = Vec::with_capacity((self.w * 3 + 1) * self.h);
        for row in self.px.chunks(self.w * 3) {
            raw.push(0); // filter: none
            raw.extend_from_slice(row);
        }
        let mut z = vec![0x78, 0x01]; // zlib: deflate, 32K window, no dict
        let blocks = raw.chunks(65535);
        let n = blocks.len();
        for (i, b) in blocks.enumerate() {
            z.push(u8::from(i + 1 == n)); // BFINAL, BTYPE=00 (stored)
            let len = b.len() as u16;
            z.extend_from_slice(&len.to_le_bytes());
            z.extend_from_slice(&(!len).to_le_bytes());
            z.extend_from_slice(b);
        }
        z.extend_from_slice(&adler32(&raw).to_be_bytes());

        let mut ihdr = Vec::with_capacity(13);
        ihdr.extend_from_slice(&(self.w as u32).to_be_bytes());
        ihdr.extend_from_slice(&(self.h as u32).to_be_bytes());
        ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit RGB, deflate, no filter/interlace
        let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
        for (kind, data) in [(b"IHDR", &ihdr[..]), (b"IDAT", &z[..]), (b"IEND", &[][..])] {
            out.extend_from_slice(&(data.len() as u32).to_be_bytes());
            let start = out.len();
            out.extend_from_slice(kind);
            out.extend_from_slice(data);
            let crc = crc32(&out[start..]);
            out.extend_from_slice(&crc.to_be_bytes());
        }
        out
    }
}

fn text_width(s: &str, scale: i64) -> i64 {
    let n = s.chars().count() as i64;
    if n == 0 {
        0
    } else {
        (n * 6 - 1) * scale
    }
}

/// CRC-32 (IEEE, reflected, as PNG uses), bitwise — fast enough for one image.
fn crc32(data: &[u8]) -> u32 {
    let mut table = [0u32; 256];
    for (n, t) in table.iter_mut().enumerate() {
        let mut c = n as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
        *t = c;
    }
    !data.iter().fold(!0u32, |c, &b| {
        table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8)
    })
}

fn adler32(data: &[u8]) -> u32 {
    let (mut a, mut b) = (1u32, 0u32);
    for chunk in data.chunks(5552) {
        for &x in chunk {
            a += x as u32;
            b += a;
        }
        a %= 65521;
        b %= 65521;
    }
    (b << 16) | a
}

/// The 5×7 glyph for `ch`: five columns, left to right, bit 0 the top row
/// (bit 7, an eighth row, is used only by descenders).
/// Anything outside ASCII 32–126 draws as '?'.
fn glyph(ch: char) -> [u8; 5] {
    let i = ch as usize;
    if (32..=126).contains(&i) {
        FONT[i - 32]
    } else {
        FONT[b'?' as usize - 32]
    }
}

/// The classic 5×7 LCD font, ASCII 32 (' ') to 126 ('~'), with g, j, p, q
/// and y moved down into an 8th row so their descenders read as such.
#[rustfmt::skip]
const FONT: [[u8; 5]; 95] = [
    [0x00, 0x00, 0x00, 0x00, 0x00], // ' '
    [0x00, 0x00, 0x5f, 0x00, 0x00], // !
    [0x00, 0x07, 0x00, 0x07, 0x00], // "
    [0x14, 0x7f, 0x14, 0x7f, 0x14], // #
    [0x24, 0x2a, 0x7f, 0x2a, 0x12], // $
    [0x23, 0x13, 0x08, 0x64, 0x62], // %
    [0x36, 0x49, 0x55, 0x22, 0x50], // &
    [0x00, 0x05, 0x03, 0x00, 0x00], // '
    [0x00, 0x1c, 0x22, 0x41, 0x00], // (
    [0x00, 0x41, 0x22, 0x1c, 0x00], // )
    [0x08, 0x2a, 0x1c, 0x2a, 0x08], // *
    [0x08, 0x08, 0x3e, 0x08, 0x08], // +
    [0x00, 0x50, 0x30, 0x00, 0x00], // ,
    [0x08, 0x08, 0x08, 0x08, 0x08], // -
    [0x00, 0x60, 0x60, 0x00, 0x00], // .
    [0x20, 0x10, 0x08, 0x04, 0x02], // /
    [0x3e, 0x51, 0x49, 0x45, 0x3e], // 0
    [0x00, 0x42, 0x7f, 0x40, 0x00], // 1
    [0x42, 0x61, 0x51, 0x49, 0x46], // 2
    [0x21, 0x41, 0x45, 0x4b, 0x31], // 3
    [0x18, 0x14, 0x12, 0x7f, 0x10], // 4
    [0x27, 0x45, 0x45, 0x45, 0x39], // 5
    [0x3c, 0x4a, 0x49, 0x49, 0x30], // 6
    [0x01, 0x71, 0x09, 0x05, 0x03], // 7
    [0x36, 0x49, 0x49, 0x49, 0x36], // 8
    [0x06, 0x49, 0x49, 0x29, 0x1e], // 9
    [0x00, 0x36, 0x36, 0x00, 0x00], // :
    [0x00, 0x56, 0x36, 0x00, 0x00], // ;
    [0x08, 0x14, 0x22, 0x41, 0x00], // <
    [0x14, 0x14, 0x14, 0x14, 0x14], // =
    [0x00, 0x41, 0x22, 0x14, 0x08], // >
    [0x02, 0x01, 0x51, 0x09, 0x06], // ?
    [0x32, 0x49, 0x79, 0x41, 0x3e], // @
    [0x7e, 0x11, 0x11, 0x11, 0x7e], // A
    [0x7f, 0x49, 0x49, 0x49, 0x36], // B
    [0x3e, 0x41, 0x41, 0x41, 0x22], // C
    [0x7f, 0x41, 0x41, 0x22, 0x1c], // D
    [0x7f, 0x49, 0x49, 0x49, 0x41], // E
    [0x7f, 0x09, 0x09, 0x09, 0x01], // F
    [0x3e, 0x41, 0x49, 0x49, 0x7a], // G
    [0x7f, 0x08, 0x08, 0x08, 0x7f], // H
    [0x00, 0x41, 0x7f, 0x41, 0x00], // I
    [0x20, 0x40, 0x41, 0x3f, 0x01], // J
    [0x7f, 0x08, 0x14, 0x22, 0x41], // K
    [0x7f, 0x40, 0x40, 0x40, 0x40], // L
    [0x7f, 0x02, 0x0c, 0x02, 0x7f], // M
    [0x7f, 0x04, 0x08, 0x10, 0x7f], // N
    [0x3e, 0x41, 0x41, 0x41, 0x3e], // O
    [0x7f, 0x09, 0x09, 0x09, 0x06], // P
    [0x3e, 0x41, 0x51, 0x21, 0x5e], // Q
    [0x7f, 0x09, 0x19, 0x29, 0x46], // R
    [0x46, 0x49, 0x49, 0x49, 0x31], // S
    [0x01, 0x01, 0x7f, 0x01, 0x01], // T
    [0x3f, 0x40, 0x40, 0x40, 0x3f], // U
    [0x1f, 0x20, 0x40, 0x20, 0x1f], // V
    [0x3f, 0x40, 0x38, 0x40, 0x3f], // W
    [0x63, 0x14, 0x08, 0x14, 0x63], // X
    [0x07, 0x08, 0x70, 0x08, 0x07], // Y
    [0x61, 0x51, 0x49, 0x45, 0x43], // Z
    [0x00, 0x7f, 0x41, 0x41, 0x00], // [
    [0x02, 0x04, 0x08, 0x10, 0x20], // backslash
    [0x00, 0x41, 0x41, 0x7f, 0x00], // ]
    [0x04, 0x02, 0x01, 0x02, 0x04], // ^
    [0x40, 0x40, 0x40, 0x40, 0x40], // _
    [0x00, 0x01, 0x02, 0x04, 0x00], // `
    [0x20, 0x54, 0x54, 0x54, 0x78], // a
    [0x7f, 0x48, 0x44, 0x44, 0x38], // b
    [0x38, 0x44, 0x44, 0x44, 0x20], // c
    [0x38, 0x44, 0x44, 0x48, 0x7f], // d
    [0x38, 0x54, 0x54, 0x54, 0x18], // e
    [0x08, 0x7e, 0x09, 0x01, 0x02], // f
    [0x18, 0xa4, 0xa4, 0xa4, 0x7c], // g
    [0x7f, 0x08, 0x04, 0x04, 0x78], // h
    [0x00, 0x44, 0x7d, 0x40, 0x00], // i
    [0x40, 0x80, 0x80, 0x84, 0x7d], // j
    [0x7f, 0x10, 0x28, 0x44, 0x00], // k
    [0x00, 0x41, 0x7f, 0x40, 0x00], // l
    [0x7c, 0x04, 0x18, 0x04, 0x78], // m
    [0x7c, 0x08, 0x04, 0x04, 0x78], // n
    [0x38, 0x44, 0x44, 0x44, 0x38], // o
    [0xfc, 0x24, 0x24, 0x24, 0x18], // p
    [0x18, 0x24, 0x24, 0x24, 0xfc], // q
    [0x7c, 0x08, 0x04, 0x04, 0x08], // r
    [0x48, 0x54, 0x54, 0x54, 0x20], // s
    [0x04, 0x3f, 0x44, 0x40, 0x20], // t
    [0x3c, 0x40, 0x40, 0x20, 0x7c], // u
    [0x1c, 0x20, 0x40, 0x20, 0x1c], // v
    [0x3c, 0x40, 0x30, 0x40, 0x3c], // w
    [0x44, 0x28, 0x10, 0x28, 0x44], // x
    [0x1c, 0xa0, 0xa0, 0xa0, 0x7c], // y
    [0x44, 0x64, 0x54, 0x4c, 0x44], // z
    [0x00, 0x08, 0x36, 0x41, 0x00], // {
    [0x00, 0x00, 0x7f, 0x00, 0x00], // |
    [0x00, 0x41, 0x36, 0x08, 0x00], // }
    [0x08, 0x04, 0x08, 0x10, 0x08], // ~
];

#[cfg(test)]
mod tests {
    use super::*;

    /// Decodes what `encode_png` writes (RGB8, stored deflate, filter 0),
    /// checking every CRC and the Adler-32 on the way.
    fn decode(png: &[u8]) -> (u32, u32, Vec<u8>) {
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "signature");
        let (mut pos, mut w, mut h, mut z) = (8, 0, 0, Vec::new());
        let mut kinds = Vec::new();
        while pos < png.len() {
            let len = u32::from_be_bytes(png[pos..pos + 4].try_into().unwrap()) as usize;
            let kind = &png[pos + 4..pos + 8];
            let data = &png[pos + 8..pos + 8 + len];
            let crc = u32::from_be_bytes(png[pos + 8 + len..pos + 12 + len].try_into().unwrap());
            assert_eq!(crc, crc32(&png[pos + 4..pos + 8 + len]), "chunk CRC");
            match kind {
                b"IHDR" => {
                    w = u32::from_be_bytes(data[0..4].try_into().unwrap());
                    h = u32::from_be_bytes(data[4..8].try_into().unwrap());
                    assert_eq!(&data[8..13], &[8, 2, 0, 0, 0], "8-bit RGB");
                }
                b"IDAT" => z.extend_from_slice(data),
                _ => {}
            }
            kinds.push(kind.to_vec());
            pos += 12 + len;
        }
        assert_eq!(kinds.first().map(|k| &k[..]), Some(&b"IHDR"[..]));
        assert_eq!(kinds.last().map(|k| &k[..]), Some(&b"IEND"[..]));
        assert_eq!(
            (u16::from_be_bytes([z[0], z[1]])) % 31,
            0,
            "zlib header check"
        );
        let (mut p, mut raw) = (2, Vec::new());
        loop {
            let hdr = z[p];
            assert_eq!(hdr >> 1, 0, "stored block");
            let len = u16::from_le_bytes([z[p + 1], z[p + 2]]);
            let nlen = u16::from_le_bytes([z[p + 3], z[p + 4]]);
            assert_eq!(len, !nlen);
            raw.extend_from_slice(&z[p + 5..p + 5 + len as usize]);
            p += 5 + len as usize;
            if hdr & 1 == 1 {
                break;
            }
        }
        assert_eq!(
            z[p..].to_vec(),
            adler32(&raw).to_be_bytes().to_vec(),
            "adler"
        );
        let stride = w as usize * 3 + 1;
        assert_eq!(raw.len(), stride * h as usize);
        let mut px = Vec::new();
        for row in raw.chunks(stride) {
            assert_eq!(row[0], 0, "filter none");
            px.extend_from_slice(&row[1..]);
        }
        (w, h, px)
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
        let (w, h, px) = decode(&png);
        assert_eq!((w, h), (960, 600));
        let at = |x: usize, y: usize| -> Rgb {
            let i = (y * w as usize + x) * 3;
            [px[i], px[i + 1], px[i + 2]]
        };
        let mut count = [0usize; 2];
        let mut white = 0;
        for y in TOP..HEIGHT - BOTTOM {
            for x in LEFT..WIDTH - RIGHT {
                let c = at(x, y);
                for (k, n) in count.iter_mut().enumerate() {
                    if c == PALETTE[k] {
                        *n += 1;
                    }
                }
                if c == WHITE {
                    white += 1;
                }
            }
        }
        // Each line spans the plot width at 2 px plus 11 markers of 7×7.
        assert!(count[0] > 1000, "direct pixels: {}", count[0]);
        assert!(count[1] > 1000, "staged pixels: {}", count[1]);
        let area = (WIDTH - LEFT - RIGHT) * (HEIGHT - TOP - BOTTOM);
        assert!(white > area * 3 / 4, "background: {white} of {area}");
        // Corners of the image and of the plot area's upper right are background.
        assert_eq!(at(0, 0), WHITE);
        assert_eq!(at(959, 599), WHITE);
        assert_eq!(at(5, 300), WHITE);
        // Axis lines are black.
        assert_eq!(at(LEFT, HEIGHT - BOTTOM - 20), BLACK);
        assert_eq!(at(LEFT + 200, HEIGHT - BOTTOM), BLACK);
        // Something (title text) is drawn in the top margin.
        assert!((0..TOP * WIDTH).any(|i| at(i % WIDTH, i / WIDTH) == BLACK));
    }

    #[test]
    fn plot_axes() {
        let x = Axis::log2(1.0, 1024.0);
        assert!(x.log2);
        let labels: Vec<&str> = x.ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(labels, ["1", "4", "16", "64", "256", "1024"]);
        let x = Axis::log2(0.25, 16.0);
        let labels: Vec<&str> = x.ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(labels, ["0.25", "0.5", "1", "2", "4", "8", "16"]);
        let y = Axis::linear(0.5, 22.3, true);
        let labels: Vec<&str> = y.ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(labels, ["0", "5", "10", "15", "20", "25"]);
        let y = Axis::linear(0.0, 0.9, true);
        let labels: Vec<&str> = y.ticks.iter().map(|t| t.1.as_str()).collect();
        assert_eq!(labels, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]);
        assert_eq!(y.frac(0.5), Some(0.5));
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
            assert_eq!((w, h), (960, 600));
        }
    }
}
