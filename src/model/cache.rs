//! Derived attention inputs, computed once instead of per forward.
//!
//! The relative-position bias depends only on a block's table, so it is gathered at load. The
//! shift mask depends only on the padded feature size; the official code rebuilds it on the
//! host in every shifted block for every size but the training size. Here it is built once per
//! (H, W), shared by every shifted block, tile and batch, and safe to use from several threads;
//! so is the gather that puts tokens into (shifted) window order. Only the few most recently
//! used sizes are kept: a mask costs ~200 MB at window 16 for a 512² tile, and a folder of
//! differently sized images would otherwise grow the cache without bound.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};

/// Mask value for token pairs from different regions of the rolled image, as the official
/// code uses (not -inf: the softmax result is the same, and it keeps fp16 finite).
const MASK_VALUE: f32 = -100.0;

/// Index into the `(2ws-1)^2` bias table for every (query, key) pair of a window, row-major.
pub fn relative_position_index(ws: usize) -> Vec<u32> {
    let n = ws * ws;
    let side = 2 * ws - 1;
    let mut idx = Vec::with_capacity(n * n);
    for i in 0..n {
        let (yi, xi) = (i / ws, i % ws);
        for j in 0..n {
            let (yj, xj) = (j / ws, j % ws);
            idx.push(((yi + ws - 1 - yj) * side + (xi + ws - 1 - xj)) as u32);
        }
    }
    idx
}

/// Gather a `[(2ws-1)^2, heads]` table into the `(heads, N, N)` bias added to the scores.
/// Gathered on the host in one loop (the table is a few thousand values): candle's
/// index_select, reshape and permute made two copies of every block's 1.5 MB bias at load.
pub fn relative_position_bias(table: &Tensor, ws: usize) -> Result<Tensor> {
    let n = ws * ws;
    let (rows, heads) = table.dims2()?;
    if rows != (2 * ws - 1) * (2 * ws - 1) {
        candle_core::bail!("relative position table of {rows} rows for window {ws}");
    }
    let values = table
        .to_dtype(DType::F32)?
        .to_device(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let idx = relative_position_index(ws);
    let mut bias = Vec::with_capacity(heads * n * n);
    for h in 0..heads {
        bias.extend(idx.iter().map(|&r| values[r as usize * heads + h]));
    }
    Tensor::from_vec(bias, (heads, n, n), &Device::Cpu)?
        .to_dtype(table.dtype())?
        .to_device(table.device())
}

/// The shifted-window mask for a padded feature map of `h x w` (multiples of `ws`), as
/// `(nW, N, N)` with windows row-major.
pub fn shift_mask(h: usize, w: usize, ws: usize) -> Vec<f32> {
    let shift = ws / 2;
    // Regions of the rolled image: the body, the band that wrapped from the start, and the
    // band that stayed; tokens attend only within their region.
    let region = |p: usize, size: usize| -> usize {
        if p + ws < size {
            0
        } else if p + shift < size {
            1
        } else {
            2
        }
    };
    let (nh, nw) = (h / ws, w / ws);
    let n = ws * ws;
    let mut mask = vec![0f32; nh * nw * n * n];
    let mut labels = vec![0usize; n];
    for wy in 0..nh {
        for wx in 0..nw {
            for (t, label) in labels.iter_mut().enumerate() {
                let y = wy * ws + t / ws;
                let x = wx * ws + t % ws;
                *label = 3 * region(y, h) + region(x, w);
            }
            let base = (wy * nw + wx) * n * n;
            for i in 0..n {
                for j in 0..n {
                    if labels[i] != labels[j] {
                        mask[base + i * n + j] = MASK_VALUE;
                    }
                }
            }
        }
    }
    mask
}

/// For a padded `h x w` map, the source position (row-major) of every token in window order
/// after the cyclic shift by `-shift` on both axes: one gather replaces the two rolls and the
/// window partition. Windows are row-major, tokens row-major inside a window.
pub fn window_order(h: usize, w: usize, ws: usize, shift: usize) -> Vec<u32> {
    let (nh, nw) = (h / ws, w / ws);
    let mut order = Vec::with_capacity(h * w);
    for wy in 0..nh {
        for wx in 0..nw {
            for iy in 0..ws {
                let y = (wy * ws + iy + shift) % h;
                for ix in 0..ws {
                    let x = (wx * ws + ix + shift) % w;
                    order.push((y * w + x) as u32);
                }
            }
        }
    }
    order
}

/// A window ordering and its inverse (window order back to the map), as device index tensors.
pub type Partition = (Tensor, Tensor);

/// Sizes kept per cache: a tiled image uses one tile shape (two when it has an alpha plane),
/// and whole-image runs of a folder one per image size.
pub const CACHED_SIZES: usize = 4;

/// A small least-recently-used map: the newest entry last.
struct Lru<K, V> {
    entries: Vec<(K, V)>,
}

impl<K: PartialEq + Copy, V: Clone> Lru<K, V> {
    fn new() -> Self {
        Self {
            entries: Vec::with_capacity(CACHED_SIZES + 1),
        }
    }

    fn get(&mut self, key: K) -> Option<V> {
        let i = self.entries.iter().position(|(k, _)| *k == key)?;
        let entry = self.entries.remove(i);
        let value = entry.1.clone();
        self.entries.push(entry);
        Some(value)
    }

    fn insert(&mut self, key: K, value: V) {
        self.entries.retain(|(k, _)| *k != key);
        if self.entries.len() == CACHED_SIZES {
            self.entries.remove(0);
        }
        self.entries.push((key, value));
    }
}

/// A per-size cache shared by every block of a model and every thread. A poisoned lock only
/// means another thread panicked between complete operations; the map is still consistent.
struct Shared<K, V>(Arc<Mutex<Lru<K, V>>>);

impl<K, V> Clone for Shared<K, V> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<K: PartialEq + Copy, V: Clone> Shared<K, V> {
    fn new() -> Self {
        Self(Arc::new(Mutex::new(Lru::new())))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Lru<K, V>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cached value for `key`, or `make()`'s, which is then cached.
    fn get_or_try_insert(&self, key: K, make: impl FnOnce() -> Result<V>) -> Result<V> {
        let mut map = self.lock();
        if let Some(v) = map.get(key) {
            return Ok(v);
        }
        let v = make()?;
        map.insert(key, v.clone());
        Ok(v)
    }
}

/// Shift masks and window orderings keyed by padded size, on the model's device (masks in its
/// dtype).
#[derive(Clone)]
pub struct WindowCache {
    window: usize,
    dtype: DType,
    device: Device,
    masks: Shared<(usize, usize), Tensor>,
    partitions: Shared<(usize, usize, bool), Partition>,
}

impl WindowCache {
    pub fn new(window: usize, dtype: DType, device: &Device) -> Self {
        Self {
            window,
            dtype,
            device: device.clone(),
            masks: Shared::new(),
            partitions: Shared::new(),
        }
    }

    /// The gather into window order for an `h x w` map (shifted by half a window or not), and
    /// the gather back.
    pub fn partition(&self, h: usize, w: usize, shifted: bool) -> Result<Partition> {
        self.partitions.get_or_try_insert((h, w, shifted), || {
            let shift = if shifted { self.window / 2 } else { 0 };
            let order = window_order(h, w, self.window, shift);
            let mut inverse = vec![0u32; order.len()];
            for (i, &src) in order.iter().enumerate() {
                inverse[src as usize] = i as u32;
            }
            Ok((
                Tensor::from_vec(order, h * w, &self.device)?,
                Tensor::from_vec(inverse, h * w, &self.device)?,
            ))
        })
    }

    pub fn mask(&self, h: usize, w: usize) -> Result<Tensor> {
        self.masks.get_or_try_insert((h, w), || {
            let ws = self.window;
            let n = ws * ws;
            Tensor::from_vec(
                shift_mask(h, w, ws),
                ((h / ws) * (w / ws), n, n),
                &Device::Cpu,
            )?
            .to_dtype(self.dtype)?
            .to_device(&self.device)
        })
    }

    #[cfg(test)]
    /// Number of sizes with a cached mask.
    pub fn len(&self) -> usize {
        self.masks.lock().entries.len()
    }

    #[cfg(test)]
    /// Number of cached window orderings (per size and shift).
    pub fn partitions(&self) -> usize {
        self.partitions.lock().entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host gather equals candle's index_select / reshape / permute of the table.
    #[test]
    fn bias_is_the_table_gathered_per_head() -> Result<()> {
        for (ws, heads) in [(4usize, 3usize), (8, 6)] {
            let n = ws * ws;
            let side = 2 * ws - 1;
            let table = Tensor::randn(0f32, 1.0, (side * side, heads), &Device::Cpu)?;
            let idx = Tensor::from_vec(relative_position_index(ws), n * n, &Device::Cpu)?;
            let want = table
                .index_select(&idx, 0)?
                .reshape((n, n, heads))?
                .permute((2, 0, 1))?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let ours = relative_position_bias(&table, ws)?;
            assert_eq!(ours.dims(), [heads, n, n]);
            assert_eq!(ours.flatten_all()?.to_vec1::<f32>()?, want);
        }
        let wrong = Tensor::zeros((10, 2), DType::F32, &Device::Cpu)?;
        assert!(relative_position_bias(&wrong, 4).is_err());
        Ok(())
    }

    #[test]
    fn index_matches_definition_at_corners() {
        let ws = 4;
        let idx = relative_position_index(ws);
        let n = ws * ws;
        // Same token: zero offset, the centre of the table.
        assert_eq!(idx[0], ((ws - 1) * (2 * ws - 1) + ws - 1) as u32);
        // Query at the last token, key at the first: the largest offset.
        assert_eq!(idx[(n - 1) * n], ((2 * ws - 1) * (2 * ws - 1) - 1) as u32);
        // Query first, key last: the smallest.
        assert_eq!(idx[n - 1], 0);
        // Query (0,1), key (0,0): dx = +1, dy = 0 -> row ws-1, column ws.
        assert_eq!(idx[n], ((ws - 1) * (2 * ws - 1) + ws) as u32);
    }

    #[test]
    fn only_last_row_and_column_of_windows_are_masked() {
        let (h, w, ws) = (24, 32, 8);
        let m = shift_mask(h, w, ws);
        let n = ws * ws;
        let nw = w / ws;
        for win in 0..(h / ws) * nw {
            let (wy, wx) = (win / nw, win % nw);
            let any = m[win * n * n..(win + 1) * n * n].iter().any(|&v| v != 0.0);
            assert_eq!(any, wy == h / ws - 1 || wx == nw - 1, "window {wy},{wx}");
        }
        // In the bottom-right window, the top-left token (region 1,1) and the bottom-right
        // token (region 2,2) must not see each other; a token always sees itself.
        let last = (h / ws) * nw - 1;
        assert_eq!(m[last * n * n + n - 1], MASK_VALUE);
        assert_eq!(m[last * n * n + (n - 1) * n + n - 1], 0.0);
    }

    #[test]
    fn cache_reuses_masks() -> Result<()> {
        let c = WindowCache::new(4, DType::F32, &Device::Cpu);
        let a = c.mask(8, 12)?;
        let _ = c.mask(8, 12)?;
        assert_eq!(c.len(), 1);
        assert_eq!(a.dims(), &[6, 16, 16]);
        c.mask(12, 8)?;
        assert_eq!(c.len(), 2);
        Ok(())
    }

    #[test]
    fn cache_keeps_only_the_most_recent_sizes() -> Result<()> {
        let c = WindowCache::new(4, DType::F32, &Device::Cpu);
        let first = c.mask(8, 8)?;
        for k in 1..20 {
            let (h, w) = (8 + 4 * k, 8 + 4 * (k % 3));
            c.mask(h, w)?;
            c.partition(h, w, k % 2 == 0)?;
            // Keep the first size in use, as a tile shape used by every batch is.
            c.mask(8, 8)?;
            assert!(c.len() <= CACHED_SIZES && c.partitions() <= CACHED_SIZES);
        }
        assert_eq!(c.len(), CACHED_SIZES);
        // Still the same tensor: the size in use was never evicted and rebuilt.
        assert_eq!(c.mask(8, 8)?.id(), first.id());
        Ok(())
    }

    #[test]
    fn window_order_is_roll_then_partition() -> Result<()> {
        let (b, h, w, ws, c) = (2, 8, 12, 4, 3);
        let x =
            Tensor::arange(0f32, (b * h * w * c) as f32, &Device::Cpu)?.reshape((b, h, w, c))?;
        for shift in [0, ws / 2] {
            let s = shift as i32;
            let want = x
                .roll(-s, 1)?
                .roll(-s, 2)?
                .reshape((b, h / ws, ws, w / ws, ws, c))?
                .permute((0, 1, 3, 2, 4, 5))?
                .flatten_all()?
                .to_vec1::<f32>()?;
            let c_ = WindowCache::new(ws, DType::F32, &Device::Cpu);
            let (fwd, inv) = c_.partition(h, w, shift > 0)?;
            let got = x.reshape((b, h * w, c))?.index_select(&fwd, 1)?;
            assert_eq!(got.flatten_all()?.to_vec1::<f32>()?, want, "shift {shift}");
            let back = got.index_select(&inv, 1)?.reshape((b, h, w, c))?;
            assert_eq!(
                back.flatten_all()?.to_vec1::<f32>()?,
                x.flatten_all()?.to_vec1::<f32>()?
            );
        }
        Ok(())
    }
}
