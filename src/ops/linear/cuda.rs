//! Linear layers on CUDA as one cuBLASLt call that adds the bias (and a residual) in the
//! GEMM's epilogue.
//!
//! candle's GEMM writes `x · wᵀ`, and a bias pass then reads it back and writes it again: three
//! passes over the output where one will do. In bf16 and f16 the linear layers with nothing
//! after them but the bias (qkv and proj of every attention) take [`linear_bias`], and the
//! MLP's second layer, whose residual the Swin block owns, takes [`accumulate_linear_bias`]
//! onto that residual in place. f32 stays on candle's GEMM, because cuBLASLt's f32 here
//! computes in TF32 and the f32 path is held to the CPU within 1e-4.
//!
//! The MLP's first layer keeps its exact (erf) GELU in a pass of its own
//! ([`crate::ops::rowwise`]): cuBLASLt's GELU epilogue is the tanh approximation, and on an
//! H200 it made DRCT-L 1.33x slower at unaligned widths (docs/performance-history.md).

use candle_core::{Result, Tensor};

use crate::switches::cuda_off::Off;

fn check(x: &Tensor, w: &Tensor, b: &Tensor, what: &str) -> Result<(usize, usize)> {
    let (t, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if kw != k || b.dims() != [n] || t == 0 {
        candle_core::bail!(
            "{what}: x {:?}, w {:?}, b {:?}",
            x.dims(),
            w.dims(),
            b.dims()
        );
    }
    Ok((t, n))
}

/// `x · wᵀ + b` for `x` `(T, K)`, `w` `(N, K)` and `b` `(N)`, all contiguous, or `None` where
/// this path does not apply (not CUDA, f32, a view that does not start its buffer, no
/// cuBLASLt algorithm for the shape, or `off` names `cublaslt`) and the caller runs its own.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor, off: Off) -> Result<Option<Tensor>> {
    check(x, w, b, "linear_bias")?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && !off.cublaslt {
        return cublaslt::linear_bias(x, w, b);
    }
    Ok(None)
}

/// `acc += x · wᵀ + b` in place, for `acc` `(T, N)`; `false` where this path does not apply
/// (as for [`linear_bias`], or an operand shares `acc`'s storage), and `acc` is then
/// unchanged. Every tensor that shares `acc`'s storage sees the sum, so the caller must own it.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
pub fn accumulate_linear_bias(
    acc: &Tensor,
    x: &Tensor,
    w: &Tensor,
    b: &Tensor,
    off: Off,
) -> Result<bool> {
    let (t, n) = check(x, w, b, "accumulate_linear_bias")?;
    if acc.dims() != [t, n] {
        candle_core::bail!(
            "accumulate_linear_bias: acc {:?}, x · wᵀ ({t}, {n})",
            acc.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() && !off.cublaslt {
        return cublaslt::accumulate_linear_bias(acc, x, w, b);
    }
    Ok(false)
}

#[cfg(feature = "cuda")]
mod cublaslt {
    use std::sync::{Arc, Mutex, OnceLock, Weak};
    use std::thread::ThreadId;

    use candle_core::cuda_backend::cudarc::cublaslt::result::CublasError;
    use candle_core::cuda_backend::cudarc::cublaslt::sys::cublasStatus_t;
    use candle_core::cuda_backend::cudarc::cublaslt::{CudaBlasLT, Matmul, MatmulConfig};
    use candle_core::cuda_backend::cudarc::driver::{
        CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr,
    };
    use candle_core::cuda_backend::CudaDType;
    use candle_core::op::BackpropOp;
    use candle_core::{
        CpuStorage, CudaDevice, CudaStorage, DType, InplaceOp2, Layout, Result, Storage, Tensor,
        WithDType,
    };
    use half::{bf16, f16};

    /// One cuBLASLt handle (and its workspace) per CUDA stream: each lane has its own stream,
    /// and a handle must not be shared by launches on different streams (they would share its
    /// workspace). candle's default device (`Device::new_cuda`, which the GPU tests use)
    /// launches on the per-thread default stream, one handle value that CUDA resolves to a
    /// different stream in each thread, so there the thread is part of the key. `None` when
    /// no handle can be made: cudarc panics when the handle's 32 MiB workspace cannot be
    /// allocated, which a lane started late on a full GPU may meet, and the caller's own GEMM
    /// then runs instead. The failure is remembered, so the stream does not try (and print
    /// cudarc's panic) again on every layer. An entry goes when nothing but its own handle
    /// holds its stream any more (the device and its tensors are gone), so a program that
    /// opens and drops models keeps one stale workspace at most, not one per model.
    fn handle(dev: &CudaDevice) -> Option<Arc<CudaBlasLT>> {
        let stream = dev.cuda_stream();
        let thread =
            (stream.cu_stream() as usize == PER_THREAD_STREAM).then(|| std::thread::current().id());
        let mut entries = handles();
        entries.retain(|e| e.stream.strong_count() > e.own);
        if let Some(e) = entries
            .iter()
            .find(|e| Weak::as_ptr(&e.stream) == Arc::as_ptr(&stream) && e.thread == thread)
        {
            return e.handle.clone();
        }
        let before = Arc::strong_count(&stream);
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            CudaBlasLT::new(stream.clone())
        }));
        let handle = made.ok().and_then(|r| r.ok()).map(Arc::new);
        entries.push(Entry {
            stream: Arc::downgrade(&stream),
            thread,
            // Counted rather than assumed from cudarc's fields (the handle and its workspace
            // buffer each hold one). Another thread allocating on this stream meanwhile can
            // only skew it: too high drops an entry in use, which then makes a new handle;
            // too low keeps a stale one.
            own: Arc::strong_count(&stream).saturating_sub(before),
            handle: handle.clone(),
        });
        handle
    }

    struct Entry {
        // Weak, so that the stream's address is not reused while the entry names it.
        stream: Weak<CudaStream>,
        thread: Option<ThreadId>,
        /// How many of the stream's strong references the handle itself holds.
        own: usize,
        handle: Option<Arc<CudaBlasLT>>,
    }

    fn handles() -> std::sync::MutexGuard<'static, Vec<Entry>> {
        static HANDLES: OnceLock<Mutex<Vec<Entry>>> = OnceLock::new();
        HANDLES
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// The value of CUDA's `CU_STREAM_PER_THREAD` handle.
    const PER_THREAD_STREAM: usize = 0x2;

    /// Whether a cuBLASLt error means "not for this shape or layout" (the caller's GEMM then
    /// runs) rather than a failure that must not be hidden.
    fn declined(e: &CublasError) -> bool {
        matches!(
            e.0,
            cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                | cublasStatus_t::CUBLAS_STATUS_INVALID_VALUE
                | cublasStatus_t::CUBLAS_STATUS_ARCH_MISMATCH
        )
    }

    /// The elements of a layout that starts its buffer and is contiguous: cuBLASLt's
    /// algorithms may assume buffers aligned as allocations are.
    fn whole_len(layout: &Layout) -> Option<usize> {
        match layout.contiguous_offsets() {
            Some((0, end)) => Some(end),
            _ => None,
        }
    }

    fn view<'a, T: CudaDType>(s: &'a Storage, layout: &Layout) -> Result<Option<CudaView<'a, T>>> {
        match (s, whole_len(layout)) {
            (Storage::Cuda(s), Some(end)) => Ok(Some(s.as_cuda_slice::<T>()?.slice(0..end))),
            _ => Ok(None),
        }
    }

    /// `out = x · wᵀ + b + beta · out` over `t` tokens; `false`
    /// when a buffer is not aligned as an allocation or cuBLASLt declines the shape, and then
    /// nothing was launched; an error when cuBLASLt fails otherwise.
    fn gemm<T, O>(
        dev: &CudaDevice,
        (x, w, b): (&CudaView<T>, &CudaView<T>, &CudaView<T>),
        out: &mut O,
        (t, k, n): (usize, usize, usize),
        beta: f32,
    ) -> Result<bool>
    where
        T: CudaDType,
        O: DevicePtrMut<T>,
        CudaBlasLT: Matmul<T>,
    {
        // cuBLASLt picks its algorithm assuming 256-byte aligned buffers unless told otherwise;
        // allocations are, and anything else goes back to the caller.
        let stream = dev.cuda_stream();
        let aligned = |p: u64| p.is_multiple_of(256);
        if !(aligned(x.device_ptr(&stream).0)
            && aligned(w.device_ptr(&stream).0)
            && aligned(b.device_ptr(&stream).0)
            && aligned(out.device_ptr_mut(&stream).0))
        {
            return Ok(false);
        }
        let Some(lt) = handle(dev) else {
            return Ok(false);
        };
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
            beta,
            ldc: n as i64,
            stride_a: None,
            stride_b: None,
            stride_c: None,
            stride_bias: None,
            batch_size: None,
        };
        // SAFETY: the views hold K x N, K x T and N elements and `out` N x T, as the config
        // describes them.
        match unsafe { lt.matmul(cfg, w, x, out, Some(b), None) } {
            Ok(()) => Ok(true),
            Err(e) if declined(&e) => Ok(false),
            Err(e) => candle_core::bail!("cuBLASLt linear layer ({t} x {k} -> {n}): {e}"),
        }
    }

    fn same_16bit(ts: &[&Tensor]) -> Option<DType> {
        let d = ts[0].dtype();
        (matches!(d, DType::BF16 | DType::F16) && ts.iter().all(|t| t.dtype() == d)).then_some(d)
    }

    pub(super) fn linear_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Option<Tensor>> {
        match same_16bit(&[x, w, b]) {
            Some(DType::BF16) => typed::<bf16>(x, w, b),
            Some(DType::F16) => typed::<f16>(x, w, b),
            _ => Ok(None),
        }
    }

    fn typed<T>(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Option<Tensor>>
    where
        T: CudaDType + DeviceRepr + WithDType,
        CudaBlasLT: Matmul<T>,
    {
        let ((t, k), n) = (x.dims2()?, w.dim(0)?);
        let (sx, lx) = x.storage_and_layout();
        let (sw, lw) = w.storage_and_layout();
        let (sb, lb) = b.storage_and_layout();
        let (Some(xv), Some(wv), Some(bv), Storage::Cuda(cs)) = (
            view::<T>(&sx, lx)?,
            view::<T>(&sw, lw)?,
            view::<T>(&sb, lb)?,
            &*sx,
        ) else {
            return Ok(None);
        };
        let dev = cs.device.clone();
        // SAFETY: with beta 0 cuBLASLt writes every element of `out` and reads none.
        let mut out = unsafe { dev.alloc::<T>(t * n) }?;
        if !gemm(&dev, (&xv, &wv, &bv), &mut out, (t, k, n), 0.0)? {
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

    pub(super) fn accumulate_linear_bias(
        acc: &Tensor,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
    ) -> Result<bool> {
        if same_16bit(&[acc, x, w, b]).is_none() || whole_len(acc.layout()).is_none() {
            return Ok(false);
        }
        // candle refuses an in-place op whose operand shares the destination's storage, and
        // `w` or `b` doing so would deadlock on its lock: such a caller gets its own path.
        let place = storage_address(acc);
        if [x, w, b].iter().any(|t| storage_address(t) == place) {
            return Ok(false);
        }
        let op = Accumulate {
            w,
            b,
            ran: false.into(),
        };
        acc.inplace_op2(x, &op)?;
        Ok(op.ran.into_inner())
    }

    /// Which storage a tensor views (tensors that share one have the same address).
    fn storage_address(t: &Tensor) -> usize {
        let (s, _) = t.storage_and_layout();
        std::ptr::from_ref::<Storage>(&s).addr()
    }

    /// The in-place op behind [`accumulate_linear_bias`]: `dst += x · wᵀ + b`.
    struct Accumulate<'a> {
        w: &'a Tensor,
        b: &'a Tensor,
        /// Whether cuBLASLt ran (it may find no algorithm, and then `dst` is untouched).
        ran: std::cell::Cell<bool>,
    }

    impl Accumulate<'_> {
        fn typed<T>(
            &self,
            dst: &mut CudaStorage,
            dl: &Layout,
            x: &CudaStorage,
            xl: &Layout,
        ) -> Result<()>
        where
            T: CudaDType + DeviceRepr + WithDType,
            CudaBlasLT: Matmul<T>,
        {
            let ((t, k), n) = (xl.shape().dims2()?, self.w.dim(0)?);
            let (sw, lw) = self.w.storage_and_layout();
            let (sb, lb) = self.b.storage_and_layout();
            let xv = match whole_len(xl) {
                Some(end) => x.as_cuda_slice::<T>()?.slice(0..end),
                None => return Ok(()),
            };
            let (Some(wv), Some(bv), Some(end)) =
                (view::<T>(&sw, lw)?, view::<T>(&sb, lb)?, whole_len(dl))
            else {
                return Ok(());
            };
            let dev = dst.device.clone();
            let mut out = dst.as_cuda_slice_mut::<T>()?.slice_mut(0..end);
            self.ran
                .set(gemm(&dev, (&xv, &wv, &bv), &mut out, (t, k, n), 1.0)?);
            Ok(())
        }
    }

    impl InplaceOp2 for Accumulate<'_> {
        fn name(&self) -> &'static str {
            "accumulate-linear-bias"
        }

        fn cpu_fwd(
            &self,
            _: &mut CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<()> {
            candle_core::bail!("accumulate-linear-bias runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            dst: &mut CudaStorage,
            dl: &Layout,
            x: &CudaStorage,
            xl: &Layout,
        ) -> Result<()> {
            match dl.shape().dims().len() {
                2 if xl.shape().dims().len() == 2 => {}
                _ => candle_core::bail!("accumulate-linear-bias: 2-D tensors"),
            }
            // accumulate_linear_bias checked that every operand has w's dtype.
            match self.w.dtype() {
                DType::BF16 => self.typed::<bf16>(dst, dl, x, xl),
                DType::F16 => self.typed::<f16>(dst, dl, x, xl),
                other => candle_core::bail!("accumulate-linear-bias: dtype {other:?}"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{linear_bias, Off};
    use candle_core::{Device, Result, Tensor};

    #[test]
    fn cpu_tensors_go_back_to_the_caller() -> Result<()> {
        let x = Tensor::ones((4, 3), candle_core::DType::F32, &Device::Cpu)?;
        let w = Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu)?;
        let b = Tensor::ones(2, candle_core::DType::F32, &Device::Cpu)?;
        assert!(linear_bias(&x, &w, &b, Off::default())?.is_none());
        Ok(())
    }

    #[test]
    fn mismatched_shapes_are_errors() -> Result<()> {
        let t = |s: &[usize]| Tensor::ones(s, candle_core::DType::F32, &Device::Cpu);
        assert!(linear_bias(&t(&[4, 3])?, &t(&[2, 4])?, &t(&[2])?, Off::default()).is_err());
        assert!(linear_bias(&t(&[4, 3])?, &t(&[2, 3])?, &t(&[3])?, Off::default()).is_err());
        assert!(linear_bias(&t(&[0, 3])?, &t(&[2, 3])?, &t(&[2])?, Off::default()).is_err());
        assert!(linear_bias(&t(&[4, 3])?, &t(&[2, 3])?, &t(&[2])?, Off::default()).is_ok());
        Ok(())
    }
}
