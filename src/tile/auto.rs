//! The tile-size policy: picks tile and batch sizes for each image, fixed or from the memory
//! that is free. What it needs of the model (its window, its cost per pixel, the free memory
//! of its device) comes through [`MemoryModel`], which the engine implements; this module only
//! does the budgeting.

/// Share of free memory the plan may use. The rest absorbs allocator slack, other users of
/// the device and error in the measured per-pixel cost.
const BUDGET_FRACTION: f64 = 0.5;

/// More tiles per batch than this buys no throughput and delays the first back-off.
const MAX_BATCH: usize = 16;

/// No limit on the pixels of one forward pass (the CPU backend indexes with `usize`).
pub const UNLIMITED: usize = usize::MAX;

/// How tiles are chosen for each image.
#[derive(Clone, Debug, PartialEq)]
pub enum TileChoice {
    /// Pick from free memory and the model's measured cost per pixel.
    Auto,
    /// A fixed tile side in input pixels; 0 is the whole image.
    Fixed(usize),
}

/// How each image is tiled (and whether it is run eight times over, for the self-ensemble).
#[derive(Clone, Debug)]
pub struct TileSettings {
    pub choice: TileChoice,
    pub overlap: usize,
    /// Tiles per batch; chosen with the tile when None.
    pub batch: Option<usize>,
    pub blend: super::BlendMode,
    /// Test-time self-ensemble: the colour output is the mean over the eight flips and
    /// transpositions of the input, each undone on its output (8x the work).
    pub tta: bool,
}

/// On the CPU a tile larger than a few hundred pixels is no faster (the products are already
/// large GEMMs), only hungrier: a 1024x1024 x4 input took 38.7 s at 6.35 GB peak with the
/// tile chosen from 21 GiB free memory, and 35.2 s at 1.09 GB with tile 256. So the automatic
/// choice on the CPU plans within this much memory, not all that is free.
const CPU_TILE_BUDGET: u64 = 4 << 30;

/// What the tile policy needs to know of a model on its device.
pub trait MemoryModel {
    /// The model's upscaling factor.
    fn scale(&self) -> usize;
    /// The model's attention window: tiles are padded to a multiple of it.
    fn window(&self) -> usize;
    /// Whether the model runs on the CPU (which plans within [`CPU_TILE_BUDGET`]).
    fn on_cpu(&self) -> bool;
    /// The most padded input pixels one forward pass may hold.
    fn max_pass_pixels(&self) -> usize;
    /// Memory free for activations on the model's device.
    fn free_memory(&self) -> u64;
    /// An upper bound on [`MemoryModel::bytes_per_pixel`] known without running the model.
    fn bytes_per_pixel_bound(&self) -> f64;
    /// Peak activation bytes per input pixel of one forward pass (may run a probe pass).
    fn bytes_per_pixel(&self) -> f64;
    /// Whether the model's output depends on its whole input (GroupNorm's statistics,
    /// OmniSR's grid attention and pooling), so that a tiled image differs from the whole one
    /// by the model's own definition: the automatic choice then plans within all free memory
    /// on the CPU too, and says so when it tiles.
    fn whole_input_matters(&self) -> bool {
        false
    }
}

/// Concrete tile options for an `h x w` image when `share` lanes split the model's device
/// memory, each with its own output canvas. However they were chosen, no forward pass
/// exceeds [`MemoryModel::max_pass_pixels`].
pub fn tile_options(
    model: &impl MemoryModel,
    settings: &TileSettings,
    h: usize,
    w: usize,
    share: usize,
) -> super::TileOptions {
    let share = share.max(1) as u64;
    let window = model.window();
    let max_pass = model.max_pass_pixels();
    let whole_matters = model.whole_input_matters();
    let auto = || {
        let free = if model.on_cpu() && !whole_matters {
            model.free_memory().min(CPU_TILE_BUDGET)
        } else {
            model.free_memory()
        };
        // The output accumulator lives for the whole image: take it off the budget.
        let s = model.scale() as u64;
        let out = (h as u64 * w as u64) * s * s * 4 * 4;
        let budget = free.saturating_sub(out * share) / share;
        let choose = |cost| choose(budget, cost, h, w, settings.overlap, window, max_pass);
        // Measuring the cost runs a probe forward pass, as long as a whole small image
        // takes; an image that fits whole even at the bound does not need it.
        match choose(model.bytes_per_pixel_bound()) {
            (0, b) => (0, b),
            _ => choose(model.bytes_per_pixel()),
        }
    };
    let (tile, batch) = match settings.choice {
        TileChoice::Fixed(t) => {
            let want = settings.batch.unwrap_or(1);
            let (th, tw) = if t == 0 { (h, w) } else { (t.min(h), t.min(w)) };
            match fit_batch(th, tw, window, want, max_pass) {
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
            // Once per process: a folder run would repeat it for every large image.
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if t != 0 && whole_matters && !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                log::warn!(
                    "this model's output depends on its whole input (GroupNorm, or grid \
                     attention and pooling) and a {h}x{w} image does not fit in memory whole: \
                     tiles of {t} make its output differ a little from the whole image's"
                );
            }
            let b = match settings.batch {
                None => b,
                Some(want) => {
                    let (th, tw) = if t == 0 { (h, w) } else { (t.min(h), t.min(w)) };
                    fit_batch(th, tw, window, want, max_pass).max(1)
                }
            };
            (t, b)
        }
    };
    super::TileOptions {
        tile,
        overlap: settings.overlap,
        batch,
        blend: settings.blend,
    }
}

/// The most padded input pixels one forward pass may hold on a device whose kernels index
/// with 32-bit integers (candle's CUDA element-wise and softmax kernels), given the largest
/// number of values any intermediate tensor holds per padded input pixel: above it an index
/// wraps and the kernel reads out of bounds or hangs.
pub fn max_pass_pixels_i32(values_per_pixel: usize) -> usize {
    (i32::MAX as usize) / values_per_pixel.max(1)
}

/// Padded input pixels of one `tile_h x tile_w` tile: the model pads each side up to a
/// multiple of its window.
pub fn padded_pixels(tile_h: usize, tile_w: usize, window: usize) -> usize {
    let window = window.max(1);
    tile_h.div_ceil(window) * window * (tile_w.div_ceil(window) * window)
}

/// The largest batch of `tile_h x tile_w` tiles, up to `batch`, that stays within
/// `max_pass_pixels`; 0 when not even one tile does.
pub fn fit_batch(
    tile_h: usize,
    tile_w: usize,
    window: usize,
    batch: usize,
    max_pass_pixels: usize,
) -> usize {
    batch.min(max_pass_pixels / padded_pixels(tile_h, tile_w, window).max(1))
}

/// Returns `(tile, batch)`; tile 0 means the whole image in one piece. Tiles are multiples
/// of `window` and at least `2 * overlap + window`, so each keeps a core no neighbour
/// overlaps; when not even that fits, the smallest such tile is returned with batch 1.
/// Whatever the memory, no pass (batch x padded tile) exceeds `max_pass_pixels`.
pub fn choose(
    free_bytes: u64,
    bytes_per_input_pixel: f64,
    image_h: usize,
    image_w: usize,
    overlap: usize,
    window: usize,
    max_pass_pixels: usize,
) -> (usize, usize) {
    let budget = free_bytes as f64 * BUDGET_FRACTION;
    let cost = |h: usize, w: usize| (h * w) as f64 * bytes_per_input_pixel;
    let window = window.max(1);
    let fits = |h: usize, w: usize| padded_pixels(h, w, window) <= max_pass_pixels;
    // An unknown (NaN) or zero cost gives no reason to tile.
    let known = bytes_per_input_pixel.is_finite() && bytes_per_input_pixel > 0.0;
    if (!known || cost(image_h, image_w) <= budget) && fits(image_h, image_w) {
        return (0, 1);
    }
    let min_tile = (2 * overlap + window).div_ceil(window) * window;
    let longest = image_h.max(image_w).div_ceil(window);
    let tile = (1..=longest)
        .rev()
        .map(|k| k * window)
        .take_while(|&t| t >= min_tile)
        .find(|&t| {
            let (h, w) = (t.min(image_h), t.min(image_w));
            (!known || cost(h, w) <= budget) && fits(h, w)
        });
    let Some(tile) = tile else {
        return (min_tile, 1);
    };
    let tile = balance(tile, image_h, image_w, overlap, window).max(min_tile);
    let (th, tw) = (tile.min(image_h), tile.min(image_w));
    let tiles = count_tiles(image_h, tile, overlap) * count_tiles(image_w, tile, overlap);
    let by_memory = if known {
        (budget / cost(th, tw)) as usize
    } else {
        1
    };
    let batch = fit_batch(
        th,
        tw,
        window,
        by_memory.clamp(1, MAX_BATCH),
        max_pass_pixels,
    )
    .min(tiles)
    .max(1);
    (tile, batch)
}

/// The smallest window multiple that needs no more tiles than `tile` does. The largest
/// tile that fits can leave a sliver for the last tile, which the end-aligned plan then
/// overlaps almost entirely; evening the tiles out saves that work and frees memory for
/// batching.
fn balance(tile: usize, image_h: usize, image_w: usize, overlap: usize, window: usize) -> usize {
    // n tiles of size t cover len when len + (n - 1) * overlap <= n * t.
    let needed = |len: usize| {
        let n = count_tiles(len, tile, overlap);
        (len + (n - 1) * overlap).div_ceil(n)
    };
    let t = needed(image_h).max(needed(image_w));
    (t.div_ceil(window) * window).min(tile)
}

fn count_tiles(len: usize, tile: usize, overlap: usize) -> usize {
    if tile >= len {
        1
    } else {
        1 + (len - tile).div_ceil(tile - overlap)
    }
}

/// Memory the kernel reports as available for new allocations, in bytes (Linux only).
pub fn available_ram() -> Option<u64> {
    if cfg!(target_os = "linux") {
        parse_mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
    } else {
        None
    }
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?;
    let mut parts = line.split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => value.checked_mul(1024),
        None => Some(value),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tile::plan::plan;

    /// A CPU model with 16 GiB free that needs 6 GiB for a 1000x1000 image whole.
    struct Cpu16 {
        normalises: bool,
    }

    impl MemoryModel for Cpu16 {
        fn scale(&self) -> usize {
            1
        }
        fn window(&self) -> usize {
            1
        }
        fn on_cpu(&self) -> bool {
            true
        }
        fn max_pass_pixels(&self) -> usize {
            UNLIMITED
        }
        fn free_memory(&self) -> u64 {
            16 << 30
        }
        fn bytes_per_pixel_bound(&self) -> f64 {
            6.0 * (1u64 << 30) as f64 / 1e6
        }
        fn bytes_per_pixel(&self) -> f64 {
            self.bytes_per_pixel_bound()
        }
        fn whole_input_matters(&self) -> bool {
            self.normalises
        }
    }

    /// The CPU keeps to its budget for speed, except for a model whose output a tile would
    /// change: that one runs whole where all free memory holds it.
    #[test]
    fn whole_image_for_a_model_that_normalises_over_it() {
        let settings = TileSettings {
            choice: TileChoice::Auto,
            overlap: 32,
            batch: None,
            blend: crate::tile::BlendMode::Hann,
            tta: false,
        };
        let tile = |normalises| tile_options(&Cpu16 { normalises }, &settings, 1000, 1000, 1).tile;
        assert_ne!(tile(false), 0, "within the CPU's budget: tiled");
        assert_eq!(tile(true), 0, "all free memory: whole");
    }

    #[test]
    fn whole_image_when_it_fits_with_margin() {
        // 100x100 at 10 B/pixel is 100 kB.
        assert_eq!(choose(1_000_000, 10.0, 100, 100, 32, 16, UNLIMITED), (0, 1));
        assert_eq!(choose(200_000, 10.0, 100, 100, 32, 16, UNLIMITED), (0, 1));
        assert_ne!(choose(199_000, 10.0, 100, 100, 32, 16, UNLIMITED).0, 0);
    }

    #[test]
    fn largest_window_multiple_that_fits() {
        let free = 2 * 256 * 256 * 100;
        assert_eq!(choose(free, 100.0, 2000, 3000, 32, 16, UNLIMITED), (256, 1));
        let (tile, batch) = choose(free, 100.0, 2000, 3000, 32, 7, UNLIMITED);
        assert_eq!((tile % 7, batch), (0, 1));
        assert!(tile <= 256);
        let tiles = |t| plan(2000, 3000, t, 32).unwrap().tiles.len();
        assert_eq!(tiles(tile), tiles(252));
    }

    #[test]
    fn evens_out_tiles_and_batches_them() {
        // 1024-pixel tiles fit, but a 1100-pixel image needs two per axis either way;
        // 576 is enough for that, and three of them fit at once.
        let free = 2 * 1024 * 1024;
        let (tile, batch) = choose(free, 1.0, 1100, 1100, 32, 16, UNLIMITED);
        assert_eq!((tile, batch), (576, 3));
        assert_eq!(plan(1100, 1100, tile, 32).unwrap().tiles.len(), 4);
    }

    #[test]
    fn never_below_the_minimum_tile() {
        assert_eq!(choose(10, 100.0, 1000, 1000, 32, 16, UNLIMITED), (80, 1));
        assert_eq!(choose(10, 100.0, 1000, 1000, 0, 0, UNLIMITED), (1, 1));
        assert_eq!(choose(10, f64::NAN, 1000, 1000, 32, 16, UNLIMITED), (0, 1));
    }

    #[test]
    fn wide_images_use_the_short_side() {
        // Tiles are clipped to the image's 50 rows, so a longer tile fits.
        let free = 2 * 50 * 400;
        assert_eq!(choose(free, 1.0, 50, 5000, 16, 16, UNLIMITED).0, 400);
    }

    /// Whatever the free memory, cost, image and window, no pass the planner picks reaches
    /// the 32-bit index limit of the intermediate the limit was derived from.
    #[test]
    fn no_pass_reaches_the_index_limit() {
        // Values per padded pixel: DRCT's scores (6 x 16²), its fused path, a window-8
        // model's scores, and an absurdly wide one.
        for values in [1536usize, 1024, 384, 40_000] {
            let max = max_pass_pixels_i32(values);
            for free_gib in [1u64, 8, 24, 80, 141, 1 << 20] {
                for cost in [f64::NAN, 0.0, 64.0, 4_000.0, 30_000.0] {
                    for (h, w) in [
                        (64, 64),
                        (540, 960),
                        (1080, 1920),
                        (2160, 3840),
                        (9000, 16384),
                    ] {
                        for (overlap, window) in [(32, 16), (16, 8), (0, 16)] {
                            let (tile, batch) =
                                choose(free_gib << 30, cost, h, w, overlap, window, max);
                            let (th, tw) = if tile == 0 {
                                (h, w)
                            } else {
                                (tile.min(h), tile.min(w))
                            };
                            let pass = padded_pixels(th, tw, window) * batch;
                            assert!(
                                pass * values < 1 << 31 && batch >= 1,
                                "{values} values, {free_gib} GiB, cost {cost}, {h}x{w}, \
                                 window {window}: tile {tile} batch {batch}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn explicit_batches_are_cut_to_the_limit() {
        // Eight 512² tiles of DRCT's scores would need 3.2e9 indices: five stay under 2³¹;
        // 500² tiles pad to 512².
        let max = max_pass_pixels_i32(1536);
        assert_eq!(fit_batch(512, 512, 16, 4, max), 4);
        assert_eq!(fit_batch(512, 512, 16, 8, max), 5);
        assert_eq!(fit_batch(500, 500, 16, 8, max), 5);
        assert_eq!(fit_batch(2048, 2048, 16, 1, max), 0);
        assert_eq!(fit_batch(2048, 2048, 16, 3, UNLIMITED), 3);
    }

    #[test]
    fn reads_mem_available() {
        let text = "MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n";
        assert_eq!(parse_mem_available(text), Some(8_000_000 * 1024));
        assert_eq!(parse_mem_available("MemFree: 1 kB\n"), None);
        if cfg!(target_os = "linux") {
            assert!(available_ram().is_some_and(|b| b > 0));
        }
    }
}
