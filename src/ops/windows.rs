//! Derived attention inputs, computed once instead of per forward.
//!
//! The relative-position bias depends only on a block's table. The CPU reads it straight from
//! the table, reordered once at load so that each query's biases come in runs of `ws`
//! contiguous values ([`RelativeBias`]); other devices get it gathered into `(heads, N, N)` at
//! load. The shift mask depends only on the padded feature size; the official code rebuilds it
//! on the host in every shifted block for every size but the training size. Here the CPU keeps
//! one region label per token ([`shift_regions`], 256 bytes a window) and other devices a mask
//! built once per (H, W); both are shared by every shifted block, tile and batch, and safe to
//! use from several threads, as is the gather that puts tokens into (shifted) window order.
//! Only the few most recently used sizes are kept: a mask costs ~200 MB at window 16 for a
//! 512² tile, and a folder of differently sized images would otherwise grow the cache without
//! bound.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};

/// Mask value for token pairs from different regions of the rolled image, as the official
/// code uses (not -inf: the softmax result is the same, and it keeps fp16 finite).
pub(crate) const MASK_VALUE: f32 = -100.0;

/// A block's relative-position bias, kept as its `[(2hs-1)(2ws-1), heads]` table: 4 KB a head
/// instead of the 256 KB a gathered `(N, N)` bias takes at window 16, so it stays in L1 and
/// costs nothing to load. The bias of query `(yi, xi)` and key `(yj, xj)` is table row
/// `(yi - yj + hs - 1) * side + (xi - xj + ws - 1)` (`side = 2ws - 1`): for a fixed query and
/// key row `yj` the `ws` keys read `ws` neighbouring table entries in reverse order. Stored per
/// head with each table row reversed, those are `ws` contiguous values. Windows are `hs` rows
/// of `ws` tokens: square for the Swin family, `8 x 32` and `32 x 8` for DAT.
#[derive(Clone, Debug)]
pub struct RelativeBias {
    height: usize,
    window: usize,
    heads: usize,
    /// `rows[(h * rows + r) * side + m] = table[r * side + side - 1 - m][h]`, `rows = 2hs - 1`;
    /// where `full`, the `(heads, N, N)` bias itself.
    rows: Vec<f32>,
    /// A bias free for every pair of tokens (FDAT's), not a function of their offset
    /// ([`Self::full`]).
    full: bool,
}

impl RelativeBias {
    /// The bias of `ws`-square windows.
    pub fn new(table: &Tensor, ws: usize) -> Result<Self> {
        Self::rectangular(table, (ws, ws))
    }

    /// The bias of windows of `hs` rows of `ws` tokens.
    pub fn rectangular(table: &Tensor, (hs, ws): (usize, usize)) -> Result<Self> {
        let side = 2 * ws - 1;
        let (rows, heads) = table.dims2()?;
        if ws == 0 || hs == 0 || rows != (2 * hs - 1) * side {
            candle_core::bail!("relative position table of {rows} rows for window {hs}x{ws}");
        }
        let table_rows = rows / side;
        let values = table
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut reversed = Vec::with_capacity(heads * rows);
        for h in 0..heads {
            for r in 0..table_rows {
                reversed.extend((0..side).map(|m| values[(r * side + side - 1 - m) * heads + h]));
            }
        }
        Ok(Self {
            height: hs,
            window: ws,
            heads,
            rows: reversed,
            full: false,
        })
    }

    /// A bias free for every pair of tokens of `ws`-square windows: `bias` `(heads, N, N)`.
    pub fn full(bias: &Tensor, ws: usize) -> Result<Self> {
        let n = ws * ws;
        let (heads, rows, cols) = bias.dims3()?;
        if ws == 0 || rows != n || cols != n {
            candle_core::bail!("a bias of {rows}x{cols} for windows of {ws}x{ws} tokens");
        }
        let rows = bias
            .to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(Self {
            height: ws,
            window: ws,
            heads,
            rows,
            full: true,
        })
    }

    pub fn heads(&self) -> usize {
        self.heads
    }

    /// Tokens per window row.
    pub fn window(&self) -> usize {
        self.window
    }

    /// Tokens per window.
    pub fn tokens(&self) -> usize {
        self.height * self.window
    }

    /// Adds head `h`'s biases for query `i` to its `N` scores.
    #[inline(always)]
    pub fn add_to_row(&self, h: usize, i: usize, row: &mut [f32]) {
        if self.full {
            let n = self.tokens();
            let bias = &self.rows[(h * n + i) * n..][..n];
            row.iter_mut().zip(bias).for_each(|(s, b)| *s += b);
            return;
        }
        // The official windows, with their runs a compile-time length: whole vector adds.
        match self.window {
            16 => self.add_runs::<16>(h, i, row),
            32 => self.add_runs::<32>(h, i, row),
            8 => self.add_runs::<8>(h, i, row),
            ws => self.add_runs_of(ws, h, i, row),
        }
    }

    #[inline(always)]
    fn add_runs<const WS: usize>(&self, h: usize, i: usize, row: &mut [f32]) {
        let side = 2 * WS - 1;
        let hs = self.height;
        let (yi, xi) = (i / WS, i % WS);
        let size = (2 * hs - 1) * side;
        let head = &self.rows[h * size..(h + 1) * size];
        for (yj, keys) in row.as_chunks_mut::<WS>().0.iter_mut().take(hs).enumerate() {
            let run: &[f32; WS] = head[(yi + hs - 1 - yj) * side + WS - 1 - xi..][..WS]
                .try_into()
                .expect("a run of WS values");
            // Whole arrays in and out: element by element through the two references,
            // the compiler kept every add scalar.
            *keys = std::array::from_fn(|j| keys[j] + run[j]);
        }
    }

    #[inline(always)]
    fn add_runs_of(&self, ws: usize, h: usize, i: usize, row: &mut [f32]) {
        let side = 2 * ws - 1;
        let hs = self.height;
        let (yi, xi) = (i / ws, i % ws);
        let size = (2 * hs - 1) * side;
        let head = &self.rows[h * size..(h + 1) * size];
        for (yj, keys) in row.chunks_exact_mut(ws).take(hs).enumerate() {
            let run = &head[(yi + hs - 1 - yj) * side + ws - 1 - xi..][..ws];
            keys.iter_mut().zip(run).for_each(|(s, b)| *s += b);
        }
    }

    /// The `(heads, N, N)` bias, as the GPU kernel and candle's graph take it.
    pub fn gathered(&self) -> Vec<f32> {
        let n = self.tokens();
        let mut bias = vec![0f32; self.heads * n * n];
        for (hi, row) in bias.chunks_exact_mut(n).enumerate() {
            self.add_to_row(hi / n, hi % n, row);
        }
        bias
    }

    /// What a layer on `device` keeps beside the table: nothing on the CPU, whose kernels
    /// read the table itself; elsewhere [`Self::tensor`], for candle's graph.
    pub fn for_graph(&self, dtype: DType, device: &Device) -> Result<Option<Tensor>> {
        match super::Backend::of(device) {
            super::Backend::Cpu => Ok(None),
            super::Backend::Cuda | super::Backend::Other => self.tensor(dtype, device).map(Some),
        }
    }

    /// [`Self::gathered`] as a `(heads, N, N)` tensor in `dtype` on `device`.
    pub fn tensor(&self, dtype: DType, device: &Device) -> Result<Tensor> {
        let n = self.tokens();
        Tensor::from_vec(self.gathered(), (self.heads, n, n), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(device)
    }
}

/// The `(heads, N, N)` bias added to the scores, gathered from a `[(2ws-1)^2, heads]` table
/// on the table's device and in its dtype.
pub fn relative_position_bias(table: &Tensor, ws: usize) -> Result<Tensor> {
    RelativeBias::new(table, ws)?.tensor(table.dtype(), table.device())
}

/// Region label (0..9) of every token of window `win` of a padded `h x w` map (windows
/// row-major; a batch repeats the map's windows) after the half-window shift: which of the
/// 3x3 regions of the rolled map it lies in. Tokens attend only within their region.
pub fn window_labels(h: usize, w: usize, ws: usize, win: usize, out: &mut [u8]) {
    rectangle_labels((h, w), (ws, ws), win, out)
}

/// [`window_labels`] for windows of `hs` rows of `ws` tokens, shifted by half of each.
pub fn rectangle_labels(
    (h, w): (usize, usize),
    (hs, ws): (usize, usize),
    win: usize,
    out: &mut [u8],
) {
    // Regions of the rolled image along one axis: the body, the band that wrapped from the
    // start, and the band that stayed.
    let region = |p: usize, size: usize, win: usize| -> u8 {
        if p + win < size {
            0
        } else if p + win / 2 < size {
            1
        } else {
            2
        }
    };
    let nw = w / ws;
    let win = win % ((h / hs) * nw);
    let (wy, wx) = (win / nw, win % nw);
    for (t, label) in out.iter_mut().take(hs * ws).enumerate() {
        let y = wy * hs + t / ws;
        let x = wx * ws + t % ws;
        *label = 3 * region(y, h, hs) + region(x, w, ws);
    }
}

/// [`window_labels`] of every window of an `h x w` map, `(nW, N)`.
pub fn shift_regions(h: usize, w: usize, ws: usize) -> Vec<u8> {
    rectangle_regions((h, w), (ws, ws))
}

/// [`rectangle_labels`] of every window of an `h x w` map, `(nW, N)`.
pub fn rectangle_regions((h, w): (usize, usize), (hs, ws): (usize, usize)) -> Vec<u8> {
    let n = hs * ws;
    let mut labels = vec![0u8; (h / hs) * (w / ws) * n];
    for (win, out) in labels.chunks_exact_mut(n).enumerate() {
        rectangle_labels((h, w), (hs, ws), win, out);
    }
    labels
}

/// The shifted-window mask for a padded feature map of `h x w` (multiples of `ws`), as
/// `(nW, N, N)` with windows row-major: [`MASK_VALUE`] between tokens of different regions.
pub fn shift_mask(h: usize, w: usize, ws: usize) -> Vec<f32> {
    let n = ws * ws;
    let labels = shift_regions(h, w, ws);
    let mut mask = vec![0f32; labels.len() * n];
    for (rows, labels) in mask.chunks_exact_mut(n * n).zip(labels.chunks_exact(n)) {
        for (row, li) in rows.chunks_exact_mut(n).zip(labels) {
            for (m, lj) in row.iter_mut().zip(labels) {
                if li != lj {
                    *m = MASK_VALUE;
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

/// Shift masks, region labels and window orderings keyed by padded size, on the model's
/// device (masks in its dtype; labels on the host, for the CPU kernel).
#[derive(Clone)]
pub struct WindowCache {
    window: usize,
    dtype: DType,
    device: Device,
    masks: Shared<(usize, usize), Tensor>,
    regions: Shared<(usize, usize), Arc<[u8]>>,
    partitions: Shared<(usize, usize, bool), Partition>,
}

impl WindowCache {
    pub fn new(window: usize, dtype: DType, device: &Device) -> Self {
        Self {
            window,
            dtype,
            device: device.clone(),
            masks: Shared::new(),
            regions: Shared::new(),
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

    /// [`shift_regions`] for an `h x w` map.
    pub fn regions(&self, h: usize, w: usize) -> Result<Arc<[u8]>> {
        self.regions
            .get_or_try_insert((h, w), || Ok(shift_regions(h, w, self.window).into()))
    }

    #[cfg(test)]
    /// Number of sizes with a cached mask or cached labels (a model uses one kind: labels on
    /// the CPU, masks elsewhere).
    pub fn len(&self) -> usize {
        self.masks.lock().entries.len() + self.regions.lock().entries.len()
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
    use crate::tests::normal;

    /// Index into the `(2ws-1)^2` bias table for every (query, key) pair of a window,
    /// row-major, as the official code builds it.
    fn relative_position_index(ws: usize) -> Vec<u32> {
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

    /// The host gather equals candle's index_select / reshape / permute of the table.
    #[test]
    fn bias_is_the_table_gathered_per_head() -> Result<()> {
        // Window 16 takes the compile-time path, the others the general one.
        for (ws, heads) in [(4usize, 3usize), (8, 6), (16, 2), (7, 1)] {
            let n = ws * ws;
            let side = 2 * ws - 1;
            let table = normal(0.0, 1.0, (side * side, heads), &Device::Cpu)?;
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

    /// The labels against the official construction: an image of region numbers filled slice
    /// by slice (rows `..h-ws`, `h-ws..h-shift`, `h-shift..`, the same for columns), then cut
    /// into windows.
    #[test]
    fn labels_follow_the_official_slices() {
        for (h, w, ws) in [(8, 12, 4), (24, 16, 8), (4, 8, 4), (32, 48, 16)] {
            let shift = ws / 2;
            let slices = |size: usize| {
                [
                    (0, size - ws),
                    (size - ws, size - shift),
                    (size - shift, size),
                ]
            };
            let mut img = vec![0u8; h * w];
            let mut count = 0;
            for (y0, y1) in slices(h) {
                for (x0, x1) in slices(w) {
                    for y in y0..y1 {
                        img[y * w + x0..y * w + x1].fill(count);
                    }
                    count += 1;
                }
            }
            let ours = shift_regions(h, w, ws);
            let nw = w / ws;
            for (t, &label) in ours.iter().enumerate() {
                let (win, tok) = (t / (ws * ws), t % (ws * ws));
                let y = (win / nw) * ws + tok / ws;
                let x = (win % nw) * ws + tok % ws;
                assert_eq!(
                    label,
                    img[y * w + x],
                    "{h}x{w}/{ws}: window {win}, token {tok}"
                );
            }
        }
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
