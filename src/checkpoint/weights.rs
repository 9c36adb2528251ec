//! A checkpoint's tensors, left where the file holds them and converted to f32 only when a
//! layer asks for one.
//!
//! Converting every tensor at load put a second copy of the model in fresh memory: reading a
//! 50-70 MB checkpoint took 27-37 ms on two cores, most of it page faults, before any layer
//! was built. Converted one by one as the layers are built, each copy lives only until its
//! layer has packed it, and the next one reuses its memory.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::VarBuilder;
use rayon::prelude::*;

use super::error::TensorError;

/// A weight file's bytes: mapped where the OS allows it, read otherwise, or compiled in.
pub(crate) enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
    Static(&'static [u8]),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(map) => map,
            Self::Owned(bytes) => bytes,
            Self::Static(bytes) => bytes,
        }
    }
}

/// Where one tensor lies in the file, in its own dtype: `range` holds exactly its elements.
#[derive(Clone)]
pub(crate) struct Stored {
    pub dtype: DType,
    pub dims: Vec<usize>,
    pub range: Range<usize>,
    /// The bytes are the row-major data of the reversed shape: a column-major view that torch
    /// saved as it was.
    pub column_major: bool,
    /// The whole archive entry the tensor lies in, and the CRC-32 the archive records for it.
    pub checksum: Option<(Range<usize>, u32)>,
}

/// One tensor: in the file, or already read (a compressed archive entry, a dtype read by
/// candle's own loader).
#[derive(Clone)]
pub(crate) enum Entry {
    Stored(Stored),
    Loaded(Tensor),
}

/// The tensors of a state dict by name, each converted to f32 (on the CPU) when asked for.
/// Cloning shares them.
#[derive(Clone)]
pub struct Weights(Arc<Inner>);

struct Inner {
    /// The bytes that [`Entry::Stored`] ranges point into.
    bytes: Bytes,
    entries: HashMap<String, Entry>,
}

impl Weights {
    /// `entries` in `bytes`, named as the file names them but for a `module.` prefix (a
    /// DataParallel wrapper's), which is dropped; of two that then share a name, the later wins.
    pub(crate) fn new(bytes: Bytes, entries: Vec<(String, Entry)>) -> Self {
        let entries = entries
            .into_iter()
            .map(|(name, e)| match name.strip_prefix("module.") {
                Some(short) => (short.to_string(), e),
                None => (name, e),
            })
            .collect();
        Self(Arc::new(Inner { bytes, entries }))
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.0.entries.is_empty()
    }

    /// The names, in no particular order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.entries.keys().map(String::as_str)
    }

    /// The shape of tensor `name`.
    pub fn dims(&self, name: &str) -> Option<&[usize]> {
        self.0.entries.get(name).map(|e| match e {
            Entry::Stored(s) => s.dims.as_slice(),
            Entry::Loaded(t) => t.dims(),
        })
    }

    /// The dtype tensor `name` is stored in; `None` for one read into memory at load.
    pub fn stored_dtype(&self, name: &str) -> Option<DType> {
        match self.0.entries.get(name)? {
            Entry::Stored(s) => Some(s.dtype),
            Entry::Loaded(_) => None,
        }
    }

    /// Tensor `name` in f32 on the CPU, contiguous.
    pub fn get(&self, name: &str) -> Option<Result<Tensor, TensorError>> {
        self.0.entries.get(name).map(|e| match e {
            Entry::Stored(s) => self.convert(s),
            Entry::Loaded(t) => Ok(t.clone()),
        })
    }

    /// The same tensors in memory of their own, where they were in a mapped file: for weights
    /// kept after the load, which a file truncated meanwhile would otherwise take away (a
    /// mapped page that is gone faults, SIGBUS).
    pub(crate) fn detached(&self) -> Self {
        match &self.0.bytes {
            Bytes::Mapped(map) => Self(Arc::new(Inner {
                bytes: Bytes::Owned(map.to_vec()),
                entries: self.0.entries.clone(),
            })),
            Bytes::Owned(_) | Bytes::Static(_) => self.clone(),
        }
    }

    /// Whether the tensors are read from a mapped file.
    #[cfg(test)]
    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self.0.bytes, Bytes::Mapped(_))
    }

    /// A builder that reads these tensors as `dtype` on `device`.
    pub fn var_builder(self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        VarBuilder::from_backend(Box::new(self), dtype, device.clone())
    }

    /// The first tensor by name that cannot be read or holds a NaN or an infinity, with why
    /// (the same one whichever thread found it); `None` when all are sound. The stored ones
    /// are scanned in the file, not copied.
    pub(crate) fn first_bad(&self) -> Option<(String, TensorError)> {
        let mut names: Vec<&String> = self.0.entries.keys().collect();
        names.sort();
        let first_bad = names
            .into_par_iter()
            .map(|name| (name, self.check_one(&self.0.entries[name])))
            .find_first(|(_, r)| r.is_err());
        match first_bad {
            Some((name, Err(e))) => Some((name.clone(), e)),
            _ => None,
        }
    }

    fn check_one(&self, entry: &Entry) -> Result<(), TensorError> {
        let found = match entry {
            Entry::Stored(s) if !s.column_major => match &s.checksum {
                Some((entry, crc)) => self.checked_scan(s, (entry.clone(), *crc))?,
                None => first_non_finite(s.dtype, self.data(s)),
            },
            // Where the values are not in their row-major order, or not in a float format
            // read here, the converted tensor is searched (so the index is that of the
            // tensor as the layers see it).
            Entry::Stored(s) => {
                if let Some((entry, crc)) = &s.checksum {
                    self.check_crc(entry.clone(), *crc)?;
                }
                values_non_finite(&self.convert(s)?)?
            }
            Entry::Loaded(t) => values_non_finite(t)?,
        };
        match found {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The CRC-32 of archive entry `entry` checked, and the tensor's values in it scanned for
    /// a NaN or an infinity, in one pass: each block is scanned while the checksum has just
    /// brought it into cache. A checksum that differs is reported before any value.
    fn checked_scan(
        &self,
        s: &Stored,
        (entry, crc): (Range<usize>, u32),
    ) -> Result<Option<TensorError>, TensorError> {
        /// Bytes per block: well inside a core's L2.
        const BLOCK: usize = 1 << 16;
        let bytes = &self.0.bytes;
        if !(entry.start <= s.range.start && s.range.end <= entry.end) {
            // Not where the archive says its entry is: checked one after the other.
            self.check_crc(entry, crc)?;
            return Ok(first_non_finite(s.dtype, self.data(s)));
        }
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&bytes[entry.start..s.range.start]);
        let size = s.dtype.size_in_bytes();
        let mut found = None;
        for (k, block) in self.data(s).chunks(BLOCK / size * size).enumerate() {
            hasher.update(block);
            if found.is_none() {
                found = first_non_finite(s.dtype, block).map(|e| match e {
                    TensorError::NonFinite { value, index } => TensorError::NonFinite {
                        value,
                        index: index + k * (BLOCK / size),
                    },
                    other => other,
                });
            }
        }
        hasher.update(&bytes[s.range.end..entry.end]);
        if hasher.finalize() != crc {
            return Err(TensorError::Checksum);
        }
        Ok(found)
    }

    /// The CRC-32 of the archive entry at `entry` against the one the archive records.
    fn check_crc(&self, entry: Range<usize>, crc: u32) -> Result<(), TensorError> {
        if crc32fast::hash(&self.0.bytes[entry]) == crc {
            Ok(())
        } else {
            Err(TensorError::Checksum)
        }
    }

    fn data(&self, s: &Stored) -> &[u8] {
        &self.0.bytes[s.range.clone()]
    }

    fn convert(&self, s: &Stored) -> Result<Tensor, TensorError> {
        let data = self.data(s);
        let dims: Vec<usize> = if s.column_major {
            s.dims.iter().rev().copied().collect()
        } else {
            s.dims.clone()
        };
        let values: Vec<f32> = match s.dtype {
            DType::F32 => f32_values(data),
            DType::F16 => data.chunks_exact(2).map(f16_value).collect(),
            DType::BF16 => data.chunks_exact(2).map(bf16_value).collect(),
            other => {
                let t = Tensor::from_raw_buffer(data, other, &dims, &Device::Cpu)?;
                t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?
            }
        };
        let t = Tensor::from_vec(values, dims.as_slice(), &Device::Cpu)?;
        if s.column_major && dims.len() > 1 {
            let order: Vec<usize> = (0..dims.len()).rev().collect();
            Ok(t.permute(order)?.contiguous()?)
        } else {
            Ok(t)
        }
    }
}

#[cfg(test)]
impl FromIterator<(String, Tensor)> for Weights {
    /// Tensors already in memory, as a test makes them.
    fn from_iter<I: IntoIterator<Item = (String, Tensor)>>(tensors: I) -> Self {
        let entries = tensors.into_iter().map(|(k, t)| (k, Entry::Loaded(t)));
        Self::new(Bytes::Owned(Vec::new()), entries.collect())
    }
}

/// The first NaN or infinity in `data` read as `dtype`, for the float formats read here
/// directly; the others are converted and searched.
fn first_non_finite(dtype: DType, data: &[u8]) -> Option<TensorError> {
    let found = match dtype {
        DType::F32 => first_not_finite(data, 4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        DType::F16 => first_not_finite(data, 2, f16_value),
        DType::BF16 => first_not_finite(data, 2, bf16_value),
        other => {
            let t = Tensor::from_raw_buffer(
                data,
                other,
                &[data.len() / other.size_in_bytes()],
                &Device::Cpu,
            )
            .and_then(|t| t.to_dtype(DType::F32));
            return match t {
                Ok(t) => values_non_finite(&t).unwrap_or_else(Some),
                Err(e) => Some(e.into()),
            };
        }
    };
    found.map(|(index, value)| TensorError::NonFinite { value, index })
}

/// An f16 from its two little-endian bytes.
fn f16_value(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// A bf16 from its two little-endian bytes.
fn bf16_value(b: &[u8]) -> f32 {
    half::bf16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// Little-endian f32 bytes as values: one copy (a plain memory copy on little-endian CPUs).
fn f32_values(data: &[u8]) -> Vec<f32> {
    let n = data.len() / 4;
    #[cfg(target_endian = "little")]
    {
        let mut values = Vec::<f32>::with_capacity(n);
        // SAFETY: `values` has room for n f32s, 4n bytes, which `data` holds; every bit
        // pattern is an f32, and a little-endian CPU stores them as the file does.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), values.as_mut_ptr().cast::<u8>(), 4 * n);
            values.set_len(n);
        }
        values
    }
    #[cfg(not(target_endian = "little"))]
    data.chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The first value of `data` (of `size` bytes each, read by `value`) that is not finite, with
/// its index. Blocks of values are tested without an early exit, so that the test runs in
/// vector lanes; only a block that holds one is searched.
fn first_not_finite(
    data: &[u8],
    size: usize,
    value: impl Fn(&[u8]) -> f32,
) -> Option<(usize, f32)> {
    const BLOCK: usize = 256;
    data.chunks(BLOCK * size)
        .enumerate()
        .find(|(_, block)| {
            !block
                .chunks_exact(size)
                .fold(true, |finite, b| finite & value(b).is_finite())
        })
        .and_then(|(k, block)| {
            let mut values = block.chunks_exact(size).map(&value).enumerate();
            values
                .find(|(_, x)| !x.is_finite())
                .map(|(i, x)| (k * BLOCK + i, x))
        })
}

/// The first NaN or infinity among `t`'s values (f32) in row-major order.
fn values_non_finite(t: &Tensor) -> Result<Option<TensorError>, TensorError> {
    let values = t.flatten_all()?.to_vec1::<f32>()?;
    Ok(values
        .iter()
        .position(|x| !x.is_finite())
        .map(|index| TensorError::NonFinite {
            value: values[index],
            index,
        }))
}

impl SimpleBackend for Weights {
    fn get(
        &self,
        shape: Shape,
        name: &str,
        _: candle_nn::Init,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        // The shape is checked before anything is converted, with candle's own message.
        match self.dims(name) {
            Some(dims) if dims != shape.dims() => Err(candle_core::Error::UnexpectedShape {
                msg: format!("shape mismatch for {name}"),
                expected: shape,
                got: dims.into(),
            }
            .bt()),
            _ => self.get_unchecked(name, dtype, device),
        }
    }

    fn get_unchecked(
        &self,
        name: &str,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let t = Weights::get(self, name).ok_or_else(|| {
            candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            }
            .bt()
        })?;
        let t = t.map_err(candle_core::Error::wrap)?;
        t.to_device(device)?.to_dtype(dtype)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.entries.contains_key(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `values` as little-endian f32 bytes.
    fn bytes(values: &[f32]) -> Vec<u8> {
        values.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    #[test]
    fn a_column_major_tensor_reads_and_is_checked_as_its_row_major_self() {
        // The 2x3 matrix [[0, 1, 2], [3, 4, 5]] stored column-major, after 4 bytes of
        // something else.
        let mut data = vec![0u8; 4];
        data.extend(bytes(&[0., 3., 1., 4., 2., 5.]));
        let stored = |column_major| Stored {
            dtype: DType::F32,
            dims: vec![2, 3],
            range: 4..28,
            column_major,
            checksum: None,
        };
        let w = Weights::new(
            Bytes::Owned(data.clone()),
            vec![
                ("c".into(), Entry::Stored(stored(true))),
                ("module.r".into(), Entry::Stored(stored(false))),
            ],
        );
        let c = w.get("c").unwrap().unwrap();
        assert_eq!(c.to_vec2::<f32>().unwrap(), [[0., 1., 2.], [3., 4., 5.]]);
        let r = w.get("r").expect("the prefix dropped").unwrap();
        assert_eq!(r.to_vec2::<f32>().unwrap(), [[0., 3., 1.], [4., 2., 5.]]);
        assert_eq!(w.dims("c"), Some(&[2, 3][..]));
        assert!(w.first_bad().is_none());
        // An infinity at storage position 1 is element (1, 0): index 3 row-major.
        data[8..12].copy_from_slice(&f32::INFINITY.to_le_bytes());
        let w = Weights::new(
            Bytes::Owned(data),
            vec![("c".into(), Entry::Stored(stored(true)))],
        );
        let (name, e) = w.first_bad().unwrap();
        assert_eq!(name, "c");
        assert!(matches!(e, TensorError::NonFinite { index: 3, .. }), "{e}");
    }

    #[test]
    fn a_shape_that_differs_from_the_layers_is_refused_before_conversion() {
        let w = Weights::new(
            Bytes::Owned(bytes(&[1., 2., 3., 4.])),
            vec![(
                "w".into(),
                Entry::Stored(Stored {
                    dtype: DType::F32,
                    dims: vec![2, 2],
                    range: 0..16,
                    column_major: false,
                    checksum: None,
                }),
            )],
        );
        let vb = w.var_builder(DType::F32, &Device::Cpu);
        let e = vb.get((4, 1), "w").unwrap_err().to_string();
        assert!(e.contains("shape mismatch for w"), "{e}");
        assert!(vb.get((2, 2), "absent").is_err());
        let t = vb.get((2, 2), "w").unwrap();
        assert_eq!(t.to_vec2::<f32>().unwrap(), [[1., 2.], [3., 4.]]);
    }

    #[test]
    fn a_checksummed_tensor_is_scanned_across_blocks_and_the_checksum_comes_first() {
        // 40,000 f32 values (160,000 bytes: three blocks of the scan) between 12 bytes of
        // archive entry before and 8 after, an infinity at index 30,000, in the second block.
        let mut values = vec![0.5f32; 40_000];
        values[30_000] = f32::NEG_INFINITY;
        let mut data = vec![7u8; 12];
        data.extend(bytes(&values));
        data.extend([9u8; 8]);
        let crc = crc32fast::hash(&data);
        let weights = |data: Vec<u8>, crc: u32| {
            let stored = Stored {
                dtype: DType::F32,
                dims: vec![200, 200],
                range: 12..160_012,
                column_major: false,
                checksum: Some((0..160_020, crc)),
            };
            Weights::new(
                Bytes::Owned(data),
                vec![("w".into(), Entry::Stored(stored))],
            )
        };
        let (_, e) = weights(data.clone(), crc).first_bad().unwrap();
        let found = matches!(e, TensorError::NonFinite { index: 30_000, value }
            if value == f32::NEG_INFINITY);
        assert!(found, "{e}");
        // A byte after the tensor changed: the whole entry is checked, and the damage is
        // what is reported, not the value.
        let mut damaged = data.clone();
        damaged[160_015] ^= 1;
        let (_, e) = weights(damaged, crc).first_bad().unwrap();
        assert!(matches!(e, TensorError::Checksum), "{e}");
        // Sound values and entry: nothing to report.
        data[12 + 4 * 30_000..][..4].copy_from_slice(&1f32.to_le_bytes());
        let crc = crc32fast::hash(&data);
        assert!(weights(data, crc).first_bad().is_none());
    }
}
