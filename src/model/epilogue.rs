//! Linear layers on CUDA as one cuBLASLt call that adds the bias in the GEMM's epilogue.
//!
//! candle's GEMM writes `x · wᵀ`, and a bias pass then reads it back and writes it again: three
//! passes over the output where one will do. The linear layers without an activation or a
//! residual (qkv and proj of every attention) take this path in bf16 and f16; f32 stays on
//! candle's GEMM, because cuBLASLt's f32 here computes in TF32 and the f32 path is held to the
//! CPU within 1e-4.

use candle_core::{Result, Tensor};

/// `x · wᵀ + b` for `x` `(T, K)`, `w` `(N, K)` and `b` `(N)`, all contiguous, or `None` where
/// this path does not apply (not CUDA, f32, a view that does not start its buffer, or no
/// cuBLASLt algorithm for the shape) and the caller runs its own.
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
    let (t, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if kw != k || b.dims() != [n] || t == 0 {
        candle_core::bail!(
            "linear_bias: x {:?}, w {:?}, b {:?}",
            x.dims(),
            w.dims(),
            b.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return cuda::linear_bias(x, w, b);
    }
    Ok(None)
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex, OnceLock};

    use candle_core::cuda_backend::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
    use candle_core::cuda_backend::cudarc::driver::{CudaView, DeviceRepr};
    use candle_core::cuda_backend::CudaDType;
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Result, Storage, Tensor};
    use half::{bf16, f16};

    /// One cuBLASLt handle (and its workspace) per CUDA stream: each lane has its own stream.
    fn handle(dev: &CudaDevice) -> Result<Arc<CudaBlasLT>> {
        static HANDLES: OnceLock<Mutex<HashMap<usize, Arc<CudaBlasLT>>>> = OnceLock::new();
        let stream = dev.cuda_stream();
        // The handle keeps its stream alive, so the address cannot be reused by another.
        let key = Arc::as_ptr(&stream) as usize;
        let mut map = HANDLES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(h) = map.get(&key) {
            return Ok(h.clone());
        }
        let h = CudaBlasLT::new(stream)
            .map_err(|e| candle_core::Error::Msg(format!("cuBLASLt handle: {e:?}")))?;
        let h = Arc::new(h);
        map.insert(key, h.clone());
        Ok(h)
    }

    /// The whole buffer of `t` as a view, or `None` when `t` is a view into a larger one:
    /// cuBLASLt's algorithms may assume buffers aligned as allocations are.
    fn whole<'a, T: CudaDType>(s: &'a Storage, t: &Tensor) -> Result<Option<CudaView<'a, T>>> {
        let Storage::Cuda(s) = s else {
            return Ok(None);
        };
        match t.layout().contiguous_offsets() {
            Some((0, end)) => Ok(Some(s.as_cuda_slice::<T>()?.slice(0..end))),
            _ => Ok(None),
        }
    }

    pub(super) fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
        match x.dtype() {
            DType::BF16 => typed::<bf16>(x, w, b),
            DType::F16 => typed::<f16>(x, w, b),
            _ => Ok(None),
        }
    }

    fn typed<T>(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Option<Tensor>>
    where
        T: CudaDType + DeviceRepr + candle_core::WithDType,
        CudaBlasLT: Matmul<T>,
    {
        if w.dtype() != x.dtype() || b.dtype() != x.dtype() {
            return Ok(None);
        }
        let (t, k) = x.dims2()?;
        let n = w.dim(0)?;
        let (sx, _) = x.storage_and_layout();
        let (sw, _) = w.storage_and_layout();
        let (sb, _) = b.storage_and_layout();
        let (Some(xv), Some(wv), Some(bv)) = (
            whole::<T>(&sx, x)?,
            whole::<T>(&sw, w)?,
            whole::<T>(&sb, b)?,
        ) else {
            return Ok(None);
        };
        let Storage::Cuda(cs) = &*sx else {
            return Ok(None);
        };
        let dev = cs.device.clone();
        let lt = handle(&dev)?;
        // SAFETY: cuBLASLt writes every element of the output before anything reads it
        // (beta is 0, so it never reads the uninitialised buffer).
        let mut out = unsafe { dev.alloc::<T>(t * n) }?;
        // Column-major view of the row-major product: out (N x T) = w (K x N)ᵀ · x (K x T).
        let cfg = MatmulConfig {
            transa: true,
            transb: false,
            transc: false,
            m: n as u64,
            n: t as u64,
            k: k as u64,
            alpha: 1.0,
            lda: k as i64,
            ldb: k as i64,
            beta: 0.0,
            ldc: n as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        // SAFETY: the views hold K x N, K x T and N elements and `out` N x T, as the config
        // describes them.
        if unsafe { lt.matmul(cfg, &wv, &xv, &mut out, Some(&bv), None) }.is_err() {
            // No algorithm for this shape or alignment: the caller's GEMM and bias pass.
            return Ok(None);
        }
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev));
        Ok(Some(Tensor::from_storage(
            storage,
            (t, n),
            BackpropOp::none(),
            false,
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::linear_bias;
    use candle_core::{Device, Result, Tensor};

    #[test]
    fn cpu_tensors_go_back_to_the_caller() -> Result<()> {
        let x = Tensor::ones((4, 3), candle_core::DType::F32, &Device::Cpu)?;
        let w = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu)?;
        let b = Tensor::ones(2, candle_core::DType::F32, &Device::Cpu)?;
        assert!(linear_bias(&x, &w, &b)?.is_none());
        Ok(())
    }

    #[test]
    fn mismatched_shapes_are_errors() -> Result<()> {
        let t = |s: &[usize]| Tensor::ones(s, candle_core::DType::F32, &Device::Cpu);
        assert!(linear_bias(&t(&[4, 3])?, &t(&[2, 4])?, &t(&[2])?).is_err());
        assert!(linear_bias(&t(&[4, 3])?, &t(&[2, 3])?, &t(&[3])?).is_err());
        assert!(linear_bias(&t(&[0, 3])?, &t(&[2, 3])?, &t(&[2])?).is_err());
        assert!(linear_bias(&t(&[4, 3])?, &t(&[2, 3])?, &t(&[2])?).is_ok());
        Ok(())
    }
}
