//! PyTorch `.pth` files (`torch.save`'s zip archive: a pickle and one entry per storage),
//! read through one open archive: the pickle's top-level keys, one state dict's tensor
//! descriptions, and each tensor's data.
//!
//! candle has a reader for these, but it opens the archive with the zip crate's default
//! search for where the archive starts inside the file, and that search gets every archive
//! wrong whose first directory entry is 76 bytes long, which is what `torch.save` writes for
//! any file name of 21 characters before `.pth` (the entry is `NAME/data.pkl`). torch puts a
//! zip64 end record and its locator, 76 bytes together, between the central directory and
//! the end record. The zip crate (9.x) first tries the directory start that the end record's
//! position minus the directory's size implies, ignoring those 76 bytes, and accepts it when
//! a directory entry begins there: with a first entry of exactly 76 bytes the second one
//! does. It then takes the archive to start 76 bytes into the file and reads the directory
//! on into the zip64 record: "Invalid Central Directory header". A `.pth` we load always
//! starts at byte 0 (the loader only takes files that begin with a local header), so the
//! archive is opened at offset 0 and the directory read where the end record says it is.

use std::fs::File;
use std::io::{BufReader, Read};
use std::path::Path;

use candle_core::pickle::{Object, Stack, TensorInfo};
use candle_core::{Device, Layout, Tensor};
use zip::read::{ArchiveOffset, Config};
use zip::{CompressionMethod, ZipArchive};

use super::Stored;

/// Why a `.pth` archive or its pickle could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PthError {
    /// The file could not be opened.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// The zip directory, or an entry in it, could not be read.
    #[error(transparent)]
    Zip(#[from] zip::result::ZipError),
    /// The archive holds no pickle.
    #[error("no data.pkl in the archive")]
    NoPickle,
    /// The pickle could not be decoded.
    #[error(transparent)]
    Pickle(candle_core::Error),
}

/// Why one tensor of a `.pth` could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PthTensorError {
    /// Its description in the pickle is not one candle reads (e.g. an integer storage other
    /// than int64).
    #[error(transparent)]
    Description(candle_core::Error),
    /// Its storage could not be read from the archive.
    #[error(transparent)]
    Zip(#[from] zip::result::ZipError),
    /// Its storage could not be read from the file.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// Neither row- nor column-major: torch saves such views with their whole storage.
    #[error("cannot retrieve non-contiguous tensors {0:?}")]
    Strided(candle_core::Layout),
    /// The storage ends before the tensor's elements do.
    #[error("its storage holds {have} bytes, and the tensor needs {need}")]
    Short {
        /// Bytes in the storage entry.
        have: usize,
        /// Bytes the tensor's offset and shape reach.
        need: u128,
    },
    /// candle could not make a tensor of the bytes.
    #[error(transparent)]
    Build(candle_core::Error),
}

/// One opened `.pth`: its archive and its decoded pickle.
pub struct PthArchive {
    zip: ZipArchive<BufReader<File>>,
    /// The folder of the archive's entries (`NAME/` of `NAME/data.pkl`), where the
    /// storages are.
    folder: String,
    root: Object,
}

impl PthArchive {
    /// Opens `path` and decodes its pickle.
    pub fn open(path: &Path) -> Result<Self, PthError> {
        let file = BufReader::new(File::open(path)?);
        // Offset 0, not the zip crate's search for one: see the module's documentation.
        let config = Config {
            archive_offset: ArchiveOffset::Known(0),
        };
        let mut zip = ZipArchive::with_config(config, file)?;
        let pickle = zip
            .file_names()
            .filter_map(Result::ok)
            .find(|n| n.ends_with("data.pkl"))
            .map(|n| n.into_owned())
            .ok_or(PthError::NoPickle)?;
        let folder = pickle.strip_suffix(".pkl").unwrap_or(&pickle).to_string();
        let entry = zip.by_name(&pickle)?;
        let mut stack = Stack::empty();
        stack
            .read_loop(&mut BufReader::new(entry))
            .map_err(PthError::Pickle)?;
        let root = stack.finalize().map_err(PthError::Pickle)?;
        Ok(Self { zip, folder, root })
    }

    /// The string keys of the pickled top-level object when it is a dict (a wrapped
    /// checkpoint such as `{"params_ema": state_dict, ...}`), empty otherwise.
    pub fn top_level_keys(&self) -> Vec<String> {
        match &self.root {
            Object::Dict(entries) => entries
                .iter()
                .filter_map(|(k, _)| match k {
                    Object::Unicode(s) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
            _ => Vec::new(),
        }
    }

    /// The tensors of the state dict under `key` (`None`: the top-level object itself), by
    /// name, as candle describes them; entries that are no tensors are left out, and so are
    /// those `skip` names, unread. A key that is missing, or an object that is no dict,
    /// gives no tensors.
    pub fn tensor_infos(
        &self,
        key: Option<&str>,
        skip: impl Fn(&str) -> bool,
    ) -> Vec<(String, Result<TensorInfo, PthTensorError>)> {
        let mut obj = &self.root;
        // A scripted module pickles its state dict as the arguments of a `Module` object.
        if let Object::Build { callable, args } = obj {
            if let Object::Reduce { callable, .. } = callable.as_ref() {
                if matches!(callable.as_ref(), Object::Class { module_name, class_name }
                    if module_name == "__torch__" && class_name == "Module")
                {
                    obj = args.as_ref();
                }
            }
        }
        if let (Some(key), Object::Dict(entries)) = (key, obj) {
            match entries
                .iter()
                .find(|(k, _)| matches!(k, Object::Unicode(s) if s == key))
            {
                Some((_, value)) => obj = value,
                None => return Vec::new(),
            }
        }
        let Object::Dict(entries) = obj else {
            return Vec::new();
        };
        let folder = Path::new(&self.folder);
        entries
            .iter()
            .filter_map(|(name, value)| {
                let Object::Unicode(text) = name else {
                    return None;
                };
                if skip(text) {
                    return None;
                }
                match value.clone().into_tensor_info(name.clone(), folder) {
                    Ok(Some(info)) => Some((text.clone(), Ok(info))),
                    Ok(None) => None,
                    Err(e) => Some((text.clone(), Err(PthTensorError::Description(e)))),
                }
            })
            .collect()
    }

    /// Where the tensor `info` describes lies in the file (of `file_len` bytes), when its
    /// storage is kept uncompressed, as torch.save keeps every one; `None` for a compressed
    /// one, which [`PthArchive::tensor`] reads. Refused as [`PthArchive::tensor`] would.
    pub fn stored(
        &mut self,
        info: &TensorInfo,
        file_len: usize,
    ) -> Result<Option<Stored>, PthTensorError> {
        let column_major = check_layout(&info.layout)?;
        let entry = self.zip.by_name_raw(info.path.as_bytes())?;
        let start = match entry.data_start() {
            Some(start)
                if entry.compression() == CompressionMethod::Stored && !entry.encrypted() =>
            {
                start
            }
            _ => return Ok(None),
        };
        let (have, crc) = (entry.size(), entry.crc32());
        if start.saturating_add(have) > file_len as u64 || entry.compressed_size() != have {
            // A directory that disagrees with the file: the archive reader says how.
            return Ok(None);
        }
        let need = needed(info);
        if need > u128::from(have) {
            return Err(PthTensorError::Short {
                have: have as usize,
                need,
            });
        }
        let (start, offset) = (start as usize, info.layout.start_offset());
        Ok(Some(Stored {
            dtype: info.dtype,
            dims: info.layout.dims().to_vec(),
            range: start + offset..start + need as usize,
            column_major: column_major && info.layout.dims().len() > 1,
            // Checked as the archive reader checks what it reads (Weights::first_bad).
            checksum: Some((start..start + have as usize, crc)),
        }))
    }

    /// The tensor `info` describes, in its own dtype, on the CPU. Each storage is read
    /// whole once per call; the tensors of a state dict rarely share one.
    pub fn tensor(&mut self, info: &TensorInfo) -> Result<Tensor, PthTensorError> {
        let layout = &info.layout;
        let column_major = check_layout(layout)?;
        let mut entry = self.zip.by_name(&info.path)?;
        // The declared size only bounds what is reserved up front: a corrupt directory may
        // declare anything, and reading stops where the data does.
        let mut bytes = Vec::with_capacity(entry.size().min(1 << 30) as usize);
        entry.read_to_end(&mut bytes)?;
        let dims = layout.dims();
        let need = needed(info);
        if need > bytes.len() as u128 {
            return Err(PthTensorError::Short {
                have: bytes.len(),
                need,
            });
        }
        let data = &bytes[layout.start_offset()..need as usize];
        if column_major && dims.len() > 1 {
            // Column-major data is the row-major data of the reversed shape, transposed.
            let reversed: Vec<usize> = dims.iter().rev().copied().collect();
            let order: Vec<usize> = (0..dims.len()).rev().collect();
            Tensor::from_raw_buffer(data, info.dtype, &reversed, &Device::Cpu)
                .and_then(|t| t.permute(order))
                .map_err(PthTensorError::Build)
        } else {
            Tensor::from_raw_buffer(data, info.dtype, dims, &Device::Cpu)
                .map_err(PthTensorError::Build)
        }
    }
}

/// The tensor descriptions of the state dict under `key` in `archive`, by name, in name
/// order, each with its own error; `skip` as in [`PthArchive::tensor_infos`].
pub fn state_dict_infos(
    archive: &PthArchive,
    key: Option<&str>,
    skip: impl Fn(&str) -> bool,
) -> Vec<(String, Result<TensorInfo, PthTensorError>)> {
    let mut infos = archive.tensor_infos(key, skip);
    // A crafted dict may repeat a key: the last value wins, as it would in Python. Reversed
    // then stably sorted, each name's last value comes first among its own.
    infos.reverse();
    infos.sort_by(|a, b| a.0.cmp(&b.0));
    infos.dedup_by(|a, b| a.0 == b.0);
    infos
}

/// Whether `layout` is column-major; refused unless it is that or row-major.
fn check_layout(layout: &Layout) -> Result<bool, PthTensorError> {
    let column_major = !layout.is_contiguous() && layout.is_fortran_contiguous();
    if !layout.is_contiguous() && !column_major {
        return Err(PthTensorError::Strided(layout.clone()));
    }
    Ok(column_major)
}

/// The bytes of its storage that the tensor `info` describes reaches to: its offset and its
/// elements. In u128: a corrupt pickle may declare dims whose product overflows usize.
fn needed(info: &TensorInfo) -> u128 {
    let size = info.dtype.size_in_bytes();
    info.layout
        .dims()
        .iter()
        .fold(size as u128, |n, &d| n.saturating_mul(d as u128))
        .saturating_add(info.layout.start_offset() as u128)
}
