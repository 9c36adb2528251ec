//! SwinV2's scaled cosine attention (Swin2SR's blocks), brought to the window attention every
//! other Swin block runs: the query and key of each head divided by their norms, as
//! `F.normalize` does (the norm clamped below at 1e-12), and the query then multiplied by its
//! head's logit scale, so that `q·kᵀ` is the scaled cosine the reference computes and
//! [`super::Attend`] can add the bias and take the softmax as it does for any block.

use candle_core::{DType, Result, Tensor, D};
use rayon::prelude::*;

/// `F.normalize`'s floor under a norm.
const EPS: f32 = 1e-12;

/// `qkv` `(.., 3C)` (q, k, v, each `heads` heads of `C / heads` channels) with every head of
/// q normalised and multiplied by `scales[head]`, and every head of k normalised; v as it is.
pub(crate) fn normalise_qk(qkv: &Tensor, scales: &[f32]) -> Result<Tensor> {
    let heads = scales.len();
    let c3 = qkv.dim(D::Minus1)?;
    if heads == 0 || c3 % (3 * heads) != 0 {
        candle_core::bail!("qkv of {c3} channels does not split into 3 x {heads} heads");
    }
    let d = c3 / 3 / heads;
    if qkv.device().is_cpu() && qkv.dtype() == DType::F32 {
        let mut values = qkv.flatten_all()?.to_vec1::<f32>()?;
        values
            .par_chunks_mut(c3)
            .for_each(|row| normalise_row(row, scales, d));
        return Tensor::from_vec(values, qkv.dims(), qkv.device());
    }
    // Elsewhere candle's ops, in f32: a head's sum of squares can pass f16's range.
    let dims = qkv.dims().to_vec();
    let rows = qkv.elem_count() / c3;
    let x = qkv.to_dtype(DType::F32)?.reshape((rows, 3, heads, d))?;
    let qk = x.narrow(1, 0, 2)?;
    let norm = qk.sqr()?.sum_keepdim(3)?.sqrt()?.maximum(EPS as f64)?;
    let mut by = scales.to_vec();
    by.extend(std::iter::repeat_n(1f32, heads));
    let by = Tensor::from_vec(by, (1, 2, heads, 1), qkv.device())?;
    let qk = qk.broadcast_mul(&by)?.broadcast_div(&norm)?;
    Tensor::cat(&[&qk, &x.narrow(1, 2, 1)?], 1)?
        .reshape(dims)?
        .to_dtype(qkv.dtype())
}

/// One token's `q, k, v` (`3 * heads * d` values) with q and k normalised as
/// [`normalise_qk`] says: the same arithmetic whichever path calls it.
pub(crate) fn normalise_row(row: &mut [f32], scales: &[f32], d: usize) {
    let heads = scales.len();
    for (part, head) in (0..2).flat_map(|p| (0..heads).map(move |h| (p, h))) {
        let start = (part * heads + head) * d;
        let v = &mut row[start..start + d];
        let norm = sum_of_squares(v).sqrt().max(EPS);
        let by = if part == 0 { scales[head] } else { 1.0 } / norm;
        v.iter_mut().for_each(|x| *x *= by);
    }
}

/// `Σ x²`, in eight lanes that the compiler keeps in one vector register.
fn sum_of_squares(v: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = v.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().map(|x| x * x).sum();
    for c in chunks {
        lanes.iter_mut().zip(c).for_each(|(l, x)| *l += x * x);
    }
    lanes.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The CPU kernel and the graph give the same values, and each head of q has the norm of
    /// its scale, each of k norm 1, v untouched; a zero head stays zero (the clamped norm).
    #[test]
    fn cosine_normalisation_matches_its_definition() {
        let (rows, heads, d) = (5, 3, 4);
        let mut v: Vec<f32> = (0..rows * 3 * heads * d)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) / 7.0)
            .collect();
        v[..d].iter_mut().for_each(|x| *x = 0.0);
        let qkv = Tensor::from_vec(v.clone(), (1, rows, 3 * heads * d), &Device::Cpu).unwrap();
        let scales = [2.0f32, 0.5, 100.0];
        let kernel = normalise_qk(&qkv, &scales).unwrap();
        let graph = normalise_qk(&qkv.to_dtype(DType::F64).unwrap(), &scales)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let (a, b) = (
            kernel.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            graph.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        );
        for (x, y) in a.iter().zip(&b) {
            assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{x} vs {y}");
        }
        for (r, row) in a.chunks(3 * heads * d).enumerate() {
            for (i, head) in row.chunks(d).enumerate() {
                let norm = head.iter().map(|x| x * x).sum::<f32>().sqrt();
                let want = match i / heads {
                    0 if r == 0 && i == 0 => 0.0,
                    0 => scales[i % heads],
                    1 => 1.0,
                    _ => {
                        let at = r * 3 * heads * d + i * d;
                        assert_eq!(head, &v[at..at + d]);
                        continue;
                    }
                };
                assert!(
                    (norm - want).abs() < 1e-4 * want.max(1.0),
                    "{r} {i}: {norm}"
                );
            }
        }
    }
}
