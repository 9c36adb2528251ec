//! The final size of an upscaled image when it is not the model's own scale (`--outscale`,
//! `--width`, `--height`): the model runs at its scale and its output is then resampled.
//!
//! Lanczos3 keeps the detail the model made when shrinking and adds no blur of its own when
//! growing a little; colour is resampled premultiplied by alpha, so the colour of transparent
//! pixels does not bleed into their visible neighbours.

use image::imageops::{self, FilterType};
use image::{ImageBuffer, Luma};
use rayon::prelude::*;

use crate::io::OutputError;
use crate::planar::Planar;

/// Largest output, in pixels, that resampling will produce (4 GiB per f32 plane); a larger
/// request is an error for that image rather than an allocation that takes the process down.
pub const MAX_OUTPUT_PIXELS: u64 = 1 << 30;

/// What size the result should have.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum OutputSize {
    /// The model's scale: no resampling.
    #[default]
    Model,
    /// `round(input × factor)` on each side.
    Factor(f64),
    /// This width; the height keeps the input's aspect ratio.
    Width(u32),
    /// This height; the width keeps the input's aspect ratio.
    Height(u32),
    /// Exactly this size, aspect ratio or not.
    Exact {
        /// Output width in pixels.
        width: u32,
        /// Output height in pixels.
        height: u32,
    },
}

impl OutputSize {
    /// From the three command-line flags (clap keeps `--outscale` apart from the others).
    pub fn from_flags(outscale: Option<f64>, width: Option<u32>, height: Option<u32>) -> Self {
        match (outscale, width, height) {
            (Some(f), _, _) => OutputSize::Factor(f),
            (None, Some(width), Some(height)) => OutputSize::Exact { width, height },
            (None, Some(w), None) => OutputSize::Width(w),
            (None, None, Some(h)) => OutputSize::Height(h),
            (None, None, None) => OutputSize::Model,
        }
    }

    /// The output's (width, height) for an input of `width` × `height` and a model of
    /// `scale`; never 0 on a side.
    pub fn dims(&self, width: usize, height: usize, scale: usize) -> (usize, usize) {
        let scaled = |n: usize, f: f64| ((n as f64 * f).round() as usize).max(1);
        match *self {
            OutputSize::Model => (width * scale, height * scale),
            OutputSize::Factor(f) => (scaled(width, f), scaled(height, f)),
            OutputSize::Width(w) => (w as usize, scaled(height, w as f64 / width as f64)),
            OutputSize::Height(h) => (scaled(width, h as f64 / height as f64), h as usize),
            OutputSize::Exact { width, height } => (width as usize, height as usize),
        }
    }

    /// What tells the results apart in file and folder names: `x4` (the model's scale),
    /// `x3.5`, `w1920`, `h1080`, `640x480`. Distinct sizes give distinct tags, so results
    /// of one input at different sizes never overwrite each other.
    pub fn tag(&self, scale: usize) -> String {
        match *self {
            OutputSize::Model => format!("x{scale}"),
            OutputSize::Factor(f) => format!("x{f}"),
            OutputSize::Width(w) => format!("w{w}"),
            OutputSize::Height(h) => format!("h{h}"),
            OutputSize::Exact { width, height } => format!("{width}x{height}"),
        }
    }
}

/// `rgb` (and `alpha`, same size) resampled to `width` × `height` with Lanczos3. Returns the
/// planes unchanged when they already have that size.
pub fn resize(
    rgb: Planar,
    alpha: Option<Planar>,
    width: usize,
    height: usize,
) -> Result<(Planar, Option<Planar>), OutputError> {
    if (rgb.width, rgb.height) == (width, height) {
        return Ok((rgb, alpha));
    }
    if width as u64 * height as u64 > MAX_OUTPUT_PIXELS || width > u32::MAX as usize {
        return Err(OutputError::TooLarge {
            width,
            height,
            limit: MAX_OUTPUT_PIXELS,
        });
    }
    let Some(alpha) = alpha else {
        return Ok((resize_planes(&rgb, width, height), None));
    };
    let n = rgb.width * rgb.height;
    let mut premultiplied = rgb.clone();
    for c in 0..rgb.channels {
        let plane = &mut premultiplied.data[c * n..(c + 1) * n];
        for (v, a) in plane.iter_mut().zip(alpha.plane(0)) {
            *v *= a.clamp(0.0, 1.0);
        }
    }
    let mut out = resize_planes(&premultiplied, width, height);
    let new_alpha = resize_planes(&alpha, width, height);
    // Where almost nothing is visible, dividing by alpha only amplifies ringing; the plainly
    // resampled colour is as good there and keeps what transparent pixels held.
    let plain = resize_planes(&rgb, width, height);
    let m = width * height;
    for c in 0..out.channels {
        let plain = plain.plane(c);
        let plane = &mut out.data[c * m..(c + 1) * m];
        for ((v, a), p) in plane.iter_mut().zip(new_alpha.plane(0)).zip(plain) {
            *v = if *a > 1.0 / 512.0 { *v / a } else { *p };
        }
    }
    Ok((out, Some(new_alpha)))
}

/// The image crate clamps resampled f32 samples to [0, 1], which cuts Lanczos3's overshoot
/// at edges unevenly between alpha and premultiplied colour (their ratio then drifts). The
/// samples are squeezed into [1/4, 3/4] for the filter and mapped back, so nothing the
/// filter makes is clipped; its weights sum to 1, so the affine map commutes with it.
const SQUEEZE: (f32, f32) = (0.5, 0.25);

fn resize_planes(img: &Planar, width: usize, height: usize) -> Planar {
    let (gain, offset) = SQUEEZE;
    let planes: Vec<Vec<f32>> = (0..img.channels)
        .into_par_iter()
        .map(|c| {
            let squeezed = img.plane(c).iter().map(|v| v * gain + offset).collect();
            let src: ImageBuffer<Luma<f32>, Vec<f32>> =
                ImageBuffer::from_raw(img.width as u32, img.height as u32, squeezed)
                    .expect("a plane holds width × height samples");
            let mut out = imageops::resize(&src, width as u32, height as u32, FilterType::Lanczos3)
                .into_raw();
            for v in &mut out {
                *v = (*v - offset) / gain;
            }
            out
        })
        .collect();
    Planar::new(img.channels, height, width, planes.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dims_and_tags() {
        let s = |o: OutputSize| (o.dims(16, 12, 4), o.tag(4));
        assert_eq!(s(OutputSize::Model), ((64, 48), "x4".into()));
        assert_eq!(s(OutputSize::Factor(2.0)), ((32, 24), "x2".into()));
        assert_eq!(s(OutputSize::Factor(3.5)), ((56, 42), "x3.5".into()));
        assert_eq!(s(OutputSize::Width(40)), ((40, 30), "w40".into()));
        assert_eq!(s(OutputSize::Height(30)), ((40, 30), "h30".into()));
        let exact = OutputSize::Exact {
            width: 7,
            height: 5,
        };
        assert_eq!(s(exact), ((7, 5), "7x5".into()));
        assert_eq!(OutputSize::Factor(0.01).dims(16, 12, 4), (1, 1));
        assert_eq!(
            OutputSize::from_flags(None, Some(3), None),
            OutputSize::Width(3)
        );
    }

    /// A flat image stays flat (the filter's weights sum to 1), and a transparent pixel's
    /// colour does not leak into its opaque neighbours.
    #[test]
    fn resampling_keeps_flat_colour_and_ignores_hidden_colour() {
        let rgb = Planar::new(3, 4, 4, [0.25f32; 16].repeat(3));
        let (out, none) = resize(rgb.clone(), None, 7, 3).unwrap();
        assert!(none.is_none());
        assert_eq!((out.width, out.height), (7, 3));
        assert!(out.data.iter().all(|v| (v - 0.25).abs() < 1e-5), "{out:?}");

        let mut hidden = rgb;
        let mut alpha = Planar::new(1, 4, 4, vec![1.0; 16]);
        // The left column is invisible and bright red.
        for y in 0..4 {
            hidden.data[y * 4] = 1.0;
            alpha.data[y * 4] = 0.0;
        }
        let (out, a) = resize(hidden, Some(alpha), 8, 8).unwrap();
        let a = a.unwrap();
        for y in 0..8 {
            for x in 0..8 {
                if a.get(0, y, x) > 0.9 {
                    let v = out.get(0, y, x);
                    let av = a.get(0, y, x);
                    assert!(
                        (v - 0.25).abs() < 0.02,
                        "red leaked at {x},{y}: {v} alpha {av}"
                    );
                }
            }
        }
    }
}
