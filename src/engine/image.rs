//! One decoded image through the network: colour, alpha and tile settings.

use crate::io::Decoded;
use crate::planar::{Planar, SYMMETRIES};
use crate::tile::auto::TileSettings;
use crate::tile::lanes::Unfinished;
use crate::tile::{LaneStats, TileError, TileOptions, TileStats};

use super::lanes::Lanes;

/// An upscaled image as planes, with how it was computed.
#[derive(Clone, Debug)]
pub struct Upscaled {
    /// 3 channels, nominally in [0, 1] (encoding clamps).
    pub rgb: Planar,
    /// 1 channel, when the input had alpha.
    pub alpha: Option<Planar>,
    /// How the colour was tiled.
    pub stats: TileStats,
    /// Work per lane, alpha included.
    pub lanes: Vec<LaneStats>,
}

/// An upscaled image whose canvases may still be on the device: [`Self::finish`] brings
/// them back and blends them into the [`Upscaled`] image (see [`Lanes::upscale_pending`]).
pub struct Pending {
    rgb: Part,
    alpha: Option<Part>,
    stats: TileStats,
    lanes: Vec<LaneStats>,
}

/// One upscaled plane group of a [`Pending`] image.
enum Part {
    Done(Planar),
    Rgb(Unfinished),
    /// Alpha run through the network as three equal channels, averaged when finished.
    Alpha(Unfinished),
}

impl Part {
    fn finish(self) -> Result<Planar, TileError> {
        Ok(match self {
            Self::Done(p) => p,
            Self::Rgb(u) => u.finish()?,
            Self::Alpha(u) => {
                let out = u.finish()?;
                let n = out.height * out.width;
                let data = (0..n)
                    .map(|i| (out.data[i] + out.data[n + i] + out.data[2 * n + i]) / 3.0)
                    .collect();
                Planar::new(1, out.height, out.width, data)
            }
        })
    }
}

impl Pending {
    /// The upscaled image: canvases still on a device come back and every canvas is
    /// normalised by its blend weights.
    pub fn finish(self) -> Result<Upscaled, TileError> {
        Ok(Upscaled {
            rgb: self.rgb.finish()?,
            alpha: self.alpha.map(Part::finish).transpose()?,
            stats: self.stats,
            lanes: self.lanes,
        })
    }
}

impl Lanes {
    /// Upscale a decoded image. Alpha goes through the network on its own (as a gray image)
    /// so edges stay as sharp as the colour; a constant alpha is just filled.
    #[cfg(test)]
    pub fn upscale_decoded(
        &self,
        img: &Decoded,
        settings: &TileSettings,
    ) -> Result<Upscaled, TileError> {
        self.upscale_pending(img, settings, false)?.finish()
    }

    /// [`Self::upscale_decoded`] up to the canvases: with `defer_download`, device canvases
    /// stay where they are until [`Pending::finish`], which another thread may call while
    /// the lanes start on the next image. The eight-symmetry ensemble finishes here: its
    /// outputs are summed on the host.
    pub fn upscale_pending(
        &self,
        img: &Decoded,
        settings: &TileSettings,
        defer_download: bool,
    ) -> Result<Pending, TileError> {
        let opts = self.tile_options(settings, img.rgb.height, img.rgb.width);
        let (rgb, stats, mut lanes) = if settings.tta {
            let (out, stats, lanes) = self.run_ensemble(&img.rgb, settings)?;
            (Part::Done(out), stats, lanes)
        } else {
            let (out, stats, lanes) = self.run_unfinished(&img.rgb, &opts, defer_download)?;
            (Part::Rgb(out), stats, lanes)
        };
        let alpha = match &img.alpha {
            None => None,
            Some(a) => Some(self.upscale_alpha(a, &opts, &mut lanes, defer_download)?),
        };
        Ok(Pending {
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
            LaneStats::merge(&mut lanes, &l);
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
        defer_download: bool,
    ) -> Result<Part, TileError> {
        let s = self.primary().scale();
        let (h, w) = (a.height * s, a.width * s);
        let first = a.data.first().copied().unwrap_or(1.0);
        if a.data.iter().all(|&v| v == first) {
            return Ok(Part::Done(Planar::new(1, h, w, vec![first; h * w])));
        }
        let mut rgb = a.data.clone();
        rgb.extend_from_slice(&a.data);
        rgb.extend_from_slice(&a.data);
        let gray = Planar::new(3, a.height, a.width, rgb);
        let (out, _, more) = self.run_unfinished(&gray, opts, defer_download)?;
        LaneStats::merge(lanes, &more);
        Ok(Part::Alpha(out))
    }
}
