//! The cuBLASLt linear layer with the bias in its epilogue (src/ops/linear/cuda.rs)
//! against the same product on the CPU in f32, from the same rounded inputs.
//!
//! What cuBLASLt guarantees is the f32 accumulation of the product, not how many times the
//! result is rounded to the 16-bit output on the way: for some shapes it writes `x · wᵀ` in
//! the output type and adds the bias (and the residual) in a second kernel, or reduces
//! split-K partial sums in the output type. On an H200 (build 1761d16) 5 to 7% of the outputs
//! of the shapes below were off by more than one rounding (worst 0.021 and 0.031). So the
//! bound allows one rounding of each partial sum: `u (|x·wᵀ| + |x·wᵀ + b| + |want|)` (the
//! residual adds one more term), plus f32 noise. A wrong bias column or a transposed operand
//! moves outputs by about their own size, far beyond it.

use super::gpu;
use crate::ops::linear::cuda::{accumulate_linear_bias, linear_bias};
use crate::switches::cuda_off::Off;
use candle_core::{DType, Device, Result, Tensor};

fn randn(shape: &[usize], scale: f64) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, &Device::Cpu)? * scale
}

fn rounded(t: &Tensor, dtype: DType) -> Result<Tensor> {
    t.to_dtype(dtype)?.to_dtype(DType::F32)
}

/// Panics unless `ours` (any device and dtype) is within `u · Σ|partial|  + 1e-3` of `want`
/// (f32, CPU) everywhere, where `partials` are the partial sums that may each be rounded
/// (`want` last). Prints how many outputs needed more than one rounding, so a GPU run shows
/// which kind of kernel cuBLASLt chose.
fn assert_close(
    what: &str,
    ours: &Tensor,
    want: &Tensor,
    partials: &[&Tensor],
    u: f64,
) -> Result<()> {
    assert_eq!(ours.dims(), want.dims(), "{what}");
    let ours = ours.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let err = (&ours - want)?.abs()?;
    let count = |limit: &Tensor| -> Result<f32> {
        err.gt(limit)?
            .to_dtype(DType::F32)?
            .sum_all()?
            .to_scalar::<f32>()
    };
    let once = count(&((want.abs()? * u)? + 1e-3)?)?;
    let mut sum = want.abs()?;
    for p in partials {
        sum = (sum + p.abs()?)?;
    }
    let over = count(&((sum * u)? + 1e-3)?)?;
    let worst = err.max_all()?.to_scalar::<f32>()?;
    eprintln!(
        "{what}: {once} of {} outputs beyond one rounding, worst {worst}",
        want.elem_count()
    );
    assert_eq!(
        over, 0.0,
        "{what}: {over} outputs beyond one rounding per partial sum, worst {worst}"
    );
    Ok(())
}

#[test]
fn linear_bias_matches_the_cpu_in_bf16_and_f16() -> Result<()> {
    let dev = gpu();
    // DRCT-L's qkv (rows of 180: 8-byte aligned in bf16, not 16) and a wide block's proj,
    // which must take this path, and an odd product that cuBLASLt may decline (the caller's
    // GEMM then runs); token counts that fill no GEMM tile exactly.
    for (t, k, n, required) in [
        (1000, 180, 540, true),
        (4099, 308, 308, true),
        (333, 53, 53, false),
    ] {
        let x = randn(&[t, k], 1.0)?;
        let w = randn(&[n, k], 1.0 / (k as f64).sqrt())?;
        let b = randn(&[n], 1.0)?;
        for (dtype, u) in [(DType::BF16, 1.0 / 256.0), (DType::F16, 1.0 / 2048.0)] {
            let (xr, wr, br) = (
                rounded(&x, dtype)?,
                rounded(&w, dtype)?,
                rounded(&b, dtype)?,
            );
            let product = xr.matmul(&wr.t()?)?;
            let want = product.broadcast_add(&br)?;
            let on = |t: &Tensor| t.to_dtype(dtype)?.to_device(&dev);
            match linear_bias(&on(&x)?, &on(&w)?, &on(&b)?, Off::default())? {
                Some(ours) => {
                    let what = format!("{dtype:?} {t}x{k}x{n}");
                    assert_close(&what, &ours, &want, &[&product], u)?
                }
                None => assert!(!required, "{dtype:?} {t}x{k}x{n}: cuBLASLt did not run"),
            }
        }
    }
    Ok(())
}

/// `x` (64, 32), `w` (16, 32) and `b` (16) in f32 on the CPU.
fn small_layer() -> Result<(Tensor, Tensor, Tensor)> {
    Ok((
        randn(&[64, 32], 1.0)?,
        randn(&[16, 32], 1.0)?,
        randn(&[16], 1.0)?,
    ))
}

#[test]
fn linear_bias_leaves_f32_and_offset_views_to_the_caller() -> Result<()> {
    let dev = gpu();
    let (x, w, b) = small_layer()?;
    let f32s = (x.to_device(&dev)?, w.to_device(&dev)?, b.to_device(&dev)?);
    assert!(
        linear_bias(&f32s.0, &f32s.1, &f32s.2, Off::default())?.is_none(),
        "f32 must stay exact"
    );
    let bf = |t: &Tensor| t.to_dtype(DType::BF16)?.to_device(&dev);
    let (xb, wb, bb) = (bf(&x)?, bf(&w)?, bf(&b)?);
    assert!(linear_bias(&xb, &wb, &bb, Off::default())?.is_some());
    let view = xb.narrow(0, 1, 63)?;
    assert!(
        linear_bias(&view, &wb, &bb, Off::default())?.is_none(),
        "a view inside a buffer"
    );
    Ok(())
}

#[test]
fn accumulate_linear_bias_adds_in_place_in_bf16_and_f16() -> Result<()> {
    let dev = gpu();
    // DRCT-L's fc2 of the first block (360 -> 180), which must take this path, and an odd
    // narrow one that cuBLASLt may decline.
    for (t, k, n, required) in [(1000, 360, 180, true), (333, 53, 77, false)] {
        let x = randn(&[t, k], 1.0)?;
        let w = randn(&[n, k], 1.0 / (k as f64).sqrt())?;
        let b = randn(&[n], 1.0)?;
        let acc = randn(&[t, n], 1.0)?;
        for (dtype, u) in [(DType::BF16, 1.0 / 256.0), (DType::F16, 1.0 / 2048.0)] {
            let r = |t: &Tensor| rounded(t, dtype);
            let product = r(&x)?.matmul(&r(&w)?.t()?)?;
            let biased = product.broadcast_add(&r(&b)?)?;
            // The residual may come in before the bias or after it.
            let residual = (&product + r(&acc)?)?;
            let want = (&biased + r(&acc)?)?;
            let on = |t: &Tensor| t.to_dtype(dtype)?.to_device(&dev);
            let ours = on(&acc)?;
            // A second handle on the same storage: it must see the sum too.
            let alias = ours.clone();
            let ran = accumulate_linear_bias(&ours, &on(&x)?, &on(&w)?, &on(&b)?, Off::default())?;
            let what = format!("{dtype:?} {t}x{k}x{n}");
            if ran {
                assert_close(&what, &alias, &want, &[&product, &biased, &residual], u)?;
            } else {
                assert!(!required, "{what}: cuBLASLt did not run");
                // Declined: the accumulator must be as it was.
                assert_close(&what, &alias, &r(&acc)?, &[], 0.0)?;
            }
        }
    }
    Ok(())
}

#[test]
fn accumulate_linear_bias_leaves_f32_untouched() -> Result<()> {
    let dev = gpu();
    let (x, w, b) = small_layer()?;
    let acc = randn(&[64, 16], 1.0)?;
    let on = |t: &Tensor| t.to_device(&dev);
    let ours = on(&acc)?;
    assert!(!accumulate_linear_bias(
        &ours,
        &on(&x)?,
        &on(&w)?,
        &on(&b)?,
        Off::default()
    )?);
    let back = ours.to_device(&Device::Cpu)?;
    let diff = (back - &acc)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert_eq!(diff, 0.0, "f32 must be left to the caller, unchanged");
    Ok(())
}

/// An operand that shares the accumulator's storage is handed back to the caller: candle
/// refuses such an in-place op, and a weight inside the accumulator's buffer would wait on the
/// accumulator's own lock for ever.
#[test]
fn accumulate_linear_bias_leaves_operands_inside_the_accumulator_to_the_caller() -> Result<()> {
    let dev = gpu();
    let acc = randn(&[64, 16], 1.0)?
        .to_dtype(DType::BF16)?
        .to_device(&dev)?;
    let (x, w, b) = small_layer()?;
    let bf = |t: &Tensor| t.to_dtype(DType::BF16)?.to_device(&dev);
    let before = acc.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    let own_w = bf(&w.narrow(1, 0, 16)?.contiguous()?)?;
    // x is the accumulator itself; then w is its first 16 rows (a view that starts the buffer).
    assert!(!accumulate_linear_bias(
        &acc,
        &acc,
        &own_w,
        &bf(&b)?,
        Off::default()
    )?);
    let w_in_acc = acc.narrow(0, 0, 16)?;
    assert!(!accumulate_linear_bias(
        &acc,
        &bf(&x.narrow(1, 0, 16)?.contiguous()?)?,
        &w_in_acc,
        &bf(&b)?,
        Off::default()
    )?);
    let after = acc.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
    assert_close("aliased operands", &after, &before, &[], 0.0)?;
    Ok(())
}

/// A model dropped with its device leaves no cuBLASLt handle (32 MiB of workspace on an H100)
/// behind for long: the next lookup, from any device, lets it go.
#[test]
fn a_dropped_devices_cublaslt_handle_is_let_go() -> Result<()> {
    let (x, w, b) = small_layer()?;
    let run = |dev: &Device| -> Result<()> {
        let bf = |t: &Tensor| t.to_dtype(DType::BF16)?.to_device(dev);
        assert!(linear_bias(&bf(&x)?, &bf(&w)?, &bf(&b)?, Off::default())?.is_some());
        dev.synchronize()
    };
    let gone = {
        let dev = Device::new_cuda_with_stream(0)?;
        run(&dev)?;
        let Device::Cuda(cuda) = &dev else {
            unreachable!("a CUDA device")
        };
        std::sync::Arc::downgrade(&cuda.cuda_stream())
    };
    let held = gone.strong_count();
    assert!(
        held > 0,
        "the cache holds the handle, and the handle its stream"
    );
    run(&gpu())?;
    assert!(
        gone.strong_count() < held,
        "the handle of a dropped device is still cached ({held} references to its stream)"
    );
    Ok(())
}
