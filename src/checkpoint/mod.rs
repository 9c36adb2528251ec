//! Reading model weights (of any architecture the registry holds) from `.safetensors` and
//! PyTorch `.pth` files.
//!
//! The file format is told by content, not extension: safetensors starts with a little-endian
//! header length, a modern `.pth` is a zip archive. Key names are normalised (wrappers,
//! `module.` prefix), the official buffers are dropped (they are recomputed exactly at load),
//! and every tensor is checked for NaN/Inf before the model sees it.

use std::collections::BTreeMap;
use std::path::Path;

mod error;
pub mod pth;
mod weights;

use candle_core::{DType, Device, Tensor};

use crate::checkpoint::pth::{state_dict_infos, PthArchive};
use crate::nets::registry::{infer_file, Beyond, Shapes};
use crate::nets::ArchConfig;
pub use error::{ModelError, TensorError};
pub(crate) use weights::{Bytes, Weights};
use weights::{Entry, Stored};

/// Where the weights came from, for messages and `upscale info`.
#[derive(Clone, Debug)]
pub enum Source {
    File(std::path::PathBuf),
    Embedded(&'static str),
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(p) => write!(f, "{}", p.display()),
            Source::Embedded(name) => write!(f, "{name} (embedded)"),
        }
    }
}

/// A validated state dict of a supported architecture: official key names, no buffers,
/// every tensor checked to be readable and finite; each is converted to f32 on the CPU when a
/// layer asks for it ([`Weights`]).
#[derive(Clone)]
pub struct Checkpoint {
    pub source: Source,
    pub config: ArchConfig,
    pub tensors: Weights,
    /// safetensors metadata, when the file had any.
    pub metadata: BTreeMap<String, String>,
    /// The wrapper key the state dict came from in a `.pth` (e.g. `params_ema`); `upscale
    /// info` and `convert` report it.
    pub wrapper: Option<String>,
}

/// Wrapper keys in order of preference: EMA weights are what the authors evaluate.
const PTH_KEYS: [&str; 5] = ["params_ema", "params", "state_dict", "model", "net"];

/// Tensors found unreadable while a file's tensors were listed, each with why.
type Failed = Vec<(String, TensorError)>;

impl Checkpoint {
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let source = Source::File(path.to_path_buf());
        let io = |e: std::io::Error| ModelError::Io {
            path: path.display().to_string(),
            source: e,
        };
        let bytes = file_bytes(path).map_err(io)?;
        if bytes.is_empty() {
            return Err(ModelError::file(&source, "the file is empty"));
        }
        if bytes.starts_with(b"PK\x03\x04") || bytes.starts_with(pth::LEGACY_MAGIC) {
            Self::from_pth(path, bytes, source)
        } else if looks_like_safetensors(&bytes) {
            Self::from_safetensors(bytes, source)
        } else if bytes.first() == Some(&0x80) {
            Err(ModelError::file(
                &source,
                "a pickle that is no PyTorch checkpoint (no torch.save archive or magic number)",
            ))
        } else {
            Err(ModelError::file(
                &source,
                "neither a safetensors file nor a PyTorch .pth archive",
            ))
        }
    }

    #[cfg(test)]
    pub fn from_safetensors_bytes(bytes: &[u8], source: Source) -> Result<Self, ModelError> {
        Self::from_safetensors(Bytes::Owned(bytes.to_vec()), source)
    }

    /// A safetensors file's tensors, left in `bytes` until a layer asks for them.
    pub(crate) fn from_safetensors(bytes: Bytes, source: Source) -> Result<Self, ModelError> {
        let st =
            safetensors::SafeTensors::deserialize(&bytes).map_err(|e| ModelError::Safetensors {
                origin: source.to_string(),
                source: e,
            })?;
        let metadata = safetensors::SafeTensors::read_metadata(&bytes)
            .ok()
            .and_then(|(_, m)| m.metadata().clone())
            .map(|m| m.into_iter().collect())
            .unwrap_or_default();
        let (entries, buffers, failed) = listed(&st, &bytes);
        drop(st);
        let listing = Listing {
            entries,
            buffers,
            failed,
        };
        Self::from_entries(bytes, listing, source, (None, metadata))
    }

    fn from_pth(path: &Path, bytes: Bytes, source: Source) -> Result<Self, ModelError> {
        let mut archive = PthArchive::open(path).map_err(|e| ModelError::Archive {
            origin: source.to_string(),
            source: e,
        })?;
        let keys = archive.top_level_keys();
        // The wrappers present, in order of preference, then the object itself as a bare
        // state dict.
        let wrappers = PTH_KEYS.iter().filter(|k| keys.iter().any(|key| key == *k));
        for key in wrappers.map(|k| Some(*k)).chain([None]) {
            // Buffers are dropped unread: they are recomputed at load. Their shapes are kept
            // for the one configuration recorded only there (Swin2SR's window).
            let infos = state_dict_infos(&archive, key, is_buffer);
            if infos.is_empty() {
                continue;
            }
            let buffers: Shapes = state_dict_infos(&archive, key, |n| !is_buffer(n))
                .into_iter()
                .filter_map(|(name, info)| Some((name, info.ok()?.layout.dims().to_vec())))
                .collect();
            let (mut entries, mut failed) = (Vec::new(), Failed::new());
            for (name, info) in infos {
                // Storages the archive keeps uncompressed (all of torch.save's) are read
                // where they lie in the file; others are read out of the archive now.
                let entry = info.and_then(|info| match archive.stored(&info, bytes.len())? {
                    Some(stored) => Ok(Entry::Stored(stored)),
                    None => Ok(Entry::Loaded(archive.tensor(&info)?)),
                });
                match entry.map_err(TensorError::from) {
                    Ok(Entry::Loaded(t)) => match as_f32(t) {
                        Ok(t) => entries.push((name, Entry::Loaded(t))),
                        Err(e) => failed.push((name, e)),
                    },
                    Ok(e) => entries.push((name, e)),
                    Err(e) => failed.push((name, e)),
                }
            }
            let listing = Listing {
                entries,
                buffers,
                failed,
            };
            let wrapper = key.map(str::to_string);
            return Self::from_entries(bytes, listing, source, (wrapper, BTreeMap::new()));
        }
        Err(ModelError::file(
            &source,
            "no state dict found (looked for params_ema, params, state_dict, model, net and a bare dict)",
        ))
    }

    /// The checkpoint of `listing`'s entries (in `bytes`), with the `.pth` wrapper key and the
    /// safetensors metadata it came with; refused with the first bad tensor by name (of those
    /// that failed to list and of those holding a NaN or an infinity) so that the message
    /// does not change from run to run, whichever thread found it.
    fn from_entries(
        bytes: Bytes,
        listing: Listing,
        source: Source,
        (wrapper, metadata): (Option<String>, BTreeMap<String, String>),
    ) -> Result<Self, ModelError> {
        let Listing {
            mut entries,
            buffers,
            failed,
        } = listing;
        // In name order, so that of two names that are one without its `module.` prefix the
        // same one wins every time.
        entries.sort_by(|a, b| a.0.cmp(&b.0));
        let tensors = Weights::new(bytes, entries);
        let first_bad = failed
            .into_iter()
            .chain(tensors.first_bad())
            .min_by(|a, b| a.0.cmp(&b.0));
        if let Some((name, e)) = first_bad {
            return Err(ModelError::tensor(&source, &name, e));
        }
        if tensors.is_empty() {
            return Err(ModelError::file(&source, "the file holds no tensors"));
        }
        let shapes: BTreeMap<String, Vec<usize>> = tensors
            .names()
            .map(|k| (k.to_string(), tensors.dims(k).unwrap_or_default().to_vec()))
            .collect();
        let values = |name: &str| {
            let t = tensors.get(name)?.ok()?.flatten_all().ok()?;
            t.to_vec1::<f32>().ok()
        };
        let beyond = Beyond {
            values: &values,
            buffers: &buffers,
            stored: metadata.get("upscale.config").map(String::as_str),
        };
        let config = infer_file(&shapes, &beyond).map_err(|e| ModelError::Config {
            origin: source.to_string(),
            source: e,
        })?;
        Ok(Self {
            source,
            config,
            tensors,
            metadata,
            wrapper,
        })
    }
}

/// A file's tensors as listed: the parameters, the shapes of the buffers dropped, and the
/// tensors that could not be read, each with why.
struct Listing {
    entries: Vec<(String, Entry)>,
    buffers: Shapes,
    failed: Failed,
}

/// The tensors of `st` (parsed from `bytes`) but the buffers, as entries pointing into `bytes`;
/// those in a format read by candle's loader are read now, and those it could not read are
/// listed apart; the buffers' shapes.
fn listed(st: &safetensors::SafeTensors, bytes: &[u8]) -> (Vec<(String, Entry)>, Shapes, Failed) {
    let base = bytes.as_ptr() as usize;
    let (mut entries, mut buffers, mut failed) = (Vec::new(), Shapes::new(), Failed::new());
    // Buffers are dropped unread, as they would be from a .pth: an official file's masks and
    // indices are recomputed at load, whatever values they hold.
    for (name, view) in st.tensors() {
        if is_buffer(&name) {
            buffers.insert(name, view.shape().to_vec());
            continue;
        }
        match candle_dtype(view.dtype()) {
            Some(dtype) => {
                let start = view.data().as_ptr() as usize - base;
                let stored = Stored {
                    dtype,
                    dims: view.shape().to_vec(),
                    range: start..start + view.data().len(),
                    column_major: false,
                    checksum: None,
                };
                entries.push((name, Entry::Stored(stored)));
            }
            None => match candle_core::safetensors::Load::load(&view, &Device::Cpu)
                .map_err(TensorError::from)
                .and_then(as_f32)
            {
                Ok(t) => entries.push((name, Entry::Loaded(t))),
                Err(e) => failed.push((name, e)),
            },
        }
    }
    (entries, buffers, failed)
}

impl Checkpoint {
    /// This checkpoint with its tensors in memory of their own ([`Weights::detached`]).
    pub(crate) fn detached(&self) -> Self {
        Self {
            tensors: self.tensors.detached(),
            ..self.clone()
        }
    }
}

/// A weight file's bytes: mapped where the OS allows it, else read. Mapping saves a copy of
/// the whole file and the page faults of a fresh buffer for it; the tensors are read out of
/// it as the layers ask for them.
fn file_bytes(path: &Path) -> std::io::Result<Bytes> {
    let file = std::fs::File::open(path)?;
    // An empty file cannot be mapped, and pipes or devices are read instead.
    if file.metadata()?.len() > 0 {
        // SAFETY: the map is read-only, and kept only while the model is built from it
        // (weights kept longer are copied out: `Checkpoint::detached`). Were the file
        // truncated by another process meanwhile, reading the lost pages would fault
        // (SIGBUS), as with any mapped model loader; a file replaced by a rename, the usual
        // way to update one, keeps the mapped data intact.
        if let Ok(map) = unsafe { memmap2::Mmap::map(&file) } {
            return Ok(Bytes::Mapped(map));
        }
    }
    std::fs::read(path).map(Bytes::Owned)
}

/// candle's name for the safetensors dtypes read here without candle's loader.
fn candle_dtype(dtype: safetensors::Dtype) -> Option<DType> {
    use safetensors::Dtype;
    Some(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::U8 => DType::U8,
        Dtype::U32 => DType::U32,
        Dtype::I64 => DType::I64,
        _ => return None,
    })
}

/// Buffers the official model registers: derived data that we recompute, never weights.
pub(crate) fn is_buffer(name: &str) -> bool {
    name.ends_with("relative_position_index")
        || name.ends_with("attn_mask")
        // Swin2SR's log-spaced coordinates, the continuous position bias's input.
        || name.ends_with("relative_coords_table")
        // DAT's shift masks of its training size, one per branch, and BatchNorm's counters.
        || name.ends_with("attn_mask_0")
        || name.ends_with("attn_mask_1")
        || name.ends_with("num_batches_tracked")
        // HAT's model-level indices for its window and overlapping cross-attention.
        || name == "relative_position_index_SA"
        || name == "relative_position_index_OCA"
}

fn looks_like_safetensors(bytes: &[u8]) -> bool {
    bytes.len() >= 9 && bytes[8] == b'{'
}

/// `t` as f32, contiguous ([`Weights::first_bad`] looks for non-finite values).
fn as_f32(t: Tensor) -> Result<Tensor, TensorError> {
    Ok(t.to_dtype(DType::F32).and_then(|t| t.contiguous())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-tensor safetensors file holding `t` in its own dtype, read back as a view.
    /// As a checkpoint reads it: listed, checked, then converted when asked for.
    fn converted(t: &Tensor) -> Result<Tensor, TensorError> {
        let bytes = safetensors::serialize([("t", t)], None).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (entries, _, failed) = listed(&st, &bytes);
        drop(st);
        if let Some((_, e)) = failed.into_iter().next() {
            return Err(e);
        }
        let weights = Weights::new(Bytes::Owned(bytes), entries);
        if let Some((_, e)) = weights.first_bad() {
            return Err(e);
        }
        weights.get("t").expect("the tensor is listed")
    }

    #[test]
    fn every_float_dtype_loads_as_candles_conversion_does() {
        // Odd sizes, so a conversion that drops or shifts elements cannot line up by chance.
        let v = (Tensor::randn(0f32, 1., (7, 13), &Device::Cpu).unwrap() * 100.).unwrap();
        for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let t = v.to_dtype(dtype).unwrap();
            let ours = converted(&t).unwrap();
            assert_eq!(ours.dims(), &[7, 13], "{dtype:?}");
            let want = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            let (ours, want) = (ours.flatten_all().unwrap(), want);
            let (a, b) = (
                ours.to_vec1::<f32>().unwrap(),
                want.to_vec1::<f32>().unwrap(),
            );
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{dtype:?}"
            );
        }
    }

    #[test]
    fn a_non_finite_value_is_found_in_every_float_dtype() {
        // In the first block of values searched at once, and in a later one.
        for (len, at) in [(40, 29), (600, 517)] {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut v = vec![0.5f32; len];
                v[at] = bad;
                let t = Tensor::from_vec(v, (len / 8, 8), &Device::Cpu).unwrap();
                for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
                    let err = converted(&t.to_dtype(dtype).unwrap()).unwrap_err();
                    assert!(
                        matches!(err, TensorError::NonFinite { index, .. } if index == at),
                        "{dtype:?} {bad} at {at}: {err}"
                    );
                }
            }
        }
    }
}
