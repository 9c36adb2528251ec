//! Blend weights for overlapping tiles. A tile's 2-D weight is the product of one profile
//! per axis, and a profile depends only on the tile's length and its overlaps with the
//! neighbours on that axis, so the few distinct profiles are computed once and shared
//! (through `Arc`, so an accumulator can move to another thread).

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::Arc;

use super::plan::Span;

/// How the outputs of overlapping tiles are merged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BlendMode {
    /// Raised-cosine crossfade over the middle half of each overlap; the outer quarter at a
    /// tile's inner edge gets no weight, since the model saw little context there.
    #[default]
    Hann,
    /// Uniform average of all tiles covering a pixel, as the official inference script does.
    Average,
    /// Crop and paste: every output pixel comes from one tile, seams mid-overlap.
    None,
}

impl FromStr for BlendMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().as_str() {
            "hann" => Ok(Self::Hann),
            "average" | "avg" => Ok(Self::Average),
            "none" => Ok(Self::None),
            _ => Err(format!(
                "unknown blend mode {s:?} (expected hann, average or none)"
            )),
        }
    }
}

/// Weight of the incoming tile at pixel `j` of an overlap `len` pixels long. The outgoing
/// tile takes `1 - ramp`, so two tiles always share a pixel's weight exactly.
fn ramp(mode: BlendMode, j: usize, len: usize) -> f32 {
    match mode {
        BlendMode::Average => 1.0,
        BlendMode::None => {
            if 2 * j + 1 >= len {
                1.0
            } else {
                0.0
            }
        }
        BlendMode::Hann => {
            let u = (j as f64 + 0.5) / len as f64;
            let v = (2.0 * u - 0.5).clamp(0.0, 1.0);
            (0.5 - 0.5 * (std::f64::consts::PI * v).cos()) as f32
        }
    }
}

/// Weights of `len` output pixels of a tile that shares `lead` pixels with the previous
/// tile and `trail` with the next (0 at the image border, where nothing tapers).
pub fn profile(mode: BlendMode, len: usize, lead: usize, trail: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            if mode == BlendMode::Average {
                return 1.0;
            }
            let up = if i < lead { ramp(mode, i, lead) } else { 1.0 };
            let down = match (i + trail).checked_sub(len) {
                Some(j) => 1.0 - ramp(mode, j, trail),
                None => 1.0,
            };
            up * down
        })
        .collect()
}

/// Caches profiles keyed by (output length, lead, trail) in output pixels.
pub struct Weights {
    mode: BlendMode,
    scale: usize,
    cache: HashMap<(usize, usize, usize), Arc<[f32]>>,
}

impl Weights {
    pub fn new(mode: BlendMode, scale: usize) -> Self {
        Self {
            mode,
            scale,
            cache: HashMap::new(),
        }
    }

    /// The output-pixel profile of a tile's extent along one axis.
    pub fn axis(&mut self, span: &Span) -> Arc<[f32]> {
        let s = self.scale;
        let key = (span.len * s, span.lead * s, span.trail * s);
        let mode = self.mode;
        self.cache
            .entry(key)
            .or_insert_with(|| profile(mode, key.0, key.1, key.2).into())
            .clone()
    }

    #[cfg(test)]
    pub fn cached(&self) -> usize {
        self.cache.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hann_has_no_taper_at_the_image_border() {
        let interior = profile(BlendMode::Hann, 64, 16, 16);
        let first = profile(BlendMode::Hann, 64, 0, 16);
        let last = profile(BlendMode::Hann, 64, 16, 0);
        assert_eq!(interior[32], 1.0);
        assert_eq!(first[0], interior[32]);
        assert_eq!(last[63], interior[32]);
        assert!(profile(BlendMode::Hann, 10, 0, 0).iter().all(|&w| w == 1.0));
    }

    #[test]
    fn hann_gives_inner_edges_no_weight() {
        let p = profile(BlendMode::Hann, 64, 16, 16);
        // The outer quarter of each 16-pixel overlap.
        assert!(p[..4].iter().all(|&w| w == 0.0));
        assert!(p[60..].iter().all(|&w| w == 0.0));
        assert!(p[4] > 0.0 && p[59] > 0.0);
        assert!(p[12..52].iter().all(|&w| w == 1.0));
    }

    #[test]
    fn neighbours_sum_to_one_across_an_overlap() {
        for mode in [BlendMode::Hann, BlendMode::None] {
            for overlap in 1..20 {
                let a = profile(mode, 40, 0, overlap);
                let b = profile(mode, 40, overlap, 0);
                for j in 0..overlap {
                    let sum = a[40 - overlap + j] + b[j];
                    assert!((sum - 1.0).abs() < 1e-6, "{mode:?} {overlap} {j}: {sum}");
                }
            }
        }
    }

    #[test]
    fn none_cuts_at_the_middle_of_the_overlap() {
        let a = profile(BlendMode::None, 8, 0, 4);
        assert_eq!(a, vec![1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]);
        assert!(profile(BlendMode::Average, 8, 4, 4)
            .iter()
            .all(|&w| w == 1.0));
    }

    #[test]
    fn profiles_are_cached_per_geometry() {
        let mut w = Weights::new(BlendMode::Hann, 2);
        let span = |start, lead, trail| Span {
            start,
            len: 16,
            lead,
            trail,
        };
        let a = w.axis(&span(0, 0, 4));
        let b = w.axis(&span(12, 4, 4));
        let c = w.axis(&span(24, 4, 4));
        assert!(Arc::ptr_eq(&b, &c));
        assert_eq!(a.len(), 32);
        assert_eq!(w.cached(), 2);
        assert_eq!("Average".parse::<BlendMode>(), Ok(BlendMode::Average));
        assert!("x".parse::<BlendMode>().is_err());
    }
}
