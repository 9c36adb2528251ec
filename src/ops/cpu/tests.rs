use super::*;
use crate::ops::attention::cpu::window_attention;
use crate::ops::conv::cpu::{conv3x3, conv3x3_bf16, conv3x3_shuffled, conv3x3_shuffled_bf16};
use crate::ops::linear::cpu::{linear, linear_bf16, linear_packed, pack, After};
use crate::tests::normal;
use candle_core::Device;

/// Largest absolute difference, in f64, between a result and its reference.
fn max_abs_diff(ours: &Tensor, want: &Tensor) -> Result<f64> {
    (ours.to_dtype(DType::F64)? - want.to_dtype(DType::F64)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f64>()
}

/// No probability leaves the softmax subnormal: a full window of equal scores plus one
/// 86 below them would give e^-86 / 257 ≈ 1.6e-40 without the cutoff. Both forms: with
/// fused multiply-adds and without.
#[test]
fn softmax_never_outputs_subnormals() {
    let forms: [fn(&mut [f32], usize); 2] = [softmax_rows_body::<true>, softmax_rows_body::<false>];
    for (offset, softmax) in [-79.0f32, -80.5, -84.0, -86.0, -90.0, -100.0]
        .into_iter()
        .flat_map(|o| forms.map(|f| (o, f)))
    {
        let mut row = vec![0f32; 257];
        row[100] = offset;
        softmax(&mut row, 257);
        for &p in &row {
            assert!(p == 0.0 || p.is_normal(), "offset {offset}: {p:e}");
        }
        assert_eq!(row[100] == 0.0, offset < SOFTMAX_CUTOFF, "offset {offset}");
        let sum: f32 = row.iter().sum();
        assert!((sum - 1.0).abs() < 1e-5, "{sum}");
    }
}

#[test]
fn exp_is_accurate_over_the_softmax_range() {
    for exp in [exp_nonpositive::<true>, exp_nonpositive::<false>] {
        let mut worst = 0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 87.0 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max(((exp(x) as f64 - want) / want).abs());
        }
        assert!(worst < 5e-7, "relative error {worst}");
        assert_eq!(exp(-1000.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }
}

#[test]
fn gelu_matches_exact_gelu_and_not_tanh() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(gelu_matches_exact_gelu_and_not_tanh_on_one_isa)
}

fn gelu_matches_exact_gelu_and_not_tanh_on_one_isa() -> Result<()> {
    let xs: Vec<f32> = (-4000..4000).map(|i| i as f32 / 400.0).collect();
    let x = Tensor::new(xs.as_slice(), &Device::Cpu)?;
    let ours = gelu_erf(&x)?;
    let exact = x.to_dtype(DType::F64)?.gelu_erf()?;
    let d = max_abs_diff(&ours, &exact)?;
    assert!(d < 1e-6, "max abs error {d}");
    let gap = (ours - x.gelu()?)?.abs()?.max(0)?.to_scalar::<f32>()?;
    assert!(gap > 1e-4, "indistinguishable from tanh GELU: {gap}");
    Ok(())
}

/// SiLU and SPAN's attention against their float64 definitions, over the range where the
/// sigmoid saturates both ways (SiLU of -100 is 0 or a tiny negative, never NaN); the
/// attention is not `(o + x) · sigmoid(o)`.
/// The load-time f64 product against the plain triple loop in the same order, bit for bit:
/// blocks of 4 x 16 and the row and column tails (m 7, n 37), accumulating onto `c`.
#[test]
fn gemm_f64_sums_in_k_order_on_every_isa() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(|| {
        let (m, k, n) = (7, 5, 37);
        let value = |i: usize| ((i * 7919) % 1013) as f64 / 97.0 - 5.0;
        let a: Vec<f64> = (0..m * k).map(value).collect();
        let b: Vec<f64> = (0..k * n).map(|i| value(i + 3)).collect();
        let start: Vec<f64> = (0..m * n).map(|i| value(i + 11)).collect();
        let mut want = start.clone();
        for i in 0..m {
            for p in 0..k {
                for j in 0..n {
                    want[i * n + j] += a[i * k + p] * b[p * n + j];
                }
            }
        }
        let mut got = start;
        gemm_f64(&a, &b, (m, k, n), &mut got);
        assert!(
            got.iter()
                .zip(&want)
                .all(|(g, w)| g.to_bits() == w.to_bits()),
            "gemm_f64 differs from the triple loop"
        );
        Ok(())
    })
}

#[test]
fn silu_and_sigmoid_gate_match_their_definitions() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(silu_and_sigmoid_gate_match_their_definitions_on_one_isa)
}

fn silu_and_sigmoid_gate_match_their_definitions_on_one_isa() -> Result<()> {
    let os: Vec<f32> = (-5000..5000).map(|i| i as f32 / 50.0).collect();
    let xs: Vec<f32> = os.iter().map(|o| (o * 7.3).sin() * 3.0).collect();
    let o = Tensor::new(os.as_slice(), &Device::Cpu)?;
    let x = Tensor::new(xs.as_slice(), &Device::Cpu)?;
    let (o64, x64) = (o.to_dtype(DType::F64)?, x.to_dtype(DType::F64)?);
    let sigmoid64 = o64.neg()?.exp()?.affine(1.0, 1.0)?.recip()?;
    let d = max_abs_diff(&silu(&o)?, &(&o64 * &sigmoid64)?)?;
    assert!(d < 2e-5, "SiLU: max abs error {d}");
    let tail = silu(&Tensor::new(&[-100f32], &Device::Cpu)?)?.to_vec1::<f32>()?[0];
    assert!(tail <= 0.0 && tail > -1e-30, "SiLU(-100) = {tail:e}");
    let gate = sigmoid_gate(&o, &x)?;
    let want = ((&o64 + &x64)? * sigmoid64.affine(1.0, -0.5)?)?;
    let d = max_abs_diff(&gate, &want)?;
    assert!(d < 2e-5, "gate: max abs error {d}");
    let ungated = ((&o64 + &x64)? * &sigmoid64)?;
    assert!(max_abs_diff(&gate, &ungated)? > 1.0);
    // The strided fallback (candle's ops) computes the same.
    let strided = Tensor::stack(&[&o, &x], 1)?;
    let (o_s, x_s) = (strided.narrow(1, 0, 1)?, strided.narrow(1, 1, 1)?);
    let fallback = sigmoid_gate(&o_s, &x_s)?.flatten_all()?;
    assert!(max_abs_diff(&fallback, &gate)? < 1e-5);
    Ok(())
}

#[test]
fn softmax_rows_match_candle_with_masked_entries() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(softmax_rows_match_candle_with_masked_entries_on_one_isa)
}

fn softmax_rows_match_candle_with_masked_entries_on_one_isa() -> Result<()> {
    // Rows of 70: four full lanes of 16 and a remainder of 6; 65 rows, more than the 58 the
    // softmax takes a step at a time.
    let x = normal(0.0, 3.0, (5, 13, 70), &Device::Cpu)?;
    let masked = (x.narrow(2, 0, 32)? - 100.0)?;
    let x = Tensor::cat(&[&masked, &x.narrow(2, 32, 38)?], 2)?;
    let want = candle_nn::ops::softmax_last_dim(&x.to_dtype(DType::F64)?)?;
    let mut d = 0f64;
    for softmax in [softmax_rows_body::<true>, softmax_rows_body::<false>] {
        let mut ours = x.flatten_all()?.to_vec1::<f32>()?;
        softmax(&mut ours, 70);
        let ours = Tensor::from_vec(ours, (5, 13, 70), &Device::Cpu)?;
        d = d.max(max_abs_diff(&ours, &want)?);
    }
    assert!(d < 1e-6, "max abs error {d}");
    Ok(())
}

/// The unfused graph, in f64: scores, bias, mask, softmax, weighted sum, heads concatenated.
/// With `bf16`, q, k, v and the probabilities are first rounded to bf16, as the bf16
/// products take them.
fn attention_reference(
    qkv: &Tensor,
    bias: &Tensor,
    mask: Option<&Tensor>,
    heads: usize,
    bf16: bool,
) -> Result<Tensor> {
    let round = |t: Tensor| -> Result<Tensor> {
        if bf16 {
            t.to_dtype(DType::BF16)?.to_dtype(DType::F64)
        } else {
            Ok(t)
        }
    };
    let (bw, n, c3) = qkv.dims3()?;
    let d = c3 / 3 / heads;
    let qkv = round(qkv.to_dtype(DType::F64)?)?
        .reshape((bw, n, 3, heads, d))?
        .permute((2, 0, 3, 1, 4))?;
    let (q, k, v) = (
        qkv.get(0)?.contiguous()?,
        qkv.get(1)?.contiguous()?,
        qkv.get(2)?.contiguous()?,
    );
    let mut attn = q
        .matmul(&k.t()?)?
        .broadcast_add(&bias.to_dtype(DType::F64)?)?;
    if let Some(mask) = mask {
        let nw = mask.dim(0)?;
        attn = attn
            .reshape((bw / nw, nw, heads, n, n))?
            .broadcast_add(&mask.to_dtype(DType::F64)?.unsqueeze(1)?)?
            .reshape((bw, heads, n, n))?;
    }
    round(candle_nn::ops::softmax_last_dim(&attn)?)?
        .matmul(&v)?
        .transpose(1, 2)?
        .reshape((bw, n, heads * d))
}

/// Random attention inputs for `bw` windows of `ws x ws` tokens: qkv, a bias table, and
/// for shifted windows (`nw > 0`) the region labels of a `ws x nw*ws` map (whose windows
/// all straddle regions). Also the gathered bias and the stored mask the reference takes.
#[allow(clippy::type_complexity)]
fn attention_inputs(
    (bw, ws, heads, d, nw): (usize, usize, usize, usize, usize),
) -> Result<(
    Tensor,
    RelativeBias,
    Option<Vec<u8>>,
    Tensor,
    Option<Tensor>,
)> {
    let dev = Device::Cpu;
    let n = ws * ws;
    let qkv = normal(0.0, 1.0, (bw, n, 3 * heads * d), &dev)?;
    let side = 2 * ws - 1;
    let table = normal(0.0, 1.0, (side * side, heads), &dev)?;
    let (regions, mask) = if nw > 0 {
        let mask = crate::ops::windows::shift_mask(ws, nw * ws, ws);
        (
            Some(crate::ops::windows::shift_regions(ws, nw * ws, ws)),
            Some(Tensor::from_vec(mask, (nw, n, n), &dev)?),
        )
    } else {
        (None, None)
    };
    Ok((
        qkv,
        RelativeBias::new(&table, ws)?,
        regions,
        crate::ops::windows::relative_position_bias(&table, ws)?,
        mask,
    ))
}

#[test]
fn bf16_window_attention_matches_the_rounded_graph() -> Result<()> {
    let isas = crate::ops::cpu::bf16::available_isas();
    if isas.is_empty() {
        eprintln!("bf16 attention not tested: this CPU has no bf16 arithmetic");
    }
    for isa in isas {
        // (windows, window, heads, head dim, mask windows). Windows whose token count
        // leaves partial row groups, tiles and panels (49), pads the probabilities' pairs
        // (16, 49), odd head dims, and the official window.
        for shape in [
            (4, 4, 3, 5, 2),
            (2, 7, 2, 7, 0),
            (3, 8, 2, 6, 1),
            (2, 16, 2, 6, 2),
        ] {
            let (qkv, bias, regions, gathered, mask) = attention_inputs(shape)?;
            let ours = window_attention(&qkv, &bias, regions.as_deref(), Some(isa))?
                .expect("the CPU kernel applies");
            let want = attention_reference(&qkv, &gathered, mask.as_ref(), shape.2, true)?;
            // Only a probability whose f32 and f64 values round to different bf16
            // neighbours differs, by one bf16 step of it (at most 2^-7 p) times a value;
            // the probabilities of a row sum to 1, so the output moves by at most
            // 2^-7 max|v|. The inputs are random each run: a fixed bound failed
            // on rare draws with large values.
            let (_, _, c3) = qkv.dims3()?;
            let v_max = qkv
                .narrow(2, 2 * c3 / 3, c3 / 3)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()? as f64;
            let bound = 2f64.powi(-7) * v_max * (1.0 + 2f64.powi(-8)) + 1e-5;
            let diff = max_abs_diff(&ours, &want)?;
            assert!(
                diff < bound,
                "{isa:?} {shape:?}: max abs error {diff} (bound {bound})"
            );
        }
    }
    Ok(())
}

#[test]
fn fused_window_attention_matches_the_graph() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(fused_window_attention_matches_the_graph_on_one_isa)
}

fn fused_window_attention_matches_the_graph_on_one_isa() -> Result<()> {
    // (windows, window, heads, head dim, mask windows): a batch of two images with a
    // shift mask, odd head dims, a single window (the GEMMs split across threads), and
    // the official window with a mask (256 tokens: v packed on AVX2), once with heads wider
    // than a panel (DRCT's 53).
    for shape in [
        (8, 4, 3, 5, 4),
        (3, 8, 2, 7, 0),
        (1, 8, 4, 6, 1),
        (4, 16, 2, 5, 2),
        (2, 16, 2, 53, 2),
    ] {
        let (qkv, bias, regions, gathered, mask) = attention_inputs(shape)?;
        let ours = window_attention(&qkv, &bias, regions.as_deref(), None)?
            .expect("the CPU f32 kernel applies");
        let want = attention_reference(&qkv, &gathered, mask.as_ref(), shape.2, false)?;
        let diff = max_abs_diff(&ours, &want)?;
        assert!(diff < 1e-5, "{shape:?}: max abs error {diff}");
    }
    Ok(())
}

#[test]
fn window_attention_declines_other_dtypes_and_checks_shapes() -> Result<()> {
    let dev = Device::Cpu;
    let table = Tensor::zeros((9, 1), DType::F32, &dev)?;
    let bias = RelativeBias::new(&table, 2)?;
    let qkv = Tensor::zeros((2, 4, 6), DType::F16, &dev)?;
    assert!(window_attention(&qkv, &bias, None, None)?.is_none());
    let qkv = qkv.to_dtype(DType::F32)?;
    assert!(window_attention(&qkv, &bias, None, None)?.is_some());
    // Tokens that are not the window's, labels for 3 windows of a batch of 2.
    let wrong = Tensor::zeros((2, 9, 6), DType::F32, &dev)?;
    assert!(window_attention(&wrong, &bias, None, None).is_err());
    assert!(window_attention(&qkv, &bias, Some(&[0; 12]), None).is_err());
    Ok(())
}

#[test]
fn linear_matches_matmul_plus_bias() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(linear_matches_matmul_plus_bias_on_one_isa)
}

fn linear_matches_matmul_plus_bias_on_one_isa() -> Result<()> {
    let dev = Device::Cpu;
    // No rows too: packed, the f32 weight is not there to fall back on.
    for dims in [vec![2usize, 3, 5, 7], vec![4, 7], vec![1, 7], vec![0, 7]] {
        let x = normal(0.0, 1.0, dims.as_slice(), &dev)?;
        let w = normal(0.0, 1.0, (11, 7), &dev)?;
        let b = normal(0.0, 1.0, 11, &dev)?;
        let want = x
            .to_dtype(DType::F64)?
            .broadcast_matmul(&w.to_dtype(DType::F64)?.t()?)?;
        let mut out_dims = dims.clone();
        *out_dims.last_mut().expect("non-empty") = 11;
        let r = normal(0.0, 1.0, out_dims.as_slice(), &dev)?;
        for (bias, residual) in [
            (None, None),
            (Some(&b), None),
            (None, Some(&r)),
            (Some(&b), Some(&r)),
        ] {
            // Packed per call and packed once at load (where the panels run) alike.
            let ours = linear(
                &x,
                &w,
                bias,
                residual.map_or(After::Nothing, After::Residual),
            )?
            .expect("the CPU f32 kernel applies");
            let after = residual.map_or(After::Nothing, After::Residual);
            if let Some(packed) = pack(&w)? {
                let again = linear_packed(&x, &packed, bias, after)?;
                assert_eq!(again.dims(), ours.dims());
                if ours.elem_count() > 0 {
                    assert_eq!(max_abs_diff(&ours, &again)?, 0.0);
                }
            }
            let mut want = want.clone();
            if let Some(b) = bias {
                want = want.broadcast_add(&b.to_dtype(DType::F64)?)?;
            }
            if let Some(r) = residual {
                want = (want + r.to_dtype(DType::F64)?)?;
            }
            assert_eq!(ours.dims(), want.dims());
            if ours.elem_count() == 0 {
                continue;
            }
            let diff = max_abs_diff(&ours, &want)?;
            let case = (bias.is_some(), residual.is_some());
            assert!(diff < 1e-5, "{dims:?} (bias, residual) {case:?}: {diff}");
        }
        let wrong = Tensor::zeros(3, DType::F32, &dev)?;
        assert!(linear(&x, &w, Some(&b), After::Residual(&wrong)).is_err());
    }
    Ok(())
}

/// The GELU epilogue equals the GELU of the plain product (float64 GELU), in f32 and on
/// every bf16 ISA this CPU has, over several row blocks and a partial one.
#[test]
fn linear_gelu_epilogue_matches_gelu_of_the_product() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(linear_gelu_epilogue_matches_gelu_of_the_product_on_one_isa)
}

fn linear_gelu_epilogue_matches_gelu_of_the_product_on_one_isa() -> Result<()> {
    let dev = Device::Cpu;
    let (m, k, n) = (2 * EPILOGUE_ROWS + 45, 40, 37);
    let x = normal(0.0, 1.0, (m, k), &dev)?;
    let w = normal(0.0, 0.3, (n, k), &dev)?;
    let b = normal(0.0, 1.0, n, &dev)?;
    let check = |ours: &Tensor, plain: &Tensor, what: &str| -> Result<()> {
        let want = plain.to_dtype(DType::F64)?.gelu_erf()?;
        let diff = max_abs_diff(ours, &want)?;
        assert!(diff < 1e-6, "{what}: {diff}");
        Ok(())
    };
    let gelu = linear(&x, &w, Some(&b), After::Gelu)?.expect("the CPU f32 kernel applies");
    let plain = linear(&x, &w, Some(&b), After::Nothing)?.expect("as above");
    check(&gelu, &plain, "f32")?;
    let wt = w.t()?.contiguous()?.flatten_all()?.to_vec1::<f32>()?;
    let packed = PackedB::new(&wt, (k, n), (n, 1));
    let isas = crate::ops::cpu::bf16::available_isas();
    if isas.is_empty() {
        eprintln!("bf16 epilogue not tested: this CPU has no bf16 arithmetic");
    }
    for isa in isas {
        let gelu = linear_bf16(&x, isa, &packed, &b, After::Gelu)?;
        let plain = linear_bf16(&x, isa, &packed, &b, After::Nothing)?;
        check(&gelu, &plain, &format!("{isa:?}"))?;
    }
    Ok(())
}

#[test]
fn conv3x3_matches_candle_conv2d() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(conv3x3_matches_candle_conv2d_on_one_isa)
}

fn conv3x3_matches_candle_conv2d_on_one_isa() -> Result<()> {
    let dev = Device::Cpu;
    for (b, h, w, cin, cout, chunk) in [
        (2, 5, 7, 4, 6, 1 << 20),
        (1, 9, 4, 3, 5, 40),
        (1, 1, 1, 2, 3, 1),
        (2, 6, 5, 37, 3, 1 << 20),
        // The narrow kernel with every channel count, image widths around its pixel
        // groups, and 64 channels as the models' last convolution has.
        (1, 3, 9, 64, 3, 1 << 20),
        (1, 4, 4, 16, 1, 1 << 20),
        (2, 2, 11, 33, 2, 1 << 20),
        (1, 5, 3, 64, 4, 1 << 20),
    ] {
        let x = normal(0.0, 1.0, (b, h, w, cin), &dev)?;
        let weight = normal(0.0, 1.0, (cout, cin, 3, 3), &dev)?;
        let bias = normal(0.0, 1.0, cout, &dev)?;
        let w9 = weight
            .permute((2, 3, 1, 0))?
            .reshape((9 * cin, cout))?
            .contiguous()?;
        let ours = conv3x3(&x, &w9, &bias, chunk)?.expect("the CPU f32 kernel applies");
        let want = x
            .to_dtype(DType::F64)?
            .permute((0, 3, 1, 2))?
            .conv2d(&weight.to_dtype(DType::F64)?, 1, 1, 1, 1)?
            .broadcast_add(&bias.to_dtype(DType::F64)?.reshape((1, cout, 1, 1))?)?
            .permute((0, 2, 3, 1))?;
        // f32 sums of 9 * cin unit-variance products: the rounding error grows with the
        // number of terms (1.1e-5 seen at 333 terms), a misplaced tap costs O(1).
        let diff = max_abs_diff(&ours, &want)?;
        let tolerance = 1e-6 * (9 * cin) as f64;
        assert!(diff < tolerance, "{b}x{h}x{w}x{cin} chunk {chunk}: {diff}");
    }
    Ok(())
}

/// The bf16 convolution against a float64 convolution of the bf16-rounded input and
/// weights, on every bf16 kernel this CPU has: patches packed straight from the image
/// (even `cin`, rows wider than a block of pixels, several images) and through the f32
/// patch matrix (odd `cin`).
#[test]
fn bf16_conv_matches_the_rounded_convolution() -> Result<()> {
    let dev = Device::Cpu;
    let round = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F64);
    for isa in crate::ops::cpu::bf16::available_isas() {
        for (b, h, w, cin, cout) in [
            (2, 5, 7, 6, 40),
            (1, 3, 100, 8, 33),
            (1, 4, 5, 5, 32),
            (1, 2, 3, 64, 64),
        ] {
            let x = normal(0.0, 1.0, (b, h, w, cin), &dev)?;
            let weight = normal(0.0, 1.0, (cout, cin, 3, 3), &dev)?;
            let bias = normal(0.0, 1.0, cout, &dev)?;
            let w9 = weight.permute((2, 3, 1, 0))?.reshape((9 * cin, cout))?;
            let ws = w9.flatten_all()?.to_vec1::<f32>()?;
            let packed = PackedB::new(&ws, (9 * cin, cout), (cout, 1));
            let ours = conv3x3_bf16(&x, isa, &packed, &bias, 1 << 20)?;
            let want = round(&x)?
                .permute((0, 3, 1, 2))?
                .conv2d(&round(&weight)?, 1, 1, 1, 1)?
                .broadcast_add(&bias.to_dtype(DType::F64)?.reshape((1, cout, 1, 1))?)?
                .permute((0, 2, 3, 1))?;
            let diff = max_abs_diff(&ours, &want)?;
            let tolerance = 1e-6 * (9 * cin) as f64;
            assert!(
                diff < tolerance,
                "{isa:?} {b}x{h}x{w}x{cin} -> {cout}: {diff}"
            );
        }
    }
    Ok(())
}

/// The shuffled convolution against the convolution followed by the shuffle, in f32 and
/// (where the CPU has it) bf16, for both factors and bands of one and several rows.
#[test]
fn shuffled_conv_matches_conv_then_shuffle() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(shuffled_conv_matches_conv_then_shuffle_on_one_isa)
}

fn shuffled_conv_matches_conv_then_shuffle_on_one_isa() -> Result<()> {
    let dev = Device::Cpu;
    for (b, h, w, cin, c, r, chunk) in [
        (2, 5, 7, 6, 16, 2, 1 << 20),
        (1, 4, 3, 5, 32, 3, 1),
        (1, 3, 9, 8, 16, 2, 200),
        // A row wider than one packed block of pixels.
        (1, 2, 100, 8, 16, 2, 1 << 20),
    ] {
        let cout = r * r * c;
        let x = normal(0.0, 1.0, (b, h, w, cin), &dev)?;
        let w9 = normal(0.0, 0.3, (9 * cin, cout), &dev)?;
        let bias = normal(0.0, 1.0, cout, &dev)?;
        let plain = conv3x3(&x, &w9, &bias, chunk)?.expect("f32 kernel");
        let want = pixel_shuffle_reordered(&plain, r)?.expect("f32 kernel");
        let ours = conv3x3_shuffled(&x, &w9, &bias, r, chunk)?.expect("f32 kernel");
        assert_eq!(ours.dims(), [b, h * r, w * r, c]);
        let diff = max_abs_diff(&ours, &want)?;
        assert!(diff < 1e-5, "f32 {b}x{h}x{w}x{cin} r {r}: {diff}");
        if let Some(isa) = crate::ops::cpu::bf16::isa() {
            let ws = w9.flatten_all()?.to_vec1::<f32>()?;
            let packed = PackedB::new(&ws, (9 * cin, cout), (cout, 1));
            let plain = conv3x3_bf16(&x, isa, &packed, &bias, chunk)?;
            let want = pixel_shuffle_reordered(&plain, r)?.expect("f32 kernel");
            let ours = conv3x3_shuffled_bf16(&x, isa, &packed, &bias, r, chunk)?
                .expect("blocks of 32 and 96 columns start panels");
            let diff = max_abs_diff(&ours, &want)?;
            assert!(diff < 1e-5, "bf16 {b}x{h}x{w}x{cin} r {r}: {diff}");
        }
    }
    Ok(())
}

#[test]
fn dense_concatenation_and_shuffle_match_candle() -> Result<()> {
    let dev = Device::Cpu;
    // Channel counts off the vector width, and a negative zero and exact zeros in y.
    let x = normal(0.0, 1.0, (2, 3, 37), &dev)?;
    let y = normal(0.0, 1.0, (2, 3, 19), &dev)?;
    let y = y.slice_assign(
        &[0..1, 0..1, 0..2],
        &Tensor::new(&[[[-0.0f32, 0.0]]], &dev)?,
    )?;
    let ours = cat_leaky(&x, &y, 0.2)?.expect("the CPU f32 kernel applies");
    let want = Tensor::cat(&[&x, &candle_nn::ops::leaky_relu(&y, 0.2)?], 2)?;
    assert_eq!(ours.dims(), want.dims());
    assert_eq!(
        ours.flatten_all()?.to_vec1::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?
    );
    assert!(cat_leaky(&x, &y.narrow(1, 0, 2)?.contiguous()?, 0.2).is_err());

    for r in [2, 3] {
        let (b, h, w, c) = (2, 3, 4, 5);
        let x = normal(0.0, 1.0, (b, h, w, r * r * c), &dev)?;
        let ours = pixel_shuffle_reordered(&x, r)?.expect("the CPU f32 kernel applies");
        let want = x
            .reshape((b, h, w, r, r, c))?
            .permute((0, 1, 3, 2, 4, 5))?
            .reshape((b, h * r, w * r, c))?;
        assert_eq!(
            ours.flatten_all()?.to_vec1::<f32>()?,
            want.flatten_all()?.to_vec1::<f32>()?,
            "r {r}"
        );
    }
    Ok(())
}

/// The sum over several parallel chunks and a partial one, and the refusals.
#[test]
fn add_matches_candle_and_checks_shapes() -> Result<()> {
    let dev = Device::Cpu;
    let a = normal(0.0, 1.0, (3, CHUNK + 77), &dev)?;
    let b = normal(0.0, 1.0, (3, CHUNK + 77), &dev)?;
    let ours = add(&a, &b)?.expect("f32 on the CPU");
    assert_eq!(max_abs_diff(&ours, &(&a + &b)?)?, 0.0);
    assert!(add(&a, &b.narrow(1, 0, 5)?.contiguous()?).is_err());
    assert!(add(&a.to_dtype(DType::F64)?, &b.to_dtype(DType::F64)?)?.is_none());
    Ok(())
}

/// GFLOP/s of the f32 linear layers of a SwinIR-M block at 64x64 (qkv, proj, fc1 with its
/// GELU, fc2 onto its residual) and of its 3x3 convolution, with the bias, on all threads.
/// Run with `UPSCALE_CPU_GEMM=crate` to time the `gemm` crate instead of the panels:
/// `cargo test --release --lib swinir_layer_throughput -- --ignored --nocapture`.
#[test]
#[ignore]
fn swinir_layer_throughput() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(layer_throughput_on_one_isa)
}

fn layer_throughput_on_one_isa() -> Result<()> {
    eprintln!("{:?}:", crate::ops::cpu::isa::cpu_isa());
    let dev = Device::Cpu;
    let m = 4096;
    let reps = 20;
    let time = |run: &dyn Fn() -> Result<Tensor>, flops: f64| -> Result<f64> {
        run()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            std::hint::black_box(run()?);
        }
        Ok(flops * reps as f64 / t.elapsed().as_secs_f64() / 1e9)
    };
    for (k, n, after) in [(180, 540, 0), (180, 180, 0), (180, 360, 1), (360, 180, 2)] {
        let x = normal(0.0, 1.0, (m, k), &dev)?;
        let w = normal(0.0, 0.1, (n, k), &dev)?;
        let b = normal(0.0, 1.0, n, &dev)?;
        let r = normal(0.0, 1.0, (m, n), &dev)?;
        let after = match after {
            0 => After::Nothing,
            1 => After::Gelu,
            _ => After::Residual(&r),
        };
        let run = || Ok(linear(&x, &w, Some(&b), after)?.expect("f32 on the CPU"));
        let g = time(&run, 2.0 * (m * k * n) as f64)?;
        eprintln!("linear {m}x{k}x{n}: {g:.0} GFLOP/s");
    }
    for (side, cin, cout) in [(64, 180, 180), (64, 180, 64), (128, 64, 256)] {
        let x = normal(0.0, 1.0, (1, side, side, cin), &dev)?;
        let w = normal(0.0, 0.1, (9 * cin, cout), &dev)?;
        let b = normal(0.0, 1.0, cout, &dev)?;
        let run = || Ok(conv3x3(&x, &w, &b, 16 << 20)?.expect("f32 on the CPU"));
        let g = time(&run, 2.0 * (side * side * 9 * cin * cout) as f64)?;
        eprintln!("conv3x3 {side}x{side} {cin}->{cout}: {g:.0} GFLOP/s");
    }
    Ok(())
}

/// Milliseconds per call of two small kernels at SwinIR-M's 64x64 shapes, on each ISA: its
/// window attention (64 windows of 8x8, 6 heads of 30, shifted) and its final RGB convolution
/// (64 -> 3 channels at 256x256), the fastest of 30 calls on all threads.
/// `cargo test --release --lib small_kernel_throughput -- --ignored --nocapture`
#[test]
#[ignore]
fn small_kernel_throughput() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(|| {
        // The fastest of 30 calls: the least disturbed by other work on the machine.
        let fastest = |run: &dyn Fn() -> Result<Tensor>| -> Result<f64> {
            run()?;
            let mut t = Vec::new();
            for _ in 0..30 {
                let start = std::time::Instant::now();
                std::hint::black_box(run()?);
                t.push(start.elapsed().as_secs_f64() * 1e3);
            }
            Ok(t.into_iter().fold(f64::INFINITY, f64::min))
        };
        let (qkv, bias, regions, _, _) = attention_inputs((64, 8, 6, 30, 64))?;
        let attention = fastest(&|| {
            Ok(window_attention(&qkv, &bias, regions.as_deref(), None)?.expect("f32 on the CPU"))
        })?;
        let dev = Device::Cpu;
        let x = normal(0.0, 1.0, (1, 256, 256, 64), &dev)?;
        let w = normal(0.0, 0.1, (9 * 64, 3), &dev)?;
        let b = normal(0.0, 1.0, 3, &dev)?;
        let rgb = fastest(&|| Ok(conv3x3(&x, &w, &b, 16 << 20)?.expect("f32 on the CPU")))?;
        // fc1's output in SwinIR-M at 64x64, on one thread.
        let hidden = normal(0.0, 1.0, 4096 * 360, &dev)?.to_vec1::<f32>()?;
        let gelu = fastest(&|| {
            let mut h = hidden.clone();
            crate::ops::cpu::gelu_in_place(&mut h);
            Tensor::from_vec(h, 4096 * 360, &dev)
        })?;
        eprintln!(
            "{:?}: window attention {attention:.3} ms, RGB convolution {rgb:.3} ms, \
             GELU of 4096 x 360 {gelu:.3} ms",
            crate::ops::cpu::isa::cpu_isa()
        );
        Ok(())
    })
}

/// The spatial mean against candle's in f64: odd sizes, and a map of more rows than one
/// task sums (the blocks' partial sums added together), over a batch of two.
#[test]
fn mean_over_height_and_width_matches_candle() -> Result<()> {
    for dims in [(2, 5, 7, 33), (2, 64, 64, 180), (1, 1, 1, 3)] {
        let x = (normal(0.0, 1.0, dims, &Device::Cpu)? + 0.5)?;
        let ours = mean_hw(&x)?;
        assert_eq!(ours.dims(), [dims.0, 1, 1, dims.3]);
        let want = x.to_dtype(DType::F64)?.mean_keepdim(1)?.mean_keepdim(2)?;
        let d = max_abs_diff(&ours, &want)?;
        assert!(d < 1e-6, "{dims:?}: max abs error {d}");
    }
    Ok(())
}

/// The centre of a map (and its mean) against candle's narrow views, plain, gated per image
/// and channel, plus a tensor, and both; odd sizes, a batch of two, and the whole map (t = 0).
#[test]
fn centres_match_candles_narrow_views() -> Result<()> {
    let dev = Device::Cpu;
    for ((b, h, w, c), t) in [((2, 9, 12, 5), 2), ((1, 40, 38, 64), 16), ((2, 3, 4, 3), 0)] {
        let x = normal(0.0, 1.0, (b, h, w, c), &dev)?;
        let want = x.narrow(1, t, h - 2 * t)?.narrow(2, t, w - 2 * t)?;
        let plain = centre(&x, t, Centre::Plain)?.unwrap();
        assert_eq!(max_abs_diff(&plain, &want)?, 0.0, "{t}");
        let gate = normal(0.0, 1.0, (b, c), &dev)?;
        let scaled = centre(&x, t, Centre::Scaled(&gate))?.unwrap();
        let d = max_abs_diff(&scaled, &want.broadcast_mul(&gate.reshape((b, 1, 1, c))?)?)?;
        assert_eq!(d, 0.0, "gated, {t}");
        let other = normal(0.0, 1.0, want.dims(), &dev)?;
        let plus = centre(&x, t, Centre::Plus(&other))?.unwrap();
        assert_eq!(max_abs_diff(&plus, &(&want + &other)?)?, 0.0, "plus, {t}");
        let both = centre(&x, t, Centre::ScaledPlus(&gate, &other))?.unwrap();
        let want_both = (want.broadcast_mul(&gate.reshape((b, 1, 1, c))?)? + &other)?;
        assert_eq!(max_abs_diff(&both, &want_both)?, 0.0, "gated plus, {t}");
        let mean = centre_mean(&x, t)?;
        let want_mean = want
            .to_dtype(DType::F64)?
            .mean_keepdim(1)?
            .mean_keepdim(2)?;
        assert!(max_abs_diff(&mean, &want_mean)? < 1e-6, "mean, {t}");
    }
    let x = normal(0.0, 1.0, (1, 4, 4, 2), &dev)?;
    assert!(
        centre(&x, 3, Centre::Plain).is_err(),
        "a centre past the map"
    );
    let gate = normal(0.0, 1.0, (1, 2), &dev)?;
    assert!(
        centre(&x, 1, Centre::ScaledPlus(&gate, &x)).is_err(),
        "a sum shaped as the map, not its centre"
    );
    Ok(())
}

/// Space-to-depth against candle's reshape and permute, in (i, j, c) order; LeakyReLU
/// against candle's.
#[test]
fn space_to_depth_and_leaky_match_candle() -> Result<()> {
    let dev = Device::Cpu;
    let (b, h, w, c) = (2, 6, 10, 7);
    let x = normal(0.0, 1.0, (b, h, w, c), &dev)?;
    let ours = space_to_depth(&x, 2)?.unwrap();
    let want = x
        .reshape((b, h / 2, 2, w / 2, 2, c))?
        .permute((0, 1, 3, 2, 4, 5))?
        .contiguous()?
        .reshape((b, h / 2, w / 2, 4 * c))?;
    assert_eq!(max_abs_diff(&ours, &want)?, 0.0);
    assert!(space_to_depth(&normal(0.0, 1.0, (1, 5, 4, 2), &dev)?, 2).is_err());
    let ours = leaky(&x, 0.1)?.unwrap();
    let want = candle_nn::ops::leaky_relu(&x, 0.1)?;
    assert_eq!(max_abs_diff(&ours, &want)?, 0.0);
    Ok(())
}

/// A product with LeakyReLU applied to its finished rows, against the product and candle's
/// LeakyReLU after it.
#[test]
fn linear_with_leaky_epilogue_matches_the_two_steps() -> Result<()> {
    let dev = Device::Cpu;
    let (m, k, n) = (300, 48, 40);
    let x = normal(0.0, 1.0, (m, k), &dev)?;
    let w = normal(0.0, 1.0, (n, k), &dev)?;
    let b = normal(0.0, 1.0, n, &dev)?;
    let packed = pack(&w)?.expect("the panels run on this CPU");
    let fused = linear_packed(&x, &packed, Some(&b), After::Leaky(0.1))?;
    let plain = linear_packed(&x, &packed, Some(&b), After::Nothing)?;
    let want = candle_nn::ops::leaky_relu(&plain, 0.1)?;
    assert_eq!(max_abs_diff(&fused, &want)?, 0.0);
    assert!(max_abs_diff(&fused, &plain)? > 0.1, "the epilogue ran");
    Ok(())
}

/// The attention's softmax one row at a time, as it was written before it went a block of
/// rows a step at a time: each row through bias, mask, maximum, exponentials and scaling
/// before the next (the same steps for a row as the kernel's).
#[inline(always)]
fn probs_row_at_a_time<const FMA: bool>(
    scores: &mut [f32],
    bias: Option<(&crate::ops::windows::RelativeBias, usize)>,
    labels: Option<&[u8]>,
    n: usize,
) {
    for (i, row) in scores.chunks_exact_mut(n).enumerate() {
        if let Some((bias, h)) = bias {
            bias.add_to_row(h, i, row);
        }
        if let Some(labels) = labels {
            let own = labels[i];
            for (s, &l) in row.iter_mut().zip(labels) {
                *s += if l == own { 0.0 } else { MASK_VALUE };
            }
        }
        let inv = row_exp::<FMA>(row, row_max(row));
        row.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Scores, a position bias and shift-mask labels for one head of `ws`-square windows.
fn probs_inputs(ws: usize) -> Result<(Vec<f32>, crate::ops::windows::RelativeBias, Vec<u8>)> {
    let n = ws * ws;
    let scores = normal(0.0, 3.0, n * n, &Device::Cpu)?.to_vec1::<f32>()?;
    let table = normal(0.0, 1.0, ((2 * ws - 1) * (2 * ws - 1), 2), &Device::Cpu)?;
    let bias = crate::ops::windows::RelativeBias::new(&table, ws)?;
    let labels = (0..n)
        .map(|i| ((i % ws) * 3 / ws + (i / ws) * 3 / ws * 3) as u8)
        .collect();
    Ok((scores, bias, labels))
}

/// The softmax a block of rows a step at a time gives every probability bit for bit as row
/// after row does, with the bias and mask of each row's own query (windows of 64 tokens: one
/// block; 256: sixteen rows a block; 49: a block of 83 rows cut at 49): the blocking only
/// reorders independent work.
#[test]
fn attention_probs_are_those_of_one_row_at_a_time() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(|| {
        // The kernels use fused multiply-adds wherever the vector units have them: on x86
        // with AVX2 or AVX-512, and always on aarch64.
        let fused = cfg!(target_arch = "aarch64")
            || crate::ops::cpu::isa::cpu_isa() != crate::ops::cpu::isa::CpuIsa::Scalar;
        for (ws, masked) in [(8, true), (16, true), (7, false)] {
            let (scores, bias, labels) = probs_inputs(ws)?;
            let n = ws * ws;
            let labels = masked.then_some(&labels[..]);
            let mut want = scores.clone();
            match fused {
                true => probs_row_at_a_time::<true>(&mut want, Some((&bias, 1)), labels, n),
                false => probs_row_at_a_time::<false>(&mut want, Some((&bias, 1)), labels, n),
            }
            let mut ours = scores.clone();
            attention_probs(&mut ours, Some((&bias, 1)), labels, n, None);
            let same = ours
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "window {ws}: the probabilities differ from row by row"
            );
        }
        Ok::<(), candle_core::Error>(())
    })
}

/// Nanoseconds per score of the attention softmax (64-token windows, bias and mask), a block
/// of rows a step at a time against row after row, alternating, medians of 41 rounds, held to
/// AVX2: `cargo test --release --lib attention_probs_rate -- --ignored --nocapture`.
#[cfg(target_arch = "x86_64")]
#[test]
#[ignore]
fn attention_probs_rate() -> Result<()> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
        eprintln!("not measured: this CPU has no AVX2 and FMA");
        return Ok(());
    }
    let (scores, bias, labels) = probs_inputs(8)?;
    let n = 64;
    let reps = 2000;
    let mut work = scores.clone();
    let mut time = |f: &mut dyn FnMut(&mut [f32])| {
        let t = std::time::Instant::now();
        for _ in 0..reps {
            work.copy_from_slice(&scores);
            f(&mut work);
            std::hint::black_box(&mut work);
        }
        t.elapsed().as_secs_f64() / (reps * n * n) as f64 * 1e9
    };
    let (mut blocks, mut rows) = (Vec::new(), Vec::new());
    crate::ops::cpu::isa::with_cpu_isa(crate::ops::cpu::isa::CpuIsa::Avx2, || {
        for _ in 0..41 {
            blocks.push(time(&mut |s| {
                attention_probs(s, Some((&bias, 1)), Some(&labels), n, None)
            }));
            // The same instructions as the kernel's: compiled for AVX2 and FMA.
            #[target_feature(enable = "avx2,fma")]
            unsafe fn rows_avx2(s: &mut [f32], b: &crate::ops::windows::RelativeBias, l: &[u8]) {
                probs_row_at_a_time::<true>(s, Some((b, 1)), Some(l), 64)
            }
            // SAFETY: the CPU has AVX2 and FMA, checked above.
            rows.push(time(&mut |s| unsafe { rows_avx2(s, &bias, &labels) }));
        }
    });
    let median = crate::tests::median;
    let (b, r) = (median(&mut blocks), median(&mut rows));
    eprintln!(
        "row by row {r:.3} ns/score, blocks {b:.3} ns/score: {:.2}x",
        r / b
    );
    Ok(())
}

/// The gated feed-forward's gate against its definition in f64 (`libm`'s erf), on every
/// instruction set: 37 channels, a vector run and a tail, over 15 tokens; and candle's
/// operations (the path off the CPU) agree with it.
#[test]
fn gelu_gate_matches_its_definition() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(|| {
        let dev = Device::Cpu;
        let c = 37;
        let h = normal(0.0, 2.0, (3, 5, 2 * c), &dev)?;
        let got = gelu_gate(&h)?;
        assert_eq!(got.dims(), [3, 5, c]);
        let graph = (gelu_erf(&h.narrow(2, 0, c)?.contiguous()?)? * h.narrow(2, c, c)?)?;
        let hv = h.flatten_all()?.to_vec1::<f32>()?;
        let (gv, rv) = (
            got.flatten_all()?.to_vec1::<f32>()?,
            graph.flatten_all()?.to_vec1::<f32>()?,
        );
        for (i, (&g, &r)) in gv.iter().zip(&rv).enumerate() {
            let (t, ch) = (i / c, i % c);
            let (a, b) = (hv[t * 2 * c + ch] as f64, hv[t * 2 * c + c + ch] as f64);
            let want = 0.5
                * a
                * (1.0 + super::depthwise::tests::libm_erf(a / std::f64::consts::SQRT_2))
                * b;
            let bound = 2e-6 * (1.0 + want.abs());
            assert!((g as f64 - want).abs() < bound, "{i}: {g} vs {want}");
            assert!((r as f64 - want).abs() < bound, "graph {i}: {r} vs {want}");
        }
        Ok(())
    })
}

/// The depthwise k x k kernel against candle's grouped convolution (channels-first, one
/// group per channel) plus the bias: 7x7, 5x5 and 3x3 on the row kernel (rows of 11 and 14
/// tokens: one-by-one edges and groups of four; 21 and 20 channels: whole vectors and a part)
/// and 9x9 one token at a time, maps smaller than the kernel, a batch of two, and a map that
/// is the last channels of a wider one, read in place; on every instruction set.
#[test]
fn depthwise_kxk_matches_candles_grouped_convolution() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(|| {
        let dev = Device::Cpu;
        let cases = [
            (7, (2, 9, 11, 21)),
            (7, (1, 3, 4, 5)),
            (5, (1, 6, 14, 20)),
            (3, (1, 6, 11, 16)),
            (9, (1, 5, 12, 3)),
        ];
        for (k, (b, h, w, c)) in cases {
            let wide = normal(0.0, 1.0, (b, h, w, c + 7), &dev)?;
            let weight = normal(0.0, 1.0, (c, 1, k, k), &dev)?;
            let bias = normal(0.0, 1.0, c, &dev)?;
            let taps = weight.reshape((c, k * k))?.t()?.contiguous()?;
            let (taps, b_host): (Vec<f32>, Vec<f32>) =
                (taps.flatten_all()?.to_vec1()?, bias.to_vec1()?);
            for x in [wide.narrow(3, 7, c)?, wide.narrow(3, 7, c)?.contiguous()?] {
                let ours = depthwise::depthwise_kxk(&x, k, (&taps, &b_host))?.unwrap();
                let want = x
                    .permute((0, 3, 1, 2))?
                    .contiguous()?
                    .conv2d(&weight, k / 2, 1, 1, c)?
                    .broadcast_add(&bias.reshape((1, c, 1, 1))?)?
                    .permute((0, 2, 3, 1))?;
                let d = max_abs_diff(&ours, &want)?;
                assert!(d < 1e-4, "{k}x{k} of {:?}: {d}", x.dims());
            }
        }
        Ok::<(), candle_core::Error>(())
    })?;
    let dev = Device::Cpu;
    let x = normal(0.0, 1.0, (1, 4, 4, 2), &dev)?;
    assert!(depthwise::depthwise_kxk(&x, 4, (&[0.0; 32], &[0.0; 2])).is_err());
    Ok(())
}

/// MoSR's gate in one pass is Mish, the concatenation and the product one after the other,
/// bit for bit, with and without a convolved tail, on every instruction set; shapes that do
/// not chain are refused.
#[test]
fn mish_gate_is_mish_then_the_product_with_the_concatenation() -> Result<()> {
    crate::ops::cpu::isa::on_each_isa(|| {
        let dev = Device::Cpu;
        let h = 37;
        let y = normal(0.0, 3.0, (2, 5, 3, 2 * h), &dev)?;
        for k in [0, 16, h] {
            let tail = normal(0.0, 1.0, (2, 5, 3, k), &dev)?;
            let got = mish_gate(&y, h, &tail)?.expect("f32 on the CPU");
            let g = mish(&y.narrow(3, 0, h)?.contiguous()?)?;
            let want = (g * Tensor::cat(&[&y.narrow(3, h, h - k)?, &tail], 3)?)?;
            assert_eq!(got.dims(), want.dims());
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.flatten_all()?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|v| v.to_bits())
                    .collect())
            };
            assert_eq!(bits(&got)?, bits(&want)?, "k = {k}");
        }
        let wide = normal(0.0, 1.0, (2, 5, 3, h + 1), &dev)?;
        assert!(mish_gate(&y, h, &wide).is_err());
        Ok::<(), candle_core::Error>(())
    })
}
