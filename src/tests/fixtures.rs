//! The golden fixtures (tests/golden/): each case's weights, input and the float64 reference
//! output of the official model, listed in manifest.json.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

/// A float32 port lands within ~3e-6 of the float64 reference; every bug class we know of
/// (tanh GELU, LayerNorm eps, bias index, mask, slopes, padding) lands above 5e-5.
pub const TOLERANCE: f64 = 2e-5;

pub fn golden_dir() -> PathBuf {
    crate::tests::repo().join("tests/golden")
}

pub struct Case {
    pub name: String,
    pub weights: PathBuf,
    pub io: PathBuf,
    pub scale: usize,
}

pub fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(golden_dir().join("manifest.json")).expect("manifest");
    let v: serde_json::Value = serde_json::from_str(&text).expect("manifest json");
    let list = v
        .get("cases")
        .and_then(|c| c.as_array())
        .or_else(|| v.as_array())
        .expect("manifest: a list of cases");
    list.iter()
        .map(|c| Case {
            name: c["name"].as_str().unwrap().to_string(),
            weights: golden_dir().join(c["weights"].as_str().unwrap()),
            io: golden_dir().join(c["io"].as_str().unwrap()),
            scale: c["scale"].as_u64().unwrap() as usize,
        })
        .collect()
}

pub fn load_io(path: &Path) -> (Tensor, Tensor) {
    let t = candle_core::safetensors::load(path, &Device::Cpu).expect("io fixture");
    (t["input"].clone(), t["output"].clone())
}

/// The largest difference of two same-shape tensors, on any devices.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.dims(), b.dims());
    let f64_on_cpu = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
    };
    (f64_on_cpu(a) - f64_on_cpu(b))
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Panics unless `out`, the output of the model in `weights` for `input` with bf16 products
/// on the CPU, differs from its f32 output: the same output would mean that no layer packed
/// its weights for bf16 products at load.
pub fn assert_bf16_products(name: &str, weights: &Path, input: &Tensor, out: &Tensor) {
    let f32 = crate::model::Model::load(weights, DType::F32, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let want = candle_core::Module::forward(&f32.net, input).unwrap();
    let d = max_abs_diff(out, &want);
    assert!(d > 0.0, "{name}: bf16 gave the f32 output");
}
