//! One decoded image through the network: colour, alpha and tile settings.

use crate::io::Decoded;
use crate::planar::Planar;
use crate::tile::lanes::merge_lane_stats;
use crate::tile::{LaneStats, TileOptions, TileStats};

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
    pub quiet: bool,
}

impl Engine {
    /// Concrete tile options for an `h x w` image.
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
        let (tile, batch) = match settings.choice {
            TileChoice::Fixed(t) => (t, settings.batch.unwrap_or(1)),
            TileChoice::Auto => {
                let free = self.free_memory();
                let cost = self.bytes_per_pixel();
                // The output accumulator lives for the whole image: take it off the budget.
                let s = self.scale() as u64;
                let out = (h as u64 * w as u64) * s * s * 4 * 4;
                let (t, b) = crate::tile::auto::choose(
                    free.saturating_sub(out * share) / share,
                    cost,
                    h,
                    w,
                    settings.overlap,
                    self.model.config().window,
                );
                (t, settings.batch.unwrap_or(b))
            }
        };
        TileOptions {
            tile,
            overlap: settings.overlap,
            batch,
            blend: settings.blend,
            quiet: settings.quiet,
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
    ) -> anyhow::Result<Upscaled> {
        let opts = self.tile_options(settings, img.rgb.height, img.rgb.width);
        let (rgb, stats, mut lanes) = self.run(&img.rgb, &opts)?;
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

    fn upscale_alpha(
        &self,
        a: &Planar,
        opts: &TileOptions,
        lanes: &mut Vec<LaneStats>,
    ) -> anyhow::Result<Planar> {
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
