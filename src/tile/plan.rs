//! Tile geometry: where each tile reads in the input and how much it shares with its
//! neighbours. Pure arithmetic, no tensors, so it can be checked exhaustively.

use thiserror::Error;

/// Why an image cannot be cut into tiles.
#[derive(Debug, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum PlanError {
    /// The image has no pixels.
    #[error("cannot tile an empty image ({height}x{width})")]
    EmptyImage {
        /// Image height in pixels.
        height: usize,
        /// Image width in pixels.
        width: usize,
    },
    /// The overlap leaves no tile interior.
    #[error("tile overlap ({overlap}) must be smaller than the tile size ({tile})")]
    OverlapTooLarge {
        /// Tile side in input pixels.
        tile: usize,
        /// Overlap in input pixels.
        overlap: usize,
    },
}

/// One tile's extent along one axis, in input pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Span {
    pub start: usize,
    pub len: usize,
    /// Pixels shared with the previous tile on this axis; 0 at the image border.
    pub lead: usize,
    /// Pixels shared with the next tile on this axis; 0 at the image border.
    pub trail: usize,
}

impl Span {
    pub fn end(&self) -> usize {
        self.start + self.len
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tile {
    pub y: Span,
    pub x: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub height: usize,
    pub width: usize,
    /// Every tile has this shape, so any group of tiles forms one batch tensor.
    pub tile_h: usize,
    pub tile_w: usize,
    /// Row-major: all tiles of the first tile row, then the next.
    pub tiles: Vec<Tile>,
}

impl Plan {
    /// Whether the plan is one tile over the whole image, which shares no pixels: its blend
    /// weights are all 1, so the tile's output is the upscaled image.
    pub fn is_whole(&self) -> bool {
        let whole = |s: &Span, len: usize| s.start == 0 && s.len == len && s.lead + s.trail == 0;
        match self.tiles.as_slice() {
            [t] => whole(&t.y, self.height) && whole(&t.x, self.width),
            _ => false,
        }
    }
}

/// Plans `tile`-sized tiles (0 = the whole image) with `overlap` pixels shared between
/// neighbours. Tiles are clipped to the image, so a small image is a single tile.
pub fn plan(height: usize, width: usize, tile: usize, overlap: usize) -> Result<Plan, PlanError> {
    if height == 0 || width == 0 {
        return Err(PlanError::EmptyImage { height, width });
    }
    if tile != 0 && overlap >= tile {
        return Err(PlanError::OverlapTooLarge { tile, overlap });
    }
    let ys = axis(height, tile, overlap);
    let xs = axis(width, tile, overlap);
    let tiles = ys
        .iter()
        .flat_map(|&y| xs.iter().map(move |&x| Tile { y, x }))
        .collect();
    Ok(Plan {
        height,
        width,
        tile_h: ys[0].len,
        tile_w: xs[0].len,
        tiles,
    })
}

/// Tiles along one axis. The last tile is pulled back to end exactly at the image edge
/// (rather than being cut short) so that all tiles keep one shape; it then shares more
/// than `overlap` with its predecessor, which `lead`/`trail` record.
fn axis(len: usize, tile: usize, overlap: usize) -> Vec<Span> {
    let t = if tile == 0 { len } else { tile.min(len) };
    let mut starts = vec![0];
    // Only reached when t == tile < len, so the stride is at least 1.
    let stride = tile.saturating_sub(overlap);
    while starts[starts.len() - 1] + t < len {
        let next = (starts[starts.len() - 1] + stride).min(len - t);
        starts.push(next);
    }
    let n = starts.len();
    (0..n)
        .map(|i| Span {
            start: starts[i],
            len: t,
            lead: if i == 0 {
                0
            } else {
                starts[i - 1] + t - starts[i]
            },
            trail: if i + 1 == n {
                0
            } else {
                starts[i] + t - starts[i + 1]
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn starts(len: usize, tile: usize, overlap: usize) -> Vec<usize> {
        axis(len, tile, overlap).iter().map(|s| s.start).collect()
    }

    #[test]
    fn last_tile_is_aligned_to_the_image_end() {
        assert_eq!(starts(100, 64, 16), vec![0, 36]);
        assert_eq!(starts(112, 64, 16), vec![0, 48]);
        assert_eq!(starts(113, 64, 16), vec![0, 48, 49]);
        let a = axis(100, 64, 16);
        assert_eq!(
            (a[0].lead, a[0].trail, a[1].lead, a[1].trail),
            (0, 28, 28, 0)
        );
    }

    #[test]
    fn small_images_are_one_tile() {
        let p = plan(1, 1, 64, 16).unwrap();
        assert_eq!(p.tiles.len(), 1);
        assert_eq!((p.tile_h, p.tile_w), (1, 1));
        let p = plan(13, 200, 64, 16).unwrap();
        assert_eq!((p.tile_h, p.tile_w), (13, 64));
        assert!(p.tiles.iter().all(|t| t.y.lead == 0 && t.y.trail == 0));
    }

    #[test]
    fn zero_tile_means_whole_image() {
        let p = plan(97, 89, 0, 32).unwrap();
        assert_eq!(p.tiles.len(), 1);
        assert_eq!((p.tile_h, p.tile_w), (97, 89));
    }

    #[test]
    fn rejects_bad_input() {
        assert_eq!(
            plan(100, 100, 32, 32),
            Err(PlanError::OverlapTooLarge {
                tile: 32,
                overlap: 32
            })
        );
        assert!(plan(0, 5, 8, 0).is_err());
    }
}
