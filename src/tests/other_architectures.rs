//! Checkpoints of architectures this build does not run are named, not answered with the
//! fallback's missing tensor: one network of each (its state-dict keys, from
//! tests/fixtures/make_other_architectures.py) must be refused as what it is, claimed by no
//! registry entry; and no committed fixture of ours looks like any of them.

use std::path::{Path, PathBuf};

use crate::checkpoint::{is_buffer, Checkpoint};
use crate::nets::registry::{infer, other_architecture, Shapes, REGISTRY};
use crate::nets::ConfigError;

fn fixture() -> Vec<(String, String, Vec<String>)> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/other_architectures.json");
    let text = std::fs::read_to_string(&path).expect("tests/fixtures/other_architectures.json");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v.as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let keys = n["keys"].as_array().unwrap();
            (
                n["name"].as_str().unwrap().to_string(),
                n["class"].as_str().unwrap().to_string(),
                keys.iter()
                    .map(|k| k.as_str().unwrap().to_string())
                    .collect(),
            )
        })
        .collect()
}

#[test]
fn each_other_architecture_is_named_and_claimed_by_no_entry() {
    let networks = fixture();
    assert!(networks.len() >= 20, "{} networks", networks.len());
    for (name, class, keys) in networks {
        // What loading hands to the registry: the buffers dropped.
        let shapes: Shapes = keys
            .into_iter()
            .filter(|k| !is_buffer(k))
            .map(|k| (k, vec![1]))
            .collect();
        let claimed: Vec<_> = REGISTRY
            .iter()
            .filter(|a| a.detect(&shapes))
            .map(|a| a.name())
            .collect();
        assert!(claimed.is_empty(), "{class}: claimed by {claimed:?}");
        match infer(&shapes) {
            Err(ConfigError::OtherArchitecture { found, supported }) => {
                assert!(found.contains(&name), "{class}: named as '{found}'");
                assert!(supported.contains("DRCT"), "{supported}");
            }
            other => panic!("{class}: {other:?}"),
        }
    }
}

fn weight_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            weight_files(&path, out);
        } else if matches!(
            path.extension().and_then(|e| e.to_str()),
            Some("pth" | "safetensors")
        ) && !path.to_string_lossy().contains(".io.")
        {
            out.push(path);
        }
    }
}

#[test]
fn no_fixture_of_ours_looks_like_another_architecture() {
    let mut files = Vec::new();
    weight_files(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden"),
        &mut files,
    );
    assert!(files.len() >= 20, "{} fixtures", files.len());
    for file in files {
        let ck = Checkpoint::load(&file).unwrap_or_else(|e| panic!("{e}"));
        let shapes: Shapes = ck
            .tensors
            .names()
            .map(|k| (k.to_string(), ck.tensors.dims(k).unwrap().to_vec()))
            .collect();
        assert_eq!(other_architecture(&shapes), None, "{}", file.display());
    }
}
