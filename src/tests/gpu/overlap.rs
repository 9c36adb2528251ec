//! HAT's overlapping cross-attention kernel (`FusedOverlapAttention`, kernels/window_attention.cu)
//! on a GPU: against its CPU twin (which the CPU tests hold to the model's graph), against
//! candle's graph on the GPU at HAT's shape, and in whole HAT models with the kernel on and
//! off (`UPSCALE_CUDA_OCA`) against the float64 reference.

use std::path::PathBuf;
use std::time::Instant;

use super::{gpu, max_abs, within};
use crate::checkpoint::Checkpoint;
use crate::model::Model;
use crate::ops::attention::cuda::FusedOverlapAttention;
use crate::ops::attention::Attention;
use crate::ops::attention::{overlap_attention_graph, overlap_bias};
use crate::tests::fixtures::{load_io, max_abs_diff, TOLERANCE};
use candle_core::{DType, Device, Result, Tensor};

/// `batch` maps of `height x width`, queries from `window` windows, keys and values from the
/// `overlap` windows around them, `heads` heads of `head_dim`.
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    height: usize,
    width: usize,
    window: usize,
    overlap: usize,
    heads: usize,
    head_dim: usize,
}

const fn case(
    (batch, height, width): (usize, usize, usize),
    (window, overlap, heads, head_dim): (usize, usize, usize, usize),
) -> Case {
    Case {
        batch,
        height,
        width,
        window,
        overlap,
        heads,
        head_dim,
    }
}

/// HAT and Real_HAT_GAN (6 heads of 30) and HAT-S (6 of 24) at window 16 in 24 on non-square
/// maps of several windows and on one window alone; margins of 1 and 2 with odd head dims;
/// every scalar variant (d up to 32, 64, 128).
const CASES: &[Case] = &[
    case((2, 32, 48), (16, 24, 6, 30)),
    case((1, 48, 32), (16, 24, 6, 24)),
    case((1, 16, 16), (16, 24, 2, 30)),
    case((2, 8, 12), (4, 6, 3, 7)),
    case((1, 12, 8), (4, 8, 2, 5)),
    case((1, 16, 24), (8, 12, 2, 53)),
    case((1, 16, 8), (8, 12, 1, 128)),
];

impl Case {
    /// Random `(qkv, bias)` on the CPU in f32, q scaled by `d^-0.5` as the model scales it, the
    /// bias gathered from a random table as the model gathers it.
    fn inputs(&self) -> Result<(Tensor, Tensor)> {
        let dev = Device::Cpu;
        let (b, h, w) = (self.batch, self.height, self.width);
        let c = self.heads * self.head_dim;
        let q =
            (Tensor::randn(0f32, 1.0, (b, h, w, c), &dev)? * (self.head_dim as f64).powf(-0.5))?;
        let kv = Tensor::randn(0f32, 1.0, (b, h, w, 2 * c), &dev)?;
        let side = self.window + self.overlap - 1;
        let table = Tensor::randn(0f32, 1.0, (side * side, self.heads), &dev)?;
        Ok((
            Tensor::cat(&[q, kv], 3)?,
            overlap_bias(&table, self.window, self.overlap)?,
        ))
    }

    /// The scalar kernel (or, with `tensor_cores`, the tensor-core one for bf16/f16).
    fn run_with(&self, qkv: &Tensor, bias: &Tensor, tensor_cores: bool) -> Result<Tensor> {
        FusedOverlapAttention {
            heads: self.heads,
            window: self.window,
            overlap_window: self.overlap,
            tensor_cores,
        }
        .apply(qkv, bias)
    }

    fn run(&self, qkv: &Tensor, bias: &Tensor) -> Result<Tensor> {
        self.run_with(qkv, bias, false)
    }

    fn graph(&self, qkv: &Tensor, bias: &Tensor) -> Result<Tensor> {
        overlap_attention_graph(qkv, bias, self.heads, self.window, self.overlap)
    }
}

/// f32: the kernel against its CPU twin and against the model's graph on the CPU, within 1e-4
/// (f32 summation order; a wrong key, border or bias row moves outputs by a sizeable fraction
/// of |v| ~ 1).
#[test]
fn overlap_kernel_matches_the_cpu_in_f32() {
    let dev = gpu();
    let mut failures = Vec::new();
    for c in CASES {
        let (qkv, bias) = c.inputs().unwrap();
        let ours = c
            .run(
                &qkv.to_device(&dev).unwrap(),
                &bias.to_device(&dev).unwrap(),
            )
            .unwrap();
        assert!(ours.device().is_cuda());
        let twin = c.run(&qkv, &bias).unwrap();
        let graph = c.graph(&qkv, &bias).unwrap();
        let (d_twin, d_graph) = (max_abs_diff(&ours, &twin), max_abs_diff(&ours, &graph));
        eprintln!("{c:?}: {d_twin:.2e} vs twin, {d_graph:.2e} vs the graph");
        if !(within(d_twin, 1e-4) && within(d_graph, 1e-4)) {
            failures.push(format!("{c:?}: {d_twin:.2e} / {d_graph:.2e}"));
        }
    }
    assert!(failures.is_empty(), "over 1e-4: {failures:#?}");
}

/// bf16 and f16: the scalar kernel reads the rounded inputs, computes in f32 and rounds once
/// on output, so against the twin run in f32 on the same rounded inputs each output may differ
/// by its rounding (u |out|: u = 2^-8 for bf16, 2^-11 for f16) plus f32 summation-order noise
/// (1e-4). The tensor-core kernel also rounds the probabilities to the input type (normalised
/// by their rounded sum): each weight moves by at most u relative, which moves the output by
/// at most u max|v - out| <= 2u max|v|, added to the bound.
#[test]
fn overlap_kernels_match_the_cpu_in_bf16_and_f16() {
    let dev = gpu();
    let mut failures = Vec::new();
    for (dtype, u) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        for (c, tensor_cores) in CASES.iter().flat_map(|c| [(c, false), (c, true)]) {
            let (qkv, bias) = c.inputs().unwrap();
            let (qkv, bias) = (qkv.to_dtype(dtype).unwrap(), bias.to_dtype(dtype).unwrap());
            let slack = if tensor_cores {
                let v = qkv.narrow(3, 2 * c.heads * c.head_dim, c.heads * c.head_dim);
                2.0 * u * max_abs(&v.unwrap())
            } else {
                0.0
            };
            let ours = c
                .run_with(
                    &qkv.to_device(&dev).unwrap(),
                    &bias.to_device(&dev).unwrap(),
                    tensor_cores,
                )
                .unwrap();
            assert_eq!(ours.dtype(), dtype);
            let ours = ours
                .to_device(&Device::Cpu)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let want = c
                .run(
                    &qkv.to_dtype(DType::F32).unwrap(),
                    &bias.to_dtype(DType::F32).unwrap(),
                )
                .unwrap();
            let err = (&ours - &want).unwrap().abs().unwrap();
            let allowed = ((want.abs().unwrap() * u).unwrap() + (1e-4 + slack)).unwrap();
            let over = err
                .gt(&allowed)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            let worst = max_abs(&err);
            eprintln!("{dtype:?} {c:?} tensor cores {tensor_cores}: max abs diff {worst:.2e}");
            if over > 0.0 {
                failures.push(format!(
                    "{dtype:?} {c:?} tensor cores {tensor_cores}: {over} elements over the \
                     bound, worst {worst:.2e}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// HAT's shape (6 heads of 30, window 16 in 24) on a batch of 64x64 maps: the scalar kernel,
/// the tensor-core kernel (bf16) and candle's graph on the GPU, each against the f32 result on
/// the same (rounded) inputs. In f32 the graph within 1e-4 of the kernel; in bf16 the scalar
/// kernel may differ by its output rounding alone (2^-8 |out|, plus 1e-4) and the tensor-core
/// one by that plus its rounded probabilities (2^-7 max |v|), while the graph's error (rounded
/// scores and probabilities) is printed beside them. The times are printed, not asserted.
#[test]
fn overlap_kernels_hat_shape_against_the_graph() {
    let dev = gpu();
    let c = case((8, 64, 64), (16, 24, 6, 30));
    let (qkv, bias) = c.inputs().unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let qkv = qkv.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
        let bias = bias.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
        let truth = c
            .run(
                &qkv.to_dtype(DType::F32).unwrap(),
                &bias.to_dtype(DType::F32).unwrap(),
            )
            .unwrap();
        let time = |f: &dyn Fn() -> Tensor| {
            f();
            dev.synchronize().unwrap();
            let mut ms = Vec::new();
            for _ in 0..10 {
                let t = Instant::now();
                f();
                dev.synchronize().unwrap();
                ms.push(t.elapsed().as_secs_f64() * 1e3);
            }
            ms.sort_by(f64::total_cmp);
            ms[ms.len() / 2]
        };
        let scalar = || c.run(&qkv, &bias).unwrap();
        let tensor_core = || c.run_with(&qkv, &bias, true).unwrap();
        let graph = || c.graph(&qkv, &bias).unwrap();
        let d_scalar = max_abs_diff(&scalar(), &truth);
        let d_tc = max_abs_diff(&tensor_core(), &truth);
        let d_graph = max_abs_diff(&graph(), &truth);
        let (t_scalar, t_tc, t_graph) = (time(&scalar), time(&tensor_core), time(&graph));
        eprintln!(
            "{dtype:?} {c:?}: scalar kernel {t_scalar:.3} ms, tensor-core kernel {t_tc:.3} ms, \
             graph {t_graph:.3} ms (median of 10); max abs diff from f32: scalar {d_scalar:.2e}, \
             tensor-core {d_tc:.2e}, graph {d_graph:.2e}"
        );
        if dtype == DType::F32 {
            // f32 has no tensor-core kernel: both runs are the scalar one.
            assert!(
                within(d_graph, 1e-4) && within(d_tc, 0.0),
                "f32: graph {d_graph:.2e}, tensor-core request {d_tc:.2e}"
            );
        } else {
            let u = 2f64.powi(-8);
            let v = qkv.narrow(3, 2 * c.heads * c.head_dim, c.heads * c.head_dim);
            let bound = u * max_abs(&truth) + 1e-4;
            let tc_bound = bound + 2.0 * u * max_abs(&v.unwrap());
            assert!(
                within(d_scalar, bound) && within(d_tc, tc_bound),
                "bf16: scalar {d_scalar:.2e} (bound {bound:.2e}), tensor-core {d_tc:.2e} \
                 (bound {tc_bound:.2e})"
            );
        }
    }
}

/// (name, weights, io) of every HAT fixture (tests/golden/hat/manifest.json).
fn hat_fixtures() -> Vec<(String, PathBuf, PathBuf)> {
    let dir = crate::tests::repo().join("tests/golden/hat");
    let text = std::fs::read_to_string(dir.join("manifest.json")).expect("manifest");
    let v: serde_json::Value = serde_json::from_str(&text).expect("manifest json");
    v.as_array()
        .expect("a list of cases")
        .iter()
        .map(|c| {
            (
                c["name"].as_str().unwrap().to_string(),
                dir.join(c["weights"].as_str().unwrap()),
                dir.join(c["io"].as_str().unwrap()),
            )
        })
        .collect()
}

/// Whole HAT models on CUDA with the overlap kernel on and off (the graph). In f32: the two
/// within 1e-4 of each other (the bar the GPU's f32 is held to against the CPU), and the
/// kernel's error from the float64 reference within the CPU's bar (2e-5) or, should candle's
/// f32 on the GPU already miss that for HAT, no more than the graph's (plus 1e-5). In bf16,
/// with the scalar kernel (`--attention fused`) and the tensor-core one (the default): each
/// one's error no more than twice the graph's (plus 1e-2 for run-to-run noise), as for the
/// window-attention kernels.
#[test]
fn hat_models_with_the_overlap_kernel_match_the_reference() {
    let dev = gpu();
    let mut failures = Vec::new();
    for (name, weights, io) in hat_fixtures() {
        let (input, expected) = load_io(&io);
        let x = input.to_device(&dev).unwrap();
        let run = |dtype, attention, kernel| {
            let ck = Checkpoint::load(&weights).unwrap();
            let model = crate::switches::with(
                |s| s.overlap_kernel = kernel,
                || Model::from_checkpoint_with(ck, dtype, &dev, attention),
            );
            model.unwrap().net.forward(&x).unwrap()
        };
        let on = run(DType::F32, Attention::Fused, true);
        let off = run(DType::F32, Attention::Fused, false);
        let between = max_abs_diff(&on, &off);
        let (f32_on, f32_off) = (max_abs_diff(&on, &expected), max_abs_diff(&off, &expected));
        let bf16 =
            |attention, kernel| max_abs_diff(&run(DType::BF16, attention, kernel), &expected);
        let bf16_scalar = bf16(Attention::Fused, true);
        let bf16_tc = bf16(Attention::TensorCore, true);
        let bf16_graph = bf16(Attention::TensorCore, false);
        eprintln!(
            "{name:<24} f32: kernel {f32_on:.3e}, graph {f32_off:.3e} (between {between:.3e}); \
             bf16: scalar kernel {bf16_scalar:.3e}, tensor-core kernel {bf16_tc:.3e}, graph \
             {bf16_graph:.3e} (vs the float64 reference)"
        );
        if !(within(between, 1e-4) && within(f32_on, TOLERANCE.max(f32_off + 1e-5))) {
            failures.push(format!(
                "{name} f32: kernel {f32_on:.3e}, graph {f32_off:.3e}, between {between:.3e}"
            ));
        }
        for (what, d) in [("scalar", bf16_scalar), ("tensor-core", bf16_tc)] {
            if !within(d, 2.0 * bf16_graph + 1e-2) {
                failures.push(format!(
                    "{name} bf16: {what} {d:.3e}, graph {bf16_graph:.3e}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
