//! Crafted and corrupted checkpoints: thousands of mutated files, each loaded and, when it
//! loads, built and run on a tiny input. Every one must end in `Ok` or an error, never a panic
//! (the fuzz targets in fuzz/ explore the same entry points without a bound).

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::checkpoint::{Checkpoint, Source};

use crate::model::Model;
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::TensorView;

/// A small deterministic generator, so a failure names a reproducible case.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Loads `bytes` as the product does and, if that succeeds, builds the network and runs it on
/// an 8x8 input. Returns whether the file was accepted; panics only if the product did.
fn load_and_run(bytes: &[u8], case: &str) -> bool {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let ck = Checkpoint::from_safetensors_bytes(bytes, Source::Embedded("mutant"))?;
        let model = Model::from_checkpoint(ck, DType::F32, &Device::Cpu)?;
        let x = Tensor::zeros((1, 3, 8, 8), DType::F32, &Device::Cpu).expect("input");
        model.net.forward(&x).map_err(|e| e.to_string()).ok();
        Ok::<_, crate::checkpoint::ModelError>(())
    }));
    match result {
        Ok(r) => r.is_ok(),
        Err(_) => panic!("{case}: the loader or the network panicked"),
    }
}

/// The fixture's tensors as (name, shape, f32 data).
fn tensors(bytes: &[u8]) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let mut v: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            let t = candle_core::safetensors::Load::load(&view, &Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let data = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            (name, t.dims().to_vec(), data)
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn serialize(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> Vec<u8> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, d)| d.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| {
            let view = TensorView::new(safetensors::Dtype::F32, shape.clone(), b).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize(views, None::<HashMap<String, String>>).unwrap()
}

/// A new shape for a tensor: degenerate, reshaped, truncated or extended.
fn mutate_shape(rng: &mut Rng, shape: &[usize], len: usize) -> Vec<usize> {
    match rng.below(7) {
        0 => vec![],
        1 => vec![0],
        2 => vec![len],
        3 => shape.iter().rev().copied().collect(),
        4 => {
            let mut s = shape.to_vec();
            if let Some(d) = s.first_mut() {
                *d = rng.below(4);
            }
            s
        }
        5 => {
            let mut s = shape.to_vec();
            s.push(1);
            s
        }
        _ => vec![1 + rng.below(len.max(1)), 1],
    }
}

/// `n` valid safetensors files made of `base` with one to three tensors reshaped, removed or
/// renamed (a digit of the name changed: a layer index the file does not have), each loaded
/// and run; returns how many were accepted.
fn structured(
    base: &[(String, Vec<usize>, Vec<f32>)],
    rng: &mut Rng,
    n: usize,
    what: &str,
) -> usize {
    let mut accepted = 0;
    for i in 0..n {
        let mut t = base.to_vec();
        for _ in 0..1 + rng.below(3) {
            let k = rng.below(t.len());
            match rng.below(8) {
                0 => {
                    t.remove(k);
                }
                1 => {
                    let digits: Vec<usize> = (t[k].0.char_indices())
                        .filter(|(_, c)| c.is_ascii_digit())
                        .map(|(at, _)| at)
                        .collect();
                    if let Some(&at) = digits.get(rng.below(digits.len())) {
                        let d = [b'0', b'1', b'7', b'9'][rng.below(4)] as char;
                        t[k].0.replace_range(at..at + 1, &d.to_string());
                    }
                }
                _ => {
                    let shape = mutate_shape(rng, &t[k].1, t[k].2.len());
                    let n: usize = shape.iter().product();
                    t[k].2.resize(n, 0.5);
                    t[k].1 = shape;
                }
            }
        }
        t.sort_by(|a, b| a.0.cmp(&b.0));
        t.dedup_by(|a, b| a.0 == b.0);
        accepted += load_and_run(&serialize(&t), &format!("{what} #{i}")) as usize;
    }
    accepted
}

/// The same structured mutations of an ESRGAN model that unshuffles its input, of Compact
/// models, of RealPLKSR models (one with DySample), of an OmniSR model, of RCAN models (one
/// unshuffling its input), of MoSR models, of greyscale ones, of FDAT and of SAFMN models: their configuration is read from layer
/// indices and channel ratios; of FDAT models, whose upsampler only its description names.
#[test]
fn mutated_esrgan_and_compact_checkpoints_never_panic() {
    let mut rng = Rng(0x5851_f42d_4c95_7f2d);
    for file in [
        "esrgan/esrgan_x2_unshuffle.safetensors",
        "esrgan/esrgan_x8_trunk.safetensors",
        "compact/compact_x3_prelu.safetensors",
        "compact/compact_x2_relu.safetensors",
        "plksr/plksr_x2_layer.safetensors",
        "plksr/plksr_x2_dysample.safetensors",
        "omnisr/omnisr_x2_no_bias.safetensors",
        "rcan/rcan_x8_shift.safetensors",
        "rcan/rcan_x1_unshuffle.safetensors",
        "grey/swinir_jpeg_grey.safetensors",
        "grey/span_x2_grey.safetensors",
        "mosr/mosr_x2_gps.safetensors",
        "mosr/mosr_x3_dys.safetensors",
        "fdat/fdat_x4_ps.safetensors",
        "fdat/fdat_x2_unshuffle.safetensors",
        "fdat/fdat_x4_dys.safetensors",
        "fdat/fdat_x2_pa.safetensors",
        "safmn/safmn_x4.safetensors",
    ] {
        let original = std::fs::read(crate::tests::golden(file)).unwrap();
        assert!(load_and_run(&original, file), "{file} must load");
        let accepted = structured(&tensors(&original), &mut rng, 300, file);
        eprintln!("{file}: 300 mutated files, {accepted} accepted, none panicked");
    }
}

/// FDAT's upsampler description (`upsampler.MetaUpsample`) with random values, some far out
/// of range or not numbers, over each kind of upsampler's tensors: loaded and run, never a
/// panic; the file's own values load.
#[test]
fn fdat_upsampler_descriptions_never_panic() {
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let values = [
        0.0,
        1.0,
        2.0,
        3.0,
        4.0,
        7.0,
        16.0,
        255.0,
        1e9,
        -1.0,
        f32::NAN,
        f32::INFINITY,
    ];
    for file in [
        "fdat/fdat_x4_ps.safetensors",
        "fdat/fdat_x2_pa.safetensors",
        "fdat/fdat_x3_psd.safetensors",
        "fdat/fdat_x4_nc.safetensors",
    ] {
        let original = tensors(&std::fs::read(crate::tests::golden(file)).unwrap());
        let meta = original
            .iter()
            .position(|(name, _, _)| name == "upsampler.MetaUpsample")
            .expect("the description");
        assert!(
            load_and_run(&serialize(&original), file),
            "{file} must load"
        );
        let mut accepted = 0;
        for i in 0..200 {
            let mut t = original.clone();
            for _ in 0..1 + rng.below(3) {
                let at = rng.below(7);
                t[meta].2[at] = values[rng.below(values.len())];
            }
            accepted += load_and_run(&serialize(&t), &format!("{file} description #{i}")) as usize;
        }
        eprintln!("{file}: 200 descriptions, {accepted} accepted, none panicked");
    }
}

#[test]
fn mutated_checkpoints_never_panic() {
    let original = std::fs::read(crate::tests::golden(crate::tests::FAST_MODEL)).unwrap();
    assert!(load_and_run(&original, "original"), "the fixture must load");
    let base = tensors(&original);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let (mut tried, mut accepted) = (0, 0);

    // Structured: valid safetensors files whose tensors have the wrong shapes or are missing.
    accepted += structured(&base, &mut rng, 600, "structured");
    tried += 600;

    // Byte-level: corrupt the header (lengths, JSON) and the data of the real file.
    let header_end = 8 + u64::from_le_bytes(original[..8].try_into().unwrap()) as usize;
    for i in 0..1400 {
        let mut bytes = original.clone();
        for _ in 0..1 + rng.below(4) {
            let at = if rng.below(4) == 0 {
                rng.below(bytes.len())
            } else {
                rng.below(header_end)
            };
            bytes[at] = match rng.below(4) {
                0 => 0,
                1 => 0xff,
                2 => bytes[at] ^ (1 << rng.below(8)),
                _ => b"[]{},:\"0123456789"[rng.below(17)],
            };
        }
        if rng.below(10) == 0 {
            bytes.truncate(rng.below(bytes.len()));
        }
        accepted += load_and_run(&bytes, &format!("bytes #{i}")) as usize;
        tried += 1;
    }
    eprintln!("{tried} mutated safetensors files: {accepted} accepted, none panicked");
    assert_eq!(tried, 2000);
}

/// `n` mutants of `original` (`mutate` changes a copy with `rng`), each written to a `.pth`
/// and loaded and built on the CPU: none may panic. How many were accepted.
fn pth_mutants_never_panic(
    original: &[u8],
    (n, seed): (usize, u64),
    mutate: impl Fn(&mut Vec<u8>, &mut Rng),
) -> usize {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mutant.pth");
    let mut rng = Rng(seed);
    let mut accepted = 0;
    for i in 0..n {
        let mut bytes = original.to_vec();
        mutate(&mut bytes, &mut rng);
        std::fs::write(&path, &bytes).unwrap();
        let result = catch_unwind(|| {
            Checkpoint::load(&path)
                .and_then(|ck| Model::from_checkpoint(ck, DType::F32, &Device::Cpu))
                .is_ok()
        });
        match result {
            Ok(ok) => accepted += ok as usize,
            Err(_) => panic!("pth #{i}: the loader panicked"),
        }
    }
    accepted
}

/// The official `.pth` (a zip holding a pickle and the tensor data) with corrupted bytes,
/// mostly in the pickle and the zip directory, where a reader's assumptions live.
#[test]
fn mutated_pth_files_never_panic() {
    let original = std::fs::read(crate::tests::golden("x2_w8_official.pth")).unwrap();
    let pickle = original
        .windows(8)
        .position(|w| w == b"data.pkl")
        .expect("a torch.save archive");
    let directory = original.len().saturating_sub(4096);
    let accepted =
        pth_mutants_never_panic(&original, (500, 0x2545_f491_4f6c_dd1d), |bytes, rng| {
            for _ in 0..1 + rng.below(3) {
                let at = match rng.below(3) {
                    0 => pickle + rng.below(2048),
                    1 => directory + rng.below(4096),
                    _ => rng.below(bytes.len()),
                }
                .min(bytes.len() - 1);
                bytes[at] ^= 1 << rng.below(8);
            }
        });
    eprintln!("500 mutated .pth files: {accepted} accepted, none panicked");
}

/// A legacy (pre-zip) `.pth` with corrupted bytes, mostly in its pickles (the file's first
/// part), or cut short: each storage's place is found by walking the file, so counts and
/// lengths a mutation changes must be refused, never followed past the end.
#[test]
fn mutated_legacy_pth_files_never_panic() {
    let original = std::fs::read(crate::tests::golden("esrgan/esrgan_x4_old_legacy.pth")).unwrap();
    assert!(original.starts_with(crate::checkpoint::pth::LEGACY_MAGIC));
    // Cuts start past the magic number, so that the file is still taken for a legacy one.
    let head = crate::checkpoint::pth::LEGACY_MAGIC.len() + 1;
    let accepted =
        pth_mutants_never_panic(&original, (500, 0x9e37_79b9_7f4a_7c15), |bytes, rng| {
            for _ in 0..1 + rng.below(3) {
                let at = match rng.below(2) {
                    0 => rng.below(4096),
                    _ => rng.below(bytes.len()),
                }
                .min(bytes.len() - 1);
                bytes[at] ^= 1 << rng.below(8);
            }
            if rng.below(4) == 0 {
                bytes.truncate(head + rng.below(bytes.len() - head));
            }
        });
    eprintln!("500 mutated legacy .pth files: {accepted} accepted, none panicked");
}

#[test]
fn of_several_bad_tensors_the_first_by_name_is_reported_every_time() {
    let original = std::fs::read(crate::tests::golden(crate::tests::FAST_MODEL)).unwrap();
    let mut t = tensors(&original);
    // Poison the last tensor by name and the first: the tensors convert on several threads,
    // and a report that depended on which finished first would name either.
    let last = t.len() - 1;
    t[last].2[0] = f32::NAN;
    t[0].2[0] = f32::INFINITY;
    let first = t[0].0.clone();
    let bytes = serialize(&t);
    for _ in 0..20 {
        let err = Checkpoint::from_safetensors_bytes(&bytes, Source::Embedded("poisoned"))
            .err()
            .expect("a poisoned checkpoint must be refused");
        assert!(err.to_string().contains(&first), "{err}");
    }
}

#[test]
fn detached_weights_leave_the_mapped_file() {
    let ck = Checkpoint::load(&crate::tests::golden(crate::tests::FAST_MODEL)).unwrap();
    assert!(ck.tensors.is_mapped());
    let kept = ck.detached();
    assert!(!kept.tensors.is_mapped());
    let mut names: Vec<&str> = ck.tensors.names().collect();
    names.sort();
    let mut kept_names: Vec<&str> = kept.tensors.names().collect();
    kept_names.sort();
    assert_eq!(names, kept_names);
    for name in names {
        let read = |ck: &Checkpoint| {
            let t = ck.tensors.get(name).unwrap().unwrap();
            t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        };
        assert_eq!(read(&ck), read(&kept), "{name}");
    }
}
