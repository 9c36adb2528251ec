//! Each layer is in its final form when it is constructed: built on the CPU with a plan that
//! asks for bf16 products, it computes them from the first call (its weights packed then),
//! and built without, it computes in f32.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;

use super::attention::Attend;
use super::conv::Conv3x3;
use super::linear::Dense;
use super::LoadPlan;
use crate::ops::pad::Pad;
use crate::ops::windows::WindowCache;
use crate::tests::normal;

/// The plan without bf16 products and the one with them, or `None` on a CPU without bf16
/// arithmetic (where a model asking for them is refused before any layer is built).
fn plans() -> Option<(LoadPlan, LoadPlan)> {
    let isa = crate::ops::cpu::bf16::isa();
    if isa.is_none() {
        eprintln!("this CPU has no bf16 arithmetic: nothing to check");
    }
    let f32 = LoadPlan::default();
    isa.map(|isa| {
        let bf16 = LoadPlan {
            bf16: Some(isa),
            ..f32
        };
        (f32, bf16)
    })
}

fn max_abs(t: &Tensor) -> Result<f32> {
    t.abs()?.flatten_all()?.max(0)?.to_scalar()
}

/// `bf16` is `f32`'s output with bf16 products: not the same (so the products were not
/// computed in f32), within a few bf16 roundings of it.
fn assert_bf16_products(f32: &Tensor, bf16: &Tensor, what: &str) -> Result<()> {
    let d = max_abs(&(f32 - bf16)?)?;
    let scale = max_abs(f32)?;
    assert!(
        d > 0.0,
        "{what}: the f32 output: its weights were not packed"
    );
    assert!(d < 0.05 * scale, "{what}: {d} off, outputs up to {scale}");
    Ok(())
}

/// A VarBuilder over random tensors of these shapes, under these names.
fn weights(shapes: &[(&str, &[usize])]) -> Result<VarBuilder<'static>> {
    let mut map = HashMap::new();
    for (name, shape) in shapes {
        map.insert(name.to_string(), normal(0.0, 1.0, *shape, &Device::Cpu)?);
    }
    Ok(VarBuilder::from_tensors(map, DType::F32, &Device::Cpu))
}

#[test]
fn dense_packs_its_weight_when_built_for_bf16_products() -> Result<()> {
    let Some((f32, bf16)) = plans() else {
        return Ok(());
    };
    let dev = Device::Cpu;
    let w = normal(0.0, 1.0, (40, 48), &dev)?;
    let b = normal(0.0, 1.0, 40, &dev)?;
    let x = normal(0.0, 1.0, (2, 5, 48), &dev)?;
    let plain = Dense::new(w.clone(), b.clone(), &f32)?;
    // Packed where the panel kernels run, and then without its f32 weight.
    let packs = crate::ops::cpu::panels::available();
    assert!(matches!(plain, Dense::CpuPacked { .. }) == packs);
    assert!(matches!(plain, Dense::Cpu(..)) == !packs);
    let packed = Dense::new(w, b, &bf16)?;
    assert!(matches!(packed, Dense::CpuBf16 { .. }));
    assert_bf16_products(&plain.forward(&x)?, &packed.forward(&x)?, "linear")
}

#[test]
fn convolutions_pack_their_weights_when_built_for_bf16_products() -> Result<()> {
    let Some((f32, bf16)) = plans() else {
        return Ok(());
    };
    let (cin, cout) = (8, 16);
    let vb = weights(&[
        ("conv.weight", &[cout, cin, 3, 3]),
        ("conv.bias", &[cout]),
        ("rgb.weight", &[3, cin, 3, 3]),
        ("rgb.bias", &[3]),
    ])?;
    let x = normal(0.0, 1.0, (1, 6, 7, cin), &Device::Cpu)?;
    let conv = |plan| Conv3x3::unpadded(cin, cout, plan, vb.pp("conv"));
    let (plain, packed) = (conv(&f32)?, conv(&bf16)?);
    assert_bf16_products(&plain.forward(&x)?, &packed.forward(&x)?, "3x3")?;
    // The same weights followed by PixelShuffle by 2, 4 channels out.
    let shuffled =
        |plan| Conv3x3::shuffled(&Pad::OFF.one(cin), (4, 2), Pad::OFF, plan, vb.pp("conv"));
    let (plain, packed) = (shuffled(&f32)?, shuffled(&bf16)?);
    let (want, got) = (
        plain.forward_shuffled(&x, 2)?,
        packed.forward_shuffled(&x, 2)?,
    );
    assert_bf16_products(&want, &got, "3x3 and PixelShuffle")?;
    // The RGB output is computed directly, in f32 either way.
    let rgb = |plan| Conv3x3::unpadded(cin, 3, plan, vb.pp("rgb"));
    let (plain, packed) = (rgb(&f32)?, rgb(&bf16)?);
    let d = max_abs(&(plain.forward(&x)? - packed.forward(&x)?)?)?;
    assert_eq!(d, 0.0, "the narrow convolution keeps f32");
    Ok(())
}

#[test]
fn window_attention_takes_bf16_products_from_its_plan() -> Result<()> {
    let Some((f32, bf16)) = plans() else {
        return Ok(());
    };
    let dev = Device::Cpu;
    let (ws, heads, d) = (4, 2, 8);
    let (h, w) = (2 * ws, 2 * ws);
    let table = normal(0.0, 1.0, ((2 * ws - 1) * (2 * ws - 1), heads), &dev)?;
    let qkv = normal(0.0, 1.0, (4, ws * ws, 3 * heads * d), &dev)?;
    let windows = WindowCache::new(ws, DType::F32, &dev);
    let plain = Attend::new(&table, heads, d, ws, &f32)?;
    let packed = Attend::new(&table, heads, d, ws, &bf16)?;
    for shifted in [false, true] {
        let want = plain.forward(&qkv, (h, w), shifted, &windows)?;
        let got = packed.forward(&qkv, (h, w), shifted, &windows)?;
        assert_bf16_products(&want, &got, &format!("attention, shifted {shifted}"))?;
    }
    Ok(())
}

/// HAT's overlapping cross-attention on the CPU is our kernel, not candle's graph: built
/// without bf16 products its output is the kernel's to the bit (the graph sums in another
/// order, so it would differ in the last bits), and built with them it computes them.
#[test]
fn overlap_attention_runs_our_kernel_on_the_cpu() -> Result<()> {
    use super::attention::{cpu::overlap_attention, overlap_attention_graph, OverlapAttend};
    let dev = Device::Cpu;
    let (ws, ows, heads, d) = (4, 6, 2, 8);
    let side = ws + ows - 1;
    let table = normal(0.0, 1.0, (side * side, heads), &dev)?;
    let qkv = normal(0.0, 0.5, (1, 2 * ws, 3 * ws, 3 * heads * d), &dev)?;
    let f32 = LoadPlan::default();
    let plain = OverlapAttend::new(&table, heads, (ws, ows), &f32)?.forward(&qkv)?;
    let bias = super::attention::overlap_bias(&table, ws, ows)?;
    let kernel = overlap_attention(&qkv, &bias, heads, (ws, ows), None)?.expect("f32 on the CPU");
    let graph = overlap_attention_graph(&qkv, &bias, heads, ws, ows)?;
    let bits = |t: &Tensor| -> Result<Vec<u32>> { Ok(crate::tests::fixtures::f32_bits(t)) };
    assert_eq!(
        bits(&plain)?,
        bits(&kernel)?,
        "the layer's output is not the kernel's"
    );
    assert_ne!(
        bits(&graph)?,
        bits(&kernel)?,
        "the graph cannot tell the two apart here"
    );
    if let Some((_, bf16)) = plans() {
        let packed = OverlapAttend::new(&table, heads, (ws, ows), &bf16)?.forward(&qkv)?;
        assert_bf16_products(&plain, &packed, "overlap attention")?;
    }
    Ok(())
}

#[test]
fn scale_leading_gives_the_bits_of_the_narrow_scale_and_concatenation() -> Result<()> {
    let dev = Device::Cpu;
    // Negative zeros among the scaled rows: candle's scaling makes them +0.
    let mut v = normal(0.0, 1.0, (9, 5), &dev)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    v[3] = -0.0;
    v[40] = -0.0;
    let t = Tensor::from_vec(v, (9, 5), &dev)?;
    let scale = 24f64.powf(-0.5);
    for (t, n) in [(t.clone(), 3), (t.clone(), 0), (t.clone(), 9), (t.t()?, 2)] {
        let rows = t.dim(0)?;
        let want = Tensor::cat(
            &[(t.narrow(0, 0, n)? * scale)?, t.narrow(0, n, rows - n)?],
            0,
        )?;
        let got = super::scale_leading(&t, n, scale)?;
        assert_eq!(got.dims(), want.dims());
        let bits = |t: &Tensor| -> Result<Vec<u32>> {
            let v = t.flatten_all()?.to_vec1::<f32>()?;
            Ok(v.iter().map(|x| x.to_bits()).collect())
        };
        assert_eq!(bits(&got)?, bits(&want)?, "{n} of {rows} rows");
    }
    assert!(super::scale_leading(&t, 10, scale).is_err());
    Ok(())
}
