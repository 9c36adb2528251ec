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
//!
//! Files written before PyTorch 1.6 (and by `_use_new_zipfile_serialization=False`) are no
//! archive: five pickles in a row (a magic number, the format's version, the writer's
//! system, the object itself, the sorted list of its storages' keys), then each storage in
//! that order as its element count (8 bytes, little-endian) and its bytes. ESRGAN's and RCAN's
//! original releases, and many community models trained in 2019-2020, are such files. The
//! object's pickle describes its tensors as the archive's does; the storages are found by
//! walking the file once, each one's element size taken from the type its tensors name.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};

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
    /// A legacy (pre-zip) file whose layout is not the one torch writes.
    #[error("legacy PyTorch file: {0}")]
    Legacy(String),
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
    /// A legacy file lists no storage under the key its description names.
    #[error("no storage {0} in the file")]
    NoStorage(String),
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

/// The first pickle of a legacy file: protocol 2, the 10-byte integer
/// 0x1950a86a20f9469cfc6c (torch's magic number), stop.
pub(crate) const LEGACY_MAGIC: &[u8] = &[
    0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19, 0x2e,
];

/// The version of the legacy format torch has written since 0.4 (the second pickle).
const LEGACY_VERSION: i64 = 1001;

/// One opened `.pth`: where its storages are, and its decoded pickle.
pub struct PthArchive {
    storages: Storages,
    /// The folder of the archive's entries (`NAME/` of `NAME/data.pkl`), where the
    /// storages are; a legacy file's storages are named as if in [`LEGACY_FOLDER`].
    folder: String,
    root: Object,
}

/// Where a `.pth`'s storages are.
enum Storages {
    /// torch.save's zip archive: one entry per storage.
    Zip(ZipArchive<BufReader<File>>),
    /// A legacy file: each storage's bytes (past its count) by key.
    Legacy {
        path: PathBuf,
        ranges: HashMap<String, Range<u64>>,
    },
}

/// The folder a legacy file's storages are given in their tensors' descriptions.
const LEGACY_FOLDER: &str = "legacy";

impl PthArchive {
    /// Opens `path`, a zip archive or a legacy file, and decodes its pickle.
    pub fn open(path: &Path) -> Result<Self, PthError> {
        let mut head = [0u8; LEGACY_MAGIC.len()];
        let n = File::open(path)?.read(&mut head)?;
        if head[..n] == *LEGACY_MAGIC {
            return Self::open_legacy(path);
        }
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
        let root = unpickle(&mut BufReader::new(entry))?;
        Ok(Self {
            storages: Storages::Zip(zip),
            folder,
            root,
        })
    }

    /// A legacy file: its pickles read in turn, then its storages walked once.
    fn open_legacy(path: &Path) -> Result<Self, PthError> {
        let bad = |why: &str| PthError::Legacy(why.to_string());
        let mut r = BufReader::new(File::open(path)?);
        r.seek(SeekFrom::Start(LEGACY_MAGIC.len() as u64))?;
        match unpickle(&mut r)? {
            Object::Int(v) if i64::from(v) == LEGACY_VERSION => {}
            Object::Long(v) if v == LEGACY_VERSION => {}
            other => return Err(PthError::Legacy(format!("format version {other:?}"))),
        }
        // The writer's system: its byte order and type sizes. torch reads only the byte
        // order from it; candle's reader is little-endian.
        if let Object::Dict(info) = unpickle(&mut r)? {
            let big = info.iter().any(|(k, v)| {
                *k == Object::Unicode("little_endian".into()) && *v == Object::Bool(false)
            });
            if big {
                return Err(bad("written on a big-endian machine"));
            }
        }
        let root = unpickle(&mut r)?;
        let keys = match unpickle(&mut r)? {
            Object::List(keys) => keys
                .into_iter()
                .map(|k| {
                    k.unicode()
                        .map_err(|_| bad("a storage key that is no string"))
                })
                .collect::<Result<Vec<_>, _>>()?,
            _ => return Err(bad("no list of storage keys")),
        };
        let mut sizes = HashMap::new();
        element_sizes(&root, &mut sizes);
        let mut at = r.stream_position()?;
        // Each storage's count is read where the one before it ends: straight from the file.
        let mut file = r.into_inner();
        let file_len = file.metadata()?.len();
        let mut ranges = HashMap::new();
        for key in keys {
            // A storage no tensor names has no known element size, and the ones after it
            // cannot be found: they are left out, and a tensor naming one is refused.
            let Some(&size) = sizes.get(&key) else { break };
            let mut count = [0u8; 8];
            file.seek(SeekFrom::Start(at))?;
            file.read_exact(&mut count)?;
            let bytes = u64::from_le_bytes(count)
                .checked_mul(size)
                .filter(|&b| b <= file_len.saturating_sub(at + 8))
                .ok_or_else(|| bad(&format!("storage {key} runs past the end of the file")))?;
            ranges.insert(key, at + 8..at + 8 + bytes);
            at += 8 + bytes;
        }
        Ok(Self {
            storages: Storages::Legacy {
                path: path.to_path_buf(),
                ranges,
            },
            folder: LEGACY_FOLDER.to_string(),
            root,
        })
    }

    /// The byte range of a legacy file's storage that `info` names.
    fn legacy_range<'a>(
        ranges: &'a HashMap<String, Range<u64>>,
        info: &TensorInfo,
    ) -> Result<&'a Range<u64>, PthTensorError> {
        let key = info.path.rsplit('/').next().unwrap_or_default();
        ranges
            .get(key)
            .ok_or_else(|| PthTensorError::NoStorage(key.to_string()))
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
                if !describable(value) {
                    let e = candle_core::Error::Msg(
                        "a tensor description with fewer arguments than torch writes".into(),
                    );
                    return Some((text.clone(), Err(PthTensorError::Description(e))));
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
        let (start, have, checksum) = match &mut self.storages {
            Storages::Zip(zip) => {
                let entry = zip.by_name_raw(info.path.as_bytes())?;
                let start = match entry.data_start() {
                    Some(start)
                        if entry.compression() == CompressionMethod::Stored
                            && !entry.encrypted() =>
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
                (start, have, Some(crc))
            }
            Storages::Legacy { ranges, .. } => {
                let range = Self::legacy_range(ranges, info)?;
                if range.end > file_len as u64 {
                    return Err(PthTensorError::NoStorage(info.path.clone()));
                }
                (range.start, range.end - range.start, None)
            }
        };
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
            // Checked as the archive reader checks what it reads (Weights::first_bad); a
            // legacy file has no checksums.
            checksum: checksum.map(|crc| (start..start + have as usize, crc)),
        }))
    }

    /// The tensor `info` describes, in its own dtype, on the CPU. Each storage is read
    /// whole once per call; the tensors of a state dict rarely share one.
    pub fn tensor(&mut self, info: &TensorInfo) -> Result<Tensor, PthTensorError> {
        let layout = &info.layout;
        let column_major = check_layout(layout)?;
        let mut bytes = Vec::new();
        match &mut self.storages {
            Storages::Zip(zip) => {
                let mut entry = zip.by_name(&info.path)?;
                // The declared size only bounds what is reserved up front: a corrupt directory
                // may declare anything, and reading stops where the data does.
                bytes.reserve(entry.size().min(1 << 30) as usize);
                entry.read_to_end(&mut bytes)?;
            }
            Storages::Legacy { path, ranges } => {
                let range = Self::legacy_range(ranges, info)?;
                let mut file = File::open(&*path)?;
                file.seek(SeekFrom::Start(range.start))?;
                file.take(range.end - range.start).read_to_end(&mut bytes)?;
            }
        }
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

/// One pickle read from `r`, up to its stop.
fn unpickle(r: &mut impl std::io::BufRead) -> Result<Object, PthError> {
    let mut stack = Stack::empty();
    stack.read_loop(r).map_err(PthError::Pickle)?;
    stack.finalize().map_err(PthError::Pickle)
}

/// The element size of every storage `obj` names, by key: each tensor's storage is a
/// persistent id `('storage', <type>, key, location, count, ...)`. A state dict lies a few
/// levels deep (a wrapper, the dict, a tensor's rebuild call, its arguments); what lies
/// deeper than [`MAX_DEPTH`] is not looked at, so a crafted file cannot exhaust the stack.
fn element_sizes(obj: &Object, sizes: &mut HashMap<String, u64>) {
    walk_storages(obj, sizes, 0);
}

/// How deep [`element_sizes`] looks.
const MAX_DEPTH: usize = 32;

fn walk_storages(obj: &Object, sizes: &mut HashMap<String, u64>, depth: usize) {
    if depth > MAX_DEPTH {
        return;
    }
    let mut walk = |o: &Object| walk_storages(o, sizes, depth + 1);
    match obj {
        Object::PersistentLoad(id) => {
            if let Object::Tuple(parts) = id.as_ref() {
                if let (Some(Object::Class { class_name, .. }), Some(Object::Unicode(key))) =
                    (parts.get(1), parts.get(2))
                {
                    if let Some(size) = storage_element_size(class_name) {
                        sizes.insert(key.clone(), size);
                    }
                }
            }
        }
        Object::Tuple(items) | Object::List(items) => items.iter().for_each(walk),
        Object::Dict(entries) => entries.iter().for_each(|(k, v)| {
            walk(k);
            walk(v);
        }),
        Object::Reduce { callable, args } | Object::Build { callable, args } => {
            walk(callable);
            walk(args);
        }
        _ => {}
    }
}

/// The bytes per element of a torch storage type.
fn storage_element_size(class_name: &str) -> Option<u64> {
    Some(match class_name {
        "DoubleStorage" | "LongStorage" => 8,
        "FloatStorage" | "IntStorage" => 4,
        "HalfStorage" | "BFloat16Storage" | "ShortStorage" => 2,
        "ByteStorage" | "CharStorage" | "BoolStorage" => 1,
        _ => return None,
    })
}

/// Whether candle's `Object::into_tensor_info` can read `value` without indexing past the end
/// of a tuple: it takes the arguments torch writes by position (`_rebuild_from_type_v2`'s
/// first and third, `_rebuild_parameter`'s first, `_rebuild_tensor_v2`'s first four and the
/// storage id's first five), and a crafted pickle may hold fewer. What it checks and refuses
/// by itself (an object of another kind where a tuple should be) passes here.
fn describable(value: &Object) -> bool {
    let is = |o: &Object, module: &str, class: &str| {
        matches!(o, Object::Class { module_name, class_name }
            if module_name == module && class_name == class)
    };
    let Object::Reduce { callable, args } = value else {
        return true;
    };
    let (callable, args) = if is(callable, "torch._tensor", "_rebuild_from_type_v2") {
        match args.as_ref() {
            Object::Tuple(a) if a.len() < 3 => return false,
            Object::Tuple(a) => (&a[0], &a[2]),
            _ => return true,
        }
    } else if is(callable, "torch._utils", "_rebuild_parameter") {
        match args.as_ref() {
            Object::Tuple(a) => match a.first() {
                None => return false,
                Some(Object::Reduce { callable, args }) => (callable.as_ref(), args.as_ref()),
                Some(_) => return true,
            },
            _ => return true,
        }
    } else {
        (callable.as_ref(), args.as_ref())
    };
    if !is(callable, "torch._utils", "_rebuild_tensor_v2") {
        return true;
    }
    match args {
        Object::Tuple(a) if a.len() < 4 => false,
        Object::Tuple(a) => match &a[0] {
            Object::PersistentLoad(id) => !matches!(id.as_ref(), Object::Tuple(t) if t.len() < 5),
            _ => true,
        },
        _ => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(module: &str, class: &str) -> Object {
        Object::Class {
            module_name: module.into(),
            class_name: class.into(),
        }
    }

    fn tensor(args: Vec<Object>) -> Object {
        Object::Reduce {
            callable: Box::new(class("torch._utils", "_rebuild_tensor_v2")),
            args: Box::new(Object::Tuple(args)),
        }
    }

    /// Descriptions with fewer arguments than torch writes, which candle's reader would index
    /// past (a panic, checked here), are told apart from whole ones.
    #[test]
    fn short_tensor_descriptions_are_caught_before_candle_indexes_them() {
        let storage = |n: usize| {
            let mut id = vec![
                Object::Unicode("storage".into()),
                class("torch", "FloatStorage"),
                Object::Unicode("0".into()),
                Object::Unicode("cpu".into()),
                Object::Int(4),
            ];
            id.truncate(n);
            Object::PersistentLoad(Box::new(Object::Tuple(id)))
        };
        let whole = |id: Object| {
            tensor(vec![
                id,
                Object::Int(0),
                Object::Tuple(vec![Object::Int(4)]),
                Object::Tuple(vec![Object::Int(1)]),
            ])
        };
        assert!(describable(&whole(storage(5))));
        let short = [
            whole(storage(3)),
            tensor(vec![storage(5), Object::Int(0)]),
            Object::Reduce {
                callable: Box::new(class("torch._utils", "_rebuild_parameter")),
                args: Box::new(Object::Tuple(vec![])),
            },
            Object::Reduce {
                callable: Box::new(class("torch._tensor", "_rebuild_from_type_v2")),
                args: Box::new(Object::Tuple(vec![Object::None])),
            },
        ];
        for value in short {
            assert!(!describable(&value), "{value:?}");
            let name = Object::Unicode("w".into());
            let panicked = std::panic::catch_unwind(|| {
                let _ = value.into_tensor_info(name, Path::new("archive"));
            })
            .is_err();
            assert!(panicked, "candle reads it without the guard");
        }
    }
}
