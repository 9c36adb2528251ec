//! The row-wise kernels (kernels/rowwise.cu) against candle's composition of the same ops on
//! the CPU in f32, in every dtype.
//!
//! The 16-bit inputs are rounded first and the reference reads the same rounded values, so
//! the kernels may differ from it only by their single output rounding (u |out|, u the unit
//! roundoff) plus f32 noise. A wrong column, token or row moves outputs by about their own
//! size, far beyond that.

use super::gpu;
use crate::ops::conv::cuda as conv_rw;
use crate::ops::linear::rowwise::{self, Act};
use crate::ops::norm::{cuda as norm_rw, Norm};
use crate::ops::pad::{Channels, Pad};
use crate::switches::cuda_off::Off;
use crate::tests::fixtures::f32_values;
use candle_core::{DType, Device, Result, Tensor};

/// Unit roundoff of each dtype the kernels take.
const DTYPES: [(DType, f32); 3] = [
    (DType::F32, 0.0),
    (DType::BF16, 1.0 / 256.0),
    (DType::F16, 1.0 / 2048.0),
];

/// Headroom for f32 arithmetic (erf, the norms' sums) on values of about 1.
const NOISE: f32 = 2e-5;

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap()
}

/// `t` rounded to `dtype` and back to f32.
fn rounded(t: &Tensor, dtype: DType) -> Tensor {
    t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap()
}

/// A random permutation-like index vector: `n` indices below `bound`, in scrambled order.
fn scrambled(n: usize, bound: usize) -> Tensor {
    let idx: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % bound) as u32).collect();
    Tensor::from_vec(idx, n, &Device::Cpu).unwrap()
}

/// `Some(message)` when `ours` (any dtype, any device) is further from `want` (f32, CPU)
/// than `u |want| + NOISE` anywhere.
fn excess(what: &str, ours: &Tensor, want: &Tensor, u: f32) -> Option<String> {
    excess_over(what, ours, want, u, NOISE)
}

/// [`excess`] with `noise` for `NOISE`.
fn excess_over(what: &str, ours: &Tensor, want: &Tensor, u: f32, noise: f32) -> Option<String> {
    assert_eq!(ours.dims(), want.dims(), "{what}");
    let (ours, want) = (f32_values(ours), f32_values(want));
    let worst = ours
        .iter()
        .zip(&want)
        .map(|(o, w)| {
            let d = (o - w).abs();
            // NaN compares as the worst.
            if d.is_nan() {
                f32::INFINITY
            } else {
                d - u * w.abs()
            }
        })
        .fold(f32::NEG_INFINITY, f32::max);
    eprintln!("{what}: worst excess over u|want| {worst:.2e}");
    (worst > noise).then(|| format!("{what}: {worst:.2e} over u|want| + {noise:e}"))
}

#[test]
fn bias_act_matches_candle() {
    let dev = gpu();
    let mut failures = Vec::new();
    // Column counts below, at and past a warp, odd; a 3-D input as the model passes.
    for (shape, acts) in [
        (vec![37, 7], vec![Act::None, Act::Gelu]),
        (
            vec![2, 50, 180],
            vec![Act::None, Act::Gelu, Act::Leaky(0.2)],
        ),
        (vec![3, 33], vec![Act::Leaky(0.01)]),
    ] {
        let c = *shape.last().unwrap();
        let (y, b, r) = (randn(&shape), randn(&[c]), randn(&shape));
        for (dtype, u) in DTYPES {
            let (y, b, r) = (rounded(&y, dtype), rounded(&b, dtype), rounded(&r, dtype));
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
            for &act in &acts {
                for with_res in [false, true] {
                    let res = with_res.then_some(&r);
                    let want = rowwise::bias_act(&y, &b, res, act, Off::default()).unwrap();
                    let res_gpu = res.map(on);
                    let ours =
                        rowwise::bias_act(&on(&y), &on(&b), res_gpu.as_ref(), act, Off::default())
                            .unwrap();
                    assert!(ours.device().is_cuda() && ours.dtype() == dtype);
                    let what = format!("{shape:?} {dtype:?} {act:?} residual {with_res}");
                    failures.extend(excess(&what, &ours, &want, u));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn cat_bias_act_matches_candle() {
    let dev = gpu();
    let mut failures = Vec::new();
    for (lead, pc, c) in [
        (vec![2, 5, 6], 180, 32),
        (vec![9], 7, 3),
        (vec![1, 4], 1, 40),
    ] {
        let shape = |last: usize| [lead.as_slice(), &[last]].concat();
        let (prev, y, b) = (randn(&shape(pc)), randn(&shape(c)), randn(&[c]));
        for (dtype, u) in DTYPES {
            let (prev, y, b) = (
                rounded(&prev, dtype),
                rounded(&y, dtype),
                rounded(&b, dtype),
            );
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
            let act = Act::Leaky(0.2);
            let want = rowwise::cat_bias_act(&prev, &y, &b, act, Off::default()).unwrap();
            let ours =
                rowwise::cat_bias_act(&on(&prev), &on(&y), &on(&b), act, Off::default()).unwrap();
            assert!(ours.device().is_cuda());
            let what = format!("{lead:?} prev {pc} + {c} {dtype:?}");
            failures.extend(excess(&what, &ours, &want, u));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// A layer norm over the real channels of `ch` with random affine parameters rounded to
/// `dtype`: on `dev` in `dtype`, and on the CPU in f32 for the reference.
fn layer_norms(ch: &Channels, seed: &(Tensor, Tensor), dtype: DType, dev: &Device) -> (Norm, Norm) {
    let c = ch.real();
    let (w, b) = (
        seed.0.narrow(0, 0, c).unwrap(),
        seed.1.narrow(0, 0, c).unwrap(),
    );
    let (w, b) = (rounded(&w, dtype), rounded(&b, dtype));
    let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(dev).unwrap();
    (
        Norm::new(ch, on(&w), on(&b), 1e-5).unwrap(),
        Norm::new(ch, w, b, 1e-5).unwrap(),
    )
}

/// Token rows of 180 (DRCT-L's width), 7 and 308 (DRCT-L's widest block input) channels;
/// a batch of two; inputs with an offset, as residual streams have, so the mean matters.
const NORM_CASES: [(usize, usize, usize, usize); 3] =
    [(2, 64, 64, 180), (1, 50, 37, 7), (2, 16, 16, 308)];

/// The channels of a norm case, unpadded and padded to 16 as the model pads them
/// (`UPSCALE_PAD_CHANNELS`): 308 as the widest block's input of five parts, each padded on
/// its own, so the kernels must skip zeros in the middle of the row too.
fn norm_channels(c: usize) -> [Channels; 2] {
    let pad = Pad::to(16).unwrap();
    let padded = if c == 308 {
        pad.one(180).then(&pad.parts(4, 32))
    } else {
        pad.one(c)
    };
    [Pad::OFF.one(c), padded]
}

/// `randn` rows of `ch`'s real channels times 3 plus 1.5, spread to its padded width.
fn offset_rows(lead: &[usize], ch: &Channels) -> Tensor {
    let mut shape = lead.to_vec();
    shape.push(ch.real());
    let x = randn(&shape).affine(3.0, 1.5).unwrap();
    ch.spread(&x, lead.len()).unwrap()
}

#[test]
fn gather_norm_matches_candle() {
    let dev = gpu();
    let seed = (randn(&[512]), randn(&[512]));
    let mut failures = Vec::new();
    for ((b, t_in, t, c), ch) in NORM_CASES
        .into_iter()
        .flat_map(|case| norm_channels(case.3).map(|ch| (case, ch)))
    {
        let x = offset_rows(&[b, t_in], &ch);
        let order = scrambled(t, t_in);
        for (dtype, u) in DTYPES {
            let x = rounded(&x, dtype);
            let (ln, ln32) = layer_norms(&ch, &seed, dtype, &dev);
            let want = norm_rw::gather_norm(&ln32, &x, &order).unwrap();
            let x_gpu = x.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
            let ours = norm_rw::gather_norm(&ln, &x_gpu, &order.to_device(&dev).unwrap()).unwrap();
            assert!(ours.device().is_cuda());
            let what = format!(
                "gather_norm {b}x{t_in}->{t}x{} of {c} {dtype:?}",
                ch.padded()
            );
            failures.extend(excess(&what, &ours, &want, u));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn add_gather_norm_matches_candle() {
    let dev = gpu();
    let seed = (randn(&[512]), randn(&[512]));
    let mut failures = Vec::new();
    for ((b, ty, t, c), ch) in NORM_CASES
        .into_iter()
        .flat_map(|case| norm_channels(case.3).map(|ch| (case, ch)))
    {
        let x = offset_rows(&[b, t], &ch);
        let y = ch.spread(&randn(&[b, ty, c]), 2).unwrap();
        let back = scrambled(t, ty);
        for (dtype, u) in DTYPES {
            let (x, y) = (rounded(&x, dtype), rounded(&y, dtype));
            // The kernel rounds the sum to the dtype and normalises that, as the next layers
            // see it: the reference does the same.
            let sum = rounded(&(&x + y.index_select(&back, 1).unwrap()).unwrap(), dtype);
            let (ln, ln32) = layer_norms(&ch, &seed, dtype, &dev);
            let want = candle_core::Module::forward(&ln32, &sum).unwrap();
            let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
            let back_gpu = back.to_device(&dev).unwrap();
            let (ours_sum, ours) =
                norm_rw::add_gather_norm(&ln, &on(&x), None, &on(&y), &back_gpu).unwrap();
            let what = format!(
                "add_gather_norm {b}x{ty}->{t}x{} of {c} {dtype:?}",
                ch.padded()
            );
            failures.extend(excess(&format!("{what} sum"), &ours_sum, &sum, u));
            failures.extend(excess(&format!("{what} normed"), &ours, &want, u));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// HAT's channel-attention term folded into the residual step: `add_gather_norm` with
/// `(z, s)` sums `x + z * s[b] + y[back]` in f32 and rounds it once, so the stored sum is
/// within the dtype's rounding of the exact one (float64 here) plus f32 noise; the norm is
/// held to candle's f32 norm of that stored sum, which is what the kernel normalises, within
/// its own output rounding. With `UPSCALE_CUDA_OFF=cab` (the path before this kernel) candle
/// multiplies and adds in the dtype first: two roundings more, of `z * s` and of `x + z * s`,
/// so the sum's bound grows by `u (|x| + 2 |z s|)`.
#[test]
fn add_gather_norm_with_a_scaled_term_matches_the_exact_sum() {
    let dev = gpu();
    let seed = (randn(&[512]), randn(&[512]));
    let mut failures = Vec::new();
    for ((b, ty, t, c), ch) in NORM_CASES
        .into_iter()
        .flat_map(|case| norm_channels(case.3).map(|ch| (case, ch)))
    {
        let x = offset_rows(&[b, t], &ch);
        let y = ch.spread(&randn(&[b, ty, c]), 2).unwrap();
        let z = ch.spread(&randn(&[b, t, c]), 2).unwrap();
        // Scales of about 1 (the model's are below CONV_SCALE): a scale from the wrong image
        // or channel moves the sum by about its own size.
        let s = ch.spread(&randn(&[b, c]), 1).unwrap();
        let back = scrambled(t, ty);
        let back_gpu = back.to_device(&dev).unwrap();
        for (dtype, u) in DTYPES {
            let [x, y, z, s] = [&x, &y, &z, &s].map(|v| rounded(v, dtype));
            let f64_of = |v: &Tensor| v.to_dtype(DType::F64).unwrap();
            let zs = f64_of(&z)
                .broadcast_mul(&f64_of(&s).reshape((b, 1, ch.padded())).unwrap())
                .unwrap();
            let gathered = f64_of(&y).index_select(&back, 1).unwrap();
            let exact = ((f64_of(&x) + &zs).unwrap() + gathered).unwrap();
            let exact = exact.to_dtype(DType::F32).unwrap();
            let unfused = (f64_of(&x).abs().unwrap() + (zs.abs().unwrap() * 2.0).unwrap())
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap() as f32;
            let on = |v: &Tensor| v.to_dtype(dtype).unwrap().to_device(&dev).unwrap();
            let (xg, yg, zg, sg) = (on(&x), on(&y), on(&z), on(&s));
            for cab_off in [false, true] {
                let off = Off {
                    cab: cab_off,
                    ..Off::default()
                };
                let (ln, ln32) = layer_norms(&ch, &seed, dtype, &dev);
                let ln = ln.with_cuda_off(off);
                let (ours_sum, ours) =
                    norm_rw::add_gather_norm(&ln, &xg, Some((&zg, &sg)), &yg, &back_gpu).unwrap();
                assert!(ours.device().is_cuda() && ours.dtype() == dtype);
                let stored = ours_sum
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                let want = candle_core::Module::forward(&ln32, &stored).unwrap();
                let what = format!(
                    "add_gather_norm scaled {b}x{ty}->{t}x{} of {c} {dtype:?} cab off {cab_off}",
                    ch.padded()
                );
                let noise = if cab_off {
                    NOISE + 1.01 * u * unfused
                } else {
                    NOISE
                };
                failures.extend(excess_over(
                    &format!("{what} sum"),
                    &ours_sum,
                    &exact,
                    u,
                    noise,
                ));
                failures.extend(excess(&format!("{what} normed"), &ours, &want, u));
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Inputs the kernels cannot take are errors, not launches.
/// The patch kernel copies values, so it must match candle's composition exactly, on both
/// of its paths (channels a multiple of four, and not) and for chunks at both map edges.
#[test]
fn patches3x3_matches_candle() -> Result<()> {
    let dev = gpu();
    for (dims, chunks) in [
        ((2, 9, 7, 8), [(0, 9), (0, 4), (4, 5)]),
        ((1, 6, 5, 3), [(0, 6), (1, 2), (5, 1)]),
    ] {
        let x = randn(&[dims.0, dims.1, dims.2, dims.3]);
        for (dtype, _) in DTYPES {
            let xd = x.to_dtype(dtype)?;
            for (y0, rows) in chunks {
                let want =
                    conv_rw::patches3x3(&xd, y0, rows, Off::default())?.to_dtype(DType::F32)?;
                let ours = conv_rw::patches3x3(&xd.to_device(&dev)?, y0, rows, Off::default())?;
                let what = format!("{dtype:?} {dims:?} rows {y0}+{rows}");
                assert_eq!(excess_over(&what, &ours, &want, 0.0, 0.0), None);
            }
        }
    }
    Ok(())
}

/// The narrow convolution sums 9 x cin products in f32 in its own order: it may differ from
/// candle's composition by the output's rounding plus f32 noise on sums of about one.
#[test]
fn conv3x3_narrow_matches_candle() -> Result<()> {
    let dev = gpu();
    for (b, h, w, cin, cout) in [(2, 9, 7, 64, 3), (1, 5, 6, 20, 4), (1, 4, 3, 35, 1)] {
        let x = randn(&[b, h, w, cin]);
        let wt = (randn(&[9 * cin, cout]) / (9.0 * cin as f64).sqrt())?;
        let bias = randn(&[cout]);
        for (dtype, u) in DTYPES {
            let (xr, wr, br) = (
                rounded(&x, dtype),
                rounded(&wt, dtype),
                rounded(&bias, dtype),
            );
            let want = conv_rw::conv3x3_narrow(&xr, &wr, &br, Off::default())?;
            let on = |t: &Tensor| t.to_dtype(dtype)?.to_device(&dev);
            let ours = conv_rw::conv3x3_narrow(&on(&x)?, &on(&wt)?, &on(&bias)?, Off::default())?;
            let what = format!("{dtype:?} {b}x{h}x{w}x{cin} -> {cout}");
            assert_eq!(excess_over(&what, &ours, &want, u, 1e-4), None);
        }
    }
    Ok(())
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let dev = gpu();
    let y = Tensor::zeros((4, 6), DType::F32, &dev)?;
    let b = Tensor::zeros(5, DType::F32, &dev)?;
    assert!(rowwise::bias_act(&y, &b, None, Act::None, Off::default()).is_err());
    let b = Tensor::zeros(6, DType::F32, &dev)?;
    let wrong_residual = Tensor::zeros((4, 5), DType::F32, &dev)?;
    assert!(rowwise::bias_act(&y, &b, Some(&wrong_residual), Act::None, Off::default()).is_err());
    // A strided input is copied, not refused.
    let strided = Tensor::ones((6, 4), DType::F32, &dev)?.t()?;
    let out = rowwise::bias_act(&strided, &b, None, Act::Leaky(0.5), Off::default())?;
    assert_eq!(out.sum_all()?.to_scalar::<f32>()?, 24.0);
    let ints = Tensor::zeros((4, 6), DType::U32, &dev)?;
    assert!(rowwise::bias_act(
        &ints,
        &b.to_dtype(DType::U32)?,
        None,
        Act::None,
        Off::default()
    )
    .is_err());
    let ones = Tensor::ones(6, DType::F32, &dev)?;
    let ln = Norm::new(&Pad::OFF.one(6), ones, b.clone(), 1e-5)?;
    let x = Tensor::zeros((1, 4, 6), DType::F32, &dev)?;
    let float_idx = Tensor::zeros(4, DType::F32, &dev)?;
    assert!(norm_rw::gather_norm(&ln, &x, &float_idx).is_err());
    Ok(())
}

/// Our kernel modules are cached per context (a fatbin of the attention kernels is several
/// MB of GPU code); a dropped device's go when the next device loads its own.
#[test]
fn a_dropped_devices_kernel_modules_are_let_go() -> Result<()> {
    gpu(); // checks that our kernels are on
    let (y, b) = (randn(&[4, 40]), randn(&[40]));
    let run = |dev: &Device| -> Result<()> {
        let out = rowwise::bias_act(
            &y.to_device(dev)?,
            &b.to_device(dev)?,
            None,
            Act::Gelu,
            Off::default(),
        )?;
        out.to_device(&Device::Cpu).map(drop)
    };
    let gone = {
        let dev = Device::new_cuda_with_stream(0)?;
        run(&dev)?;
        let Device::Cuda(cuda) = &dev else {
            unreachable!("a CUDA device")
        };
        std::sync::Arc::downgrade(cuda.cuda_stream().context())
    };
    assert!(
        gone.strong_count() > 0,
        "the cached module holds its context"
    );
    run(&Device::new_cuda_with_stream(0)?)?;
    assert_eq!(
        gone.strong_count(),
        0,
        "a dropped device's context is still held by its kernel modules"
    );
    Ok(())
}
