//! One decoded image through the network: colour, alpha and tile settings.

use crate::io::Decoded;
use crate::planar::{Planar, SYMMETRIES};
use crate::tile::auto::TileSettings;
use crate::tile::lanes::merge_lane_stats;
use crate::tile::{LaneStats, TileError, TileOptions, TileStats};

use super::lanes::Lanes;

pub struct Upscaled {
    pub rgb: Planar,
    pub alpha: Option<Planar>,
    /// The tiling (the command-line tool reports it).
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    pub stats: TileStats,
    /// Work per lane, alpha included (the command-line tool reports it).
    #[cfg_attr(not(feature = "cli"), allow(dead_code))]
    pub lanes: Vec<LaneStats>,
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
