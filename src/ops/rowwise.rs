//! What the row-wise CUDA kernels (kernels/rowwise.cu, one CUDA module) share on the host:
//! the switch that sends an op to them, the launch geometry and count limits, and the launch
//! helpers (held storage views, function lookup, output buffers). Each operation's host code
//! lives beside it: the bias and activation epilogues with [`crate::ops::linear`]
//! (`rowwise.rs`), the patch matrix and the narrow RGB output convolution with
//! [`crate::ops::conv`] (`cuda.rs`), the window gathers with their layer norms with
//! [`crate::ops::norm`] (`cuda.rs`).
//!
//! On other devices (and on CUDA with `UPSCALE_CUDA_OFF=rowwise`) each op runs candle's
//! composition of the same ops, which is also what the GPU tests hold the kernels to.

use candle_core::{Result, Tensor};

use crate::switches::cuda_off::Off;

/// Whether `t`'s op runs our kernel: on CUDA, unless `off` (the load plan's
/// `UPSCALE_CUDA_OFF`) names `rowwise`.
pub fn ours(t: &Tensor, off: Off) -> bool {
    t.device().is_cuda() && !off.rowwise
}

/// Threads per block of the CUDA kernels: whole warps; the norms give each row one warp.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) const THREADS: usize = 256;
/// Grid cap: the kernels' loops stride over the rest.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const MAX_BLOCKS: usize = 1 << 16;
/// The largest count the kernels take. They index in 32 bits and stride by up to a whole
/// grid of threads, so a count within one grid's stride of 2³² would wrap the index
/// (`i += step` back below `n`) and the loop would never end.
const COUNT_MAX: usize = (1 << 32) - THREADS * MAX_BLOCKS;

/// `v` as a kernel's 32-bit count, or an error naming `what` where it is too large.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn u32_of(v: usize, what: &str) -> Result<u32> {
    if v > COUNT_MAX {
        candle_core::bail!("rowwise kernels: {what} {v} exceeds {COUNT_MAX}");
    }
    Ok(v as u32)
}

#[cfg(feature = "cuda")]
pub(crate) mod cuda {
    use std::ops::Deref;

    use candle_core::cuda_backend::cudarc::driver::{
        CudaFunction, CudaSlice, CudaView, DeviceRepr, LaunchConfig,
    };
    use candle_core::cuda_backend::CudaDType;
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Result, Shape, Storage, Tensor, WithDType};

    use super::{MAX_BLOCKS, THREADS};

    /// A tensor's storage held for a launch, with its contiguous element range.
    pub(crate) struct Held<G> {
        guard: G,
        range: (usize, usize),
    }

    pub(crate) fn held<'a>(
        t: &'a Tensor,
        what: &str,
    ) -> Result<Held<impl Deref<Target = Storage> + 'a>> {
        let (guard, layout) = t.storage_and_layout();
        let Some(range) = layout.contiguous_offsets() else {
            candle_core::bail!("{what} must be contiguous");
        };
        Ok(Held { guard, range })
    }

    impl<G: Deref<Target = Storage>> Held<G> {
        pub(crate) fn view<T: CudaDType>(&self) -> Result<CudaView<'_, T>> {
            match &*self.guard {
                Storage::Cuda(s) => Ok(s.as_cuda_slice::<T>()?.slice(self.range.0..self.range.1)),
                _ => candle_core::bail!("rowwise kernels take CUDA tensors"),
            }
        }

        pub(crate) fn device(&self) -> Result<CudaDevice> {
            match &*self.guard {
                Storage::Cuda(s) => Ok(s.device.clone()),
                _ => candle_core::bail!("rowwise kernels take CUDA tensors"),
            }
        }
    }

    /// Enough blocks of `per_block` work units for `units`, capped.
    pub(crate) fn grid(units: usize, per_block: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (units.div_ceil(per_block).clamp(1, MAX_BLOCKS) as u32, 1, 1),
            block_dim: (THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Kernel `name` for element type `T`.
    pub(crate) fn func<T: WithDType>(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
        let suffix = match T::DTYPE {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            other => candle_core::bail!("rowwise kernels: dtype {other:?} (f32, bf16, f16)"),
        };
        crate::gpu::function(
            dev,
            &crate::gpu::kernels::ROWWISE,
            &format!("{name}_{suffix}"),
        )
    }

    /// An output buffer of `n` elements, which the kernel writes in full.
    pub(crate) fn alloc<T: DeviceRepr>(dev: &CudaDevice, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every kernel here writes each element of its outputs before anything reads
        // them.
        unsafe { dev.alloc::<T>(n) }
    }

    pub(crate) fn wrap<T: CudaDType>(out: CudaSlice<T>, dev: &CudaDevice, shape: Shape) -> Tensor {
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, dev.clone()));
        Tensor::from_storage(storage, shape, BackpropOp::none(), false)
    }

    /// Runs `$body` with `$t` the element type of `$dtype`.
    macro_rules! with_type {
        ($dtype:expr, $t:ident => $body:block) => {
            match $dtype {
                candle_core::DType::F32 => {
                    type $t = f32;
                    $body
                }
                candle_core::DType::BF16 => {
                    type $t = half::bf16;
                    $body
                }
                candle_core::DType::F16 => {
                    type $t = half::f16;
                    $body
                }
                other => candle_core::bail!("rowwise kernels: dtype {other:?} (f32, bf16, f16)"),
            }
        };
    }
    pub(crate) use with_type;
}

#[cfg(test)]
mod tests {
    use super::{u32_of, MAX_BLOCKS, THREADS};

    /// Every count a kernel takes leaves room for one more grid stride below 2³², so its
    /// index cannot wrap; a larger count is an error, not a kernel that never ends.
    #[test]
    fn kernel_counts_leave_room_for_a_grid_stride() {
        let stride = (THREADS * MAX_BLOCKS) as u32;
        let mut largest = 0;
        for v in [
            0,
            1 << 31,
            (1 << 32) - (1 << 25),
            (1 << 32) - (1 << 24),
            (1 << 32) - 1,
            1 << 32,
        ] {
            match u32_of(v, "elements") {
                Ok(n) => {
                    assert!((n.max(1) - 1).checked_add(stride).is_some(), "{v}");
                    largest = v;
                }
                Err(e) => assert!(e.to_string().contains("elements"), "{e}"),
            }
        }
        assert!(largest >= (1 << 32) - (1 << 25), "{largest}");
    }
}
