//! The project's CUDA kernels on a GPU: the fused window attention against its CPU twin (and
//! against the model's CPU attention with its region labels), and whole models with fused
//! attention against the float64 golden outputs.

use std::path::PathBuf;
use std::time::Instant;

use super::{gpu, max_abs, within};
use crate::model::Model;
use crate::ops::attention::cuda::FusedWindowAttention;
use crate::ops::attention::Attention;
use crate::ops::windows::{relative_position_bias, RelativeBias, WindowCache};
use crate::tests::fixtures::max_abs_diff;
use candle_core::{DType, Device, Result, Tensor};

/// A window-attention problem: `batch` maps of `height x width`, `window`, `heads` heads of
/// `head_dim` columns.
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    height: usize,
    width: usize,
    window: usize,
    heads: usize,
    head_dim: usize,
}

const fn case(
    batch: usize,
    height: usize,
    width: usize,
    window: usize,
    heads: usize,
    head_dim: usize,
) -> Case {
    Case {
        batch,
        height,
        width,
        window,
        heads,
        head_dim,
    }
}

/// Windows 4, 8 and 16; non-square maps; odd head dims; every kernel variant and its bounds
/// (scalar: d 1..32, 33..64, 65..128; tensor cores: d padded to 16, 32, ..., 128, and odd
/// channel counts, which fall back to the scalar kernel); the official DRCT blocks (window 16:
/// 6x30, 4x53, 2x122, 6x46, 4x77).
const CASES: &[Case] = &[
    case(2, 8, 12, 4, 3, 5),
    case(2, 16, 8, 4, 2, 3),
    case(1, 4, 4, 4, 4, 1),
    case(2, 16, 24, 8, 2, 5),
    case(2, 8, 16, 8, 1, 7),
    case(1, 24, 16, 8, 6, 30),
    case(2, 16, 16, 8, 3, 32),
    case(1, 16, 24, 8, 2, 33),
    case(1, 16, 8, 8, 2, 64),
    case(1, 8, 16, 8, 2, 65),
    case(1, 16, 8, 8, 1, 128),
    case(1, 16, 16, 8, 2, 90),
    case(1, 8, 16, 8, 1, 112),
    case(2, 32, 48, 16, 6, 30),
    case(1, 48, 32, 16, 4, 53),
    case(1, 32, 32, 16, 2, 122),
    case(1, 32, 16, 16, 6, 46),
    case(1, 16, 32, 16, 4, 77),
];

impl Case {
    fn windows(&self) -> usize {
        self.batch * (self.height / self.window) * (self.width / self.window)
    }

    /// Random `(qkv, bias)` on the CPU in f32, q scaled by `d^-0.5` as the model scales it.
    fn inputs(&self) -> Result<(Tensor, Tensor)> {
        let (qkv, bias, _) = self.inputs_with_table()?;
        Ok((qkv, bias))
    }

    /// [`Self::inputs`], the bias gathered from a random table, and that table as the CPU
    /// kernel reads it.
    fn inputs_with_table(&self) -> Result<(Tensor, Tensor, RelativeBias)> {
        let dev = Device::Cpu;
        let (n, c) = (self.window * self.window, self.heads * self.head_dim);
        let side = 2 * self.window - 1;
        let q = (Tensor::randn(0f32, 1.0, (self.windows(), n, c), &dev)?
            * (self.head_dim as f64).powf(-0.5))?;
        let kv = Tensor::randn(0f32, 1.0, (self.windows(), n, 2 * c), &dev)?;
        let table = Tensor::randn(0f32, 1.0, (side * side, self.heads), &dev)?;
        Ok((
            Tensor::cat(&[q, kv], 2)?,
            relative_position_bias(&table, self.window)?,
            RelativeBias::new(&table, self.window)?,
        ))
    }

    fn op(&self, shifted: bool, tensor_cores: bool) -> FusedWindowAttention {
        FusedWindowAttention {
            heads: self.heads,
            window: self.window,
            height: self.height,
            width: self.width,
            shifted,
            tensor_cores,
        }
    }

    fn fused(&self, qkv: &Tensor, bias: &Tensor, shifted: bool) -> Result<Tensor> {
        self.op(shifted, false).apply(qkv, bias)
    }

    fn tensor_core(&self, qkv: &Tensor, bias: &Tensor, shifted: bool) -> Result<Tensor> {
        self.op(shifted, true).apply(qkv, bias)
    }
}

#[test]
fn fused_kernel_matches_the_cpu_in_f32() {
    let dev = gpu();
    let mut failures = Vec::new();
    for c in CASES {
        let (qkv, bias, table) = c.inputs_with_table().unwrap();
        let (qkv_gpu, bias_gpu) = (qkv.to_device(&dev).unwrap(), bias.to_device(&dev).unwrap());
        for shifted in [false, true] {
            let ours = c.fused(&qkv_gpu, &bias_gpu, shifted).unwrap();
            assert!(ours.device().is_cuda());
            let twin = c.fused(&qkv, &bias, shifted).unwrap();
            // The model's CPU attention with the region labels it stores: an independent
            // check of the kernel's labels, not only of the kernel against its twin.
            let regions = shifted.then(|| {
                WindowCache::new(c.window, DType::F32, &Device::Cpu)
                    .regions(c.height, c.width)
                    .unwrap()
            });
            let stored = crate::ops::attention::cpu::window_attention(
                &qkv,
                &table,
                regions.as_deref(),
                None,
            )
            .unwrap()
            .expect("the CPU f32 kernel applies");
            let (d_twin, d_stored) = (max_abs_diff(&ours, &twin), max_abs_diff(&ours, &stored));
            eprintln!(
                "{c:?} shifted {shifted}: {d_twin:.2e} vs twin, {d_stored:.2e} vs the CPU kernel"
            );
            if !(within(d_twin, 1e-4) && within(d_stored, 1e-4)) {
                failures.push(format!(
                    "{c:?} shifted {shifted}: {d_twin:.2e} / {d_stored:.2e}"
                ));
            }
        }
    }
    assert!(failures.is_empty(), "over 1e-4: {failures:#?}");
}

/// bf16 and f16: the kernel reads the rounded inputs, computes in f32 and rounds once on
/// output, so against the CPU twin run in f32 on the same rounded inputs it may differ by
/// the output rounding (at most the unit roundoff u times |out|: 2^-8 for bf16, 2^-11 for
/// f16) plus f32 summation-order noise (1e-4 covers it with a wide margin). Indexing or mask
/// errors move outputs by a sizeable fraction of |v| ~ 1, far beyond that.
#[test]
fn fused_kernel_matches_the_cpu_in_bf16_and_f16() {
    sixteen_bit_against_the_twin(Case::fused, false);
}

/// The tensor-core kernel also rounds the probabilities to the input type before the second
/// product, normalised by their rounded sum: each weight moves by at most u relative, which
/// moves the output by at most u max|v - out| <= 2u max|v|, added to the bound above.
#[test]
fn tensor_core_kernel_matches_the_cpu_in_bf16_and_f16() {
    sixteen_bit_against_the_twin(Case::tensor_core, true);
}

fn sixteen_bit_against_the_twin(
    run: fn(&Case, &Tensor, &Tensor, bool) -> Result<Tensor>,
    rounded_probabilities: bool,
) {
    let dev = gpu();
    let mut failures = Vec::new();
    for (dtype, u) in [(DType::BF16, 2f64.powi(-8)), (DType::F16, 2f64.powi(-11))] {
        for c in CASES {
            let (qkv, bias) = c.inputs().unwrap();
            let (qkv, bias) = (qkv.to_dtype(dtype).unwrap(), bias.to_dtype(dtype).unwrap());
            let (qkv32, bias32) = (
                qkv.to_dtype(DType::F32).unwrap(),
                bias.to_dtype(DType::F32).unwrap(),
            );
            let slack = if rounded_probabilities {
                let v = qkv32.narrow(2, 2 * c.heads * c.head_dim, c.heads * c.head_dim);
                2.0 * u * max_abs(&v.unwrap())
            } else {
                0.0
            };
            let (qkv_gpu, bias_gpu) = (qkv.to_device(&dev).unwrap(), bias.to_device(&dev).unwrap());
            for shifted in [false, true] {
                let ours = run(c, &qkv_gpu, &bias_gpu, shifted).unwrap();
                assert_eq!(ours.dtype(), dtype);
                let ours = ours
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                let want = c.fused(&qkv32, &bias32, shifted).unwrap();
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
                eprintln!(
                    "{dtype:?} {c:?} shifted {shifted}: max abs diff {worst:.2e} (|out| <= {:.2})",
                    max_abs(&want)
                );
                if over > 0.0 {
                    failures.push(format!(
                        "{dtype:?} {c:?} shifted {shifted}: {over} elements over the bound, worst {worst:.2e}"
                    ));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn unsupported_head_dims_are_errors_not_panics() {
    let dev = gpu();
    let c = case(1, 8, 8, 8, 1, 129);
    let (qkv, bias) = c.inputs().unwrap();
    let err = c
        .fused(
            &qkv.to_device(&dev).unwrap(),
            &bias.to_device(&dev).unwrap(),
            true,
        )
        .expect_err("head dim 129 has no kernel variant");
    let msg = err.to_string();
    assert!(msg.contains("head dim"), "unclear message: {msg}");
    // Mixed dtypes are refused as well.
    let c = case(1, 8, 8, 8, 1, 8);
    let (qkv, bias) = c.inputs().unwrap();
    let bias16 = bias.to_dtype(DType::BF16).unwrap().to_device(&dev).unwrap();
    assert!(c
        .fused(&qkv.to_device(&dev).unwrap(), &bias16, false)
        .is_err());
}

/// candle's graph for the same attention (what `--attention reference` runs), on any device.
fn graph_attention(
    qkv: &Tensor,
    bias: &Tensor,
    mask: Option<&Tensor>,
    heads: usize,
) -> Result<Tensor> {
    let (bw, n, c3) = qkv.dims3()?;
    let d = c3 / 3 / heads;
    let qkv = qkv
        .reshape((bw, n, 3, heads, d))?
        .permute((2, 0, 3, 1, 4))?;
    let (q, k, v) = (
        qkv.get(0)?.contiguous()?,
        qkv.get(1)?.contiguous()?,
        qkv.get(2)?.contiguous()?,
    );
    let mut attn = q.matmul(&k.t()?)?.broadcast_add(bias)?;
    if let Some(mask) = mask {
        let nw = mask.dim(0)?;
        attn = attn
            .reshape((bw / nw, nw, heads, n, n))?
            .broadcast_add(&mask.unsqueeze(1)?)?
            .reshape((bw, heads, n, n))?;
    }
    candle_nn::ops::softmax_last_dim(&attn)?
        .matmul(&v)?
        .transpose(1, 2)?
        .reshape((bw, n, heads * d))
}

/// The official DRCT block shape (window 16, 6 heads of 30, shifted) on a batch of 64x64 maps,
/// fused and through candle's graph on the GPU, each against the f32 result on the same
/// (rounded) inputs: in f32 both must agree with it; in bf16 the kernel may differ only by its
/// output rounding (u = 2^-8 of |out|), while the graph's error, rounded scores and
/// probabilities included, is printed for comparison. The times are printed, not asserted.
#[test]
fn fused_kernel_official_shape_against_the_graph() {
    let dev = gpu();
    let c = case(8, 64, 64, 16, 6, 30);
    let (qkv, bias) = c.inputs().unwrap();
    for dtype in [DType::F32, DType::BF16] {
        let qkv = qkv.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
        let bias = bias.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
        let mask = WindowCache::new(c.window, dtype, &dev)
            .mask(c.height, c.width)
            .unwrap();
        let truth = c
            .fused(
                &qkv.to_dtype(DType::F32).unwrap(),
                &bias.to_dtype(DType::F32).unwrap(),
                true,
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
        let fused = || c.fused(&qkv, &bias, true).unwrap();
        let graph = || graph_attention(&qkv, &bias, Some(&mask), c.heads).unwrap();
        let (d_fused, d_graph) = (
            max_abs_diff(&fused(), &truth),
            max_abs_diff(&graph(), &truth),
        );
        let (t_fused, t_graph) = (time(&fused), time(&graph));
        eprintln!(
            "{dtype:?} {c:?}: fused {t_fused:.3} ms, graph {t_graph:.3} ms (median of 10); \
             max abs diff from f32: fused {d_fused:.2e}, graph {d_graph:.2e}"
        );
        if dtype == DType::F32 {
            assert!(
                within(d_graph, 1e-4),
                "graph against fused f32: {d_graph:.2e}"
            );
            // Fused f32 is the truth itself here; the CPU comparisons cover its accuracy.
        } else {
            let bound = 2f64.powi(-8) * max_abs(&truth) + 1e-4;
            assert!(within(d_fused, bound), "bf16: {d_fused:.2e} > {bound:.2e}");
        }
    }
}

struct Golden {
    name: String,
    weights: PathBuf,
    io: PathBuf,
}

/// Every case of tests/golden/manifest.json, plus the shipped default model.
fn golden_cases() -> Vec<Golden> {
    let mut cases: Vec<Golden> = crate::tests::fixtures::cases()
        .into_iter()
        .map(|c| Golden {
            name: c.name,
            weights: c.weights,
            io: c.io,
        })
        .collect();
    cases.push(Golden {
        name: "default_x4".into(),
        weights: crate::tests::repo().join("models/default_x4.safetensors"),
        io: crate::tests::golden("default_x4.io.safetensors"),
    });
    cases
}

/// Whole models on CUDA with fused attention: f32 against the float64 reference (the bar the
/// CPU meets, 2e-5) and against the CPU's f32 output (1e-4), with candle's graph on CUDA
/// printed beside it; in bf16, within reach of candle's graph in bf16.
#[test]
fn models_with_fused_attention_match_the_reference() {
    let dev = gpu();
    let mut failures = Vec::new();
    for case in golden_cases() {
        let io = candle_core::safetensors::load(&case.io, &Device::Cpu).expect("io fixture");
        let (input, expected) = (&io["input"], &io["output"]);
        let load = |dtype, device: &Device, attention| {
            let ck = crate::checkpoint::Checkpoint::load(&case.weights)
                .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            Model::from_checkpoint_with(ck, dtype, device, attention).unwrap()
        };
        let cpu = load(DType::F32, &Device::Cpu, Attention::Fused)
            .net
            .forward(input)
            .unwrap();
        let x = input.to_device(&dev).unwrap();
        let fused = load(DType::F32, &dev, Attention::Fused)
            .net
            .forward(&x)
            .unwrap();
        let graph = load(DType::F32, &dev, Attention::Reference)
            .net
            .forward(&x)
            .unwrap();
        let (d_ref, d_cpu) = (max_abs_diff(&fused, expected), max_abs_diff(&fused, &cpu));
        let d_graph = max_abs_diff(&graph, expected);
        let bf16 = |attention| {
            let y = load(DType::BF16, &dev, attention).net.forward(&x).unwrap();
            max_abs_diff(&y, expected)
        };
        let (d_bf16, d_bf16_graph) = (bf16(Attention::Fused), bf16(Attention::Reference));
        let d_bf16_tc = bf16(Attention::TensorCore);
        eprintln!(
            "{:<28} fused f32: {d_ref:.3e} vs reference, {d_cpu:.3e} vs cpu; graph f32: \
             {d_graph:.3e}; bf16 fused {d_bf16:.3e}, tensor-core {d_bf16_tc:.3e}, graph \
             {d_bf16_graph:.3e}",
            case.name
        );
        if !(within(d_ref, 2e-5) && within(d_cpu, 1e-4)) {
            failures.push(format!("{} f32: {d_ref:.3e} / {d_cpu:.3e}", case.name));
        }
        // The fused kernel keeps the softmax in f32, so in bf16 it should be no worse than
        // candle's graph beyond run-to-run noise; NaN fails this too.
        if !within(d_bf16, 2.0 * d_bf16_graph + 1e-2) {
            failures.push(format!(
                "{} bf16: fused {d_bf16:.3e}, graph {d_bf16_graph:.3e}",
                case.name
            ));
        }
        // Rounded probabilities cost about as much as the graph's bf16 softmax does.
        if !within(d_bf16_tc, 2.0 * d_bf16_graph + 1e-2) {
            failures.push(format!(
                "{} bf16: tensor-core {d_bf16_tc:.3e}, graph {d_bf16_graph:.3e}",
                case.name
            ));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
