//! One decoded image through the network: colour, alpha and tile settings.

use crate::io::Decoded;
use crate::planar::{Planar, SYMMETRIES};
use crate::tile::lanes::merge_lane_stats;
use crate::tile::{LaneStats, TileError, TileOptions, TileStats};

use super::lanes::Lanes;
use super::Engine;

pub struct Upscaled {
    pub rgb: Planar,
    pub alpha: Option<Planar>,
    pub stats: TileStats,
    /// Work per lane, alpha included.
    pub lanes: Vec<LaneStats>,
}

/// How tiles are chosen for each image.
#[derive(Clone, Debug, PartialEq)]
pub enum TileChoice {
    /// Pick from free memory and the model's measured cost per pixel.
    Auto,
    /// A fixed tile side in input pixels; 0 is the whole image.
    Fixed(usize),
}

#[derive(Clone, Debug)]
pub struct TileSettings {
    pub choice: TileChoice,
    pub overlap: usize,
    /// Tiles per batch; chosen with the tile when None.
    pub batch: Option<usize>,
    pub blend: crate::tile::BlendMode,
    /// Test-time self-ensemble: the colour output is the mean over the eight flips and
    /// transpositions of the input, each undone on its output (8x the work).
    pub tta: bool,
}

/// On the CPU a tile larger than a few hundred pixels is no faster (the products are already
/// large GEMMs), only hungrier: a 1024x1024 x4 input took 38.7 s at 6.35 GB peak with the
/// tile chosen from 21 GiB free memory, and 35.2 s at 1.09 GB with tile 256. So the automatic
/// choice on the CPU plans within this much memory, not all that is free.
const CPU_TILE_BUDGET: u64 = 4 << 30;

impl Engine {
    #[cfg(test)]
    /// Concrete tile options for an `h x w` image. However they were chosen, no forward pass
    /// exceeds [`Engine::max_pass_pixels`].
    pub fn tile_options(&self, settings: &TileSettings, h: usize, w: usize) -> TileOptions {
        self.tile_options_shared(settings, h, w, 1)
    }

    /// Tile options when `share` lanes split this engine's device memory, each with its
    /// own output canvas.
    pub fn tile_options_shared(
        &self,
        settings: &TileSettings,
        h: usize,
        w: usize,
        share: usize,
    ) -> TileOptions {
        let share = share.max(1) as u64;
        let window = self.model.config().window();
        let max_pass = self.max_pass_pixels();
        let auto = || {
            let free = if self.device.is_cpu() {
                self.free_memory().min(CPU_TILE_BUDGET)
            } else {
                self.free_memory()
            };
            // The output accumulator lives for the whole image: take it off the budget.
            let s = self.scale() as u64;
            let out = (h as u64 * w as u64) * s * s * 4 * 4;
            let budget = free.saturating_sub(out * share) / share;
            let choose = |cost| {
                crate::tile::auto::choose(budget, cost, h, w, settings.overlap, window, max_pass)
            };
            // Measuring the cost runs a probe forward pass, as long as a whole small image
            // takes; an image that fits whole even at the bound does not need it.
            match choose(self.bytes_per_pixel_bound()) {
                (0, b) => (0, b),
                _ => choose(self.bytes_per_pixel()),
            }
        };
        let (tile, batch) = match settings.choice {
            TileChoice::Fixed(t) => {
                let want = settings.batch.unwrap_or(1);
                let (th, tw) = if t == 0 { (h, w) } else { (t.min(h), t.min(w)) };
                match crate::tile::auto::fit_batch(th, tw, window, want, max_pass) {
                    0 => {
                        let (t, b) = auto();
                        log::warn!(
                            "a {th}x{tw} tile is more than one pass can index on this device; \
                             using tile {t}"
                        );
                        (t, b.min(want))
                    }
                    b => {
                        if b < want {
                            log::warn!(
                                "{want} tiles of {th}x{tw} are more than one pass can \
                                 index on this device; using batches of {b}"
                            );
                        }
                        (t, b)
                    }
                }
            }
            TileChoice::Auto => {
                let (t, b) = auto();
                let b = match settings.batch {
                    None => b,
                    Some(want) => {
                        let (th, tw) = if t == 0 { (h, w) } else { (t.min(h), t.min(w)) };
                        crate::tile::auto::fit_batch(th, tw, window, want, max_pass).max(1)
                    }
                };
                (t, b)
            }
        };
        TileOptions {
            tile,
            overlap: settings.overlap,
            batch,
            blend: settings.blend,
        }
    }
}

impl Lanes {
    /// Upscale a decoded image. Alpha goes through the network on its own (as a gray image)
    /// so edges stay as sharp as the colour; a constant alpha is just filled.
    pub fn upscale_decoded(
        &self,
        img: &Decoded,
        settings: &TileSettings,
    ) -> Result<Upscaled, TileError> {
        let opts = self.tile_options(settings, img.rgb.height, img.rgb.width);
        let (rgb, stats, mut lanes) = if settings.tta {
            self.run_ensemble(&img.rgb, settings)?
        } else {
            self.run(&img.rgb, &opts)?
        };
        let alpha = match &img.alpha {
            None => None,
            Some(a) => Some(self.upscale_alpha(a, &opts, &mut lanes)?),
        };
        Ok(Upscaled {
            rgb,
            alpha,
            stats,
            lanes,
        })
    }

    /// The mean of the outputs for the eight symmetries of `img`, each mapped back. The
    /// symmetries are exact permutations, so averaging cancels some of the network's
    /// orientation-dependent error at eight times the cost.
    fn run_ensemble(
        &self,
        img: &Planar,
        settings: &TileSettings,
    ) -> Result<(Planar, TileStats, Vec<LaneStats>), TileError> {
        let mut sum: Option<Planar> = None;
        let mut stats = TileStats::default();
        let mut lanes = Vec::new();
        for k in 0..SYMMETRIES {
            let t = img.transformed(k);
            let opts = self.tile_options(settings, t.height, t.width);
            let (out, s, l) = self.run(&t, &opts)?;
            let out = out.untransformed(k);
            merge_lane_stats(&mut lanes, &l);
            stats.tiles += s.tiles;
            stats.batches += s.batches;
            stats.oom_retries += s.oom_retries;
            (stats.tile_shape, stats.batch) = (s.tile_shape, s.batch);
            match &mut sum {
                None => sum = Some(out),
                Some(acc) => acc
                    .data
                    .iter_mut()
                    .zip(&out.data)
                    .for_each(|(a, v)| *a += v),
            }
        }
        let mut mean = sum.expect("eight symmetries");
        let n = f32::from(SYMMETRIES);
        mean.data.iter_mut().for_each(|v| *v /= n);
        Ok((mean, stats, lanes))
    }

    fn upscale_alpha(
        &self,
        a: &Planar,
        opts: &TileOptions,
        lanes: &mut Vec<LaneStats>,
    ) -> Result<Planar, TileError> {
        let s = self.scale();
        let (h, w) = (a.height * s, a.width * s);
        let first = a.data.first().copied().unwrap_or(1.0);
        if a.data.iter().all(|&v| v == first) {
            return Ok(Planar::new(1, h, w, vec![first; h * w]));
        }
        let mut rgb = a.data.clone();
        rgb.extend_from_slice(&a.data);
        rgb.extend_from_slice(&a.data);
        let (out, _, more) = self.run(&Planar::new(3, a.height, a.width, rgb), opts)?;
        merge_lane_stats(lanes, &more);
        let n = h * w;
        let data = (0..n)
            .map(|i| (out.data[i] + out.data[n + i] + out.data[2 * n + i]) / 3.0)
            .collect();
        Ok(Planar::new(1, h, w, data))
    }
}
