//! PyTorch `.pth` archives as torch.save writes them, read by our own reader
//! (`model::pth`) rather than candle's.

use crate::checkpoint::pth::{state_dict_infos, PthArchive};
use crate::checkpoint::Checkpoint;
use crate::nets::config_of;
use crate::nets::swinir::SwinIrConfig;

/// Saved by torch.save under a 21-character name (tests/fixtures/pth/make_pth_fixture.py).
fn fixture() -> std::path::PathBuf {
    super::repo().join("tests/fixtures/pth/name_of_21_characters.pth")
}

fn u16_at(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes([b[at], b[at + 1]]) as usize
}

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]) as usize
}

#[test]
fn the_fixture_has_the_layout_that_misled_the_zip_crate() {
    // Were torch to change what it writes, the loading test below would pass without
    // covering anything; this one says so.
    let b = std::fs::read(fixture()).unwrap();
    let end = b.len() - 22;
    assert_eq!(
        &b[end..end + 4],
        b"PK\x05\x06",
        "an end record with no comment"
    );
    let (dir_size, dir_start) = (u32_at(&b, end + 12), u32_at(&b, end + 16));
    assert_eq!(
        end - (dir_start + dir_size),
        76,
        "zip64 end record and locator"
    );
    assert_eq!(&b[dir_start..dir_start + 4], b"PK\x01\x02");
    let first = 46 + u16_at(&b, dir_start + 28) + u16_at(&b, dir_start + 30);
    let first = first + u16_at(&b, dir_start + 32);
    assert_eq!(first, 76, "the first directory entry is as long as the gap");
    assert_eq!(&b[dir_start + 76..dir_start + 80], b"PK\x01\x02");
}

#[test]
fn a_pth_whose_first_directory_entry_is_76_bytes_loads() {
    let ck = Checkpoint::load(&fixture()).unwrap_or_else(|e| panic!("{e}"));
    let c = config_of::<SwinIrConfig>(&ck.config).expect("a SwinIR file");
    assert!(c.scale == 2 && c.window == 2);
    assert_eq!(ck.wrapper.as_deref(), Some("params_ema"));
    // Every parameter holds ((i % 17) - 8) / 16 at flat index i.
    let w = ck.tensors.get("conv_first.weight").unwrap().unwrap();
    let w = w.flatten_all().unwrap();
    let w = w.to_vec1::<f32>().unwrap();
    assert_eq!(w.len(), 6 * 3 * 3 * 3);
    for (i, v) in w.iter().enumerate() {
        assert_eq!(*v, ((i % 17) as f32 - 8.0) / 16.0, "index {i}");
    }
}

#[test]
fn keys_and_tensor_descriptions_come_from_one_open_archive() {
    let archive = PthArchive::open(&fixture()).unwrap();
    assert_eq!(archive.top_level_keys(), ["params_ema"]);
    assert!(state_dict_infos(&archive, Some("absent"), |_| false).is_empty());
    // A wrapped checkpoint's top level holds the wrapper, no tensors.
    assert!(state_dict_infos(&archive, None, |_| false).is_empty());
    let all = state_dict_infos(&archive, Some("params_ema"), |_| false);
    let kept = state_dict_infos(&archive, Some("params_ema"), |n| n.ends_with("_index"));
    assert!(all.iter().all(|(_, t)| t.is_ok()));
    assert!(all.windows(2).all(|w| w[0].0 < w[1].0), "in name order");
    assert!(kept.len() < all.len() && kept.iter().all(|(n, _)| !n.ends_with("_index")));
}

#[test]
fn storages_read_in_place_hold_what_the_archive_reader_reads() {
    let path = fixture();
    let ck = Checkpoint::load(&path).unwrap_or_else(|e| panic!("{e}"));
    let len = std::fs::metadata(&path).unwrap().len() as usize;
    let mut archive = PthArchive::open(&path).unwrap();
    let infos = state_dict_infos(&archive, Some("params_ema"), crate::checkpoint::is_buffer);
    assert!(infos.len() > 10, "{} tensors", infos.len());
    for (name, info) in infos {
        let info = info.unwrap();
        // torch.save stores every storage uncompressed: each is read where it lies.
        assert!(archive.stored(&info, len).unwrap().is_some(), "{name}");
        let want = archive.tensor(&info).unwrap();
        let want = want.to_dtype(candle_core::DType::F32).unwrap();
        let got = ck.tensors.get(&name).unwrap().unwrap();
        assert_eq!(got.dims(), want.dims(), "{name}");
        let (got, want) = (got.flatten_all().unwrap(), want.flatten_all().unwrap());
        assert_eq!(
            got.to_vec1::<f32>().unwrap(),
            want.to_vec1::<f32>().unwrap(),
            "{name}"
        );
    }
    // A directory that puts a storage past the end of the file is read by the archive
    // reader instead, which says what is wrong.
    let (_, info) = state_dict_infos(&archive, Some("params_ema"), |_| false).remove(0);
    assert!(archive.stored(&info.unwrap(), 10).unwrap().is_none());
}

#[test]
fn a_storage_damaged_in_the_file_is_refused_by_its_checksum() {
    let path = fixture();
    let mut bytes = std::fs::read(&path).unwrap();
    let mut archive = PthArchive::open(&path).unwrap();
    let (name, info) = state_dict_infos(&archive, Some("params_ema"), |_| false).remove(0);
    let stored = archive
        .stored(&info.unwrap(), bytes.len())
        .unwrap()
        .unwrap();
    // One bit of the tensor's first value: still a finite number, so only the checksum
    // can tell.
    bytes[stored.range.start] ^= 1;
    let dir = tempfile::tempdir().unwrap();
    let damaged = dir.path().join("damaged.pth");
    std::fs::write(&damaged, &bytes).unwrap();
    let e = Checkpoint::load(&damaged)
        .err()
        .expect("a damaged storage")
        .to_string();
    assert!(e.contains(&name) && e.contains("checksum"), "{e}");
}

/// The legacy copies of two fixtures (tests/golden/make_legacy_pth.py) and their zip twins.
fn legacy_pairs() -> [(std::path::PathBuf, std::path::PathBuf); 2] {
    let g = super::repo().join("tests/golden");
    [
        (
            g.join("esrgan/esrgan_x4_old_legacy.pth"),
            g.join("esrgan/esrgan_x4_old.pth"),
        ),
        (
            g.join("rcan/rcan_x4_shift_legacy.pth"),
            g.join("rcan/rcan_x4_shift.pth"),
        ),
    ]
}

/// A legacy (pre-zip) file is read as its zip twin: the same architecture and
/// configuration, the same tensors bit for bit, each read where it lies in the file.
#[test]
fn legacy_pth_files_load_as_their_zip_twins() {
    for (legacy, zip) in legacy_pairs() {
        let name = legacy.display().to_string();
        let bytes = std::fs::read(&legacy).unwrap();
        assert!(
            bytes.starts_with(crate::checkpoint::pth::LEGACY_MAGIC),
            "{name}: not a legacy file"
        );
        let old = Checkpoint::load(&legacy).unwrap_or_else(|e| panic!("{name}: {e}"));
        let new = Checkpoint::load(&zip).unwrap();
        assert_eq!(old.config.variant(), new.config.variant(), "{name}");
        assert_eq!(old.config.describe(), new.config.describe(), "{name}");
        assert!(
            old.tensors.is_mapped(),
            "{name}: storages copied, not mapped"
        );
        let sorted = |w: &crate::checkpoint::Weights| {
            let mut v: Vec<String> = w.names().map(str::to_string).collect();
            v.sort();
            v
        };
        let names = sorted(&old.tensors);
        assert_eq!(names, sorted(&new.tensors), "{name}");
        for n in &names {
            let a = old.tensors.get(n).unwrap().unwrap();
            let b = new.tensors.get(n).unwrap().unwrap();
            assert_eq!(
                super::fixtures::f32_bits(&a),
                super::fixtures::f32_bits(&b),
                "{name}: {n}"
            );
        }
    }
}

/// The legacy RCAN file runs to the float64 reference's output.
#[test]
fn a_legacy_rcan_file_matches_the_float64_reference() {
    use candle_core::{DType, Device};
    let (legacy, _) = &legacy_pairs()[1];
    let model = crate::model::Model::load(legacy, DType::F32, &Device::Cpu).unwrap();
    let io = super::repo().join("tests/golden/rcan/rcan_x4_shift.io.safetensors");
    let (input, expected) = super::fixtures::load_io(&io);
    let out = model.net.forward(&input).unwrap();
    let d = super::fixtures::max_abs_diff(&out, &expected);
    assert!(d <= super::fixtures::TOLERANCE, "{d:e}");
}

/// Broken legacy files are refused with what is wrong, not read past their end: cut inside
/// the storages, cut inside the pickles, and with another format version.
#[test]
fn broken_legacy_files_are_refused() {
    let (legacy, _) = &legacy_pairs()[0];
    let bytes = std::fs::read(legacy).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let check = |contents: &[u8], needle: &str| {
        let path = tmp.path().join("broken.pth");
        std::fs::write(&path, contents).unwrap();
        let e = Checkpoint::load(&path).err().expect("refused").to_string();
        assert!(e.contains("broken.pth") && e.contains(needle), "{e}");
    };
    check(&bytes[..bytes.len() - 100], "runs past the end of the file");
    check(&bytes[..bytes.len() / 8], "PyTorch");
    let mut version = bytes.clone();
    let at = crate::checkpoint::pth::LEGACY_MAGIC.len();
    assert_eq!(&version[at..at + 6], b"\x80\x02M\xe9\x03.");
    version[at + 3] = 0xea;
    check(&version, "format version");
}
