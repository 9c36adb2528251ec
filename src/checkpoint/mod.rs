//! Reading model weights (of any architecture the registry holds) from `.safetensors` and
//! PyTorch `.pth` files.
//!
//! The file format is told by content, not extension: safetensors starts with a little-endian
//! header length, a modern `.pth` is a zip archive. Key names are normalised (wrappers,
//! `module.` prefix), the official buffers are dropped (they are recomputed exactly at load),
//! and every tensor is checked for NaN/Inf before the model sees it.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

mod error;
pub mod pth;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use crate::checkpoint::pth::{read_state_dict, PthArchive};
use crate::nets::ArchConfig;
pub use error::{ModelError, TensorError};

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

/// A validated state dict of a supported architecture: f32 tensors on the CPU, official key names, no buffers.
#[derive(Clone)]
pub struct Checkpoint {
    pub source: Source,
    pub config: ArchConfig,
    pub tensors: HashMap<String, Tensor>,
    /// safetensors metadata, when the file had any.
    pub metadata: BTreeMap<String, String>,
    /// The wrapper key the state dict came from in a `.pth` (e.g. `params_ema`); `upscale
    /// info` and `convert` report it.
    pub wrapper: Option<String>,
}

/// Wrapper keys in order of preference: EMA weights are what the authors evaluate.
const PTH_KEYS: [&str; 5] = ["params_ema", "params", "state_dict", "model", "net"];

impl Checkpoint {
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let source = Source::File(path.to_path_buf());
        let io = |e: std::io::Error| ModelError::Io {
            path: path.display().to_string(),
            source: e,
        };
        let bytes = FileBytes::open(path).map_err(io)?;
        if bytes.is_empty() {
            return Err(ModelError::file(&source, "the file is empty"));
        }
        if bytes.starts_with(b"PK\x03\x04") {
            Self::from_pth(path, source)
        } else if looks_like_safetensors(&bytes) {
            Self::from_safetensors_bytes(&bytes, source)
        } else if bytes.first() == Some(&0x80) {
            Err(ModelError::file(
                &source,
                "legacy (pre-zip) PyTorch pickle: re-save it with torch.save in a current PyTorch",
            ))
        } else {
            Err(ModelError::file(
                &source,
                "neither a safetensors file nor a PyTorch .pth archive",
            ))
        }
    }

    pub fn from_safetensors_bytes(bytes: &[u8], source: Source) -> Result<Self, ModelError> {
        let st =
            safetensors::SafeTensors::deserialize(bytes).map_err(|e| ModelError::Safetensors {
                origin: source.to_string(),
                source: e,
            })?;
        let metadata = safetensors::SafeTensors::read_metadata(bytes)
            .ok()
            .and_then(|(_, m)| m.metadata().clone())
            .map(|m| m.into_iter().collect())
            .unwrap_or_default();
        // Converted on all threads: most of the cost is the page faults of the fresh tensors,
        // which the cores take in parallel.
        let mut views = st.tensors();
        // Buffers are dropped unread, as they would be from a .pth: an official file's
        // masks and indices are recomputed at load, whatever values they hold.
        views.retain(|(name, _)| !is_buffer(name));
        views.sort_by(|a, b| a.0.cmp(&b.0));
        let converted: Vec<_> = views
            .into_par_iter()
            .map(|(name, view)| {
                let t = f32_tensor(&view);
                (name, t)
            })
            .collect();
        // The first bad tensor by name is reported, whichever thread found it, so that the
        // message does not change from run to run.
        let raw = converted
            .into_iter()
            .map(|(name, t)| match t {
                Ok(t) => Ok((name, t)),
                Err(e) => Err(ModelError::tensor(&source, &name, e)),
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut ck = Self::from_raw(raw, source, None)?;
        ck.metadata = metadata;
        Ok(ck)
    }

    fn from_pth(path: &Path, source: Source) -> Result<Self, ModelError> {
        let mut archive = PthArchive::open(path).map_err(|e| ModelError::Archive {
            origin: source.to_string(),
            source: e,
        })?;
        let keys = archive.top_level_keys();
        // The wrappers present, in order of preference, then the object itself as a bare
        // state dict.
        let wrappers = PTH_KEYS.iter().filter(|k| keys.iter().any(|key| key == *k));
        for key in wrappers.map(|k| Some(*k)).chain([None]) {
            // Buffers are dropped unread: they are recomputed at load.
            let tensors = read_state_dict(&mut archive, key, is_buffer);
            if tensors.is_empty() {
                continue;
            }
            let mut raw = Vec::with_capacity(tensors.len());
            for (name, t) in tensors {
                let t = t
                    .map_err(TensorError::from)
                    .and_then(checked_f32)
                    .map_err(|e| ModelError::tensor(&source, &name, e))?;
                raw.push((name, t));
            }
            return Self::from_raw(raw, source, key.map(str::to_string));
        }
        Err(ModelError::file(
            &source,
            "no state dict found (looked for params_ema, params, state_dict, model, net and a bare dict)",
        ))
    }

    fn from_raw(
        raw: Vec<(String, Tensor)>,
        source: Source,
        wrapper: Option<String>,
    ) -> Result<Self, ModelError> {
        let mut tensors = HashMap::new();
        for (name, t) in raw {
            // Both readers have dropped the buffers already.
            let name = name.strip_prefix("module.").unwrap_or(&name).to_string();
            tensors.insert(name, t);
        }
        if tensors.is_empty() {
            return Err(ModelError::file(&source, "the file holds no tensors"));
        }
        let shapes: BTreeMap<String, Vec<usize>> = tensors
            .iter()
            .map(|(k, v)| (k.clone(), v.dims().to_vec()))
            .collect();
        let values = |name: &str| {
            let t = tensors.get(name)?.flatten_all().ok()?;
            t.to_vec1::<f32>().ok()
        };
        let config = crate::nets::registry::infer_with(&shapes, &values).map_err(|e| {
            ModelError::Config {
                origin: source.to_string(),
                source: e,
            }
        })?;
        Ok(Self {
            source,
            config,
            tensors,
            metadata: BTreeMap::new(),
            wrapper,
        })
    }
}

/// A weight file's bytes: mapped where the OS allows it, else read. Mapping saves a copy of
/// the whole file and the page faults of a fresh buffer for it (about 20 ms of a 56 MB
/// model's start-up); the tensors are copied out of it once, as from a read buffer.
enum FileBytes {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl FileBytes {
    fn open(path: &Path) -> std::io::Result<Self> {
        let file = std::fs::File::open(path)?;
        // An empty file cannot be mapped, and pipes or devices are read instead.
        if file.metadata()?.len() > 0 {
            // SAFETY: the map is read-only and lives only while this checkpoint is parsed.
            // Were the file truncated by another process meanwhile, reading the lost pages
            // would fault (SIGBUS), as with any mapped model loader; a file replaced by a
            // rename, the usual way to update one, keeps the mapped data intact.
            if let Ok(map) = unsafe { memmap2::Mmap::map(&file) } {
                return Ok(Self::Mapped(map));
            }
        }
        std::fs::read(path).map(Self::Read)
    }
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Self::Mapped(map) => map,
            Self::Read(bytes) => bytes,
        }
    }
}

/// Buffers the official model registers: derived data that we recompute, never weights.
pub(crate) fn is_buffer(name: &str) -> bool {
    name.ends_with("relative_position_index")
        || name.ends_with("attn_mask")
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

/// A safetensors tensor as f32, converted and checked for NaN/Inf in one copy out of the
/// file's bytes; candle's loader would copy it, then `to_dtype` and the check read it again.
fn f32_tensor(view: &safetensors::tensor::TensorView) -> Result<Tensor, TensorError> {
    use safetensors::Dtype;
    let data = view.data();
    let values: Vec<f32> = match view.dtype() {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => {
            let t = candle_core::safetensors::Load::load(view, &Device::Cpu)?;
            return checked_f32(t);
        }
    };
    check_finite(&values)?;
    Ok(Tensor::from_vec(values, view.shape(), &Device::Cpu)?)
}

/// `t` as f32, refused if it holds a NaN or an infinity.
fn checked_f32(t: Tensor) -> Result<Tensor, TensorError> {
    let t = t.to_dtype(DType::F32).and_then(|t| t.contiguous())?;
    {
        let (storage, layout) = t.storage_and_layout();
        let values = crate::ops::cpu::cpu_slice(&storage, layout)?;
        check_finite(values)?;
    }
    Ok(t)
}

fn check_finite(values: &[f32]) -> Result<(), TensorError> {
    match values.iter().position(|x| !x.is_finite()) {
        None => Ok(()),
        Some(index) => Err(TensorError::NonFinite {
            value: values[index],
            index,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The one-tensor safetensors file holding `t` in its own dtype, read back as a view.
    fn converted(t: &Tensor) -> Result<Tensor, TensorError> {
        let bytes = safetensors::serialize([("t", t)], None).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        f32_tensor(&st.tensor("t").unwrap())
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
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut v = vec![0.5f32; 40];
            v[29] = bad;
            let t = Tensor::from_vec(v, (5, 8), &Device::Cpu).unwrap();
            for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
                let err = converted(&t.to_dtype(dtype).unwrap()).unwrap_err();
                assert!(
                    matches!(err, TensorError::NonFinite { index: 29, .. }),
                    "{dtype:?} {bad}: {err}"
                );
            }
        }
    }
}
